"""Building blocks of the composer training step, shared by every recipe that trains the three
channels together: A4 ``recipes/composer_full.py`` and ``recipes/diloco.py`` (whose inner loop is
the A4 loop). The recipes keep the loop itself visible (rollouts, advantages, teacher contexts,
clip, non-finite guard, optimiser step); what they would otherwise both spell out lives here.

One optimiser step minimises ``loss.weight * policy loss + sdpo.weight * SDPO loss +
dpo.weight * DPO loss``:

* channel 1, GRPO-family RL on verifiable rewards (Cursor's Composer 2.5 recipe;
  ``composer_tune.losses.policy``);
* channel 2, SDPO self-distillation (Composer 2.5's "targeted RL with textual feedback";
  ``composer_tune.channels.sdpo.channel``);
* channel 3, trace-replay DPO on preference pairs mined from agent traces replayed by teacher
  models: this project's OWN research addition, NOT part of Cursor's published recipe
  (``composer_tune.channels.replay_dpo``).

What is here:

* :class:`ComposerChannels`: the ``loss``, ``sdpo`` and ``dpo`` config sections, parsed and
  checked, and what they imply (rollouts, a reference model, old log-probs). A channel at
  weight 0 costs nothing: the recipe builds nothing for it and :class:`ComposerObjective` runs
  no forward for it.
* channel 1's rollouts, advantages and step normalisation are shared with A1-A3:
  :mod:`composer_tune.channels.policy`.
* :class:`ComposerObjective`: forward and backward of every channel that is on over one step's
  micro-batches and pair batch; :class:`StepLosses` is what it returns, ``reduce()`` the step's
  logged loss metrics over ranks.

Channel 3's data (:class:`~composer_tune.channels.replay_dpo.PairChannel`) and channel 2's
config checks and EMA teacher state (:mod:`composer_tune.channels.sdpo.teacher`) are shared
with A2 and A3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from composer_tune.channels.policy import kl_in_reward, step_normalization
from composer_tune.channels.replay_dpo import DPOChannelConfig, pair_loss_backward
from composer_tune.channels.sdpo.channel import (
    SDPOChannelConfig,
    distilled_token_count,
    logprobs_with_sdpo,
    reduce_sdpo_metrics,
    sdpo_channel_loss,
    select_teacher_rows,
)
from composer_tune.channels.sdpo.contexts import TeacherBatch
from composer_tune.channels.sdpo.teacher import sdpo_config_from
from composer_tune.data.preference import PreferenceBatch
from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.losses import PolicyLossConfig, needs_reference_model, policy_loss
from composer_tune.losses.distill import EMATeacher
from composer_tune.rollout.rollouts import RolloutBatch, sequence_logprobs

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ComposerChannels:
    """The three channels' settings: ``policy_weight`` and ``loss`` (channel 1), ``sdpo``
    (channel 2), ``dpo`` (channel 3, this project's own addition)."""

    policy_weight: float
    loss: PolicyLossConfig
    sdpo: SDPOChannelConfig
    dpo: DPOChannelConfig

    @classmethod
    def from_config(cls, cfg: DictConfig, dist: DistInfo) -> ComposerChannels:
        """From a recipe config's ``loss``, ``sdpo`` and ``dpo`` sections (null: defaults, i.e.
        channel 1 at weight 1, channels 2 and 3 off); bad values raise naming the section.
        ``dist``: the launch, which some channel-2 settings depend on."""
        section = OmegaConf.to_container(cfg.loss, resolve=True) if cfg.loss is not None else {}
        weight = float(section.pop("weight", 1.0))
        if weight < 0:
            raise ValueError(f"loss.weight must be >= 0, got {weight}")
        section.setdefault("max_completion_length", cfg.max_new_tokens)
        channels = cls(
            policy_weight=weight,
            loss=PolicyLossConfig.from_mapping(section, source="loss"),
            sdpo=sdpo_config_from(cfg, dist),
            dpo=DPOChannelConfig.from_mapping(
                OmegaConf.to_container(cfg.dpo, resolve=True) if cfg.dpo is not None else None
            ),
        )
        if not (channels.policy_weight > 0 or channels.sdpo.enabled or channels.dpo.enabled):
            raise ValueError("every channel weight (loss.weight, sdpo.weight, dpo.weight) is 0")
        return channels

    @property
    def needs_rollouts(self) -> bool:
        """Channels 1 and 2 train on rollouts; channel 3 alone needs none."""
        return self.policy_weight > 0 or self.sdpo.enabled

    @property
    def kl_reference(self) -> bool:
        """Channel 1's KL term needs reference log-probs of the rollouts."""
        return self.policy_weight > 0 and needs_reference_model(self.loss)

    @property
    def live_dpo(self) -> bool:
        """Channel 3 scores each pair batch with a frozen reference model."""
        return self.dpo.enabled and self.dpo.reference == "live"

    @property
    def builds_reference_model(self) -> bool:
        """A frozen copy of the initial policy exists only for a KL term or live DPO scoring."""
        return self.kl_reference or self.live_dpo

    @property
    def kl_in_reward(self) -> bool:
        return self.policy_weight > 0 and kl_in_reward(self.loss)

    @property
    def uses_ema_teacher(self) -> bool:
        """Channel 2 distils from an EMA of the policy."""
        return self.sdpo.enabled and self.sdpo.teacher == "ema"

    def needs_old_logp(self, on_policy: bool) -> bool:
        """Whether rollouts need the sampling policy's log-probs: off-policy steps, KL in the
        reward and SDPO's importance-ratio clipping read them; an on-policy step recomputes them
        for free."""
        return (
            not on_policy
            or self.kl_in_reward
            or (self.sdpo.enabled and self.sdpo.loss.is_clip is not None)
        )


# ----------------------------------------------------------------------------- the objective


@dataclass
class StepLosses:
    """One rank's share of an optimiser step's objective, after its backward passes.

    ``loss``: the weighted objective summed over micro-batches (what the non-finite guard
    checks); ``metrics``: channel 1's per-micro-batch-averaged metrics and channel 3's
    ``dpo/*``; ``sdpo_metrics``: channel 2's per-micro-batch metrics.
    """

    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    sdpo_metrics: list[dict[str, float]] = field(default_factory=list)

    def reduce(self, dist: DistInfo) -> dict[str, float]:
        """The step's logged loss metrics: rank means of ``loss`` and ``metrics``, channel 2's
        token-weighted over every rank (collective)."""
        names = ["loss", *self.metrics]
        values = torch.tensor([self.loss, *self.metrics.values()], dtype=torch.float64)
        values = all_reduce_sum(values.to(dist.device)).cpu() / dist.world_size
        reduced = dict(zip(names, values.tolist(), strict=True))
        reduced.update(reduce_sdpo_metrics(self.sdpo_metrics, dist.device))
        return reduced


class ComposerObjective:
    """Forward and backward of every channel that is on, for one optimiser step.

    Args:
        model: the policy (FSDP2-sharded under torchrun).
        channels: the channels' settings.
        tokenizer: renders SDPO teacher contexts.
        dist: this rank's place; channel 1's dapo/cispo and channel 2's token means normalise
            over every rank's tokens.
        micro_batch_size: rollout rows per forward/backward.
        temperature: the sampling temperature the log-probs are taken at.
        logprob_chunk_size: sequence chunk of the log-prob and DPO computations.
        ema_teacher: channel 2's EMA teacher (None: the policy itself teaches).
        reference: the frozen initial policy; channel 3 reads it with ``dpo.reference: live``.

    With channels 1 and 2 both on they share one student forward per micro-batch
    (``logprobs_with_sdpo``). Gradients accumulate in the model; the caller clips and steps.
    """

    def __init__(
        self,
        model: nn.Module,
        channels: ComposerChannels,
        *,
        tokenizer: Any,
        dist: DistInfo,
        micro_batch_size: int,
        temperature: float,
        logprob_chunk_size: int,
        ema_teacher: EMATeacher | None = None,
        reference: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.channels = channels
        self.tokenizer = tokenizer
        self.dist = dist
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size
        self.teacher_model = ema_teacher.module if ema_teacher is not None else None
        self.reference = reference

    def backward(
        self,
        rows: RolloutBatch | None,
        advantages: torch.Tensor | None,
        teacher_rows: TeacherBatch | None,
        pair_batch: PreferenceBatch | None,
        *,
        on_policy: bool,
    ) -> StepLosses:
        """Backward of the step's objective. ``rows``: its rollouts (None with channel 3
        alone); ``advantages``: theirs (None without channel 1); ``teacher_rows``: their SDPO
        teacher batch (None without channel 2); ``pair_batch``: this rank's training pairs
        (None without channel 3); ``on_policy``: the rows were sampled by the current weights,
        so channel 1's old log-probs are the current ones (TRL's shortcut)."""
        channels, loss_cfg, dist = self.channels, self.channels.loss, self.dist
        micro_batches = rows.micro_batches(self.micro_batch_size) if rows is not None else []
        use_policy, use_sdpo = channels.policy_weight > 0, channels.sdpo.enabled
        result = StepLosses()
        if use_policy:
            normalization = step_normalization(rows, loss_cfg, dist, self.micro_batch_size)
        sdpo_normalizer = None
        if use_sdpo:
            # SDPO's divergence is a token mean over the step's distilled tokens on all ranks.
            distilled = all_reduce_sum(distilled_token_count(teacher_rows).reshape(1))
            sdpo_normalizer = float(distilled.clamp(min=1)) / dist.world_size
        for index, micro in enumerate(micro_batches):
            start = index * self.micro_batch_size
            micro_teacher = (
                select_teacher_rows(teacher_rows, slice(start, start + len(micro)))
                if use_sdpo
                else None
            )
            sdpo_args = {
                "tokenizer": self.tokenizer,
                "cfg": channels.sdpo,
                "teacher_model": self.teacher_model,
                "normalizer": sdpo_normalizer,
                "teacher_batch": micro_teacher,
            }
            loss = torch.zeros((), device=dist.device)
            if use_policy:
                logprob_args = {
                    "temperature": self.temperature,
                    "chunk_size": self.logprob_chunk_size,
                }
                if use_sdpo:  # one student forward for both channels
                    logp, entropy, sdpo_loss, metrics = logprobs_with_sdpo(
                        self.model, micro, **sdpo_args, **logprob_args
                    )
                    result.sdpo_metrics.append(metrics)
                    loss = loss + sdpo_loss
                else:
                    logp, entropy = sequence_logprobs(
                        self.model,
                        micro.tokens,
                        micro.input_pos,
                        micro.completion_mask,
                        return_entropy=True,
                        **logprob_args,
                    )
                old_logp = logp.detach() if on_policy else micro.old_logp
                policy, metrics = policy_loss(
                    logp,
                    old_logp,
                    advantages[start : start + len(micro)],
                    micro.completion_mask,
                    loss_cfg,
                    ref_logp=micro.ref_logp,
                    truncated=micro.truncated,
                    entropy=entropy,
                    normalization=normalization,
                    sampling_logp=micro.sampling_logp,
                )
                loss = loss + channels.policy_weight * policy
                for name, value in metrics.items():
                    result.metrics[name] = result.metrics.get(name, 0.0) + float(value) / len(
                        micro_batches
                    )
            else:  # channel 2 alone: the SDPO forward is the only one
                sdpo_loss, metrics = sdpo_channel_loss(self.model, micro, **sdpo_args)
                result.sdpo_metrics.append(metrics)
                loss = loss + sdpo_loss
            loss.backward()
            result.loss += float(loss.detach())
        if pair_batch is not None:  # channel 3: one forward over this rank's pairs
            pair_loss, pair_metrics = pair_loss_backward(
                self.model,
                pair_batch,
                channels.dpo,
                reference_model=self.reference,
                chunk_size=self.logprob_chunk_size,
            )
            result.loss += pair_loss
            result.metrics.update(pair_metrics)
        return result
