"""A0: the SFT recipe through `tune run`, single process and FSDP2 on 2 CPU processes."""

import re
from pathlib import Path

import pytest
import torch

from composer_tune import config
from composer_tune.checkpointing import load_decoder_from_hf
from composer_tune.checkpointing.run_state import latest_checkpoint
from recipes.sft import SFTConfig, SFTRecipe
from tests.recipe_runs import REPO_ROOT, RecipeRun, run_recipe, run_tune

pytestmark = pytest.mark.slow


def _logged(output_dir: Path, key: str) -> list[float]:
    """Values of one metric from the DiskLogger file, in step order."""
    (log_file,) = (output_dir / "logs").glob("log_*.txt")
    return [
        float(v) for v in re.findall(rf"\b{re.escape(key)}:([-0-9.e+naif]+)", log_file.read_text())
    ]


def test_cpu_smoke_learns_but_leaves_room(sft_warm_start: RecipeRun) -> None:
    accuracies = sft_warm_start.heldout_accuracies()
    before, after = accuracies[0], accuracies[-1]
    # A random-init model answers nothing right; the warm start must be clearly better than
    # that, yet imperfect so the RL arms have something to improve.
    assert before <= 0.02
    assert 0.10 <= after <= 0.90, accuracies
    assert "held-out accuracy: before" in sft_warm_start.stdout


def test_checkpoint_loads_in_transformers_with_same_logits(sft_warm_start: RecipeRun) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = latest_checkpoint(sft_warm_start.output_dir)
    assert checkpoint is not None
    model_dir = checkpoint / "model"
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_decoder_from_hf(model_dir).eval()
    tokens = torch.randint(
        0, hf_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    # The tokenizer files travel with the weights, so the folder is servable as is.
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert hf_tokenizer("What is 12 + 30?")["input_ids"]
    # transformers/vLLM stop at the chat turn's end.
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in hf_model.generation_config.eos_token_id


def test_fsdp_two_processes_match_single_process(tmp_path: Path) -> None:
    # Same global batch either way: 2 ranks x 8 rows vs 1 process x 16 rows (see DistributedSampler).
    common = (
        "max_steps=6",
        "eval_dataset.num_samples=16",
        "logging.log_every_n_steps=1",
        "lr_scheduler.num_warmup_steps=2",
        "logging.progress_bar=false",
    )
    single = run_recipe("sft", "cpu_smoke", tmp_path / "single", "batch_size=16", *common)
    result = run_tune(
        "--nproc_per_node",
        "2",
        "recipes/sft.py",
        "--config",
        "cpu_smoke",
        f"output_dir={tmp_path / 'fsdp'}",
        "batch_size=8",
        *common,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    # The FSDP2 root returns log-probs that are not views (an in-place op on a view would drop
    # the pre-backward all-gather hook; torch warns once per process).
    assert "returned a view tensor" not in result.stderr
    single_losses = _logged(single.output_dir, "loss")
    fsdp_losses = _logged(tmp_path / "fsdp", "loss")
    assert len(single_losses) == len(fsdp_losses) == 6
    # Sharded reductions change float summation order only.
    torch.testing.assert_close(
        torch.tensor(fsdp_losses), torch.tensor(single_losses), atol=1e-4, rtol=1e-4
    )
    assert latest_checkpoint(tmp_path / "fsdp") is not None


def test_length_grouped_micro_batches_take_the_whole_batch_step(tmp_path: Path) -> None:
    """cpu_smoke_hints' batches (a quarter of the questions carry a hint, so most rows are
    padded to a hinted row's length): sorted by length and run as 4 passes, the batch pads far
    fewer positions, yet its loss and every gradient are the single pass's. Dropping or
    repeating a row, or normalising each pass by its own tokens, fails here."""
    cfg = config.load_config(
        "cpu_smoke_hints",
        [f"output_dir={tmp_path}", "eval_dataset=null", "eval_reward=null"],
        recipe_file=REPO_ROOT / "recipes" / "sft.py",
        schema=SFTConfig,
    )
    recipe = SFTRecipe(cfg)
    recipe.setup()
    samples = [recipe.dataloader.dataset[index] for index in range(cfg.batch_size)]
    steps = {}
    for groups in (1, 4):
        cfg.length_grouped_micro_batches = groups
        micro_batches = recipe._collate(samples)
        assert len(micro_batches) == groups
        assert sum(len(mb["tokens"]) for mb in micro_batches) == cfg.batch_size
        padded = sum(mb["tokens"].numel() for mb in micro_batches)
        recipe.model.zero_grad()
        loss, tokens, _ = recipe._backward(micro_batches)
        grads = {name: p.grad.clone() for name, p in recipe.model.named_parameters()}
        steps[groups] = padded, float(loss), tokens, grads
    whole_padded, whole_loss, whole_tokens, whole = steps[1]
    padded, loss, tokens, grouped = steps[4]
    assert padded < 0.75 * whole_padded, (padded, whole_padded)
    assert tokens == whole_tokens and loss == pytest.approx(whole_loss, rel=1e-6)
    for name, grad in whole.items():
        torch.testing.assert_close(grouped[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    recipe.cleanup()
