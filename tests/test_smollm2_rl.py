"""A1 GRPO improves a real pretrained model: SmolLM2-135M-Instruct from its own checkpoint.

A short run of ``tune run recipes/grpo.py --config smollm2`` (the shipped config, as a user
types it, with ``SHORT_RUN``'s overrides) must raise greedy held-out accuracy above the base
model's, both measured in the same run on the config's 128 distinct held-out problems, by
``MIN_GAIN``, on the native decoder. The transformers backend is held to the native one by one
GRPO step taking the same update (the second test): equality, not a second 5-minute learning run.

Measured on a 2-core AMD EPYC with AVX2 only (``autocast: auto`` runs fp32 there), shared-prefix
forward, base model 0.250 on the 128 problems, evaluations every 4 steps of a 16-step run:

* seed 0: 0.250 -> 0.383 / 0.352 / 0.406 / 0.375 at steps 4 / 8 / 12 / 16;
* seed 1: 0.250 -> 0.352 / 0.391 at steps 4 / 8;
* ``advantage_sign=-1`` (flipped advantages), seed 0, 8 steps: 0.250 -> 0.000;
* ``optimizer.lr=0`` (no update): the weights, hence the accuracy, do not move (+0.000).

So after 8 steps the gain was +0.102 and +0.141, and every evaluation from step 4 to 16 was at
least +0.10; the margin, 8 problems, leaves 5 problems of trajectory noise below the smallest.
Before the held-out sets were made distinct, this test measured 10 steps on 64 problems that held
55 distinct ones (base 0.391): +0.078 on one run and +0.047 on CI's after a numerics change,
too close to its 0.06 margin. Both negative controls miss the margin: the test would catch a
sign error in the policy loss (the flipped run) and a run that does not train (the zeroed one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_tune.checkpointing.hf_checkpoint import load_hf_checkpoint
from composer_tune.checkpointing.run_state import MODEL_DIR, latest_checkpoint
from tests.recipe_runs import run_recipe

pytestmark = pytest.mark.slow

SHORT_RUN = (
    "max_steps=8",
    "optimizer.lr=3e-5",
    "eval_every_n_steps=0",
    "logging.progress_bar=false",
    "checkpoint.save_only_model=true",  # 0.5 GB on disk instead of 1.6 (no AdamW moments)
)
# Held-out accuracy gain (absolute, 128 distinct problems) the run must reach: 8 problems.
MIN_GAIN = 0.0625


def test_grpo_raises_smollm2_heldout_accuracy(smollm2_dir: Path, tmp_path: Path) -> None:
    """On the native decoder; the transformers backend takes the same step (the test below)."""
    run = run_recipe("grpo", "smollm2", tmp_path / "out", *SHORT_RUN)
    before, after = run.heldout_accuracies()
    assert after - before >= MIN_GAIN, run.stdout[-2000:]
    # The trained model is an ordinary Hugging Face Llama checkpoint with SmolLM2's chat template
    # and the template's end of turn as EOS.
    saved = latest_checkpoint(tmp_path / "out") / MODEL_DIR
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    chat = [{"role": "user", "content": "What is 7 + 5?"}]
    assert "<|im_start|>user\nWhat is 7 + 5?" in AutoTokenizer.from_pretrained(
        saved
    ).apply_chat_template(chat, tokenize=False)
    generation = json.loads((saved / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]


# One small GRPO step in fp32 (no autocast: both backends then compute in one precision) with
# plain SGD, whose update is the gradient itself: AdamW's first step is about lr * sign(gradient),
# which fp32 rounding flips wherever a gradient element is near zero.
ONE_STEP = (
    "max_steps=1",
    "autocast=null",
    "optimizer._component_=torch.optim.SGD",
    "~optimizer.betas",
    "optimizer.lr=1.0",
    "num_prompts_per_generation=4",
    "group_size=8",
    "eval_every_n_steps=0",
    "eval_dataset.num_samples=16",
    "logging.progress_bar=false",
    "checkpoint.save_only_model=true",
)


def test_transformers_backend_takes_the_native_grpo_step(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same GRPO step through ``transformers``' LlamaForCausalLM as through the native
    decoder: the same sampled completions and rewards, the same gradient norm, and the same
    update, so the learning the test above measures carries over to the transformers backend
    (measured directly, 8 steps on each backend: both gained at least ``MIN_GAIN``). A backend
    that dropped a parameter from the optimizer, detached the policy's log-probs or scaled the
    loss would fail here, as did one that kept transformers' ``padding_idx`` (SmolLM2's pad id
    is <|im_end|>, whose input embedding then took no gradient)."""
    # One thread in both runs (as under xdist): with two, the backends' kernels split their sums
    # differently, a sampled token can flip, and the runs part ways.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = load_hf_checkpoint(smollm2_dir, dtype=torch.float32)[1]
    updates, logged = {}, {}
    for backend in ("native", "transformers"):
        run = run_recipe(
            "grpo", "smollm2", tmp_path / backend, *ONE_STEP, f"model.backend={backend}"
        )
        logged[backend] = run.metrics()[1]
        trained = load_hf_checkpoint(
            latest_checkpoint(tmp_path / backend) / MODEL_DIR, torch.float32
        )[1]
        assert trained.keys() == base.keys(), backend
        # float64: a float32 dot product over 135M elements drifts past a cosine of 1.
        updates[backend] = torch.cat(
            [(trained[k] - base[k]).flatten() for k in sorted(base)]
        ).double()
    native, hf = logged["native"], logged["transformers"]
    assert native["grad_norm"] > 0, "no group had mixed rewards: the step would test nothing"
    for key in ("tokens/generated", "reward/mean", "eval/accuracy"):
        assert native[key] == hf[key], key
    # Before clipping (the clip to 1.0 would hide a scaled loss in the update's norm).
    assert abs(hf["grad_norm"] / native["grad_norm"] - 1) < 1e-3
    update, other = updates["native"], updates["transformers"]
    assert update.norm() > 0
    cosine = torch.nn.functional.cosine_similarity(update, other, dim=0)
    # Measured: 1 - 7e-11 (0.99975 while the backend kept transformers' padding_idx).
    assert cosine > 1 - 1e-6, f"update directions differ: cosine {cosine:.10f}"
    assert abs(other.norm() / update.norm() - 1) < 1e-4
