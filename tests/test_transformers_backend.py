"""The transformers backend (``model.backend: transformers``): any decoder-only causal LM that
``transformers`` builds, checked against ``transformers``' own model on tiny random checkpoints
that ``transformers`` writes offline (vocabulary 256, 2 layers, fp32).

Per family: the chunked log-prob head equals ``log_softmax`` of the model's own logits; the
shared-prefix forward (4-D masks) equals the plain forward; the native sampler decodes what
``transformers`` decodes, past the sliding window where the family has one; a run checkpoint
loads in ``transformers`` and back. Then what is backend-specific: the ``auto`` choice, the
models refused with a reason, a mixture of experts' load-balancing loss against
``transformers``' own ``aux_loss``, weight tying through loading, DiLoCo's fragments.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from composer_tune.checkpointing import CheckpointError
from composer_tune.checkpointing.run_state import load_model_weights, save_run_checkpoint
from composer_tune.diloco.fragments import split_into_fragments
from composer_tune.distributed import DistInfo
from composer_tune.losses.logprobs import logprob_head
from composer_tune.models import from_pretrained
from composer_tune.models.build import build_decoder
from composer_tune.models.hf_backend import HFCausalLM, load_transformers_weights, router_loss
from composer_tune.models.pretrained import resolve_backend
from composer_tune.rollout.generation import generate, pack_sequences
from composer_tune.rollout.rollouts import sequence_logprobs
from composer_tune.rollout.shared_prefix import shared_prefix_logprobs
from tests.recipe_runs import run_recipe, run_torchrun

CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
VOCAB = 256
TOL = 1e-5
WINDOW = 8  # sliding windows shorter than the sequences below, so the windows are exercised
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,  # peaky next-token distributions: wrong wiring shows
}
_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_HYBRID = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}

# The families the README's table names, plus ones the issue did not: every one of them runs
# on the backend. Native families (llama) run on it too when asked.
FAMILIES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama_tied": lambda: transformers.LlamaConfig(**_SHAPE, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**_SHAPE, sliding_window=WINDOW),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **_SHAPE, **_HYBRID, head_dim=16, final_logit_softcapping=30.0
    ),
    "phi3": lambda: transformers.Phi3Config(**_SHAPE),
    "olmo2": lambda: transformers.Olmo2Config(**_SHAPE),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_SHAPE, **_EXPERTS, num_experts=4),
    "mixtral": lambda: transformers.MixtralConfig(
        **_SHAPE, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_SHAPE, **_EXPERTS, num_experts=4, shared_expert_intermediate_size=48
    ),
    "granite": lambda: transformers.GraniteConfig(**_SHAPE, logits_scaling=4.0),
    "cohere": lambda: transformers.CohereConfig(**_SHAPE, logit_scale=0.5),
    "starcoder2": lambda: transformers.Starcoder2Config(**_SHAPE),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_SHAPE),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256
    ),
    "exaone4": lambda: transformers.Exaone4Config(**_SHAPE, **_HYBRID),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **_SHAPE, **_HYBRID, head_dim=16, num_local_experts=4, num_experts_per_tok=2
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A family's tiny random checkpoint, written by ``transformers`` once per module."""
    made: dict[str, Path] = {}

    def checkpoint(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(FAMILIES[family]())
            made[family] = tmp_path_factory.mktemp(family)
            model.save_pretrained(made[family])
        return made[family]

    return checkpoint


def _ours(path: Path, checkpoint: Path | None = None, **model_args) -> HFCausalLM:
    """The model as a recipe builds it: on the meta device, then loaded from ``checkpoint``
    (default: ``path``, as ``checkpoint.initial_checkpoint: ${model.path}``)."""
    section = {"_component_": "composer_tune.models.from_pretrained", "path": str(path)}
    model = build_decoder(
        OmegaConf.create({**section, "backend": "transformers", **model_args}),
        checkpoint=checkpoint or path,
        dtype=torch.float32,
        dist_info=CPU,
        seed=0,
        activation_checkpointing=False,
        fsdp_cpu_offload=False,
    )
    assert isinstance(model, HFCausalLM)
    return model.eval()


def _theirs(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy_by_transformers(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forwards of ``transformers``' model, no cache."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
    return sequence[len(prompt) :]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprobs_equal_the_models_own_logits(family: str, checkpoints) -> None:
    ours, theirs = _ours(checkpoints(family)), _theirs(checkpoints(family))
    tokens = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    targets = tokens[:, 1:]
    with torch.no_grad():
        logits = theirs(tokens).logits[:, :-1].float()
        for temperature in (1.0, 0.7):
            expected = torch.log_softmax(logits / temperature, dim=-1)
            logprobs, entropy = ours(
                tokens[:, :-1],
                head_fn=logprob_head(
                    targets, chunk_size=7, temperature=temperature, return_entropy=True
                ),
            )
            picked = expected.gather(-1, targets[..., None])[..., 0]
            assert (logprobs - picked).abs().max() <= TOL
            assert (entropy + (expected.exp() * expected).sum(-1)).abs().max() <= 1e-4
        assert (ours(tokens) - theirs(tokens).logits.float()).abs().max() <= 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_prefix_forward_equals_the_plain_forward(family: str, checkpoints) -> None:
    """Every family the backend loads takes the 4-D masks of the shared-prefix forward (a
    group's completions packed behind one copy of its prompt), sliding windows included."""
    model = _ours(checkpoints(family))
    prompt = list(range(10, 22))
    completions = [list(range(30, 30 + length)) for length in (9, 5, 12)]
    packed = pack_sequences([prompt] * 3, completions, pad_id=0)
    with torch.no_grad():
        plain = sequence_logprobs(model, packed.tokens, packed.input_pos, packed.completion_mask)
        shared = shared_prefix_logprobs(
            model,
            packed.tokens,
            packed.input_pos,
            packed.completion_mask,
            group_ids=torch.zeros(3, dtype=torch.long),
            prompt_lengths=packed.prompt_lengths,
        )
    assert ((plain - shared) * packed.completion_mask).abs().max() <= TOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_sampler_decodes_what_transformers_decodes(family: str, checkpoints) -> None:
    """Greedy rows of different lengths (left padding) through the model's own attention and a
    ``transformers`` cache, past the sliding window."""
    ours, theirs = _ours(checkpoints(family)), _theirs(checkpoints(family))
    prompts = [list(range(5, 17)), [20, 21, 22]]
    out = generate(ours, prompts, max_new_tokens=10, pad_id=0, greedy=True)
    assert out.completions == [_greedy_by_transformers(theirs, p, 10) for p in prompts]


@pytest.mark.parametrize("family", ["llama_tied", "gemma3_text", "qwen3_moe", "phi3"])
def test_run_checkpoint_loads_in_transformers_and_back(
    family: str, checkpoints, tmp_path: Path
) -> None:
    model = _ours(checkpoints(family))
    with torch.no_grad():  # a training step's worth of change, so loading is not a no-op
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    path = save_run_checkpoint(
        output_dir=tmp_path,
        step=1,
        model=model,
        model_config=model.config,
        optimizer=None,
        lr_scheduler=None,
        recipe_state={},
        dist_info=CPU,
    )
    tokens = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    reloaded = _theirs(path / "model")
    with torch.no_grad():
        assert (reloaded(tokens).logits.float() - model(tokens)).abs().max() <= 1e-4
    back = _ours(path / "model").state_dict()
    assert back.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(back[name], value), name
    written = json.loads((path / "model" / "config.json").read_text())
    assert written["model_type"] == FAMILIES[family]().model_type


def test_auto_picks_native_for_its_families_and_transformers_for_the_rest(checkpoints) -> None:
    def config_of(family: str) -> dict:
        return json.loads((checkpoints(family) / "config.json").read_text())

    assert resolve_backend(config_of("llama_tied"), "auto") == "native"
    assert resolve_backend(config_of("mistral"), "auto") == "transformers"
    assert resolve_backend(config_of("qwen3_moe"), "auto") == "transformers"
    # A native family with an option the native decoder lacks goes to transformers too.
    assert resolve_backend({**config_of("llama_tied"), "mlp_bias": True}, "auto") == (
        "transformers"
    )
    assert not isinstance(from_pretrained(checkpoints("llama_tied")), HFCausalLM)
    assert isinstance(from_pretrained(checkpoints("mistral")), HFCausalLM)
    with pytest.raises(ValueError, match="model.backend must be one of"):
        from_pretrained(checkpoints("mistral"), backend="vllm")


def test_models_it_cannot_run_are_refused_with_the_reason(tmp_path: Path) -> None:
    linear = transformers.Qwen3NextConfig(**_SHAPE)
    AutoModelForCausalLM.from_config(linear).save_pretrained(tmp_path / "linear")
    with pytest.raises(CheckpointError, match="layer types.*linear_attention"):
        from_pretrained(tmp_path / "linear")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES["mistral"]()).save_pretrained(tmp_path / "m")
    with pytest.raises(CheckpointError, match="takes 4-D masks"):
        from_pretrained(tmp_path / "m", attn_implementation="flash_attention_2")
    with pytest.raises(CheckpointError, match="not a mixture of experts"):
        from_pretrained(tmp_path / "m", router_aux_loss_coef=0.01)


def test_a_checkpoint_of_another_architecture_is_refused(checkpoints, tmp_path: Path) -> None:
    """``model.path`` and ``checkpoint.initial_checkpoint`` must describe one model."""
    other = transformers.MistralConfig(**{**_SHAPE, "intermediate_size": 128})
    AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="intermediate_size"):
        _ours(checkpoints("mistral"), checkpoint=tmp_path)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_router_loss_is_transformers_aux_loss(family: str, checkpoints) -> None:
    """The load-balancing loss added to a training forward's loss is ``transformers``' own
    ``aux_loss`` times the coefficient, and its gradient reaches the router."""
    path = checkpoints(family)
    ours = _ours(path, router_aux_loss_coef=0.05).train()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = theirs(tokens, output_router_logits=True).aux_loss
    ours(tokens, head_fn=lambda hidden, _output: hidden.sum())
    aux, metrics = router_loss(ours)
    assert float(aux) == pytest.approx(0.05 * float(expected), rel=1e-5)
    assert metrics["moe/aux_loss"] == pytest.approx(float(expected), rel=1e-5)
    loads = [v for k, v in metrics.items() if k.startswith("moe/load_max_over_mean/")]
    assert len(loads) == 2 and all(1.0 <= load <= 4.0 for load in loads)
    aux.backward()
    router_grads = [p.grad for n, p in ours.named_parameters() if n.endswith("mlp.gate.weight")]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads)
    assert router_loss(ours) == (None, {})  # taken once


def test_router_loss_follows_transformers_default(checkpoints) -> None:
    """Without ``model.router_aux_loss_coef`` the config decides, as in ``transformers``: its
    ``router_aux_loss_coef`` when ``output_router_logits`` is on, else no loss (the expert
    loads are reported either way); no-grad forwards (sampling, references) record nothing."""
    model = _ours(checkpoints("qwen3_moe")).train()  # output_router_logits: false
    tokens = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        model(tokens)
    assert router_loss(model) == (None, {})
    model(tokens)
    aux, metrics = router_loss(model)
    assert aux is None and "moe/aux_loss" in metrics


def test_tied_output_projection_stays_tied(checkpoints) -> None:
    model = _ours(checkpoints("llama_tied")).train()
    assert model.lm_head.weight is model.tok_embeddings.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(3, VOCAB, (2, 8))
    model(tokens[:, :-1], head_fn=logprob_head(tokens[:, 1:])).sum().backward()
    optimizer.step()
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert set(load_model_weights(checkpoints("llama_tied"), model)) == set(model.state_dict())


def test_the_pad_token_trains_as_an_input_as_on_the_native_decoder(checkpoints) -> None:
    """transformers builds the embedding with ``padding_idx = pad_token_id``, which would give
    that token's input occurrences no gradient; the pad id is often a real token (SmolLM2's is
    <|im_end|>, in every chat prompt), so the backend trains it as the native decoder does."""
    path = checkpoints("llama_tied")
    pad = _SHAPE["pad_token_id"]
    tokens = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    tokens[:, 4] = pad  # mid-prompt, as an end-of-turn token is
    rows = {}
    for backend in ("native", "transformers"):
        model = build_decoder(
            OmegaConf.create(
                {"_component_": "composer_tune.models.from_pretrained", "path": str(path),
                 "backend": backend}
            ),
            checkpoint=path, dtype=torch.float32, dist_info=CPU, seed=0,
            activation_checkpointing=False, fsdp_cpu_offload=False,
        )  # fmt: skip
        model(tokens[:, :-1], head_fn=logprob_head(tokens[:, 1:])).sum().backward()
        rows[backend] = model.tok_embeddings.weight.grad[pad]
    # The tied output projection's share of the row is the same on both: the input share differs
    # when the input occurrences are dropped.
    assert (rows["transformers"] - rows["native"]).abs().max() <= 1e-5


def test_diloco_fragments_walk_into_the_decoder_stack(checkpoints) -> None:
    tied = _ours(checkpoints("llama_tied"))
    _, names = split_into_fragments(tied, 2)
    # The tied output projection holds no parameter of its own: it is no unit.
    assert names == [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm"]]
    _, names = split_into_fragments(_ours(checkpoints("qwen3_moe")), 3)
    assert [n for group in names for n in group][-1] == "lm_head"


FSDP_FAMILIES = ["llama_tied", "qwen3_moe", "gemma3_text"]


@pytest.fixture(scope="module")
def fsdp_results(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tests/_fsdp_transformers_worker.py on 2 gloo ranks (FSDP2 + activation checkpointing)
    against one process, for a tied dense model, a mixture of experts and a hybrid-window one."""
    out = tmp_path_factory.mktemp("fsdp") / "results.json"
    run_torchrun(
        Path(__file__).with_name("_fsdp_transformers_worker.py"),
        str(out),
        *(str(checkpoints(family)) for family in FSDP_FAMILIES),
        timeout=900,
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", FSDP_FAMILIES)
def test_fsdp2_on_two_ranks_equals_one_process(family: str, fsdp_results: dict, checkpoints):
    result = fsdp_results[checkpoints(family).name]
    assert result["fsdp_losses"] == pytest.approx(result["reference_losses"], abs=TOL)
    assert result["max_weight_change"] > 1e-2  # training moved the weights
    assert result["max_weight_diff"] <= TOL
    assert result["still_tied"] == FAMILIES[family]().tie_word_embeddings


# ----------------------------------------------------------------------------- recipes


@pytest.fixture(scope="module")
def with_tokenizer(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A family's tiny random checkpoint at SmolLM2's vocabulary, with SmolLM2's tokenizer and
    chat template beside it: what a user's ``model.path=DIR`` looks like."""
    made: dict[str, Path] = {}

    def checkpoint(family: str) -> Path:
        if family not in made:
            config = FAMILIES[family]()
            config.vocab_size = 49152
            config.max_position_embeddings = 1024
            torch.manual_seed(0)
            made[family] = tmp_path_factory.mktemp(f"{family}_tok")
            AutoModelForCausalLM.from_config(config).save_pretrained(made[family])
            for source in smollm2_dir.iterdir():
                if source.name.startswith("tokenizer") or source.name == "chat_template.jinja":
                    shutil.copy(source, made[family] / source.name)
        return made[family]

    return checkpoint


@pytest.mark.slow
def test_grpo_smollm2_config_trains_a_users_model(with_tokenizer, tmp_path: Path) -> None:
    """The one-line change the README names: ``model.path=DIR``. A family the native decoder
    lacks (Gemma 3, sliding and full layers) trains a GRPO step; its checkpoint loads in
    ``transformers``."""
    run = run_recipe(
        "grpo", "smollm2", tmp_path, f"model.path={with_tokenizer('gemma3_text')}",
        "max_steps=1", "eval_every_n_steps=0", "eval_dataset.num_samples=8",
    )  # fmt: skip
    saved = tmp_path / "checkpoints" / "step_0000001" / "model"
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert model.config.model_type == "gemma3_text"
    assert 1 in run.metrics() and "loss" in run.metrics()[1]


@pytest.mark.slow
def test_composer_full_trains_a_mixture_of_experts(with_tokenizer, tmp_path: Path) -> None:
    """All three channels on Qwen3-MoE with its load-balancing loss on: the router's loss and
    each layer's expert load are logged for the shared forward (channels 1-2) and channel 3's."""
    run = run_recipe(
        "composer_full", "smollm2", tmp_path, f"model.path={with_tokenizer('qwen3_moe')}",
        "model.router_aux_loss_coef=0.01", "max_steps=1", "eval_every_n_steps=0",
        "eval_dataset.num_samples=8",
    )  # fmt: skip
    logged = run.metrics()[1]
    for prefix in ("", "dpo/"):
        assert logged[f"{prefix}moe/aux_loss"] > 0
        assert logged[f"{prefix}moe/load_max_over_mean/layer_1"] >= 1.0
    saved = tmp_path / "checkpoints" / "step_0000001" / "model"
    assert AutoModelForCausalLM.from_pretrained(saved).config.model_type == "qwen3_moe"


@pytest.mark.slow
def test_resume_is_exact_on_the_transformers_backend(with_tokenizer, tmp_path: Path) -> None:
    """Two SFT steps in one run equal one step, a stop and a resume (weights, optimizer state
    and data order through a transformers-backend checkpoint): a mixture of experts, whose
    expert tensors transformers converts on loading and saving."""
    common = [
        f"model.path={with_tokenizer('mixtral')}", "checkpoint.save_every_n_steps=1",
        "batch_size=2", "logging.log_every_n_steps=1",
    ]  # fmt: skip
    run_recipe("sft", "smollm2_tools", tmp_path / "whole", *common, "max_steps=2")
    run_recipe("sft", "smollm2_tools", tmp_path / "parts", *common, "max_steps=1")
    run_recipe(
        "sft", "smollm2_tools", tmp_path / "parts", *common, "max_steps=2",
        "checkpoint.resume_from_checkpoint=latest",
    )  # fmt: skip
    whole = load_transformers_weights(tmp_path / "whole" / "checkpoints" / "step_0000002" / "model")
    parts = load_transformers_weights(tmp_path / "parts" / "checkpoints" / "step_0000002" / "model")
    start = load_transformers_weights(with_tokenizer("mixtral"))
    assert whole.keys() == parts.keys()
    assert any(not torch.equal(whole[k], start[k]) for k in whole)  # it trained
    for name in whole:
        assert torch.equal(whole[name], parts[name]), name


@pytest.mark.parametrize("per_layer", [True, False], ids=["transformers_5_19", "transformers_5_17"])
def test_layer_types_read_either_shape_of_transformers_layer_kwargs(monkeypatch, per_layer):
    """transformers 5.19 returns one kwargs dict per layer, 5.17 (the GPU image's) one dict for
    every layer: the sliding window is read from both."""
    import transformers.cache_utils

    from composer_tune.models.hf_backend import _layer_types

    types = ["sliding_attention", "full_attention", "sliding_attention"]
    kwargs = (
        [{"sliding_window": 8}, {}, {"sliding_window": 8}] if per_layer else {"sliding_window": 8}
    )
    monkeypatch.setattr(
        transformers.cache_utils, "get_layer_types_and_kwargs", lambda config: (types, kwargs)
    )
    config = transformers.MistralConfig(**{**_SHAPE, "num_hidden_layers": 3})
    assert _layer_types(config) == (types, {"sliding_attention": 8})
