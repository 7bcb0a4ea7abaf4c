"""A1 GRPO improves a real pretrained model: SmolLM2-135M-Instruct from its own checkpoint.

A short run of ``tune run recipes/grpo.py --config smollm2`` (the shipped config, as a user
types it, with ``SHORT_RUN``'s overrides) must raise greedy held-out accuracy above the base
model's, both measured in the same run on the same 64 held-out problems, by ``MIN_GAIN``.

Measured with these overrides (seed 0, 2 threads; the same 64 problems, base model 0.391):

* ``SHORT_RUN`` alone: 0.391 -> 0.516 (+0.125), 3 min 38 s for the whole ``tune run`` on an idle 2-core
  machine with AVX512-BF16 (bf16 autocast); 0.391 -> 0.469 (+0.078), 6 min 46 s on a 2-core AMD
  EPYC with AVX2 only (``autocast: auto`` runs fp32 there), with the shared-prefix forward;
* ``advantage_sign=-1`` (flipped advantages): 0.391 -> 0.000; the policy learns to answer with
  nothing;
* ``optimizer.lr=0`` (no update): 0.391 -> 0.391 (+0.000).

Both negative controls miss the margin: the test would catch a sign error in the policy loss
(the flipped run) and a run that does not train (the zeroed one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_tune.checkpointing.run_state import MODEL_DIR, latest_checkpoint
from tests.recipe_runs import run_recipe

pytestmark = pytest.mark.slow

SHORT_RUN = (
    "max_steps=10",
    "optimizer.lr=3e-5",
    "eval_dataset.num_samples=64",
    "eval_every_n_steps=0",
    "logging.progress_bar=false",
)
# Held-out accuracy gain (absolute, 64 problems) the run must reach: 4 problems.
MIN_GAIN = 0.06


def test_grpo_raises_smollm2_heldout_accuracy(smollm2_dir: Path, tmp_path: Path) -> None:
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
