"""DAPO's dynamic sampling, an option of every RL recipe: :class:`DynamicSampling`.

A group (the ``group_size`` completions of one prompt) whose rewards are all equal has zero
group-relative advantage: it adds no policy gradient, yet takes its share of the step. DAPO
(arXiv 2503.14476, section 3.2) drops such groups and samples more prompts until the batch is
full again. An RL recipe (``grpo``, ``sdpo``, ``replay_dpo``, ``composer_full``, ``diloco``)
does so with a ``dynamic_sampling`` section:

```yaml
dynamic_sampling:
  enabled: false              # true: drop the groups whose scored rewards are all equal, refill
  max_generation_batches: 10  # generation batches one training batch may take, the first included
  train_groups: null          # groups a training batch holds over every rank (null:
                              # num_prompts_per_generation)
```

* **Dropped**: a group whose scored rewards (the reward's scores, before a ``kl_mode: reward``
  penalty; a non-finite reward is unscored) are all equal, or that has fewer than two scored
  rows. Its every advantage is zero (``compute_advantages``), and ``groups/zero_reward_std``
  counts the same groups. verl's ``algorithm.filter_groups`` with ``metric: score``.
* **Refill**: generation batches of ``num_prompts_per_generation`` prompts are drawn from the
  run's prompt stream (uniform epochs, or the task sampler) until every rank holds its share of
  ``train_groups`` kept groups or ``max_generation_batches`` have been drawn. The kept groups
  train in the order they were drawn; those beyond ``train_groups`` are not trained (verl cuts
  its batch the same way). A ``train_groups`` below ``num_prompts_per_generation`` oversamples
  each generation batch, as DAPO's larger generation batch does, so that one usually suffices.
* **Ranks**: every rank trains on the same number of groups, as FSDP2's collectives, the step's
  equal slices and ``scale_rewards: batch`` need: the fewest any rank kept, capped at its share
  and rounded down to whole ``steps_per_generation`` slices. One all-reduce of every rank's
  count after each generation batch decides, so the ranks stop refilling together; groups a rank
  kept beyond that number are not trained.
* **The limit**: after ``max_generation_batches`` the step trains on the groups kept (fewer
  rows; every loss normalises by the rows and tokens it is given). If some rank kept none (or
  fewer than one ``steps_per_generation`` slice needs), every rank trains on its last
  generation batch as drawn instead, as with dynamic sampling off (its groups of equal rewards
  have zero advantage: only the KL and entropy terms act on them), and logs
  ``dynamic_sampling/unfiltered`` 1: the run neither stalls nor trains on an empty batch. (verl
  stops the run with an error there.)
* **Everything generated counts**: the task sampler observes every generation batch, dropped
  groups included (its logged ``task_sampler/*`` metrics are the last batch's), and
  ``tokens/generated`` counts every sampled token. The rollout metrics (``reward/mean``,
  ``accuracy``, ...) describe the trained rows.
* **Resume**: nothing is carried from one training batch to the next, and the batches drawn
  advance the run's data position (or the task sampler's generator) as any batch does, so a
  checkpoint holds them and a resumed run draws what the uninterrupted one would have.
* **Metrics** (every step, over every rank): ``dynamic_sampling/generation_batches`` (drawn for
  this training batch), ``/generated_groups``, ``/dropped_groups`` (equal rewards),
  ``/kept_fraction`` (the generated groups not dropped), ``/trained_groups``, ``/unfiltered``
  and ``/generated_reward_mean`` (over every scored row generated, dropped groups included).
* **Not with a rollout worker** (``rollout.max_staleness >= 1`` or ``rollout.server.url``):
  refused at set-up; the worker requests a fixed number of batches ahead of each step.
* Channel 1 must be on (``loss.weight > 0``: the dropped groups are those its advantages ignore)
  and ``group_size`` at least 2. With channel 2 on the dropped groups are gone for it too,
  including the all-failed groups whose feedback its hinted teacher reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.rollout.async_rollouts import uses_rollout_worker
from composer_tune.rollout.rollouts import RolloutBatch

PREFIX = "dynamic_sampling/"


@dataclass
class DynamicSamplingSection:
    """The ``dynamic_sampling`` section of an RL recipe (see the module docstring)."""

    enabled: bool = False
    max_generation_batches: int = 10
    train_groups: int | None = None

    def __post_init__(self) -> None:
        if self.max_generation_batches < 1:
            raise ValueError(
                "dynamic_sampling.max_generation_batches must be >= 1, got "
                f"{self.max_generation_batches}"
            )
        if self.train_groups is not None and self.train_groups < 1:
            raise ValueError(f"dynamic_sampling.train_groups must be >= 1, got {self.train_groups}")


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``bool[num_groups]``: whether each group of ``group_size`` consecutive rows has two
    scored (finite) rewards that differ, i.e. a non-zero advantage somewhere."""
    grouped = rewards.double().view(-1, group_size)
    scored = torch.isfinite(grouped)
    highest = torch.where(scored, grouped, -math.inf).amax(dim=1)
    lowest = torch.where(scored, grouped, math.inf).amin(dim=1)
    return highest > lowest


class DynamicSampling:
    """Training batches of informative groups from a stream of generation batches (see the
    module docstring).

    Args:
        section: the config section.
        group_size: completions per prompt.
        train_groups: groups per training batch over every rank.
        steps_per_generation: the equal optimiser steps each training batch is split into.
        dist: this rank's place (the counts are summed over ranks).
        pad_id: the tokenizer's padding id (groups of different batches are padded alike).
    """

    def __init__(
        self,
        section: DynamicSamplingSection,
        *,
        group_size: int,
        train_groups: int,
        steps_per_generation: int,
        dist: DistInfo,
        pad_id: int,
    ) -> None:
        if group_size < 2:
            raise ValueError(
                f"dynamic_sampling needs group_size >= 2 (got {group_size}): a group of one "
                "never has two rewards to differ"
            )
        if train_groups % dist.world_size:
            raise ValueError(
                f"dynamic_sampling.train_groups ({train_groups}) must be a multiple of the "
                f"number of ranks ({dist.world_size})"
            )
        self.max_batches = section.max_generation_batches
        self.group_size, self.dist, self.pad_id = group_size, dist, pad_id
        self.share = train_groups // dist.world_size
        # A rank's groups come in multiples of this, so its rows split into equal steps.
        self.unit = steps_per_generation // math.gcd(steps_per_generation, group_size)
        if self.share % self.unit:
            raise ValueError(
                f"each rank's dynamic_sampling.train_groups share ({self.share}) times group_size "
                f"({group_size}) does not split into steps_per_generation={steps_per_generation} "
                "equal optimiser steps"
            )

    @classmethod
    def from_config(
        cls, cfg: Any, dist: DistInfo, *, policy_weight: float, pad_id: int
    ) -> DynamicSampling | None:
        """From a recipe config's ``dynamic_sampling`` section; None when it is off. Raises
        ``ValueError`` naming the key for a setting it cannot serve."""
        section = DynamicSamplingSection(**cfg.dynamic_sampling)
        if not section.enabled:
            return None
        if not policy_weight > 0:
            raise ValueError(
                "dynamic_sampling drops the groups channel 1 learns nothing from, and "
                "loss.weight is 0: set dynamic_sampling.enabled=false"
            )
        if uses_rollout_worker(cfg.rollout):
            raise ValueError(
                "dynamic_sampling draws more batches when a batch's groups have equal rewards; "
                "a rollout worker (rollout.max_staleness >= 1 or rollout.server.url) requests a "
                "fixed number ahead, which is not built: set dynamic_sampling.enabled=false or "
                "rollout.max_staleness=0"
            )
        return cls(
            section,
            group_size=cfg.group_size,
            train_groups=section.train_groups or cfg.num_prompts_per_generation,
            steps_per_generation=cfg.steps_per_generation,
            dist=dist,
            pad_id=pad_id,
        )

    def batches(self, generated: Iterator[RolloutBatch]) -> Iterator[RolloutBatch]:
        """Endless training batches, each :meth:`fill`'s from ``generated``."""
        while True:
            yield self.fill(generated)

    def fill(self, generated: Iterator[RolloutBatch]) -> RolloutBatch:
        """The next training batch: informative groups drawn from ``generated`` until every
        rank holds its share or ``max_generation_batches`` were drawn (collective: one
        all-reduce per generation batch), with the ``dynamic_sampling/*`` metrics in its
        ``draw_metrics`` and every sampled token in its ``sampled_tokens``."""
        size, world = self.group_size, self.dist.world_size
        kept: list[RolloutBatch] = []  # this rank's informative groups, in order, up to its share
        # Over every rank: groups generated, groups informative, scored rewards' sum and count.
        totals = torch.zeros(4, dtype=torch.float64)
        sampled, drawn = 0.0, 0
        while True:
            batch = next(generated)
            drawn += 1
            informative = informative_groups(batch.rewards, size)
            for group in torch.nonzero(informative).flatten().tolist()[: self.share - len(kept)]:
                kept.append(batch.select(slice(group * size, (group + 1) * size)))
            sampled += float(batch.completion_mask.sum())
            rewards = batch.rewards.double()
            scored = torch.isfinite(rewards)
            counts = torch.zeros(world + 4, dtype=torch.float64)
            counts[self.dist.rank] = len(kept)
            counts[world:] = torch.tensor(
                [
                    float(len(informative)),
                    float(informative.sum()),
                    float(rewards[scored].sum()),
                    float(scored.sum()),
                ]
            )
            counts = all_reduce_sum(counts.to(self.dist.device)).cpu()
            totals += counts[world:]
            fewest = int(counts[:world].min())
            if fewest >= self.share or drawn == self.max_batches:
                break
        groups = min(fewest, self.share) // self.unit * self.unit
        if groups == 0:  # a rank kept less than one step's groups: the last batch as drawn
            trained = batch
        elif drawn == 1 and groups * size == len(batch):  # nothing dropped: the batch itself
            trained = batch
        else:
            trained = RolloutBatch.cat(kept[:groups], self.pad_id)
        generated_groups, informative_count, reward_sum, scored_count = totals.tolist()
        trained.draw_metrics = {
            **batch.draw_metrics,
            f"{PREFIX}generation_batches": float(drawn),
            f"{PREFIX}generated_groups": generated_groups,
            f"{PREFIX}dropped_groups": generated_groups - informative_count,
            f"{PREFIX}kept_fraction": informative_count / generated_groups,
            f"{PREFIX}trained_groups": float(len(trained) // size * world),
            f"{PREFIX}unfiltered": float(groups == 0),
            f"{PREFIX}generated_reward_mean": reward_sum / scored_count
            if scored_count
            else math.nan,
        }
        trained.sampled_tokens = sampled
        return trained
