"""A run's resumable progress as one object: :class:`RunProgress`.

Everything a resumed run needs to continue exactly where its checkpoint was taken, apart from
the weights, the optimizer and the LR schedule (``checkpointing.run_state`` saves those): the
step, the data position, the sampling generator, the non-finite guard, the metrics taken before
training and the cumulative token counts. Every recipe saves it with :meth:`RunProgress.state_dict`
into its checkpoint's recipe state and reads it back with :meth:`RunProgress.load_state_dict`;
adding a new piece of resumable state is one field here.

The keys are the ones the recipes wrote before this object existed (``step``, ``epoch``,
``batches_in_epoch``, ``sampling_generator``, ``nonfinite_guard``, ``accuracy_before``,
``pairs_before``), so older checkpoints load; keys they lack take their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_tune.distributed import DistInfo, all_reduce_sum, gather_generator_states
from composer_tune.guards import NonFiniteGuard


@dataclass
class RunProgress:
    """Where a run stands.

    Attributes:
        guard: the non-finite guard (its run of skipped steps is saved).
        sampling_generator: this rank's sampling randomness (None for recipes that sample
            nothing); saved for every rank, restored per rank.
        step: optimiser steps taken.
        epoch: passes over the training data started.
        batches_in_epoch: batches of the current epoch already used.
        accuracy_before: held-out accuracy before training (None without evaluation).
        pairs_before: channel 3's held-out pair metrics before training ({} without it).
        task_sampler: the RL run's :class:`~composer_tune.run.task_sampler.TaskSampler`
            (None: prompts in uniform epochs); its state is saved as ``task_sampler``.
        tokens: cumulative token counts over every rank, logged as ``tokens/<name>``:
            ``generated`` (completion tokens the policy sampled; agent episodes: its own
            turns) and ``trained/<channel>`` (tokens each channel's loss was taken over:
            ``policy`` rollout tokens, ``sdpo`` distilled tokens, ``dpo`` pair completion
            tokens, ``sft`` target tokens).
    """

    guard: NonFiniteGuard
    sampling_generator: torch.Generator | None = None
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    accuracy_before: float | None = None
    pairs_before: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    task_sampler: Any = None

    def state_dict(self, dist: DistInfo) -> dict[str, Any]:
        """The checkpoint's recipe-state entries (collective: gathers every rank's generator)."""
        state: dict[str, Any] = {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "nonfinite_guard": self.guard.state_dict(),
            "accuracy_before": self.accuracy_before,
            "pairs_before": dict(self.pairs_before),
            "tokens": dict(self.tokens),
        }
        if self.sampling_generator is not None:
            state["sampling_generator"] = gather_generator_states(self.sampling_generator, dist)
        if self.task_sampler is not None:
            state["task_sampler"] = self.task_sampler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any], dist: DistInfo) -> None:
        """Restores what :meth:`state_dict` saved (an older checkpoint's missing keys keep
        their defaults)."""
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.guard.load_state_dict(state["nonfinite_guard"])
        self.accuracy_before = state.get("accuracy_before")
        self.pairs_before = dict(state.get("pairs_before") or {})
        self.tokens.update(state.get("tokens") or {})
        if self.sampling_generator is not None:
            self.sampling_generator.set_state(state["sampling_generator"][dist.rank])
        if self.task_sampler is not None and "task_sampler" in state:
            self.task_sampler.load_state_dict(state["task_sampler"])

    def record_before(self, result: Any, pairs: Mapping[str, float] | None = None) -> None:
        """The metrics taken before training: held-out ``result`` (an ``EvalResult`` or None)
        and channel 3's held-out pair metrics."""
        self.accuracy_before = result.accuracy if result is not None else None
        self.pairs_before = dict(pairs or {})

    def count_tokens(self, counts: Mapping[str, float], dist: DistInfo) -> None:
        """Adds this rank's ``counts`` summed over every rank to :attr:`tokens` (collective:
        every rank calls it with the same keys)."""
        names = sorted(counts)
        local = torch.tensor([float(counts[name]) for name in names], dtype=torch.float64)
        totals = all_reduce_sum(local.to(dist.device)).cpu().tolist()
        for name, total in zip(names, totals, strict=True):
            self.tokens[name] = self.tokens.get(name, 0.0) + total

    def token_metrics(self) -> dict[str, float]:
        """The cumulative counts as logged metrics (``tokens/generated``, ...)."""
        return {f"tokens/{name}": value for name, value in self.tokens.items()}
