"""Lengths: a completion or episode that would pass the model's window stops there, marked
truncated (TRL's semantics, with a metric); a prompt that fills the window alone gets no
completion and is unscored, never a crash in the forward; and set-up names the keys when a
config truncates by design."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune.agents import build_agent
from composer_tune.agents.episodes import EpisodeRunner, score_episodes
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.models import qwen3_tiny
from composer_tune.rewards import RewardFunctions
from composer_tune.rollout import encode_prompts
from composer_tune.rollout.rollouts import collect_rollouts, rollout_metrics
from composer_tune.rollout.window import generate_in_window
from composer_tune.run.lengths import check_prompt_lengths
from tests.test_agent_episodes import QWEN3_TOKENIZER, ScriptedPolicy


def counts_tokens(completion_ids, **kwargs) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def _sample(words: int) -> dict:
    return {"prompt": [{"role": "user", "content": " ".join(["seven"] * words)}]}


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(QWEN3_TOKENIZER)


@pytest.fixture(scope="module")
def lengths(tokenizer) -> list[int]:
    """Prompt lengths of a short, a longer and a very long prompt."""
    ids = encode_prompts(tokenizer, [_sample(2), _sample(6), _sample(60)], enable_thinking=True)
    return [len(p) for p in ids]


def _model(window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return qwen3_tiny(vocab_size=994, max_seq_len=window).eval()


def test_completions_stop_at_the_window_and_overlong_prompts_get_none(tokenizer, lengths) -> None:
    short, longer, overlong = lengths
    window = longer + 3
    assert overlong >= window  # the third prompt alone fills the window
    prompts = encode_prompts(tokenizer, [_sample(2), _sample(6), _sample(60)], enable_thinking=True)
    generated = generate_in_window(
        _model(window), prompts, max_new_tokens=20, pad_id=tokenizer.pad_id, stop_tokens=[]
    )
    output = generated.output
    # Room left by the longest fitting prompt: 3 tokens for every row of the batch.
    assert [len(c) for c in output.completions] == [3, 3, 0]
    fitting = zip(prompts[:2], output.completions[:2], strict=True)
    assert all(len(p) + len(c) <= window for p, c in fitting)
    assert output.truncated.tolist() == [True, True, True]
    assert generated.window_truncated == [True, True, True]
    assert generated.over_window == [False, False, True]
    # With room to spare, nothing is cut by the window.
    roomy = generate_in_window(
        _model(512), prompts[:2], max_new_tokens=4, pad_id=tokenizer.pad_id, stop_tokens=[]
    )
    assert (
        roomy.window_truncated == [False, False] and roomy.output.truncated.tolist() == [True] * 2
    )


def test_rollouts_at_the_window_train_and_report_it(tokenizer, lengths) -> None:
    """A batch whose prompts and completions pass a small window: no crash, rows within the
    window, the overlong prompt's group unscored, ``window_truncation_rate`` logged."""
    window = lengths[1] + 3
    model = _model(window)
    rollout = collect_rollouts(
        model, tokenizer, [_sample(2), _sample(60)], RewardFunctions([counts_tokens]),
        group_size=2, max_new_tokens=20, compute_old_logp=True, shared_prefix=True,
        enable_thinking=True,
    )  # fmt: skip
    totals = (rollout.prompt_lengths + rollout.completion_lengths).tolist()
    assert max(totals) <= window
    room = window - lengths[0]  # what the one fitting prompt leaves; less than max_new_tokens
    assert room < 20 and rollout.rewards[:2].tolist() == [room, room]
    assert all(math.isnan(r) for r in rollout.rewards[2:].tolist())
    assert rollout.window_truncated.tolist() == [True] * 4
    metrics = rollout_metrics(rollout)
    assert metrics["reward/unscored"] == 0.5 and metrics["window_truncation_rate"] == 1.0
    assert rollout.old_logp is not None and torch.isfinite(rollout.old_logp).all()


def test_an_episode_whose_prompt_fills_the_window_is_unscored_not_a_crash(tokenizer) -> None:
    agent = build_agent({"tools": ["composer_tune.agents.calculator.calculate"], "max_turns": 2})
    episodes = agent.start([_sample(2), _sample(60)], tokenizer, enable_thinking=True)
    window = episodes[0].prompt_length + 8
    runner = EpisodeRunner(tokenizer, agent.limits, seq_limit=window, enable_thinking=True)
    runner.run(episodes, ScriptedPolicy(tokenizer, ["fine"]), sync_ranks=False)
    fits, overlong = episodes
    assert fits.record.error is None and fits.record.turns == 1
    assert overlong.record.turns == 0 and overlong.record.truncated == "max_seq_len"
    assert "fills the model's window" in overlong.record.error
    assert len(overlong.ids) < window and not any(overlong.model_mask)
    results = score_episodes(episodes, RewardFunctions([counts_tokens]))
    assert results[0].score > 0 and math.isnan(results[1].score)


def _single_turn_cfg(window: int, max_new: int, eval_max_new: int) -> OmegaConf:
    return OmegaConf.create(
        {
            "model": {"max_seq_len": window},
            "rollout": {"engine": "native", "vllm": {"max_model_len": None}},
            "max_new_tokens": max_new,
            "eval_max_new_tokens": eval_max_new,
            "enable_thinking": True,
        }
    )


def test_setup_names_the_keys_when_a_config_does_not_fit(tokenizer, lengths) -> None:
    train, heldout = [_sample(2), _sample(6)], [_sample(2)]
    longer = lengths[1]
    check_prompt_lengths(_single_turn_cfg(longer + 8, 8, 8), tokenizer, train, heldout, None)
    with pytest.raises(ValueError) as info:
        check_prompt_lengths(_single_turn_cfg(longer + 8, 9, 8), tokenizer, train, heldout, None)
    assert str(info.value) == (
        f"dataset row 1: its prompt is {longer} tokens, and with max_new_tokens=9 a row reaches "
        f"{longer + 9}, past model.max_seq_len={longer + 8}: raise model.max_seq_len or lower "
        "max_new_tokens"
    )
    with pytest.raises(ValueError, match=r"^eval_dataset row 0: .* lower eval_max_new_tokens$"):
        check_prompt_lengths(
            _single_turn_cfg(lengths[0] + 8, 1, 9), tokenizer, [_sample(2)], heldout, None
        )
