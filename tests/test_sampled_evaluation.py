"""The sampled held-out evaluation (``eval_sampling``): k samples per problem, seeded, mean success
(avg@k), logged as ``eval_sampled/*`` beside the greedy ``eval/*``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.agents import build_agent
from composer_tune.agents.calculator import CalculatorProblems
from composer_tune.data.synthetic import SyntheticArithmetic
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.distributed import DistInfo
from composer_tune.evaluation import EvalSampling, evaluate_heldout
from composer_tune.rewards.base import RewardResult

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
PROBLEMS = 5


@pytest.fixture(scope="module")
def tiny():
    section = OmegaConf.load(REPO_ROOT / "recipes/configs/grpo/cpu_smoke.yaml")
    torch.manual_seed(0)
    model = config.instantiate(section.model)
    tokenizer = ChatTokenizer.from_dir(REPO_ROOT / "tests/assets/tokenizer")
    return model, tokenizer


class MatchesText:
    """Correct iff the completion equals ``expected[problem id]``: with the greedy texts, greedy
    decoding scores 1 on every problem and any other completion 0."""

    def __init__(self, expected: Mapping[str, str]) -> None:
        self.expected = expected

    def __call__(self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]):
        matches = [
            self.expected.get(sample["id"]) == text
            for text, sample in zip(completions, samples, strict=True)
        ]
        return [RewardResult(score=float(ok), correct=ok) for ok in matches]


def evaluate(model, tokenizer, dataset, reward, sampling=None, **kwargs):
    return evaluate_heldout(
        model, tokenizer, dataset, reward, dist_info=CPU, batch_size=4, max_new_tokens=6,
        num_examples=100, sampling=sampling, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def greedy(tiny):
    """The problems and the reward that scores exactly the greedy completions correct."""
    model, tokenizer = tiny
    dataset = SyntheticArithmetic(split="heldout", num_samples=PROBLEMS, seed=1)
    texts = evaluate(model, tokenizer, dataset, MatchesText({})).examples
    expected = {dataset[i]["id"]: texts[i]["completion"] for i in range(PROBLEMS)}
    return dataset, MatchesText(expected)


def test_greedy_is_the_default_and_logs_under_eval(tiny, greedy) -> None:
    dataset, reward = greedy
    result = evaluate(*tiny, dataset, reward)
    assert result.accuracy == 1.0 and result.num_samples == PROBLEMS
    assert set(result.metrics()) == {
        "eval/accuracy",
        "eval/reward_mean",
        "eval/completion_tokens",
        "eval/truncated",
    }
    # The tiny random model never stops within 6 tokens: every completion is truncated.
    assert result.metrics()["eval/truncated"] == 1.0


def test_a_cold_sample_is_the_greedy_one_and_every_sample_counts(tiny, greedy) -> None:
    dataset, reward = greedy
    result = evaluate(*tiny, dataset, reward, EvalSampling(samples_per_problem=3, temperature=1e-4))
    assert result.num_samples == 3 * PROBLEMS and result.accuracy == 1.0
    metrics = result.metrics()
    assert set(metrics) == {
        "eval_sampled/accuracy",
        "eval_sampled/reward_mean",
        "eval_sampled/completion_tokens",
        "eval_sampled/truncated",
    }
    assert "sampled, mean of 3 per problem" in result.summary()
    assert f"over {PROBLEMS} problems" in result.summary()


def test_hot_samples_are_seeded_and_scored_one_by_one(tiny, greedy) -> None:
    dataset, reward = greedy
    hot = EvalSampling(samples_per_problem=4, temperature=3.0, seed=7)
    first = evaluate(*tiny, dataset, reward, hot)
    again = evaluate(*tiny, dataset, reward, hot)
    other = evaluate(*tiny, dataset, reward, EvalSampling(4, 3.0, seed=8))
    # The same seed draws the same samples; another seed others.
    assert first.examples == again.examples and first.accuracy == again.accuracy
    assert first.examples != other.examples
    # A random model at temperature 3 rarely repeats its greedy text: the mean counts each
    # sample (k consecutive examples per problem, in order), not the problem's best one.
    texts = [example["completion"] for example in first.examples]
    assert len(texts) == 4 * PROBLEMS
    matches = sum(text == reward.expected[dataset[i // 4]["id"]] for i, text in enumerate(texts))
    assert first.accuracy == matches / (4 * PROBLEMS) < 1.0


def test_sampled_agent_episodes_log_episode_metrics_under_eval_sampled(tiny) -> None:
    model, tokenizer = tiny
    section = OmegaConf.load(REPO_ROOT / "recipes/configs/grpo/cpu_smoke_agent.yaml")
    torch.manual_seed(0)
    agent_model = config.instantiate(section.model)
    agent = build_agent({**section.agent, "max_tokens_per_turn": 4})
    result = evaluate(
        agent_model, tokenizer, CalculatorProblems("heldout", 3, seed=1), MatchesText({}),
        EvalSampling(samples_per_problem=2), agent=agent, enable_thinking=True,
    )  # fmt: skip
    metrics = result.metrics()
    assert result.num_samples == 6 and metrics["eval_sampled/accuracy"] == 0.0
    assert metrics["eval_sampled/turns"] == 1.0 and metrics["eval_sampled/tool_use_rate"] == 0.0
    assert not any(key.startswith("eval/") for key in metrics)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"samples_per_problem": 0}, "samples_per_problem must be >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
    ],
)
def test_bad_sampling_settings_are_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalSampling(**fields)


def test_config_key_is_checked_when_the_config_loads() -> None:
    cfg = config.load_recipe_config(
        REPO_ROOT / "recipes/grpo.py", "cpu_smoke", ["eval_sampling.samples_per_problem=4"]
    )
    assert cfg.eval_sampling == {"samples_per_problem": 4, "temperature": 1.0, "seed": 0}
    with pytest.raises(config.ConfigError, match="'eval_sampling.samples'"):
        config.load_recipe_config(
            REPO_ROOT / "recipes/grpo.py", "cpu_smoke", ["eval_sampling.samples=4"]
        )


def test_group_by_reports_each_groups_accuracy(tiny, greedy) -> None:
    """``group_by`` (config ``eval_group_by``): accuracy within each value of a dataset column,
    beside the overall one; problems scored wrong count in their own group only."""
    dataset, reward = greedy
    rows = [{**dataset[i], "split": "even" if i % 2 == 0 else "odd"} for i in range(PROBLEMS)]
    one_odd_wrong = MatchesText({**reward.expected, rows[1]["id"]: "never generated"})
    result = evaluate(*tiny, rows, one_odd_wrong, group_by="split")
    assert result.group_accuracy == {"even": 1.0, "odd": 0.5}
    assert result.accuracy == pytest.approx(4 / PROBLEMS)
    assert result.metrics()["eval/accuracy/odd"] == 0.5
    assert "even 1.000, odd 0.500" in result.summary()
