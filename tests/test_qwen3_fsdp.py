"""FSDP2 (torchtune ``shard_model``) + activation checkpointing on the tiny Qwen3, 2 CPU ranks.

Launches ``tests/_fsdp_worker.py`` under ``torch.distributed.run`` with gloo and compares what
it reports -- per-step losses and final weights of the sharded run -- against the unsharded
single-process run of the same seeded model on the same data, for tied and untied embeddings,
AdamW and SGD, and with the loss computed through ``head_fn`` inside the sharded forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.recipe_runs import run_torchrun

WORKER = Path(__file__).with_name("_fsdp_worker.py")
REPO_ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "results.json"
    run_torchrun(WORKER, str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["tied_adamw_head_fn", "untied_adamw", "untied_sgd_head_fn"])
def test_fsdp2_matches_single_process(fsdp_results: dict, case: str) -> None:
    result = fsdp_results[case]
    assert result["fsdp_losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    # Training really moved the weights, so agreement is not agreement of untouched inits.
    assert result["max_weight_change"] > 1e-2
    assert result["max_weight_diff"] <= TOL
    assert result["keys_match"]


def test_fsdp2_keeps_tied_embeddings_tied(fsdp_results: dict) -> None:
    assert fsdp_results["tied_adamw_head_fn"]["still_tied"]
    assert not fsdp_results["tied_adamw_head_fn"]["has_output_weight"]
    assert fsdp_results["untied_adamw"]["has_output_weight"]
