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
* :func:`sample_rollouts`, :func:`group_advantages`: the rollout side of channels 1 and 2 (the
  rollout statistics are ``composer_tune.rollout.rollouts.rollout_metrics``).
* :class:`ComposerObjective`: forward and backward of every channel that is on over one step's
  micro-batches and pair batch; :class:`StepLosses` is what it returns, ``reduce()`` the step's
  logged loss metrics over ranks.
* :class:`PairChannel`: channel 3's data: the training-pair stream (each rank of each replica
  its own shard), the held-out pairs, the reference table, the resume state, pair evaluation.
* :func:`ema_teacher_state` / :func:`load_ema_teacher_state`: channel 2's EMA teacher in a run
  checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import training

from composer_tune.channels.replay_dpo import (
    DPOChannelConfig,
    PairStream,
    evaluate_pairs,
    load_pair_splits,
    reference_table,
)
from composer_tune.channels.sdpo.channel import (
    SDPOChannelConfig,
    distilled_token_count,
    logprobs_with_sdpo,
    reduce_sdpo_metrics,
    sdpo_channel_loss,
    select_teacher_rows,
)
from composer_tune.channels.sdpo.contexts import TeacherBatch
from composer_tune.checkpointing.run_state import full_model_state_dict
from composer_tune.data.preference import PreferenceBatch
from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.losses import (
    PolicyLossConfig,
    apply_kl_to_rewards,
    apply_truncation_mask,
    compute_advantages,
    needs_reference_model,
    policy_loss,
    preference_loss,
)
from composer_tune.losses.distill import EMATeacher
from composer_tune.rollout.rollouts import (
    RolloutBatch,
    collect_rollouts,
    sequence_logprobs,
)

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
    def from_config(cls, cfg: DictConfig) -> ComposerChannels:
        """From a recipe config's ``loss``, ``sdpo`` and ``dpo`` sections (null: defaults, i.e.
        channel 1 at weight 1, channels 2 and 3 off); bad values raise naming the section."""
        section = OmegaConf.to_container(cfg.loss, resolve=True) if cfg.loss is not None else {}
        weight = float(section.pop("weight", 1.0))
        if weight < 0:
            raise ValueError(f"loss.weight must be >= 0, got {weight}")
        section.setdefault("max_completion_length", cfg.max_new_tokens)
        channels = cls(
            policy_weight=weight,
            loss=PolicyLossConfig.from_mapping(section, source="loss"),
            sdpo=_sdpo_config(cfg),
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
    def needs_reference_model(self) -> bool:
        """A frozen copy of the initial policy exists only for a KL term or live DPO scoring."""
        return self.kl_reference or self.live_dpo

    @property
    def kl_in_reward(self) -> bool:
        return self.policy_weight > 0 and self.loss.beta > 0 and self.loss.kl_mode == "reward"

    @property
    def ema_teacher(self) -> bool:
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


def _sdpo_config(cfg: DictConfig) -> SDPOChannelConfig:
    """Channel 2's settings, checked against the SDPOChannelConfig schema."""
    if cfg.sdpo is None:
        return SDPOChannelConfig()
    # Resolved against the whole config: the section may interpolate other keys
    # (e.g. context.max_teacher_tokens: ${model.max_seq_len}).
    sdpo_cfg = SDPOChannelConfig.from_mapping(OmegaConf.to_container(cfg.sdpo, resolve=True))
    if sdpo_cfg.enabled and sdpo_cfg.context.enable_thinking != cfg.enable_thinking:
        raise ValueError(
            f"sdpo.context.enable_thinking ({sdpo_cfg.context.enable_thinking}) must match "
            f"enable_thinking ({cfg.enable_thinking}): the teacher reads the student's "
            "completions after the same generation prompt"
        )
    return sdpo_cfg


# ----------------------------------------------------------------------------- rollouts


def sample_rollouts(
    model: nn.Module,
    samples: list[dict[str, Any]],
    cfg: DictConfig,
    channels: ComposerChannels,
    *,
    tokenizer: Any,
    reward: Any,
    generator: torch.Generator,
    reference: nn.Module | None,
    on_policy: bool,
    sync_ranks: bool,
) -> RolloutBatch:
    """``cfg.group_size`` completions per prompt of ``samples``, scored, with the log-probs the
    channels read (reference ones only for channel 1's KL term). ``cfg`` is the recipe config
    (its sampling keys: group_size, max_new_tokens, temperature, top_k, top_p, enable_thinking,
    logprob_chunk_size, micro_batch_size)."""
    return collect_rollouts(
        model,
        tokenizer,
        samples,
        reward,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        generator=generator,
        reference=reference if channels.kl_reference else None,
        enable_thinking=cfg.enable_thinking,
        logprob_chunk_size=cfg.logprob_chunk_size,
        forward_batch_size=cfg.micro_batch_size,
        sync_ranks=sync_ranks,
        compute_old_logp=channels.needs_old_logp(on_policy),
    )


def group_advantages(
    rollout: RolloutBatch, channels: ComposerChannels, group_size: int, dist: DistInfo
) -> torch.Tensor:
    """Channel 1's group-relative advantages of this rank's rows, after the KL penalty in
    ``kl_mode=reward``; ``scale_rewards=batch`` takes the std over every rank's rewards."""
    rewards = rollout.rewards
    loss_cfg = channels.loss
    if channels.kl_in_reward:
        rewards = apply_kl_to_rewards(
            rewards,
            rollout.old_logp,
            rollout.ref_logp,
            rollout.completion_mask,
            loss_cfg.beta,
            loss_cfg.kl_estimator,
        )
    if loss_cfg.scale_rewards != "batch" or not dist.is_distributed:
        return compute_advantages(rewards, group_size, loss_cfg.scale_rewards)
    gathered = torch.zeros(
        (dist.world_size, rewards.numel()), dtype=rewards.dtype, device=rewards.device
    )
    gathered[dist.rank] = rewards
    all_reduce_sum(gathered)
    advantages = compute_advantages(gathered.reshape(-1), group_size, "batch")
    return advantages.view(dist.world_size, -1)[dist.rank]


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
        self.dpo_reference = reference if channels.live_dpo else None

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
            # dapo/cispo normalise by the active tokens of the whole step on all ranks; FSDP
            # then averages gradients over ranks, hence the division by world size (as in TRL).
            active = rows.completion_mask
            if loss_cfg.mask_truncated_completions:
                active = apply_truncation_mask(active, rows.truncated)
            global_tokens = all_reduce_sum(active.sum().double().reshape(1))
            num_items = float(global_tokens.clamp(min=1)) / dist.world_size
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
                    num_items_in_batch=num_items,
                    truncated=micro.truncated,
                    entropy=entropy,
                )
                if loss_cfg.objective not in ("dapo", "cispo"):
                    policy = policy / len(micro_batches)  # gradient accumulation
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
        if pair_batch is not None:
            # Channel 3: one forward over this rank's share of the step's pairs. Its loss is a
            # mean over the rank's pairs; FSDP's gradient average makes it the global mean.
            output = preference_loss(
                self.model,
                pair_batch,
                channels.dpo.loss_config,
                reference_model=self.dpo_reference,
                chunk_size=self.logprob_chunk_size,
            )
            (channels.dpo.weight * output.loss).backward()
            result.loss += channels.dpo.weight * float(output.loss.detach())
            for name, value in output.metrics().items():
                result.metrics[f"dpo/{name}"] = value
        return result


# ----------------------------------------------------------------------------- channel 3 data


class PairChannel:
    """Channel 3's data in a recipe (trace-replay DPO, this project's own addition).

    Loads the train and held-out pair splits, the reference table (``dpo.reference:
    precomputed``: from the resumed run's state, else scored now by ``model``, which before the
    first step is the initial policy), and a :class:`~composer_tune.channels.replay_dpo.PairStream`.
    Pairs are dealt like prompts: over ``num_replicas`` replicas of ``dist.world_size`` ranks
    each, every rank of every replica gets its own disjoint share, ``dpo.pairs_per_step`` per
    replica and step. ``state`` is a resumed run's recipe state (``{}`` for a fresh run);
    :meth:`state_dict` is what to put into the next one.
    """

    def __init__(
        self,
        cfg: DPOChannelConfig,
        *,
        model: nn.Module,
        tokenizer: Any,
        dist: DistInfo,
        seed: int,
        logprob_chunk_size: int,
        state: Mapping[str, Any],
        resumed: bool,
        num_replicas: int = 1,
        replica_id: int = 0,
    ) -> None:
        self.cfg = cfg
        self.dist = dist
        self.pad_id = tokenizer.pad_id
        self.logprob_chunk_size = logprob_chunk_size
        self.train, self.heldout = load_pair_splits(cfg, tokenizer)
        self.reference: dict[str, tuple[float, float]] | None = None
        if cfg.reference == "precomputed" and "dpo_reference" in state:
            self.reference = state["dpo_reference"]
        elif cfg.reference == "precomputed":
            if resumed:  # the policy is no longer the initial one
                raise ValueError(
                    "dpo.reference=precomputed, but the resumed checkpoint has no reference "
                    "table (written with channel 3 off or dpo.reference=live): resume with "
                    "the settings the run started with"
                )
            self.reference = reference_table(
                model,
                [self.train, self.heldout],
                cfg,
                pad_id=self.pad_id,
                dist_info=dist,
                chunk_size=logprob_chunk_size,
            )
        shards = num_replicas * dist.world_size
        if num_replicas > 1 and len(self.train) < cfg.pairs_per_step * num_replicas:
            raise ValueError(
                f"dpo.pairs_per_step={cfg.pairs_per_step} per replica over {num_replicas} "
                f"replicas needs at least {cfg.pairs_per_step * num_replicas} training pairs, "
                f"the pairs source has {len(self.train)} in the train split"
            )
        # One shard per rank of every replica; PairStream splits pairs_per_step over its shards.
        self.stream = PairStream(
            self.train,
            pairs_per_step=cfg.pairs_per_step * num_replicas,
            dist_info=DistInfo(
                world_size=shards, rank=replica_id * dist.world_size + dist.rank, device=dist.device
            ),
            seed=seed,
            pad_id=self.pad_id,
            reference=self.reference,
        )
        if "pair_stream" in state:
            self.stream.load_state_dict(state["pair_stream"])
        if dist.is_main:
            print(
                f"dpo: {len(self.train)} training pairs {dict(self.train.stats)}, "
                f"{len(self.heldout)} held out, reference {cfg.reference}",
                flush=True,
            )

    def next_batch(self) -> PreferenceBatch:
        """This rank's training pairs for the next optimiser step, on its device."""
        return next(self.stream).to(self.dist.device)

    def state_dict(self) -> dict[str, Any]:
        """The resume state: the stream position (every rank advances in lockstep, so rank 0's
        is everyone's) and the reference table."""
        return {"pair_stream": self.stream.state_dict(), "dpo_reference": self.reference}

    def evaluate(self, model: nn.Module, reference: nn.Module | None = None) -> dict[str, float]:
        """DPO loss, margin and accuracy of ``model`` on the held-out pairs (``eval/dpo_*``;
        ``{}`` without held-out pairs); ``reference`` scores them with ``dpo.reference: live``.
        """
        return evaluate_pairs(
            model,
            self.heldout,
            self.cfg,
            pad_id=self.pad_id,
            device=self.dist.device,
            chunk_size=self.logprob_chunk_size,
            reference=self.reference,
            reference_model=reference if self.cfg.reference == "live" else None,
        )


# ----------------------------------------------------------------------------- channel 2 state


def ema_teacher_state(ema_teacher: EMATeacher | None, dist: DistInfo) -> dict[str, Any]:
    """Channel 2's EMA teacher for a run checkpoint's recipe state (its full weights on rank 0;
    collective under FSDP); ``{}`` without one."""
    if ema_teacher is None:
        return {}
    weights = full_model_state_dict(ema_teacher.module, dist)
    return {"sdpo_ema": {"weights": weights, "num_updates": ema_teacher.num_updates}}


def load_ema_teacher_state(
    ema_teacher: EMATeacher | None,
    state: Mapping[str, Any],
    *,
    source: Any,
    device: torch.device,
    cpu_offload: bool,
) -> None:
    """Restores what :func:`ema_teacher_state` saved into ``state`` (a checkpoint's recipe
    state, read from ``source``); nothing without an EMA teacher."""
    if ema_teacher is None:
        return
    if "sdpo_ema" not in state:
        raise ValueError(
            f"{source} has no EMA teacher (written without sdpo.teacher=ema): resume "
            "with the settings the run started with"
        )
    training.load_from_full_model_state_dict(
        ema_teacher.module,
        state["sdpo_ema"]["weights"],
        device,
        strict=True,
        cpu_offload=cpu_offload,
    )
    ema_teacher.rebind()  # torchtune's loader assigned new tensors to the teacher
    ema_teacher.num_updates = state["sdpo_ema"]["num_updates"]
