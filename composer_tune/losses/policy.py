"""The GRPO family of policy objectives: advantages, clipped surrogates and loss aggregation.

Semantics follow TRL's ``GRPOTrainer`` (``_compute_loss``), which the tests check against values
worked out by hand:

* Advantages: ``A = r - mean_group(r)``, divided by ``std + 1e-4`` (unbiased std within the group
  for ``scale_rewards="group"``, over the whole batch for ``"batch"``, no division for
  ``"none"``). A group is a consecutive block of ``group_size`` completions of one prompt.
* A reward of NaN means "could not be scored" (a crashed verifier): that completion gets zero
  advantage and its group's mean and std are taken over the scored completions only, so its
  group-mates keep their signal. TRL 1.16 does the same: it sums the reward functions with
  ``nansum`` but marks a row whose every function returned NaN unscorable (NaN), leaves it out
  of the ``nanmean``/``nanstd`` baseline and sets its advantage to 0 (as
  :class:`composer_tune.rewards.composite.CompositeReward` sums the scorable parts).
* Importance ratio ``w = exp(logp - old_logp)`` per token; GSPO uses one ratio per sequence,
  ``s = exp(mean_t(logp - old_logp))`` over its completion tokens, broadcast to the tokens
  (TRL's ``importance_sampling_level="sequence"``, which any objective may set).
* Clipped objectives (grpo, bnpo, dr_grpo, dapo, gspo): token loss
  ``-min(min(w, delta) * A, clip(w, 1 - eps_low, 1 + eps_high) * A)``; ``delta`` (default off)
  is the two-sided clipping of TRL's ``delta``, bounding the ratio of negative-advantage tokens.
* CISPO: ``-sg(min(w, eps_max)) * A * logp``: the IS weight is capped and detached, so every
  token keeps a gradient (through ``logp``) instead of being dropped by the clip.
* SAPO: ``-sigmoid(tau * (w - 1)) * 4 / tau * A``, a soft gate instead of the hard clip, with
  ``tau = sapo_temperature_pos`` for ``A > 0`` and ``sapo_temperature_neg`` otherwise.
* ``top_entropy_quantile = q < 1`` trains only the policy term of the tokens whose entropy is in
  the top ``q`` of the micro-batch's active tokens (TRL pools that quantile over processes too).
* Optional ``beta * KL`` added to each token's loss (``kl_mode="loss"``), or folded into the
  reward beforehand (``kl_mode="reward"``, see :func:`composer_tune.losses.kl.apply_kl_to_rewards`).
  ``kl_bias_correction=True`` multiplies the KL term by ``w`` (with its gradient), TRL's
  ``use_bias_correction_kl``; TRL 1.16 turns it on by default, this project does not, and the
  gradient differs even on-policy, where ``w = 1`` in value.
* ``sampling_correction`` (default off) multiplies the policy term of each token's loss by the
  truncated importance weight between the trainer's ``old_logp`` and the sampler's own
  log-probs (TRL's ``vllm_importance_sampling_correction``, before the KL term is added; see
  :mod:`composer_tune.losses.sampling_correction`; a NaN sampler log-prob gets weight 1, as in
  TRL). Whenever the sampler's log-probs are given, their gap to the trainer's is logged, over
  the tokens whose sampler log-prob is not NaN.
* Aggregation of the masked token losses:

  ============  =====================================================================
  grpo, gspo,   mean over sequences of each sequence's token mean
  sapo
  bnpo          token sum / active tokens in this micro-batch
  dr_grpo       token sum / (batch size * max_completion_length)
  dapo, cispo   token sum / active tokens in the whole optimiser step
                (all micro-batches and ranks; see :class:`StepNormalization`)
  ============  =====================================================================

Over an optimiser step of several micro-batches (and ranks) the loss is completed by
:class:`StepNormalization`, passed to :func:`policy_loss`: every objective but dapo and cispo is
divided by the number of micro-batches (gradient accumulation, as in TRL); dapo and cispo divide
by the step's active tokens over ranks, times the world size that FSDP's gradient average divides
by again. The loss owns this, so no caller branches on the objective.

Per-objective defaults (when the config leaves a field as ``None``):

  ========  ========  =========  ============  =====================================
  objective eps_low   eps_high   scale_rewards  source
  ========  ========  =========  ============  =====================================
  grpo      0.2       0.2        group          DeepSeekMath / TRL default epsilon
  bnpo      0.2       0.2        group          TRL
  dr_grpo   0.2       0.2        none           Dr. GRPO drops the std division
  dapo      0.2       0.28       group          DAPO "clip-higher"
  gspo      3e-4      4e-4       group          GSPO paper v2, section 5.1
  cispo     (unused)  5.0        group          eps_max, ScaleRL (TRL's recommendation)
  sapo      (unused)  (unused)   group          temperatures 1.0 / 1.05 (TRL, SAPO paper)
  ========  ========  =========  ============  =====================================

DAPO also masks truncated completions (``mask_truncated_completions=True``); it is left off by
default for every objective so that no completion is silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from composer_tune.losses.kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from composer_tune.losses.sampling_correction import (
    SAMPLING_CORRECTIONS,
    SamplingCorrection,
    sampling_correction_weights,
    sampling_mismatch_metrics,
)

Objective = Literal["grpo", "dr_grpo", "bnpo", "dapo", "gspo", "cispo", "sapo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
RewardScale = Literal["group", "batch", "none"]
KLMode = Literal["loss", "reward"]

OBJECTIVES: tuple[str, ...] = get_args(Objective)
REWARD_SCALES: tuple[str, ...] = get_args(RewardScale)
KL_MODES: tuple[str, ...] = get_args(KLMode)
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)
# Objectives whose token loss is the clipped surrogate min(w A, clip(w) A).
CLIPPED_OBJECTIVES = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo")

# Added to the std before dividing, as in TRL, so near-constant groups do not explode.
ADVANTAGE_STD_EPS = 1e-4

# objective -> (epsilon_low, epsilon_high); see the module docstring for sources.
_DEFAULT_EPSILONS: dict[str, tuple[float | None, float | None]] = {
    "grpo": (0.2, 0.2),
    "bnpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (None, 5.0),
    "sapo": (None, None),
}


@dataclass
class PolicyLossConfig:
    """Which policy objective to optimise and its hyper-parameters.

    Fields left as ``None`` are filled with the objective's defaults (module docstring) when the
    config is built, so a constructed config always holds the values actually used.

    Attributes:
        objective: one of "grpo", "dr_grpo", "bnpo", "dapo", "gspo", "cispo", "sapo".
        epsilon_low: lower clip ``1 - epsilon_low`` of the ratio; not used by cispo and sapo.
        epsilon_high: upper clip ``1 + epsilon_high``; for cispo the cap ``eps_max`` on the
            detached IS weight itself (not ``1 + eps``); not used by sapo.
        delta: two-sided clipping (TRL's ``delta``): the unclipped ratio is capped at ``delta``
            (> 1 + epsilon_high), which bounds negative-advantage tokens; clipped objectives.
        importance_sampling_level: "token" (default) or "sequence" (default for gspo): one
            length-normalised ratio per completion, for any objective.
        sapo_temperature_pos, sapo_temperature_neg: sapo's gate temperatures for positive and
            non-positive advantages (TRL's defaults 1.0 and 1.05).
        top_entropy_quantile: train the policy term only on the tokens whose entropy is in this
            top fraction of the micro-batch's active tokens (1.0: all); needs token entropies.
        beta: KL coefficient. 0 disables the KL term and the reference model entirely.
        kl_estimator: "k1", "k2" or "k3"; defaults to "k3" in the loss (TRL) and "k1" in the
            reward (Composer's report).
        kl_mode: "loss" (beta * KL added to each token's loss) or "reward" (subtracted from the
            scalar reward before advantages; the recipe calls ``apply_kl_to_rewards``).
        kl_bias_correction: multiply the in-loss KL term by the importance ratio (TRL's
            ``use_bias_correction_kl``, True by default in TRL 1.16; False here).
        scale_rewards: advantage normalisation, "group", "batch" or "none".
        max_completion_length: generation length cap; required by dr_grpo's normaliser.
        mask_truncated_completions: exclude completions that hit the length cap from the loss.
        sampling_correction: None (off), or the truncated importance-sampling mode that
            reweights each token by ``exp(old_logp - sampling_logp)``: "token_truncate",
            "token_mask", "sequence_truncate" or "sequence_mask" (TRL's
            ``vllm_importance_sampling_mode``; TRL 1.16 defaults to "sequence_mask", on).
        sampling_correction_cap: the bound on that ratio (TRL's
            ``vllm_importance_sampling_cap``, default 3.0).
    """

    objective: Objective = "grpo"
    epsilon_low: float | None = None
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: ImportanceSamplingLevel | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    top_entropy_quantile: float = 1.0
    beta: float = 0.0
    kl_estimator: KLEstimator | None = None
    kl_mode: KLMode = "loss"
    kl_bias_correction: bool = False
    scale_rewards: RewardScale | None = None
    max_completion_length: int | None = None
    mask_truncated_completions: bool = False
    sampling_correction: SamplingCorrection | None = None
    sampling_correction_cap: float = 3.0

    def __post_init__(self) -> None:
        _check_choice("PolicyLossConfig.objective", self.objective, OBJECTIVES)
        _check_choice("PolicyLossConfig.kl_mode", self.kl_mode, KL_MODES)
        default_low, default_high = _DEFAULT_EPSILONS[self.objective]
        if self.objective == "cispo":
            if self.epsilon_low is not None:
                raise ValueError(
                    "PolicyLossConfig.epsilon_low has no effect for objective 'cispo' (it only caps "
                    "the IS weight from above at epsilon_high); leave it unset"
                )
        elif self.objective == "sapo":
            if self.epsilon_low is not None or self.epsilon_high is not None:
                raise ValueError(
                    "PolicyLossConfig.epsilon_low/epsilon_high have no effect for objective "
                    "'sapo' (a soft gate replaces the clip: set sapo_temperature_pos/neg)"
                )
        elif self.epsilon_low is None:
            self.epsilon_low = default_low
        if self.epsilon_high is None:
            self.epsilon_high = default_high
        if self.importance_sampling_level is None:
            self.importance_sampling_level = "sequence" if self.objective == "gspo" else "token"
        _check_choice(
            "PolicyLossConfig.importance_sampling_level",
            self.importance_sampling_level,
            IMPORTANCE_SAMPLING_LEVELS,
        )
        if self.kl_estimator is None:
            self.kl_estimator = "k3" if self.kl_mode == "loss" else "k1"
        _check_choice("PolicyLossConfig.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.scale_rewards is None:
            self.scale_rewards = "none" if self.objective == "dr_grpo" else "group"
        _check_choice("PolicyLossConfig.scale_rewards", self.scale_rewards, REWARD_SCALES)

        if self.epsilon_low is not None and not 0.0 <= self.epsilon_low < 1.0:
            raise ValueError(
                f"PolicyLossConfig.epsilon_low must be in [0, 1), got {self.epsilon_low}"
            )
        if self.epsilon_high is not None and self.epsilon_high <= 0.0:
            raise ValueError(f"PolicyLossConfig.epsilon_high must be > 0, got {self.epsilon_high}")
        if self.delta is not None:
            if self.objective not in CLIPPED_OBJECTIVES:
                raise ValueError(
                    f"PolicyLossConfig.delta applies to the clipped objectives {CLIPPED_OBJECTIVES}, "
                    f"not {self.objective!r}"
                )
            if self.delta <= 1.0 + self.epsilon_high:
                raise ValueError(
                    f"PolicyLossConfig.delta must be > 1 + epsilon_high = {1 + self.epsilon_high}, "
                    f"got {self.delta}"
                )
        if min(self.sapo_temperature_pos, self.sapo_temperature_neg) <= 0.0:
            raise ValueError(
                "PolicyLossConfig.sapo_temperature_pos/neg must be > 0, got "
                f"{self.sapo_temperature_pos}/{self.sapo_temperature_neg}"
            )
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(
                "PolicyLossConfig.top_entropy_quantile must be in (0, 1], got "
                f"{self.top_entropy_quantile}"
            )
        if self.beta < 0.0:
            raise ValueError(f"PolicyLossConfig.beta must be >= 0, got {self.beta}")
        if self.max_completion_length is not None and self.max_completion_length <= 0:
            raise ValueError(
                "PolicyLossConfig.max_completion_length must be a positive int, got "
                f"{self.max_completion_length}"
            )
        if self.objective == "dr_grpo" and self.max_completion_length is None:
            raise ValueError(
                "PolicyLossConfig.max_completion_length is required for objective 'dr_grpo' "
                "(its normaliser is batch_size * max_completion_length)"
            )
        if self.sampling_correction is not None:
            _check_choice(
                "PolicyLossConfig.sampling_correction",
                self.sampling_correction,
                SAMPLING_CORRECTIONS,
            )
        if not self.sampling_correction_cap > 0.0:
            raise ValueError(
                "PolicyLossConfig.sampling_correction_cap must be > 0, got "
                f"{self.sampling_correction_cap}"
            )

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], source: str = "policy_loss"
    ) -> PolicyLossConfig:
        """Build a config from a dict-like section (e.g. an OmegaConf node).

        ``source`` names the section in errors, so a typo reads e.g.
        ``policy_loss: unknown key 'epsilon_hgh'``.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {unknown}; expected a subset of {sorted(known)}"
            )
        try:
            return cls(**dict(mapping))
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from err

    @property
    def sequence_level_ratio(self) -> bool:
        """Whether the importance ratio is one per sequence (GSPO's) rather than one per token."""
        return self.importance_sampling_level == "sequence"

    @property
    def normalizes_by_step_tokens(self) -> bool:
        """dapo and cispo divide by the whole step's active tokens; the others are per-micro-batch
        means, averaged over the step's micro-batches."""
        return self.objective in ("dapo", "cispo")


@dataclass(frozen=True)
class StepNormalization:
    """What completes the policy loss of one micro-batch into its share of an optimiser step.

    Attributes:
        active_tokens: the step's active completion tokens over every micro-batch and rank,
            counted after truncation masking (:func:`apply_truncation_mask`).
        world_size: data-parallel ranks whose gradients FSDP/DDP average.
        num_micro_batches: this rank's micro-batches in the step.
    """

    active_tokens: float
    world_size: int
    num_micro_batches: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_micro_batches < 1:
            raise ValueError(
                "StepNormalization: world_size and num_micro_batches must be >= 1, got "
                f"{self.world_size} and {self.num_micro_batches}"
            )

    @property
    def tokens_per_rank(self) -> float:
        """dapo/cispo's divisor: the step's active tokens (at least 1) over the world size,
        which the backend's gradient average divides by again (as in TRL)."""
        return max(self.active_tokens, 1.0) / self.world_size


def _check_choice(label: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{label} must be one of {choices}, got {value!r}")


def needs_reference_model(cfg: PolicyLossConfig) -> bool:
    """Whether the recipe must load a frozen reference model: only when the KL term is on."""
    return cfg.beta != 0.0


def compute_advantages(rewards: Tensor, group_size: int, scale: RewardScale = "group") -> Tensor:
    """Group-relative advantages ``(r - mean_group(r)) / (std + 1e-4)``.

    Args:
        rewards: ``[B]`` scalar rewards, ``B`` a multiple of ``group_size``; consecutive blocks
            of ``group_size`` rows are the completions of one prompt. For ``scale="batch"``
            pass the whole generation batch (all ranks), since the std is taken over it.
        group_size: completions per prompt (G).
        scale: "group" (unbiased std within each group), "batch" (unbiased std over all
            rewards) or "none" (no division, as in Dr. GRPO).

    Returns:
        ``[B]`` advantages in float32 (float64 for float64 rewards). A group whose rewards are
        all equal gets exactly zero advantage (so it contributes no policy gradient), even
        where float rounding of the mean would leave a tiny residue. A NaN reward (a completion
        that could not be scored) gets zero advantage and is left out of its group's mean and
        std (and the batch std); a group with one or no scored completion gets zero throughout.
    """
    if rewards.dim() != 1:
        raise ValueError(f"compute_advantages: rewards must be [B], got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"compute_advantages: group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"compute_advantages: {rewards.numel()} rewards are not a whole number of groups of "
            f"group_size={group_size}"
        )
    _check_choice("compute_advantages: scale", scale, REWARD_SCALES)
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if torch.isnan(rewards).any():
        return _advantages_with_unscored(rewards, group_size, scale)
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    constant_group = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(constant_group, torch.zeros_like(centred), centred)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + ADVANTAGE_STD_EPS)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        centred = centred / (std + ADVANTAGE_STD_EPS)
    return centred.reshape(-1)


def _advantages_with_unscored(rewards: Tensor, group_size: int, scale: RewardScale) -> Tensor:
    """compute_advantages where some rewards are NaN: statistics over the scored rows only."""
    scored = ~torch.isnan(rewards)
    grouped = rewards.view(-1, group_size)
    grouped_scored = scored.view(-1, group_size)
    counts = grouped_scored.sum(dim=1, keepdim=True)
    filled = torch.where(grouped_scored, grouped, torch.zeros_like(grouped))
    mean = filled.sum(dim=1, keepdim=True) / counts.clamp(min=1)
    centred = torch.where(grouped_scored, grouped - mean, torch.zeros_like(grouped))
    # Constant among its scored rows (or one scored row at most): exactly zero, as above.
    highest = torch.where(grouped_scored, grouped, -math.inf).amax(dim=1, keepdim=True)
    lowest = torch.where(grouped_scored, grouped, math.inf).amin(dim=1, keepdim=True)
    constant_group = (highest <= lowest) | (counts < 2)
    centred = torch.where(constant_group, torch.zeros_like(centred), centred)
    if scale == "group":
        variance = centred.square().sum(dim=1, keepdim=True) / (counts - 1).clamp(min=1)
        centred = centred / (variance.sqrt() + ADVANTAGE_STD_EPS)
    elif scale == "batch":
        values = rewards[scored]
        std = values.std() if values.numel() > 1 else rewards.new_zeros(())
        centred = centred / (std + ADVANTAGE_STD_EPS)
    return centred.reshape(-1)


def apply_truncation_mask(completion_mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the completion mask of completions that hit the length cap.

    Args:
        completion_mask: ``[B, T]`` bool/0-1 mask of completion tokens.
        truncated: ``[B]`` bool, True where generation stopped at ``max_completion_length``
            without an end-of-sequence token.

    Returns:
        ``[B, T]`` bool mask. Use it (not the raw mask) when counting the global active tokens
        passed as ``num_items_in_batch``, so the dapo/cispo normaliser matches the loss.
    """
    if truncated.shape != completion_mask.shape[:1]:
        raise ValueError(
            f"apply_truncation_mask: truncated must be [B] with B={completion_mask.shape[0]}, "
            f"got {tuple(truncated.shape)}"
        )
    return completion_mask.bool() & ~truncated.bool().unsqueeze(1)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    cfg: PolicyLossConfig,
    ref_logp: Tensor | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    *,
    truncated: Tensor | None = None,
    entropy: Tensor | None = None,
    normalization: StepNormalization | None = None,
    sampling_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy objective of ``cfg.objective`` on one micro-batch.

    Args:
        logp: ``[B, T]`` log-probabilities of the completion tokens under the current policy
            (with grad).
        old_logp: ``[B, T]`` the same tokens under the policy that generated them (detached
            here). Passing ``logp.detach()`` (fully on-policy) makes every ratio 1.
        advantages: ``[B]`` per-completion advantages (see :func:`compute_advantages`).
        completion_mask: ``[B, T]`` bool/0-1, True on completion tokens to train on.
        cfg: the objective and its hyper-parameters.
        ref_logp: ``[B, T]`` reference log-probabilities; required when ``cfg.beta > 0`` and
            ``cfg.kl_mode == "loss"``. When given it also feeds the "kl" metric.
        num_items_in_batch: TRL's argument, for a lone micro-batch: dapo/cispo divide by it
            instead of this micro-batch's active tokens; the other objectives ignore it.
            Training steps pass ``normalization`` instead.
        truncated: ``[B]`` bool, required when ``cfg.mask_truncated_completions``.
        entropy: ``[B, T]`` token entropies: the "entropy" metric, and required by
            ``cfg.top_entropy_quantile < 1``.
        normalization: the optimiser step this micro-batch belongs to; the loss is then this
            micro-batch's share of the step's loss (see :class:`StepNormalization`), for every
            objective. None: the micro-batch is the whole step on one rank.

    Returns:
        ``(loss, metrics)``: a scalar loss to backpropagate and detached scalar metrics:
        "clip_ratio/low", "clip_ratio/high", "clip_ratio/region" (clipped objectives) or
        "clip_ratio/cispo" (cispo) as TRL logs them: the fraction of active tokens whose ratio
        is past the bound on the side where the clip binds (low with A < 0, high with A > 0);
        "ratio/mean"; "kl" (when ``ref_logp`` is given); "entropy" (when ``entropy`` is
        given); "advantages/{mean,std,min,max}"; "num_tokens"; "entropy_mask/fraction" (with
        ``top_entropy_quantile < 1``); with ``sampling_logp``, "sampling/logp_diff_abs" and
        "sampling/ratio" (:func:`sampling_mismatch_metrics`), and with the correction on,
        "sampling/weight" (mean weight over active tokens) and "sampling/past_cap_fraction"
        (of the active tokens, or of the sequences in sequence modes, whose ratio exceeds the
        cap: TRL's "frac_masked" in mask modes). With sequence-level ratios the ratio metrics
        are averaged over sequences (one ratio each), as in TRL.
    """
    if normalization is not None and num_items_in_batch is not None:
        raise ValueError("policy_loss: pass normalization or num_items_in_batch, not both")
    mask = _validated_mask(
        logp, old_logp, advantages, completion_mask, ref_logp, entropy, sampling_logp
    )
    if cfg.mask_truncated_completions:
        if truncated is None:
            raise ValueError(
                "policy_loss: cfg.mask_truncated_completions is set but no `truncated` [B] "
                "tensor was passed"
            )
        mask = apply_truncation_mask(mask, truncated)
    kl_in_loss = cfg.beta != 0.0 and cfg.kl_mode == "loss"
    if kl_in_loss and ref_logp is None:
        raise ValueError(
            f"policy_loss: beta={cfg.beta} with kl_mode='loss' needs ref_logp (the reference "
            "model's log-probabilities)"
        )
    if cfg.sampling_correction is not None and sampling_logp is None:
        raise ValueError(
            f"policy_loss: sampling_correction={cfg.sampling_correction!r} needs sampling_logp "
            "(the sampler's log-probabilities of the completion tokens)"
        )

    weights = mask.to(logp.dtype)
    tokens_per_sequence = weights.sum(dim=-1)
    log_ratio = logp - old_logp.detach()
    if cfg.sequence_level_ratio:
        # GSPO: length-normalised sequence log-ratio, one per completion, broadcast to tokens.
        sequence_log_ratio = (log_ratio * weights).sum(dim=-1) / tokens_per_sequence.clamp(min=1)
        log_ratio = sequence_log_ratio.unsqueeze(1).expand_as(logp)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)

    if cfg.objective == "cispo":
        capped_weight = torch.clamp(ratio, max=cfg.epsilon_high).detach()
        per_token_loss = -capped_weight * adv * logp
    elif cfg.objective == "sapo":
        temperature = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        gate = torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature
        per_token_loss = -gate * adv
    else:
        clipped_ratio = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
        unclipped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
        per_token_loss = -torch.minimum(unclipped * adv, clipped_ratio * adv)
    entropy_mask = None
    if cfg.top_entropy_quantile < 1.0:
        entropy_mask = _high_entropy_mask(entropy, mask, cfg.top_entropy_quantile)
        per_token_loss = per_token_loss * entropy_mask.to(per_token_loss.dtype)
    correction = None
    if cfg.sampling_correction is not None:
        correction = sampling_correction_weights(
            old_logp, sampling_logp, mask, cfg.sampling_correction, cfg.sampling_correction_cap
        )
        per_token_loss = per_token_loss * correction[0].to(per_token_loss.dtype)
    if kl_in_loss:
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        if cfg.kl_bias_correction:
            kl = kl * ratio
        per_token_loss = per_token_loss + cfg.beta * kl

    if normalization is not None and cfg.normalizes_by_step_tokens:
        num_items_in_batch = normalization.tokens_per_rank
    loss = _aggregate(per_token_loss * weights, tokens_per_sequence, cfg, num_items_in_batch)
    if normalization is not None and not cfg.normalizes_by_step_tokens:
        loss = loss / normalization.num_micro_batches  # gradient accumulation, as in TRL
    metrics = _metrics(
        ratio.detach(), adv, weights, cfg, logp.detach(), ref_logp, entropy, advantages
    )
    if entropy_mask is not None:
        metrics["entropy_mask/fraction"] = _masked_mean(entropy_mask.float(), weights)
    if sampling_logp is not None:
        metrics.update(sampling_mismatch_metrics(old_logp.detach(), sampling_logp, mask))
    if correction is not None:
        correction_weights, past_cap = correction
        metrics["sampling/weight"] = _masked_mean(correction_weights.detach(), weights)
        counted = weights if past_cap.shape == weights.shape else (tokens_per_sequence > 0)
        metrics["sampling/past_cap_fraction"] = _masked_mean(
            past_cap.float().reshape(counted.shape), counted.float()
        )
    return loss, metrics


def _high_entropy_mask(entropy: Tensor | None, mask: Tensor, quantile: float) -> Tensor:
    """True on the tokens whose entropy is at or above the ``1 - quantile`` quantile of the
    active tokens' entropies (TRL's ``get_high_entropy_mask``, over this micro-batch)."""
    if entropy is None:
        raise ValueError(
            f"policy_loss: top_entropy_quantile={quantile} needs the token entropies (entropy=...)"
        )
    active = entropy.detach()[mask]
    if active.numel() == 0:
        return mask
    threshold = torch.quantile(active.float(), 1.0 - quantile)
    return (entropy.detach() >= threshold) & mask


def _validated_mask(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    ref_logp: Tensor | None,
    entropy: Tensor | None,
    sampling_logp: Tensor | None,
) -> Tensor:
    """Check every input's shape against ``logp`` [B, T]; return the mask as bool."""
    if logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got {tuple(logp.shape)}")
    batch = logp.shape[0]
    for name, tensor in (
        ("old_logp", old_logp),
        ("completion_mask", completion_mask),
        ("ref_logp", ref_logp),
        ("entropy", entropy),
        ("sampling_logp", sampling_logp),
    ):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(
                f"policy_loss: {name} has shape {tuple(tensor.shape)}, expected logp's "
                f"{tuple(logp.shape)}"
            )
    if advantages.shape != (batch,):
        raise ValueError(
            f"policy_loss: advantages must be [B] with B={batch}, got {tuple(advantages.shape)}"
        )
    return completion_mask.bool()


def _aggregate(
    masked_loss: Tensor,
    tokens_per_sequence: Tensor,
    cfg: PolicyLossConfig,
    num_items_in_batch: int | float | Tensor | None,
) -> Tensor:
    """Reduce masked ``[B, T]`` token losses to a scalar with the objective's normaliser."""
    objective = cfg.objective
    if objective in ("grpo", "gspo", "sapo"):
        return (masked_loss.sum(dim=-1) / tokens_per_sequence.clamp(min=1)).mean()
    token_sum = masked_loss.sum()
    if objective == "bnpo":
        return token_sum / tokens_per_sequence.sum().clamp(min=1)
    if objective == "dr_grpo":
        return token_sum / (masked_loss.shape[0] * cfg.max_completion_length)
    # dapo and cispo: normalise by the whole generation batch's active tokens.
    if num_items_in_batch is None:
        return token_sum / tokens_per_sequence.sum().clamp(min=1)
    if float(num_items_in_batch) <= 0:
        raise ValueError(
            f"policy_loss: num_items_in_batch must be > 0, got {float(num_items_in_batch)}"
        )
    return token_sum / num_items_in_batch


@torch.no_grad()
def _metrics(
    ratio: Tensor,
    adv: Tensor,
    weights: Tensor,
    cfg: PolicyLossConfig,
    logp: Tensor,
    ref_logp: Tensor | None,
    entropy: Tensor | None,
    advantages: Tensor,
) -> dict[str, Tensor]:
    """Detached logging metrics; ratio-based ones are per sequence for GSPO, as in TRL."""
    if cfg.sequence_level_ratio:
        # One ratio per sequence: average over sequences that have any active token.
        ratio = ratio[:, :1]
        ratio_weights = (weights.sum(dim=-1, keepdim=True) > 0).to(weights.dtype)
    else:
        ratio_weights = weights

    def ratio_mean(values: Tensor) -> Tensor:
        return _masked_mean(values, ratio_weights)

    metrics: dict[str, Tensor] = {"ratio/mean": ratio_mean(ratio)}
    if cfg.objective == "cispo":
        metrics["clip_ratio/cispo"] = ratio_mean(((ratio > cfg.epsilon_high) & (adv > 0)).float())
    elif cfg.objective in CLIPPED_OBJECTIVES:
        low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)
        high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)
        metrics["clip_ratio/low"] = ratio_mean(low.float())
        metrics["clip_ratio/high"] = ratio_mean(high.float())
        metrics["clip_ratio/region"] = ratio_mean((low | high).float())
    if ref_logp is not None:
        metrics["kl"] = _masked_mean(kl_penalty(logp, ref_logp, cfg.kl_estimator), weights)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), weights)
    advantages = advantages.detach().float()
    metrics["advantages/mean"] = advantages.mean()
    metrics["advantages/std"] = advantages.std(correction=0)
    metrics["advantages/min"] = advantages.min()
    metrics["advantages/max"] = advantages.max()
    metrics["num_tokens"] = weights.sum()
    return metrics


def _masked_mean(values: Tensor, weights: Tensor) -> Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1)
