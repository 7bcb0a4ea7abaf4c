"""composer_tune.rewards.RewardFunctions: reward functions as TRL 1.16 writes them (sync or
async, weighted, None for "not applicable"), the environment's ``get_reward()``, the project's
``RewardResult`` rewards beside them, success from a threshold, set-up checks, and every way a
reward can fail at run time leaving its rows unscored with one warning line."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from omegaconf import OmegaConf

from composer_tune.data.task_dataset import TaskRow
from composer_tune.rewards import MathAnswerReward, RewardFunctions, RewardResult
from composer_tune.rewards.functions import ScoringBatch, build_reward, score_completions

SAMPLES = [
    {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "kind": "math"},
    {"prompt": [{"role": "user", "content": "Name a colour."}], "answer": "7", "kind": "chat"},
]
TEXTS = ["4", "blue"]
IDS = [[7, 8], [9]]

received: dict = {}


def records_arguments(prompts, completions, completion_ids, **columns) -> list[float]:
    received.update(prompts=prompts, completions=completions, ids=completion_ids, **columns)
    return [1.0, 0.0]


def math_only(completions, kind, **kwargs) -> list[float | None]:
    """Scores math rows (1 when the reply is 4), None (not applicable) for the others."""
    return [
        float(c[-1]["content"] == "4") if k == "math" else None
        for c, k in zip(completions, kind, strict=True)
    ]


def length_bonus(completions, **kwargs) -> list[float]:
    return [0.5 * len(c[-1]["content"]) for c in completions]


async def async_half(completions, **kwargs) -> list[float]:
    await asyncio.sleep(0)
    return [0.5] * len(completions)


def nothing_applies(completions, **kwargs) -> list[None]:
    return [None] * len(completions)


def _batch(samples=SAMPLES, texts=TEXTS, ids=IDS, environments=None) -> ScoringBatch:
    return ScoringBatch(list(samples), list(texts), ids, environments=environments)


def test_trl_arguments_and_columns_reach_the_function() -> None:
    received.clear()
    RewardFunctions([records_arguments]).score(_batch())
    assert received["prompts"] == [s["prompt"] for s in SAMPLES]
    assert received["completions"] == [
        [{"role": "assistant", "content": "4"}],
        [{"role": "assistant", "content": "blue"}],
    ]
    assert received["ids"] == IDS
    assert received["answer"] == ["4", "7"] and received["kind"] == ["math", "chat"]
    assert "prompt" not in received and "environments" not in received


def test_standard_rows_give_strings_as_trl_does() -> None:
    received.clear()
    rows = [TaskRow({"prompt": [{"role": "user", "content": "Hi"}], "n": 1}, prompt_text="Hi")]
    RewardFunctions([records_arguments]).score(_batch(rows, ["there"], [[1]]))
    assert received["prompts"] == ["Hi"] and received["completions"] == ["there"]


def test_weights_nansum_and_rows_every_function_skips_are_unscored() -> None:
    reward = RewardFunctions([math_only, length_bonus], reward_weights=[2.0, 1.0])
    results = reward.score(_batch())
    # Row 0: 2 * 1 + 0.5 * 1; row 1: math_only is None (skipped), 0.5 * 4.
    assert [r.score for r in results] == [2.5, 2.0]
    results = RewardFunctions([math_only, nothing_applies]).score(_batch())
    assert results[0].score == 1.0 and math.isnan(results[1].score)
    assert results[1].correct is None  # unscored: no verdict either


def test_async_functions_are_awaited() -> None:
    results = RewardFunctions([async_half, math_only]).score(_batch())
    assert [r.score for r in results] == [1.5, 0.5]


def test_success_threshold_decides_success_for_plain_floats() -> None:
    scores = [r.correct for r in RewardFunctions([length_bonus]).score(_batch())]
    assert scores == [False, True]  # 0.5 < 1.0 <= 2.0
    strict = RewardFunctions([length_bonus], success_threshold=3.0).score(_batch())
    assert [r.correct for r in strict] == [False, False]


def test_project_rewards_mix_with_functions_and_keep_their_verdict_and_feedback() -> None:
    reward = RewardFunctions([MathAnswerReward(), length_bonus], reward_weights=[1.0, 0.1])
    results = reward.score(_batch())
    assert results[0] == RewardResult(1.05, True, "Your final answer 4 is correct.")
    assert results[1].score == pytest.approx(0.2) and results[1].correct is False


class Meter:
    """An environment with ``get_reward()`` (TRL's contract); ``None`` rows lack one."""

    def __init__(self, value: float) -> None:
        self.value = value

    def get_reward(self) -> float:
        return self.value


class Broken:
    def get_reward(self) -> float:
        raise RuntimeError("meter offline")


def test_environment_reward_is_a_weight_one_part_and_the_only_one_without_functions() -> None:
    environments = [Meter(2.0), Meter(0.0)]
    results = RewardFunctions().score(_batch(environments=environments))
    assert [(r.score, r.correct) for r in results] == [(2.0, True), (0.0, False)]
    results = RewardFunctions([math_only]).score(_batch(environments=environments))
    assert [r.score for r in results] == [3.0, 0.0]
    received.clear()
    RewardFunctions([records_arguments]).score(_batch(environments=environments))
    assert received["environments"] == environments


class Stuck:
    def get_reward(self) -> float:
        time.sleep(5)
        return 1.0


def test_a_get_reward_that_hangs_is_abandoned_after_the_timeout(capsys) -> None:
    reward = RewardFunctions([math_only], timeout_s=0.2)
    results = reward.score(_batch(environments=[Stuck(), Meter(1.0)]))
    assert results[0].score == 1.0 and results[1].score == 1.0  # row 1: the meter alone
    assert "warning: Stuck.get_reward timed out after 0.2 s" in capsys.readouterr().err


def test_a_failing_get_reward_leaves_its_row_to_the_other_parts(capsys) -> None:
    results = RewardFunctions([math_only]).score(_batch(environments=[Broken(), Broken()]))
    assert results[0].score == 1.0 and "get_reward failed: RuntimeError: meter offline" in (
        results[0].feedback
    )
    assert math.isnan(results[1].score)
    assert capsys.readouterr().err.count("warning: Broken.get_reward RuntimeError") == 2


def test_sdpo_feedback_column_becomes_feedback() -> None:
    rows = [{**SAMPLES[0], "privileged_context": "The answer is 4."}, SAMPLES[1]]
    results = RewardFunctions([math_only]).score(_batch(rows))
    assert results[0].feedback == "The answer is 4." and results[1].feedback == ""


def raises(completions, **kwargs):
    raise KeyError("stock")


def wrong_count(completions, **kwargs):
    return [1.0]


def not_a_list(completions, **kwargs):
    return 1.0


def bad_values(completions, **kwargs):
    return ["1.0", math.inf]


def nan_values(completions, **kwargs):
    return [math.nan, 1.0]


def hangs(completions, **kwargs):
    time.sleep(5)
    return [1.0, 1.0]


@pytest.mark.parametrize(
    ("function", "timeout_s", "warnings"),
    [
        (raises, None, ["reward raises KeyError: 'stock': its part of 2 completions is unscored"]),
        (wrong_count, None, ["reward wrong_count returned 1 rewards for 2 completions"]),
        (not_a_list, None, ["reward not_a_list returned float, not a list of rewards"]),
        (
            bad_values,
            None,
            [
                "reward bad_values returned '1.0' for completion 0, not a number",
                "reward bad_values returned inf for completion 1",
            ],
        ),
        (hangs, 0.2, ["reward hangs timed out after 0.2 s"]),
    ],
)
def test_a_failing_function_leaves_its_rows_unscored_with_a_warning(
    capsys, function, timeout_s, warnings
) -> None:
    results = RewardFunctions([function, math_only], timeout_s=timeout_s).score(_batch())
    # math_only still scores row 0; row 1 (math_only: None) has no part left.
    assert results[0].score == 1.0 and math.isnan(results[1].score)
    err = capsys.readouterr().err
    for warning in warnings:
        assert f"warning: {warning}" in err
    assert all(line.startswith("warning: ") for line in err.splitlines())


def test_nan_is_not_applicable_as_trl_reads_it(capsys) -> None:
    results = RewardFunctions([nan_values]).score(_batch())
    assert math.isnan(results[0].score) and results[1].score == 1.0
    assert capsys.readouterr().err == ""


def test_a_failing_project_reward_is_unscored_too(capsys) -> None:
    rows = [{"prompt": s["prompt"]} for s in SAMPLES]  # no "answer": MathAnswerReward raises
    results = RewardFunctions([MathAnswerReward()]).score(_batch(rows))
    assert all(math.isnan(r.score) for r in results)
    assert "warning: reward MathAnswerReward KeyError" in capsys.readouterr().err


def needs_stock(completions, stock) -> list[float]:
    return [0.0] * len(completions)


def names_every_column(prompts, completions, completion_ids, stock, item) -> list[float]:
    return [0.0] * len(completions)


def test_setup_checks_name_the_problem_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^reward: no reward: give reward functions, or an"):
        RewardFunctions().check(["prompt"], environment_reward=False, where="reward")
    RewardFunctions().check(["prompt"], environment_reward=True, where="reward")
    with pytest.raises(ValueError) as info:
        RewardFunctions([needs_stock]).check(
            ["prompt", "stock", "item"], environment_reward=False, where="reward"
        )
    message = str(info.value)
    assert message.startswith("reward: reward function needs_stock cannot be called with TRL's")
    assert "(add **kwargs)" in message and "\n" not in message
    # Naming every column works until an environment runs the episodes: TRL then passes
    # `environments` too.
    columns = ["prompt", "stock", "item"]
    RewardFunctions([names_every_column]).check(columns, where="reward")
    with pytest.raises(ValueError, match="unexpected keyword argument 'environments'"):
        RewardFunctions([names_every_column]).check(columns, environments=True, where="reward")
    with pytest.raises(ValueError, match="3 weights for 1 reward functions"):
        RewardFunctions([math_only], reward_weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="cannot import 'no.such.function'"):
        RewardFunctions(["no.such.function"])


def test_build_reward_from_config_nodes() -> None:
    path = "tests.test_reward_functions.math_only"
    assert build_reward(None).entries == []
    assert build_reward(path).names == ["math_only"]
    assert build_reward(
        OmegaConf.create([path, "tests.test_reward_functions.length_bonus"])
    ).names == [
        "math_only",
        "length_bonus",
    ]
    node = OmegaConf.create(
        {
            "_component_": "composer_tune.rewards.RewardFunctions",
            "reward_funcs": [path, {"_component_": "composer_tune.rewards.MathAnswerReward"}],
            "reward_weights": [1.0, 0.5],
            "success_threshold": 2.0,
        }
    )
    reward = build_reward(node)
    assert reward.names == ["math_only", "MathAnswerReward"] and reward.weights == [1.0, 0.5]
    assert reward.success_threshold == 2.0
    project = build_reward(
        OmegaConf.create({"_component_": "composer_tune.rewards.MathAnswerReward"})
    )
    assert [r.score for r in score_completions(project, _batch())] == [1.0, 0.0]
