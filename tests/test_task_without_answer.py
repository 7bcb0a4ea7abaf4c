"""Evaluation without a gold answer: held-out success comes from the same reward functions and
environment as training, greedy and sampled (``eval_sampling``), on rows with no ``answer``
column (before, ``evaluate_heldout`` stopped with ``KeyError: 'answer'``)."""

from __future__ import annotations

import json

import pytest
import torch

from composer_tune.agents import build_agent
from composer_tune.config import EvalSampling
from composer_tune.data import TaskDataset
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.distributed import DistInfo
from composer_tune.evaluation import evaluate_heldout
from composer_tune.models import qwen3_tiny
from composer_tune.rewards import RewardFunctions
from tests.test_agent_episodes import QWEN3_TOKENIZER

CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
# Three of the four held-out rows pay, whatever the model writes: success is 0.75 exactly when
# the rows' own columns reach the reward (or the environment) and nothing needs an answer.
ROWS = [
    {"prompt": [{"role": "user", "content": f"Task {i}."}], "pays": i != 2, "code": f"c{i}"}
    for i in range(4)
]


def pays_column(completions, pays, **kwargs) -> list[float]:
    return [float(p) for p in pays]


class Paying:
    """A TRL environment whose reward is the row's ``pays`` column."""

    def reset(self, pays: bool, **row) -> None:
        self.pays = pays

    def inspect(self, code: str) -> str:
        """Inspect a code.

        Args:
            code: The code.
        """
        return code

    def get_reward(self) -> float:
        return float(self.pays)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory: pytest.TempPathFactory) -> TaskDataset:
    path = tmp_path_factory.mktemp("task") / "heldout.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    data = TaskDataset(str(path))
    assert all("answer" not in data[i] for i in range(len(data)))
    return data


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return qwen3_tiny(vocab_size=994, max_seq_len=1024).eval(), ChatTokenizer.from_dir(
        QWEN3_TOKENIZER
    )


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_reward_functions_decide_heldout_success(heldout, tiny, sampled: bool) -> None:
    model, tokenizer = tiny
    sampling = EvalSampling(samples_per_problem=2, temperature=1.0, seed=0) if sampled else None
    result = evaluate_heldout(
        model, tokenizer, heldout, RewardFunctions([pays_column]), dist_info=CPU,
        batch_size=4, max_new_tokens=4, sampling=sampling, enable_thinking=True,
    )  # fmt: skip
    assert result.accuracy == 0.75 and result.reward_mean == 0.75
    assert result.num_samples == 4 * (2 if sampled else 1)
    if not sampled:
        assert "gold" not in result.examples[0] and result.examples[0]["reward"] == 1.0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_environment_alone_decides_heldout_success(heldout, tiny, sampled: bool) -> None:
    model, tokenizer = tiny
    agent = build_agent(
        {"environment": "tests.test_task_without_answer.Paying", "max_turns": 2,
         "max_tokens_per_turn": 4}
    )  # fmt: skip
    sampling = EvalSampling(samples_per_problem=2, temperature=1.0, seed=0) if sampled else None
    result = evaluate_heldout(
        model, tokenizer, heldout, RewardFunctions(), dist_info=CPU, batch_size=4,
        max_new_tokens=4, sampling=sampling, enable_thinking=True, agent=agent,
    )  # fmt: skip
    assert result.accuracy == 0.75 and result.episode_metrics["errors"] == 0.0
