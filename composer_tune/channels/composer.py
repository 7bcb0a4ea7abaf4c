"""The channel step: what every RL recipe (A1 ``grpo``, A2 ``sdpo``, A3 ``replay_dpo``, A4
``composer_full`` and DiLoCo's inner loop) does with a generation batch, written once. A1-A3 are
this step with one or two channels on. The recipes keep the loop itself visible (rollouts, this
step, clip, non-finite guard, optimiser step); every decision a config implies (which models
exist, which log-probs a rollout needs, each channel's normaliser) is answered here.

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
* :class:`ComposerObjective`: :meth:`~ComposerObjective.prepare` turns a generation batch's
  rollouts into :class:`GenerationBatch` (channel 1's advantages, channel 2's teacher contexts,
  the rollout metrics), whose :meth:`~GenerationBatch.optimizer_steps` are the step slices;
  :meth:`~ComposerObjective.backward` is the forward and backward of every channel that is on
  over one step's micro-batches and pair batch; :class:`StepLosses` is what it returns,
  ``reduce()`` the step's logged loss metrics over ranks.

Channel 3's data (:class:`~composer_tune.channels.replay_dpo.PairChannel`) and channel 2's
config checks and EMA teacher state (:mod:`composer_tune.channels.sdpo.teacher`) are shared
with A2 and A3.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from composer_tune.channels.gradients import ChannelGradients, channel_scope
from composer_tune.channels.policy import group_advantages, kl_in_reward, step_normalization
from composer_tune.channels.replay_dpo import DPOChannelConfig, pair_loss_backward
from composer_tune.channels.sdpo.channel import (
    SDPOChannelConfig,
    build_sdpo_teacher_batch,
    distilled_token_count,
    logprobs_with_sdpo,
    loss_normalizer_count,
    reduce_sdpo_metrics,
    sdpo_channel_loss,
    select_teacher_rows,
)
from composer_tune.channels.sdpo.contexts import TeacherBatch
from composer_tune.channels.sdpo.teacher import (
    EMATeacher,
    ema_teacher_state,
    load_ema_teacher_state,
    sdpo_config_from,
)
from composer_tune.data.preference import PreferenceBatch
from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.losses import PolicyLossConfig, needs_reference_model, policy_loss
from composer_tune.models.hf_backend import mean_metrics, router_loss
from composer_tune.rollout.rollouts import RolloutBatch, rollout_logprobs, rollout_metrics
from composer_tune.run.loop import build_model

# ----------------------------------------------------------------------------- configuration


# Generation batches in a row whose every row is unscored before a run stops (see
# ComposerObjective._stop_if_nothing_is_scored).
UNSCORED_BATCHES_LIMIT = 3


class RewardUnscoredError(RuntimeError):
    """The reward scored nothing for ``UNSCORED_BATCHES_LIMIT`` generation batches in a row."""


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
        """From a recipe config's ``loss``, ``sdpo`` and ``dpo`` sections (absent or null:
        defaults, i.e. channel 1 at weight 1, channels 2 and 3 off: A1 has neither section);
        bad values raise naming the section. With ``rollout.max_staleness >= 1`` a null
        ``loss.sampling_correction`` is ``token_truncate``: the rows' staleness is corrected. ``dist``: the launch, which some channel-2
        settings depend on."""
        section = OmegaConf.to_container(cfg.loss, resolve=True) if cfg.loss is not None else {}
        weight = float(section.pop("weight", 1.0))
        if weight < 0:
            raise ValueError(f"loss.weight must be >= 0, got {weight}")
        section.setdefault("max_completion_length", cfg.max_new_tokens)
        staleness = (cfg.get("rollout") or {}).get("max_staleness", 0)
        if staleness > 0 and not section.get("sampling_correction"):
            # Rows sampled by older weights: the loss reweights them (async_rollouts).
            section["sampling_correction"] = "token_truncate"
        channels = cls(
            policy_weight=weight,
            loss=PolicyLossConfig.from_mapping(section, source="loss"),
            sdpo=sdpo_config_from(cfg, dist),
            dpo=DPOChannelConfig.from_mapping(
                OmegaConf.to_container(cfg.dpo, resolve=True)
                if cfg.get("dpo") is not None
                else None
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

    def reference_model(
        self, cfg: DictConfig, dist: DistInfo, initial: str | None
    ) -> nn.Module | None:
        """The frozen reference, a copy of the starting policy ``initial`` (never a resumed
        one), built only when :attr:`builds_reference_model`; None otherwise."""
        if not self.builds_reference_model:
            return None
        return build_model(cfg, dist, initial, trainable=False)

    @property
    def kl_in_reward(self) -> bool:
        return self.policy_weight > 0 and kl_in_reward(self.loss)

    @property
    def uses_ema_teacher(self) -> bool:
        """Channel 2 distils from an EMA of the policy."""
        return self.sdpo.uses_ema_teacher

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
class StepData:
    """One optimiser step's share of a generation batch: its rollout rows (None with channel
    3 alone), their advantages (None without channel 1) and SDPO teacher rows (None without
    channel 2)."""

    rows: RolloutBatch | None
    advantages: torch.Tensor | None
    teacher_rows: TeacherBatch | None

    @property
    def tokens_processed(self) -> float:
        """Prompt + completion tokens of the rows (what tokens/s counts)."""
        if self.rows is None:
            return 0.0
        return float((self.rows.prompt_lengths + self.rows.completion_lengths).sum())


@dataclass
class GenerationBatch:
    """A generation batch as every channel reads it: the rollouts (None with channel 3 alone),
    channel 1's advantages over the whole batch, channel 2's teacher contexts (built once over
    the batch, so every row sees its group's siblings) and the rollout metrics."""

    rollout: RolloutBatch | None
    advantages: torch.Tensor | None
    teacher_batch: TeacherBatch | None
    metrics: dict[str, float]

    @property
    def generated_tokens(self) -> float:
        """Tokens the policy sampled for this batch on this rank (episodes: its own turns),
        the groups dynamic sampling dropped included."""
        if self.rollout is None:
            return 0.0
        if self.rollout.sampled_tokens is not None:
            return self.rollout.sampled_tokens
        return float(self.rollout.completion_mask.sum())

    def optimizer_steps(
        self, steps_per_generation: int, num_iterations: int
    ) -> Iterator[tuple[int, StepData]]:
        """``(iteration, step data)`` of each optimiser step on the batch: its
        ``steps_per_generation`` equal slices, ``num_iterations`` times over (TRL's names)."""
        rows_per_step = len(self.rollout) // steps_per_generation if self.rollout else 0
        for iteration in range(num_iterations):
            for index in range(steps_per_generation):
                rows = slice(index * rows_per_step, (index + 1) * rows_per_step)
                yield (
                    iteration,
                    StepData(
                        rows=self.rollout.select(rows) if self.rollout is not None else None,
                        advantages=self.advantages[rows] if self.advantages is not None else None,
                        teacher_rows=select_teacher_rows(self.teacher_batch, rows)
                        if self.teacher_batch is not None
                        else None,
                    ),
                )


@dataclass
class StepLosses:
    """One rank's share of an optimiser step's objective, after its backward passes.

    ``loss``: the weighted objective summed over micro-batches (what the non-finite guard
    checks); ``metrics``: channel 1's per-micro-batch-averaged metrics, channel 2's weighted
    loss and channel 3's ``dpo/*``; ``sdpo_metrics``: channel 2's per-micro-batch metrics;
    ``tokens``: tokens each channel's loss was taken over on this rank (``policy``, ``sdpo``,
    ``dpo``).
    """

    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    sdpo_metrics: list[dict[str, float]] = field(default_factory=list)
    tokens: dict[str, float] = field(
        default_factory=lambda: {"policy": 0.0, "sdpo": 0.0, "dpo": 0.0}
    )

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
    """What every channel that is on does with a generation batch and with one optimiser step.

    Args:
        model: the policy (FSDP2-sharded under torchrun).
        channels: the channels' settings.
        tokenizer: renders SDPO teacher contexts.
        dist: this rank's place; channel 1's dapo/cispo and channel 2's token means normalise
            over every rank's tokens.
        micro_batch_size: rollout rows per forward/backward.
        temperature: the sampling temperature the log-probs are taken at.
        logprob_chunk_size: sequence chunk of the log-prob and DPO computations.
        group_size: completions per prompt (channel 1's groups).
        ema_teacher: channel 2's EMA teacher (None: the policy itself teaches).
        reference: the frozen initial policy; channel 3 reads it with ``dpo.reference: live``.
        shared_prefix: the training forward runs each group's prompt once
            (:mod:`composer_tune.rollout.shared_prefix`; the same log-probs and gradients up to
            float rounding), config key ``shared_prefix_forward``.
        log_channel_gradients: with two or more channels on, each channel's gradient norm and
            share of the step are logged (:mod:`composer_tune.channels.gradients`; channels 1
            and 2 then take a student forward and backward each instead of sharing one).

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
        group_size: int,
        ema_teacher: EMATeacher | None = None,
        reference: nn.Module | None = None,
        shared_prefix: bool = False,
        log_channel_gradients: bool = False,
    ) -> None:
        self.model = model
        self.channels = channels
        self._unscored_batches = 0  # generation batches in a row with no row scored
        self.tokenizer = tokenizer
        self.dist = dist
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size
        self.group_size = group_size
        self.ema_teacher = ema_teacher
        self.teacher_model = ema_teacher.module if ema_teacher is not None else None
        self.reference = reference
        self.shared_prefix = shared_prefix
        self.log_channel_gradients = log_channel_gradients

    @classmethod
    def for_recipe(
        cls,
        cfg: DictConfig,
        dist: DistInfo,
        channels: ComposerChannels,
        model: nn.Module,
        tokenizer: Any,
        *,
        reference: nn.Module | None = None,
        ema_teacher: EMATeacher | None = None,
    ) -> ComposerObjective:
        """The step of a recipe config's channels (micro-batch size, temperature, chunk size
        and group size from ``cfg``), with the models the recipe built for them: the frozen
        ``reference`` (``channels.builds_reference_model``) and the ``ema_teacher``
        (``channels.uses_ema_teacher``)."""
        return cls(
            model,
            channels,
            tokenizer=tokenizer,
            dist=dist,
            micro_batch_size=cfg.micro_batch_size,
            temperature=cfg.temperature,
            logprob_chunk_size=cfg.logprob_chunk_size,
            group_size=cfg.group_size,
            ema_teacher=ema_teacher,
            reference=reference,
            shared_prefix=cfg.shared_prefix_forward,
            log_channel_gradients=cfg.log_channel_gradients,
        )

    def state_dict(self) -> dict[str, Any]:
        """The channels' own checkpoint state: channel 2's EMA teacher (collective under
        FSDP2; ``{}`` without one)."""
        return ema_teacher_state(self.ema_teacher, self.dist)

    def load_state_dict(self, state: Mapping[str, Any], *, source: Any, cpu_offload: bool) -> None:
        """Restores :meth:`state_dict` from a checkpoint's recipe state (read from ``source``)."""
        load_ema_teacher_state(
            self.ema_teacher, state, source=source, device=self.dist.device, cpu_offload=cpu_offload
        )

    def prepare(
        self, rollout: RolloutBatch | None, *, advantage_sign: float = 1.0
    ) -> GenerationBatch:
        """A generation batch's rollouts (None with channel 3 alone) for every channel that is
        on: channel 1's group-relative advantages (after the KL penalty in ``kl_mode=reward``;
        times ``advantage_sign``, the negative control's -1) and channel 2's teacher contexts.
        Collective (rollout metrics, batch-scaled advantages)."""
        if rollout is None:
            return GenerationBatch(None, None, None, {})
        advantages = None
        if self.channels.policy_weight > 0:
            advantages = group_advantages(rollout, self.channels.loss, self.group_size, self.dist)
            advantages = advantages * advantage_sign
        teacher_batch = None
        if self.channels.sdpo.enabled:
            teacher_batch = build_sdpo_teacher_batch(
                rollout, tokenizer=self.tokenizer, cfg=self.channels.sdpo
            )
        metrics = rollout_metrics(rollout)
        self._stop_if_nothing_is_scored(rollout, metrics["reward/unscored"])
        return GenerationBatch(rollout, advantages, teacher_batch, metrics)

    def _stop_if_nothing_is_scored(self, rollout: RolloutBatch, unscored: float) -> None:
        """A reward that scores no row of ``UNSCORED_BATCHES_LIMIT`` generation batches in a
        row is broken (a grader that cannot start, an environment without ``get_reward``):
        the run stops with the first row's reason instead of training on nothing for hours.
        ``unscored`` is over every rank, so the ranks stop together."""
        self._unscored_batches = self._unscored_batches + 1 if unscored >= 1.0 else 0
        if self._unscored_batches >= UNSCORED_BATCHES_LIMIT:
            reason = (rollout.feedback[0] if rollout.feedback else "") or "no reason given"
            raise RewardUnscoredError(
                f"the reward scored no completion of the last {UNSCORED_BATCHES_LIMIT} "
                f"generation batches (reward/unscored 1.0); the first one's reason: {reason}"
            )

    def backward(
        self, step: StepData, pair_batch: PreferenceBatch | None, *, on_policy: bool
    ) -> StepLosses:
        """Backward of one optimiser step's objective over ``step``'s rows and this rank's
        training pairs (``pair_batch``; None without channel 3). ``on_policy``: the rows were
        sampled by the current weights, so channel 1's old log-probs are the current ones
        (TRL's shortcut)."""
        channels, loss_cfg, dist = self.channels, self.channels.loss, self.dist
        rows, advantages, teacher_rows = step.rows, step.advantages, step.teacher_rows
        micro_batches = rows.micro_batches(self.micro_batch_size) if rows is not None else []
        use_policy, use_sdpo = channels.policy_weight > 0, channels.sdpo.enabled
        result = StepLosses()
        channels_on = sum((use_policy and rows is not None, use_sdpo, pair_batch is not None))
        split = (
            ChannelGradients(self.model.parameters(), eos_token=self.tokenizer.eos_id)
            if self.log_channel_gradients and channels_on > 1
            else None
        )
        # With the gradients told apart, each channel's logit gradient on the end of reply too.
        model = split.watch(self.model) if split is not None else self.model
        # Channels 1 and 2 share the student forward unless their gradients are told apart:
        # then each runs its own forward and backward (a second backward through a shared
        # graph would recompute checkpointed layers from FSDP2's resharded parameters).
        one_student_forward = use_policy and use_sdpo and split is None
        if use_policy:
            normalization = step_normalization(rows, loss_cfg, dist, self.micro_batch_size)
            result.tokens["policy"] = float(rows.completion_mask.sum())
        sdpo_normalizer = None
        sdpo_total = 0.0
        if use_sdpo:
            # SDPO's loss is a mean over the step's distilled tokens (or rows) on all ranks.
            result.tokens["sdpo"] = float(distilled_token_count(teacher_rows))
            count = loss_normalizer_count(teacher_rows, channels.sdpo.loss)
            sdpo_normalizer = float(all_reduce_sum(count.reshape(1)).clamp(min=1)) / dist.world_size
        router_metrics: list[dict[str, float]] = []

        def with_router_loss(channel_loss: torch.Tensor) -> torch.Tensor:
            """``channel_loss`` plus a mixture of experts' load-balancing loss of the forward
            just run (zero for other models), before the backward that takes that forward."""
            aux, metrics = router_loss(self.model, scale=1 / len(micro_batches))
            router_metrics.append(metrics)
            return channel_loss if aux is None else channel_loss + aux

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
                with channel_scope(split, "policy"):
                    logprob_args = {
                        "temperature": self.temperature,
                        "chunk_size": self.logprob_chunk_size,
                    }
                    if one_student_forward:  # both channels' terms from one forward
                        logp, entropy, sdpo_loss, metrics = logprobs_with_sdpo(
                            model,
                            micro,
                            shared_prefix=self.shared_prefix,
                            **sdpo_args,
                            **logprob_args,
                        )
                        result.sdpo_metrics.append(metrics)
                        loss = loss + sdpo_loss
                        sdpo_total += float(sdpo_loss.detach())
                    else:
                        logp, entropy = rollout_logprobs(
                            model,
                            micro,
                            shared_prefix=self.shared_prefix,
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
                    weighted_policy = with_router_loss(channels.policy_weight * policy)
                    loss = loss + weighted_policy
                    for name, value in metrics.items():
                        result.metrics[name] = result.metrics.get(name, 0.0) + float(value) / len(
                            micro_batches
                        )
                    if split is not None:
                        weighted_policy.backward()
            if use_sdpo and not one_student_forward:  # channel 2's own student forward
                with channel_scope(split, "sdpo"):
                    sdpo_loss, metrics = sdpo_channel_loss(model, micro, **sdpo_args)
                    sdpo_loss = with_router_loss(sdpo_loss)
                    result.sdpo_metrics.append(metrics)
                    loss = loss + sdpo_loss
                    sdpo_total += float(sdpo_loss.detach())
                    if split is not None:
                        sdpo_loss.backward()
            if split is None:
                loss.backward()
            result.loss += float(loss.detach())
        if use_sdpo:
            result.metrics["sdpo/weighted_loss"] = sdpo_total
        result.metrics.update(mean_metrics(router_metrics))
        if pair_batch is not None:  # channel 3: one forward over this rank's pairs
            with channel_scope(split, "dpo"):
                pair_loss, pair_metrics = pair_loss_backward(
                    model,
                    pair_batch,
                    channels.dpo,
                    reference_model=self.reference,
                    chunk_size=self.logprob_chunk_size,
                )
            result.loss += pair_loss
            result.metrics.update(pair_metrics)
            result.tokens["dpo"] = float(pair_batch.packed.completion_mask.sum())
        if split is not None:
            result.metrics.update(split.combine(distributed=dist.is_distributed))
        return result
