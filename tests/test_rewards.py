"""Tests for the math answer, format and composite rewards."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from composer_tune.data import GSM8K, SyntheticArithmetic
from composer_tune.rewards import (
    CompositeReward,
    FormatReward,
    MathAnswerReward,
    RewardResult,
    final_response,
)
from composer_tune.rewards.format import think_tags_balanced

GSM8K_DIR = Path(__file__).parent / "assets" / "gsm8k"

YAML = """
reward:
  _component_: composer_tune.rewards.CompositeReward
  components:
    - reward: {_component_: composer_tune.rewards.MathAnswerReward}
      weight: 1.0
    - reward: {_component_: composer_tune.rewards.FormatReward}
      weight: 0.1
"""


class FixedReward:
    """A stub component returning preset results, counting how often it is called."""

    def __init__(self, results: list[RewardResult]) -> None:
        self.results = results
        self.calls = 0

    def __call__(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        self.calls += 1
        return self.results[: len(completions)]


def _sample(answer: str) -> dict[str, Any]:
    return {"id": f"s-{answer}", "prompt": [], "answer": answer, "target": "", "solution": None}


@pytest.mark.parametrize(
    "dataset",
    [
        SyntheticArithmetic("heldout", 100, seed=0, operations=("add", "sub", "mul")),
        GSM8K("test", source=str(GSM8K_DIR), num_samples=150),
        GSM8K("test", source=str(GSM8K_DIR), num_samples=150, target_format="boxed"),
    ],
    ids=["synthetic", "gsm8k-answer-is", "gsm8k-boxed"],
)
def test_reference_targets_score_one_and_shifted_answers_zero(dataset) -> None:
    samples = [dataset[i] for i in range(len(dataset))]
    reward = MathAnswerReward()
    results = reward([s["target"] for s in samples], samples)
    assert all(
        r == RewardResult(1.0, True, f"Your final answer {s['answer']} is correct.")
        for r, s in zip(results, samples, strict=True)
    )
    wrong = [str(int(s["answer"]) + 1) for s in samples]
    results = reward(wrong, samples)
    assert [r.score for r in results] == [0.0] * len(samples)
    assert [r.feedback for r in results] == [f"Your final answer {w} is wrong." for w in wrong]


@pytest.mark.parametrize(
    ("completion", "gold", "reveal", "expected"),
    [
        (
            "The answer is 42.",
            "42",
            False,
            RewardResult(1.0, True, "Your final answer 42 is correct."),
        ),
        (
            "#### 1,234",
            "1234",
            False,
            RewardResult(1.0, True, "Your final answer 1234 is correct."),
        ),
        (
            "\\boxed{\\frac{1}{2}}",
            "0.5",
            False,
            RewardResult(1.0, True, "Your final answer 0.5 is correct."),
        ),
        ("It is 41", "42", False, RewardResult(0.0, False, "Your final answer 41 is wrong.")),
        (
            "It is 41",
            "42",
            True,
            RewardResult(0.0, False, "Your final answer 41 is wrong. The correct answer is 42."),
        ),
        ("I give up.", "42", False, RewardResult(0.0, False, "No final answer found.")),
        (
            "I give up.",
            "42",
            True,
            RewardResult(0.0, False, "No final answer found. The correct answer is 42."),
        ),
        # Numbers tried while thinking are not the answer; an unfinished think block has none.
        (
            "<think>maybe 41? no, 42</think>The answer is 42.",
            "42",
            False,
            RewardResult(1.0, True, "Your final answer 42 is correct."),
        ),
        (
            "<think>6*7 = 42, so the answer is 42",
            "42",
            False,
            RewardResult(0.0, False, "No final answer found."),
        ),
        (
            "<think>42</think>I think it is 41",
            "42",
            False,
            RewardResult(0.0, False, "Your final answer 41 is wrong."),
        ),
    ],
)
def test_math_answer_reward_cases(
    completion: str, gold: str, reveal: bool, expected: RewardResult
) -> None:
    reward = MathAnswerReward(reveal_answer=reveal)
    assert reward([completion], [_sample(gold)]) == [expected]


def test_math_answer_reward_can_read_inside_thinking() -> None:
    completion = "<think>6*7 = 42, so the answer is 42"
    assert MathAnswerReward(strip_thinking=False)([completion], [_sample("42")])[0].correct


def test_math_answer_reward_errors_name_the_culprit() -> None:
    reward = MathAnswerReward(answer_key="gold")
    with pytest.raises(KeyError, match="sample 1 \\(id 's-2'\\) has no 'gold' field"):
        reward(["1", "2"], [{"gold": "1"}, _sample("2")])
    with pytest.raises(ValueError, match="MathAnswerReward: got 2 completions for 1 samples"):
        MathAnswerReward()(["1", "2"], [_sample("1")])
    with pytest.raises(
        ValueError, match="sample 0 \\(id 's-n/a'\\): answers_match: gold answer 'n/a' holds"
    ):
        MathAnswerReward()(["1"], [_sample("n/a")])


@pytest.mark.parametrize(
    ("text", "balanced"),
    [
        ("no tags", True),
        ("<think>a</think>b", True),
        ("<think>a</think><think>b</think>c", True),
        ("<think>a", False),
        ("a</think>", False),
        ("<think><think>a</think></think>", False),
        ("</think><think>", False),
    ],
)
def test_think_tags_balanced(text: str, balanced: bool) -> None:
    assert think_tags_balanced(text) is balanced


@pytest.mark.parametrize(
    ("text", "final"),
    [
        ("plain 5", "plain 5"),
        ("<think>a</think> b", " b"),
        ("<think>a</think>b<think>c</think>d", "d"),
        ("<think>a</think>b<think>unfinished", ""),
    ],
)
def test_final_response(text: str, final: str) -> None:
    assert final_response(text) == final


@pytest.mark.parametrize(
    ("completion", "score", "feedback"),
    [
        ("<think>hmm</think>The answer is 5.", 0.5, ""),
        ("Final Answer: 5", 0.5, ""),
        ("so \\boxed{5}", 0.5, ""),
        ("It is 5.", 0.0, "Your response does not state its final answer in the expected format."),
        (
            "<think>the answer is 5",
            0.0,
            "Your <think> tags are unbalanced. Your response does not state its final answer in the expected format.",
        ),
        ("<think>a</think></think>#### 5", 0.0, "Your <think> tags are unbalanced."),
    ],
)
def test_format_reward(completion: str, score: float, feedback: str) -> None:
    result = FormatReward(bonus=0.5)([completion], [_sample("5")])[0]
    assert result == RewardResult(score, None, feedback)


def test_format_reward_custom_pattern_and_no_think_check() -> None:
    bare_number = FormatReward(pattern=r"^\s*-?\d+\s*$", check_think=False)
    results = bare_number(["415", "It is 415", "</think>415"], [_sample("415")] * 3)
    assert [r.score for r in results] == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="pattern '\\(' is not a valid regex"):
        FormatReward(pattern="(")


def test_composite_from_yaml_scores_weighted_sum() -> None:
    from torchtune import config

    reward = config.instantiate(OmegaConf.create(YAML).reward)
    assert isinstance(reward, CompositeReward)
    completions = [
        "<think>7*6</think>The answer is 42.",  # right, well formed
        "The answer is 41.",  # wrong, well formed
        "42",  # right, no marker
        "<think>41",  # unfinished
    ]
    samples = [_sample("42")] * 4
    results = reward(completions, samples)
    # Peer computation: call the components directly and combine by hand.
    math_results = MathAnswerReward()(completions, samples)
    format_results = FormatReward()(completions, samples)
    for result, m, f in zip(results, math_results, format_results, strict=True):
        assert result.score == pytest.approx(1.0 * m.score + 0.1 * f.score)
        assert result.correct is m.correct
        assert result.feedback == " ".join(x for x in (m.feedback, f.feedback) if x)
    assert [r.score for r in results] == pytest.approx([1.1, 0.1, 1.0, 0.0])
    assert results[3].feedback == (
        "No final answer found. Your <think> tags are unbalanced. "
        "Your response does not state its final answer in the expected format."
    )


def test_composite_yaml_passes_component_arguments_and_nests() -> None:
    from torchtune import config

    cfg = OmegaConf.create(
        """
        _component_: composer_tune.rewards.CompositeReward
        components:
          - reward:
              _component_: composer_tune.rewards.CompositeReward
              components:
                - reward: {_component_: composer_tune.rewards.MathAnswerReward, reveal_answer: true}
                  weight: 2
            weight: 1.0
          - reward: {_component_: composer_tune.rewards.FormatReward, bonus: 0.5}
            weight: -1.0
        """
    )
    reward = config.instantiate(cfg)
    [result] = reward(["It is 41"], [_sample("42")])
    assert result.score == pytest.approx(2 * 0.0 - 1.0 * 0.0)
    assert result.feedback.startswith("Your final answer 41 is wrong. The correct answer is 42.")
    [result] = reward(["The answer is 42"], [_sample("42")])
    assert result.score == pytest.approx(2 * 1.0 - 1.0 * 0.5)


def test_composite_correctness_needs_every_defined_verdict() -> None:
    yes, no, none = (RewardResult(1.0, True), RewardResult(0.0, False), RewardResult(0.5, None))
    first = FixedReward([yes, yes, none])
    second = FixedReward([yes, no, none])
    reward = CompositeReward([{"reward": first, "weight": 1.0}, {"reward": second, "weight": 3.0}])
    results = reward(["a", "b", "c"], [_sample("1")] * 3)
    assert [r.correct for r in results] == [True, False, None]
    assert [r.score for r in results] == pytest.approx([4.0, 1.0, 2.0])
    # Each component scores the batch in one call.
    assert first.calls == second.calls == 1


def test_composite_sums_the_scorable_parts_and_is_unscorable_only_when_all_parts_are() -> None:
    """TRL 1.16: ``nansum`` over reward functions, NaN only where every function returned NaN."""
    nan = float("nan")
    answer = FixedReward([RewardResult(1.0, True), RewardResult(nan), RewardResult(nan)])
    bonus = FixedReward([RewardResult(nan), RewardResult(0.5), RewardResult(nan)])
    reward = CompositeReward([{"reward": answer, "weight": 2.0}, {"reward": bonus, "weight": 0.1}])
    first, second, third = reward(["a", "b", "c"], [_sample("1")] * 3)
    assert first.score == pytest.approx(2.0)
    assert second.score == pytest.approx(0.05)
    assert math.isnan(third.score)
    assert first.correct is True


@pytest.mark.parametrize(
    ("components", "error", "message"),
    [
        ([], ValueError, "components is empty"),
        ([{"reward": MathAnswerReward()}], ValueError, "components\\[0\\] must have exactly"),
        (
            [{"reward": MathAnswerReward(), "weight": 1, "extra": 0}],
            ValueError,
            "components\\[0\\] must have exactly",
        ),
        ([{"reward": MathAnswerReward(), "weight": "1"}], TypeError, "components\\[0\\].weight"),
        (
            [{"reward": MathAnswerReward(), "weight": 1}, {"reward": {"bonus": 1}, "weight": 1}],
            ValueError,
            "components\\[1\\].reward is a mapping without '_component_'",
        ),
        ([{"reward": 3, "weight": 1}], TypeError, "components\\[0\\].reward is not a reward"),
    ],
)
def test_composite_bad_components_name_the_culprit(
    components: list, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        CompositeReward(components)


def test_composite_rejects_a_component_returning_the_wrong_count() -> None:
    short = FixedReward([RewardResult(1.0)])
    reward = CompositeReward([{"reward": short, "weight": 1.0}])
    with pytest.raises(ValueError, match="FixedReward returned 1 results for 2 completions"):
        reward(["a", "b"], [_sample("1")] * 2)
