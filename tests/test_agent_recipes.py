"""Agent episodes in a real recipe run: a TRL-style environment class and a plain tool-function
list, written only against TRL 1.16's documented contract, train in ``grpo`` unchanged (tiny
Qwen3, cpu_smoke_agent, two steps); a missing environment is one ``error:`` line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.recipe_runs import run_recipe, run_tune

_instances = itertools.count()


class CoinEnvironment:
    """TRL's ``environment_factory`` contract: ``reset(**sample)`` returns text appended to the
    last user message, public methods are tools, ``get_reward()`` owns (part of) the reward.
    Every other instance pays 1, so groups have reward spread and the policy gets gradients."""

    def __init__(self) -> None:
        self.index = next(_instances)
        self.flips = 0

    def reset(self, **sample) -> str | None:
        self.expression = sample["expression"]
        return " (You may flip a coin.)"

    def flip(self, times: int) -> str:
        """Flip a coin.

        Args:
            times: How many flips.
        """
        self.flips += times
        return "heads"

    def get_reward(self) -> float:
        return float(self.index % 2)


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return key.upper()


def test_trl_environment_and_tool_list_train_in_grpo(tmp_path: Path) -> None:
    run = run_recipe(
        "grpo",
        "cpu_smoke_agent",
        tmp_path / "run",
        "agent.environment._component_=tests.test_agent_recipes.CoinEnvironment",
        "agent.tools=[tests.test_agent_recipes.lookup]",
    )
    metrics = run.metrics()
    steps = [metrics[step] for step in sorted(metrics) if "episode/turns" in metrics[step]]
    assert len(steps) == 2
    for step in steps:
        # The environment's reward reached the advantage (half the episodes pay 1) ...
        assert 0.0 < step["reward/mean"] < 1.0 and step["reward/std"] > 0
        # ... and the policy trained on it.
        assert step["grad_norm"] > 0
        assert step["episode/turns"] >= 1.0 and 0.0 <= step["episode/truncated"] <= 1.0
        assert step["episode/generation_seconds"] > 0
    evaluation = [metrics[s] for s in sorted(metrics) if "eval/tool_use_rate" in metrics[s]]
    assert len(evaluation) == 2  # before and after training
    config = (tmp_path / "run" / "torchtune_config.yaml").read_text()
    assert "tests.test_agent_recipes.CoinEnvironment" in config


@pytest.mark.slow  # build_agent's own errors: tests/test_agent_episodes.py, in milliseconds
def test_a_missing_environment_is_one_error_line(tmp_path: Path) -> None:
    result = run_tune(
        "recipes/grpo.py",
        "--config",
        "cpu_smoke_agent",
        f"output_dir={tmp_path / 'run'}",
        "agent.environment._component_=composer_tune.agents.NoSuchEnvironment",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # Caught while the config is checked, before any model is built: the key and the file named.
    assert len(errors) == 1 and "'agent.environment._component_'" in errors[0], result.stderr[
        -2000:
    ]
    assert "cpu_smoke_agent.yaml" in errors[0] and "NoSuchEnvironment" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
