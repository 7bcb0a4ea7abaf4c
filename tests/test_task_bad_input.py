"""Bad task input, nothing lost: a reward function or environment that fails, a dataset row
without a prompt, a task that does not fit the window. What set-up can see is one ``error:``
line before any weight is built (a trapped model builder proves it); what only a run can see
leaves rows unscored, with warning lines and error observations, and the run goes on to write
its metrics and checkpoint. (Tools that raise or hang: tests/test_agent_episodes.py; reward
functions that raise, hang or return the wrong thing: tests/test_reward_functions.py.)"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import time
from pathlib import Path

import pytest

from composer_tune.agents import build_agent
from composer_tune.agents.episodes import EpisodeRunner, score_episodes
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.rewards import RewardFunctions
from composer_tune.run import rl
from recipes import grpo
from tests.recipe_runs import run_recipe
from tests.test_agent_episodes import QWEN3_TOKENIZER, ScriptedPolicy

ROWS = [{"prompt": [{"role": "user", "content": f"Open door {i}."}], "door": i} for i in range(8)]


class Doors:
    """A TRL environment whose ``reset`` raises for door 3 and hangs for door 5."""

    def reset(self, door: int, **row) -> str:
        if door == 3:
            raise RuntimeError("door 3 is jammed")
        if door == 5:
            time.sleep(5)
        self.door = door
        return f" (door {door})"

    def knock(self, times: int) -> str:
        """Knock on the door.

        Args:
            times: How many knocks.
        """
        return "knock " * times

    def get_reward(self) -> float:
        return float(self.door % 2)


def test_a_reset_that_raises_or_hangs_ends_only_its_episode_unscored() -> None:
    agent = build_agent(
        {"environment": "tests.test_task_bad_input.Doors", "max_turns": 2, "tool_timeout_s": 0.5}
    )
    tokenizer = agent.tokenizer_for(ChatTokenizer.from_dir(QWEN3_TOKENIZER))
    episodes = agent.start([ROWS[1], ROWS[3], ROWS[5]], tokenizer, enable_thinking=True)
    runner = EpisodeRunner(tokenizer, agent.limits, seq_limit=None, enable_thinking=True)
    runner.run(episodes, ScriptedPolicy(tokenizer, ["done"]), sync_ranks=False)
    fine, raised, hung = episodes
    assert fine.record.error is None and fine.record.turns == 1
    assert raised.record.error == "Doors.reset RuntimeError: door 3 is jammed"
    assert hung.record.error == "Doors.reset timed out after 0.5 s"
    assert raised.record.turns == hung.record.turns == 0  # nothing sampled for them
    results = score_episodes(episodes, RewardFunctions())
    assert results[0].score == 1.0
    assert math.isnan(results[1].score) and math.isnan(results[2].score)
    assert results[1].feedback == raised.record.error  # SDPO's hint names the failure


# ----------------------------------------------------------------------------- set-up


class ExpensiveWorkStarted(AssertionError):
    """The trap: the recipe got to building the model."""


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def trap(*_args: object, **_kwargs: object) -> None:
        raise ExpensiveWorkStarted("the bad input was not caught before the model was built")

    monkeypatch.setattr(rl, "build_model", trap)


def _setup_error(tmp_path: Path, *overrides: str) -> str:
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(stderr):
        grpo.recipe_main(
            ["--config", "cpu_smoke_agent", f"output_dir={tmp_path / 'out'}", *overrides]
        )
    assert info.value.code == 2
    (line,) = [line for line in stderr.getvalue().splitlines() if line.strip()]
    assert line.startswith("error: ")
    assert not (tmp_path / "out").exists()  # nothing written
    return line.removeprefix("error: ")


def needs_answer(completions, answer) -> list[float]:
    return [0.0] * len(completions)


def _task_file(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


AS_TASK = (
    "dataset._component_=composer_tune.data.TaskDataset",
    "~dataset.split",
    "~dataset.num_samples",
    "~dataset.seed",
)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            (
                "reward._component_=composer_tune.rewards.RewardFunctions",
                "reward.reward_funcs=[tests.test_task_bad_input.needs_answer]",
            ),
            "reward: reward function needs_answer cannot be called with TRL's arguments",
        ),
        (("reward=null",), "reward: no reward: give reward functions, or an agent environment"),
        (("model.max_seq_len=200",), "past model.max_seq_len=200: raise model.max_seq_len or "),
    ],
)
def test_setup_errors_are_one_line_before_the_model(
    tmp_path: Path, no_model: None, overrides: tuple[str, ...], expected: str
) -> None:
    assert expected in _setup_error(tmp_path, *overrides)


def test_a_row_without_a_prompt_is_one_line_before_the_model(
    tmp_path: Path, no_model: None
) -> None:
    source = _task_file(tmp_path, [ROWS[0], {"door": 9}, ROWS[2]])
    message = _setup_error(tmp_path, *AS_TASK, f"dataset.source={source}")
    assert message == f"dataset {source}: row 1 has no prompt"


# ----------------------------------------------------------------------------- a run

_calls = itertools.count()


def flaky(completions, door, **kwargs) -> list[float]:
    """Raises on every third call; else 1 for even doors."""
    if next(_calls) % 3 == 1:
        raise ConnectionError("grader unreachable")
    return [float(d % 2 == 0) for d in door]


def test_a_run_with_a_failing_reward_and_environment_keeps_going_and_saves(
    tmp_path: Path,
) -> None:
    """cpu_smoke_agent on a task of its own: the reward function fails on some calls and the
    environment's reset on door 3; the run trains its steps, logs its metrics and saves."""
    source = _task_file(tmp_path, ROWS[:5])  # no hanging door: keep the run quick
    run = run_recipe(
        "grpo",
        "cpu_smoke_agent",
        tmp_path / "run",
        *AS_TASK,
        f"dataset.source={source}",
        "dataset.shuffle_seed=0",
        "eval_dataset=null",
        "reward._component_=composer_tune.rewards.RewardFunctions",
        "reward.reward_funcs=[tests.test_task_bad_input.flaky]",
        "agent.environment=tests.test_task_bad_input.Doors",
        "agent.tools=[]",
        "num_prompts_per_generation=4",
        "group_size=2",
        "max_steps=3",
    )
    assert "warning: reward flaky ConnectionError: grader unreachable" in run.stderr
    metrics = run.metrics()
    steps = [metrics[s] for s in sorted(metrics) if "reward/unscored" in metrics[s]]
    assert len(steps) == 3 and all(math.isfinite(step["loss"]) for step in steps)
    # Door 3's failed reset: its episodes are unscored, the others train.
    assert sum(step["episode/errors"] for step in steps) > 0
    assert all(step["reward/unscored"] < 1.0 for step in steps)
    assert (tmp_path / "run" / "checkpoints" / "step_0000003").is_dir()
