"""Tests for composer_tune.rollout.rollouts: the group-rollout engine on a tiny random Qwen3.

References are independent of the code under test: prompts rendered by the tokenizer directly,
log-probabilities from one full-logits forward of the whole packed row (no chunking, no shift
helper) and, separately, the generator's own sampling log-probabilities; rewards recomputed by
calling the reward on the decoded texts.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from composer_tune.data.synthetic import SyntheticArithmetic
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.models import qwen3_tiny
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout import generate
from composer_tune.rollout.rollouts import (
    RolloutBatch,
    collect_rollouts,
    rollout_metrics,
    sequence_logprobs,
)

GROUP = 4
MAX_NEW = 6
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_dir("tests/assets/tokenizer")


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    data = SyntheticArithmetic(split="train", num_samples=3, seed=0, min_digits=1)
    return [data[i] for i in range(3)]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # A wide init gives peaky logits, so a misaligned log-prob is far from the right one.
    return qwen3_tiny(vocab_size=994, initializer_range=0.3).eval()


class _ManyStopsTokenizer:
    """The real tokenizer, but one token in 16 ends a completion, so a random model
    produces both stopped and truncated rows."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.stop_tokens = list(range(0, 994, 16))

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _rollout(tokenizer, samples, *, seed: int = 0, reference=None, **kwargs) -> RolloutBatch:
    return collect_rollouts(
        _model(0),
        tokenizer,
        samples,
        MathAnswerReward(),
        group_size=GROUP,
        max_new_tokens=MAX_NEW,
        temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(seed),
        reference=reference,
        **kwargs,
    )


def _the_same_draw(tokenizer, batch: RolloutBatch):
    """``_rollout``'s draw again (same model and seed), with the sampler's log-probs."""
    return generate(
        _model(0),
        [batch.tokens[row, : int(batch.prompt_lengths[row])].tolist() for row in range(len(batch))],
        max_new_tokens=MAX_NEW,
        pad_id=tokenizer.pad_id,
        temperature=TEMPERATURE,
        stop_tokens=tokenizer.stop_tokens,
        generator=torch.Generator().manual_seed(0),
        return_logprobs=True,
    )


def _naive_logprobs(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """Log-prob of every completion token from full logits, row by row, unpadded."""
    expected = torch.zeros(batch.tokens.shape)
    with torch.no_grad():
        for row in range(len(batch)):
            start = int(batch.prompt_lengths[row])
            end = start + int(batch.completion_lengths[row])
            ids = batch.tokens[row, :end]
            logits = model(ids[None])[0].float() / TEMPERATURE
            logprobs = torch.log_softmax(logits, dim=-1)
            for t in range(start, end):  # token t is predicted by the logits at t - 1
                expected[row, t] = logprobs[t - 1, ids[t]]
    return expected


def test_group_layout(tokenizer, samples) -> None:
    batch = _rollout(tokenizer, samples)
    assert len(batch) == len(samples) * GROUP
    assert batch.group_ids.tolist() == [g for g in range(len(samples)) for _ in range(GROUP)]
    for row in range(len(batch)):
        sample = samples[row // GROUP]
        assert batch.samples[row] is sample
        prompt, _ = tokenizer.tokenize_messages(
            sample["prompt"], add_generation_prompt=True, enable_thinking=False
        )
        assert int(batch.prompt_lengths[row]) == len(prompt)
        assert batch.tokens[row, : len(prompt)].tolist() == prompt
    # Rewards are the reward's scores of exactly the decoded completions.
    completions = [
        batch.tokens[row, int(p) : int(p) + int(c)].tolist()
        for row, (p, c) in enumerate(
            zip(batch.prompt_lengths, batch.completion_lengths, strict=True)
        )
    ]
    texts = [tokenizer.decode(ids) for ids in completions]
    assert batch.texts == texts
    results = MathAnswerReward()(texts, batch.samples)
    assert batch.rewards.tolist() == [r.score for r in results]
    assert batch.correct.tolist() == [bool(r.correct) for r in results]
    assert batch.feedback == [r.feedback for r in results]


def test_truncation_flags_and_completion_mask(tokenizer, samples) -> None:
    many_stops = _ManyStopsTokenizer(tokenizer)
    batch = _rollout(many_stops, samples)
    stops = set(many_stops.stop_tokens)
    for row in range(len(batch)):
        start, length = int(batch.prompt_lengths[row]), int(batch.completion_lengths[row])
        completion = batch.tokens[row, start : start + length].tolist()
        ended = completion[-1] in stops
        assert bool(batch.truncated[row]) == (not ended)
        if not ended:
            assert length == MAX_NEW
        # The mask marks exactly the completion columns (targets), nothing in the prompt.
        expected_mask = [start <= t < start + length for t in range(batch.tokens.shape[1])]
        assert batch.completion_mask[row].tolist() == expected_mask
    assert batch.truncated.any() and (~batch.truncated).any(), "need both kinds of rows"


def test_old_logp_aligned_with_targets(tokenizer, samples) -> None:
    batch = _rollout(tokenizer, samples, forward_batch_size=5, logprob_chunk_size=7)
    torch.testing.assert_close(batch.old_logp, _naive_logprobs(_model(0), batch))
    # The generator's own log-probs of the tokens it drew (KV-cache path, same seed) agree too.
    output = _the_same_draw(tokenizer, batch)
    for row, sampled in enumerate(output.logprobs):
        torch.testing.assert_close(batch.old_logp[row][batch.completion_mask[row]], sampled)
    assert batch.ref_logp is None


def test_sampling_logp_is_what_the_sampler_reported_in_the_target_frame(tokenizer, samples) -> None:
    batch = _rollout(tokenizer, samples)
    output = _the_same_draw(tokenizer, batch)
    for row, sampled in enumerate(output.logprobs):
        assert torch.equal(batch.sampling_logp[row][batch.completion_mask[row]], sampled)
    assert not batch.sampling_logp[~batch.completion_mask].any()
    # Native engine, float32, no top-k/top-p: the sampler's log-probs are the trainer's up to
    # kernel rounding (a misaligned frame would be off by whole nats).
    gap = (batch.sampling_logp - batch.old_logp)[batch.completion_mask].abs().max()
    assert gap < 1e-4


def test_reference_logprobs_only_when_asked(tokenizer, samples) -> None:
    reference = _model(1)
    batch = _rollout(tokenizer, samples, reference=reference)
    assert batch.ref_logp is not None
    torch.testing.assert_close(batch.ref_logp, _naive_logprobs(reference, batch))
    assert not torch.allclose(batch.ref_logp, batch.old_logp)


def test_micro_batches_keep_alignment(tokenizer, samples) -> None:
    batch = _rollout(tokenizer, samples)
    parts = batch.micro_batches(5)
    assert [len(p) for p in parts] == [5, 5, 2]
    model = _model(0)
    row = 0
    for part in parts:
        # Trailing all-padding columns are dropped, and nothing else.
        width = int((part.prompt_lengths + part.completion_lengths).max())
        assert part.tokens.shape[1] == width
        assert torch.equal(part.tokens, batch.tokens[row : row + len(part), :width])
        assert not batch.completion_mask[row : row + len(part), width:].any()
        assert part.group_ids.tolist() == batch.group_ids[row : row + len(part)].tolist()
        assert part.texts == batch.texts[row : row + len(part)]
        with torch.no_grad():
            logp = sequence_logprobs(
                model,
                part.tokens,
                part.input_pos,
                part.completion_mask,
                temperature=TEMPERATURE,
            )
        torch.testing.assert_close(logp, part.old_logp)
        assert torch.equal(part.sampling_logp, batch.sampling_logp[row : row + len(part), :width])
        row += len(part)
    with pytest.raises(ValueError, match="micro_batch_size"):
        batch.micro_batches(0)


def test_sequence_logprobs_entropy_and_grad(tokenizer, samples) -> None:
    batch = _rollout(tokenizer, samples)
    model = _model(0)
    logp, entropy = sequence_logprobs(
        model,
        batch.tokens,
        batch.input_pos,
        batch.completion_mask,
        temperature=TEMPERATURE,
        return_entropy=True,
    )
    logits = model(batch.tokens)[:, :-1].float() / TEMPERATURE
    probs = torch.softmax(logits, dim=-1)
    naive_entropy = -(probs * torch.log_softmax(logits, dim=-1)).sum(-1)
    mask = batch.completion_mask[:, 1:]
    torch.testing.assert_close(entropy[:, 1:][mask], naive_entropy[mask])
    assert torch.all(entropy[:, 0] == 0) and torch.all(logp[:, 0] == 0)
    logp.sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_bad_arguments_are_named(tokenizer, samples) -> None:
    with pytest.raises(ValueError, match="group_size"):
        collect_rollouts(
            _model(0), tokenizer, samples, MathAnswerReward(), group_size=0, max_new_tokens=2
        )
    with pytest.raises(ValueError, match="temperature"):
        collect_rollouts(
            _model(0),
            tokenizer,
            samples,
            MathAnswerReward(),
            group_size=2,
            max_new_tokens=2,
            temperature=0.0,
        )


@dataclass
class _Rows:
    """The fields of a rollout batch that ``rollout_metrics`` reads."""

    rewards: torch.Tensor
    correct: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor
    group_ids: torch.Tensor

    def __len__(self) -> int:
        return self.rewards.numel()


def test_rollout_metrics_leave_unscored_rewards_out_and_count_them() -> None:
    rows = _Rows(
        rewards=torch.tensor([1.0, float("nan"), 0.0, 0.5]),
        correct=torch.tensor([True, False, False, False]),
        completion_lengths=torch.tensor([4, 8, 2, 2]),
        truncated=torch.tensor([False, True, False, False]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    metrics = rollout_metrics(rows)
    assert metrics["reward/mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3
    assert metrics["reward/std"] == pytest.approx(math.sqrt((0.25 + 0.25 + 0) / 3))
    assert metrics["reward/unscored"] == pytest.approx(0.25)
    assert metrics["accuracy"] == pytest.approx(0.25)
    # Group 0 has one scored row (no spread) and a correct one; group 1 spreads, none correct.
    assert metrics["groups/zero_reward_std"] == pytest.approx(0.5)
    assert metrics["groups/no_correct"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("rewards", "correct", "zero_std", "no_correct"),
    [
        ([0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0, 0, 0], 1.0, 1.0),  # the hard split's case
        ([1.0, 1.0, 0.5, 0.0, 1.0, 0.5], [1, 1, 0, 0, 1, 0], 1 / 3, 1 / 3),
        ([0.0, 1.0, 0.2, 0.2, float("nan"), float("nan")], [0, 1, 0, 0, 0, 0], 2 / 3, 2 / 3),
    ],
)
def test_group_metrics_count_groups_grpo_cannot_learn_from(
    rewards: list[float], correct: list[int], zero_std: float, no_correct: float
) -> None:
    rows = _Rows(
        rewards=torch.tensor(rewards),
        correct=torch.tensor(correct, dtype=torch.bool),
        completion_lengths=torch.ones(6),
        truncated=torch.zeros(6, dtype=torch.bool),
        group_ids=torch.arange(3).repeat_interleave(2),
    )
    metrics = rollout_metrics(rows)
    assert metrics["groups/zero_reward_std"] == pytest.approx(zero_std)
    assert metrics["groups/no_correct"] == pytest.approx(no_correct)
