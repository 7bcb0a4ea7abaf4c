"""The loop's chores at the end of a run: the last step's weights are evaluated once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune.distributed import DistInfo
from composer_tune.guards import NonFiniteGuard
from composer_tune.run.loop import LoopChores
from composer_tune.run.state import RunProgress


def _run(max_steps: int, eval_every: int) -> tuple[list[int], object]:
    """Steps at which ``evaluate`` ran over a run of ``max_steps``, and what ``finish`` gave."""
    cfg = OmegaConf.create(
        {
            "max_steps": max_steps,
            "eval_every_n_steps": eval_every,
            "logging": {"progress_bar": False, "log_every_n_steps": 1},
            "checkpoint": {"save_every_n_steps": 0},
        }
    )
    dist = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
    progress = RunProgress(NonFiniteGuard(max_consecutive=3, device=dist.device, verbose=False))
    evaluated: list[int] = []

    def evaluate() -> str:
        evaluated.append(progress.step)
        return f"accuracy at step {progress.step}"

    chores = LoopChores(
        cfg, dist, progress, log=lambda metrics: None, evaluate=evaluate,
        save_checkpoint=lambda: Path("unused"),
    )  # fmt: skip
    for _ in range(max_steps):
        chores.step_done({}, {}, tokens_processed=1.0, tokens_trained={})
    return evaluated, chores.finish()


@pytest.mark.parametrize(
    ("max_steps", "eval_every", "evaluated"),
    [(4, 2, [2, 4]), (5, 2, [2, 4, 5]), (3, 0, [3])],
    ids=["last_step_evaluated_once", "off_cadence_end_evaluates", "no_cadence"],
)
def test_the_end_of_a_run_evaluates_its_last_step_once(
    max_steps: int, eval_every: int, evaluated: list[int]
) -> None:
    steps, after = _run(max_steps, eval_every)
    assert steps == evaluated
    assert after == f"accuracy at step {max_steps}"
