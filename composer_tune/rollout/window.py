"""Generation that never passes the model's window: a completion stopped there is truncated,
as TRL's is at ``max_completion_length``, and a prompt that leaves no room gets no completion
and is unscored, instead of a crash in the forward. Single-turn rollouts and held-out
evaluation generate through :func:`generate_in_window`; agent episodes stop at the same window
(:func:`model_window`) turn by turn (``composer_tune.agents.episodes``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from composer_tune.distributed import min_over_ranks
from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.functions import ScoringBatch, score_completions
from composer_tune.rollout.generation import GenerationOutput, generate


def model_window(policy: nn.Module, engine: Any = None) -> int | None:
    """The longest row (prompt + completion) generation may produce: a vLLM engine's
    ``max_model_len``, else the policy's ``max_seq_len`` (None: unbounded)."""
    if engine is not None:
        return engine.max_model_len
    return getattr(policy, "max_seq_len", None)


@dataclass
class WindowedGeneration:
    """:func:`generate_in_window`'s result, one entry per prompt: the generation (empty
    completions where the prompt filled the window), which prompts did (``over_window``) and which
    rows the window stopped (``window_truncated``: those, and completions cut at the window)."""

    output: GenerationOutput
    over_window: list[bool]
    window_truncated: list[bool]


def generate_in_window(
    policy: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    engine: Any = None,
    sync_ranks: bool = False,
    **sampling: Any,
) -> WindowedGeneration:
    """One completion per prompt that never passes the model's window (:func:`model_window`):
    ``max_new_tokens`` is cut to the room the longest prompt leaves (on every rank: the shapes
    of a sharded generation agree), a completion stopped there is truncated, as TRL's is at
    ``max_completion_length``; a prompt with no room at all gets no completion. ``sampling``:
    ``generate``'s temperature, top_k, top_p, stop_tokens, generator, greedy."""
    window = model_window(policy, engine)
    fits = [window is None or len(prompt) < window for prompt in prompts]
    fitting = [prompt for prompt, fit in zip(prompts, fits, strict=True) if fit]
    budget = max_new_tokens
    if window is not None:
        longest = max((len(prompt) for prompt in fitting), default=1)
        budget = min(budget, window - longest)
    device = next(policy.parameters()).device
    budget = min_over_ranks(max(budget, 1), device, sync_ranks)
    stand_in = fitting or [[pad_id]]  # a rank out of rows still runs the collective forwards
    output: GenerationOutput | None = None
    if engine is not None:
        output = engine.generate(stand_in, max_new_tokens=budget, **sampling)
    elif fitting or sync_ranks:
        output = generate(
            policy,
            stand_in,
            max_new_tokens=budget,
            pad_id=pad_id,
            sync_ranks=sync_ranks,
            return_logprobs=True,
            **sampling,
        )
    rows = iter(range(len(fitting)))
    assert output is not None or not fitting
    completions, logprobs, truncated, window_truncated = [], [], [], []
    for fit in fits:
        row = next(rows) if fit else None
        completions.append(output.completions[row] if fit else [])
        logprobs.append(output.logprobs[row] if fit else torch.zeros(0))
        cut = fit and bool(output.truncated[row])
        truncated.append(cut or not fit)
        window_truncated.append(not fit or (cut and budget < max_new_tokens))
    return WindowedGeneration(
        output=GenerationOutput(
            completions=completions,
            completion_lengths=torch.tensor([len(c) for c in completions], dtype=torch.long),
            truncated=torch.tensor(truncated, dtype=torch.bool),
            logprobs=logprobs,
        ),
        over_window=[not fit for fit in fits],
        window_truncated=window_truncated,
    )


def score_in_window(
    reward: Any, batch: ScoringBatch, over_window: Sequence[bool]
) -> list[RewardResult]:
    """``batch`` scored by ``reward``, the rows whose prompt filled the model's window left
    unscored (they have no completion)."""
    results = score_completions(reward, batch)
    unscored = RewardResult(math.nan, None, "the prompt fills the model's window")
    return [unscored if over else result for result, over in zip(results, over_window, strict=True)]
