"""Episodes as channel 1's data: the RolloutBatch that ``sample_rollouts(agent=...)`` returns
carries the model's tokens only in its mask, and log-probs, advantages, KL and every objective
work on it unchanged; held-out evaluation reports episode success and episode metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.agents import build_agent
from composer_tune.channels.policy import sample_rollouts
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.distributed import DistInfo
from composer_tune.evaluation import evaluate_heldout
from composer_tune.losses import PolicyLossConfig, compute_advantages, policy_loss
from composer_tune.losses.policy import OBJECTIVES
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout.generation import GenerationOutput
from composer_tune.rollout.rollouts import rollout_metrics, sequence_logprobs

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
AGENT = {"tools": ["composer_tune.agents.calculator.calculate"], "max_turns": 3}


CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "347 * 68"}}\n</tool_call>'
# Per turn, the text of each live row: row 0 of each pair calls the tool then answers right, row 1
# answers wrong at once.
CALL_THEN_ANSWER = [[CALL, "12"], ["<think>\n\n</think>\n\n23596"] * 2]


class ScriptedEngine:
    """The rollout-engine interface (``generate(prompts, **sampling)``, ``max_model_len``),
    answering turn ``k`` of the live rows with ``script[k]`` (default ``CALL_THEN_ANSWER``)."""

    max_model_len = 1024

    def __init__(self, tokenizer: ChatTokenizer, script: list[list[str]] | None = None) -> None:
        self.tokenizer, self.turn = tokenizer, 0
        self.script = script or CALL_THEN_ANSWER

    def sync_weights(self, model, version) -> bool:
        return False

    def sleep(self) -> None:
        pass

    def generate(self, prompts, *, max_new_tokens, stop_tokens, **_) -> GenerationOutput:
        texts = self.script[self.turn]
        self.turn += 1
        completions = [self.tokenizer.encode(t) + [stop_tokens[0]] for t in texts[: len(prompts)]]
        return GenerationOutput(
            completions=completions,
            completion_lengths=torch.tensor([len(c) for c in completions]),
            truncated=torch.zeros(len(completions), dtype=torch.bool),
            logprobs=[torch.full((len(c),), -1.0) for c in completions],
        )


@pytest.fixture(scope="module")
def tiny():
    section = OmegaConf.load(REPO_ROOT / "recipes/configs/grpo/cpu_smoke_agent.yaml")
    torch.manual_seed(0)
    model = config.instantiate(section.model)
    tokenizer = ChatTokenizer.from_dir(REPO_ROOT / "tests/assets/tokenizer")
    return model, tokenizer, section


def scripted_episodes(
    tiny_fixture, sample: dict, agent: dict, script: list[list[str]] | None = None, **kwargs
):
    """A group of two episodes of ``sample`` driven by ``ScriptedEngine(script)`` through
    ``sample_rollouts`` (``kwargs``: reward, reference, compute_old_logp)."""
    model, tokenizer, section = tiny_fixture
    cfg = OmegaConf.merge(
        section,
        {
            "group_size": 2,
            "micro_batch_size": 2,
            "top_k": None,
            "top_p": None,
            "logprob_chunk_size": 1024,
            "shared_prefix_forward": True,  # the group's episodes share their first prompt
        },
    )
    return sample_rollouts(
        model,
        [sample],
        cfg,
        tokenizer=tokenizer,
        generator=torch.Generator().manual_seed(0),
        sync_ranks=False,
        engine=ScriptedEngine(tokenizer, script),
        agent=build_agent(agent),
        **kwargs,
    )


def test_episode_rollout_batch_trains_only_on_model_tokens(tiny) -> None:
    model, tokenizer, _ = tiny
    sample = {"prompt": [{"role": "user", "content": "What is 347 * 68?"}], "answer": "23596"}
    batch = scripted_episodes(
        tiny, sample, AGENT, reward=MathAnswerReward(), reference=model, compute_old_logp=True
    )
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.correct.tolist() == [True, False]
    tool_row, direct_row = batch.episodes
    assert (tool_row.turns, len(tool_row.tool_calls), direct_row.turns) == (2, 1, 1)
    # The mask is exactly the sampled turns; the prompt is shared, lengths add up.
    for row, record in enumerate(batch.episodes):
        spans = [t for start, end in record.turn_spans for t in range(start, end)]
        assert torch.nonzero(batch.completion_mask[row]).flatten().tolist() == spans
        assert (
            int(batch.prompt_lengths[row] + batch.completion_lengths[row])
            == record.turn_spans[-1][1]
        )
    assert batch.prompt_lengths[0] == batch.prompt_lengths[1]
    # The tool response sits between the turns, unmasked and without sampler log-probs.
    first_end, second_start = tool_row.turn_spans[0][1], tool_row.turn_spans[1][0]
    between = tokenizer.decode(
        batch.tokens[0, first_end:second_start].tolist(), skip_special_tokens=False
    )
    assert "<tool_response>\n23596\n</tool_response>" in between
    assert not batch.sampling_logp[0, first_end:second_start].any()
    assert (batch.sampling_logp[batch.completion_mask] == -1.0).all()
    # Old and reference log-probs: the trainer's, at the model's tokens only.
    with torch.no_grad():
        expected = sequence_logprobs(model, batch.tokens, batch.input_pos, batch.completion_mask)
    torch.testing.assert_close(batch.old_logp, expected)
    torch.testing.assert_close(batch.ref_logp, expected)
    assert not batch.old_logp[~batch.completion_mask].any()
    # Every objective (with a KL term) trains on the model's tokens and nothing else.
    advantages = compute_advantages(batch.rewards, 2, "group")
    for objective in OBJECTIVES:
        logp = sequence_logprobs(model, batch.tokens, batch.input_pos, batch.completion_mask)
        logp.retain_grad()
        loss_cfg = PolicyLossConfig(objective=objective, beta=0.04, max_completion_length=64)
        loss, _ = policy_loss(
            logp,
            batch.old_logp,
            advantages,
            batch.completion_mask,
            loss_cfg,
            ref_logp=batch.ref_logp,
        )
        loss.backward()
        assert torch.isfinite(loss), objective
        assert not logp.grad[~batch.completion_mask].any(), objective
        assert logp.grad[batch.completion_mask].abs().sum() > 0, objective
        model.zero_grad(set_to_none=True)
    # Slicing keeps the records; the metrics count the episodes.
    assert batch.select(slice(1, 2)).episodes == [direct_row]
    metrics = rollout_metrics(batch)
    assert metrics["episode/turns"] == 1.5 and metrics["episode/tool_calls"] == 0.5
    assert metrics["episode/tool_errors"] == 0.0 and metrics["episode/truncated"] == 0.0
    assert metrics["episode/generation_seconds"] >= 0 and "episode/env_seconds" in metrics


def test_heldout_evaluation_runs_greedy_episodes(tiny) -> None:
    model, tokenizer, _ = tiny
    from composer_tune.agents.calculator import CalculatorProblems

    dataset = CalculatorProblems("heldout", 3, seed=1)
    agent = build_agent({**AGENT, "max_tokens_per_turn": 4})
    result = evaluate_heldout(
        model,
        tokenizer,
        dataset,
        MathAnswerReward(),
        dist_info=CPU,
        batch_size=2,
        max_new_tokens=4,
        enable_thinking=True,
        agent=agent,
    )
    metrics = result.metrics()
    assert result.num_samples == 3 and metrics["eval/accuracy"] == 0.0
    assert metrics["eval/turns"] == 1.0 and metrics["eval/truncated"] == 1.0  # 4 random tokens
    assert metrics["eval/tool_use_rate"] == 0.0 and metrics["eval/completion_tokens"] == 4.0
    json.dumps(result.examples)  # loggable
