"""Shared fixtures."""

import pytest

from tests.recipe_runs import RecipeRun, run_recipe


@pytest.fixture(scope="session")
def sft_warm_start(tmp_path_factory: pytest.TempPathFactory) -> RecipeRun:
    """The A0 SFT cpu_smoke run, trained once per test session; RL recipes start from it."""
    return run_recipe("sft", "cpu_smoke", tmp_path_factory.mktemp("sft_cpu_smoke"))


@pytest.fixture(scope="session")
def sft_hints_warm_start(tmp_path_factory: pytest.TempPathFactory) -> RecipeRun:
    """The A0 SFT cpu_smoke_hints run (a quarter of its questions carry SDPO's hints), trained
    once per test session; the SDPO-family cpu_smoke configs start from it."""
    return run_recipe("sft", "cpu_smoke_hints", tmp_path_factory.mktemp("sft_cpu_smoke_hints"))
