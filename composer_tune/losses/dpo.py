"""DPO-family preference losses on completion log-probs (pure math: the model forwards that
produce the log-probs are channel 3's, ``composer_tune.channels``).

Used by channel 3 of composer-tune, trace-replay DPO: this project's OWN research addition, not
part of Cursor's published Composer recipe (which has GRPO-family RL and SDPO self-distillation
only). Preference pairs come from teacher replays of agent traces (``composer_tune.data.pairs``);
``composer_tune.data.preference`` renders and batches them.

With ``h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))`` for a chosen
completion ``y_w`` and a rejected one ``y_l``, the per-pair losses are:

=========  ==============================================================================
sigmoid    ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``; DPO (Rafailov et al.
           2023) with the conservative label smoothing ``eps`` of cDPO. Same semantics as
           ``torchtune.rlhf.loss.DPOLoss``; TRL's ``loss_type="sigmoid"`` agrees at
           ``eps = 0`` only, since TRL 1.16 ignores ``label_smoothing`` there (it reads it in
           its robust and exo losses).
ipo        ``(h - 1 / (2 beta))^2``; IPO (Azar et al. 2023, eq. 17, ``tau`` = ``beta``). As in
           TRL's ``loss_type="ipo"``, every log-prob in ``h`` (policy and reference) is the
           token AVERAGE over the completion, not the sum: the regression target
           ``1 / (2 beta)`` is then independent of completion length.
hinge      ``relu(1 - beta h)``; SLiC-style hinge on the log-ratio margin (TRL's
           ``loss_type="hinge"``).
=========  ==============================================================================

Inputs are summed completion log-probs
(``composer_tune.channels.dpo_reference.completion_logps``) plus, for ``ipo``, the completion
token counts. Implicit rewards ``beta (log pi - log pi_ref)`` and the margin are
reported from the same (summed, or averaged for ipo) log-probs the loss uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

DPOLossType = Literal["sigmoid", "ipo", "hinge"]
DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)


@dataclass(frozen=True)
class DPOLossConfig:
    """Which DPO variant to optimise and its hyper-parameters.

    Attributes:
        loss_type: ``sigmoid``, ``ipo`` or ``hinge`` (see the module docstring).
        beta: inverse temperature of the implicit reward (IPO's ``tau``); > 0. Typical values:
            0.1 for sigmoid/hinge; IPO's target margin is ``1 / (2 beta)`` in average
            log-prob units.
        label_smoothing: probability that a label is flipped (cDPO); only for ``sigmoid``,
            in ``[0, 0.5)``.
    """

    loss_type: DPOLossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(
                f"DPOLossConfig.loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}"
            )
        if not self.beta > 0:
            raise ValueError(f"DPOLossConfig.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(
                f"DPOLossConfig.label_smoothing must be in [0, 0.5), got {self.label_smoothing}"
            )
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(
                f"DPOLossConfig.label_smoothing applies to loss_type='sigmoid' only, "
                f"got loss_type={self.loss_type!r}"
            )


@dataclass
class DPOOutput:
    """Result of :func:`dpo_loss`. Everything but ``loss`` and ``losses`` is detached.

    Attributes:
        loss: scalar mean of ``losses``, the value to backpropagate.
        losses: ``[B]`` per-pair losses.
        chosen_rewards: ``[B]`` ``beta * (log pi(y_w) - log pi_ref(y_w))``.
        rejected_rewards: ``[B]`` ``beta * (log pi(y_l) - log pi_ref(y_l))``.
        margins: ``[B]`` ``chosen_rewards - rejected_rewards`` (= ``beta * h``).
        accuracies: ``[B]`` float, 1.0 where the margin is > 0.
    """

    loss: Tensor
    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    margins: Tensor
    accuracies: Tensor

    def metrics(self) -> dict[str, float]:
        """Batch means for the metric logger (``rewards/...`` names as in TRL and torchtune)."""
        return {
            "loss": float(self.loss.detach()),
            "rewards/chosen": float(self.chosen_rewards.mean()),
            "rewards/rejected": float(self.rejected_rewards.mean()),
            "rewards/margins": float(self.margins.mean()),
            "rewards/accuracies": float(self.accuracies.mean()),
        }


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    config: DPOLossConfig,
    *,
    chosen_token_counts: Tensor | None = None,
    rejected_token_counts: Tensor | None = None,
) -> DPOOutput:
    """The DPO-family loss of a batch of preference pairs.

    Args:
        policy_chosen_logps: ``[B]`` summed log-probs of the chosen completions under the policy.
        policy_rejected_logps: ``[B]`` same for the rejected completions.
        reference_chosen_logps: ``[B]`` summed log-probs of the chosen completions under the
            frozen reference (no gradient flows into them).
        reference_rejected_logps: ``[B]`` same for the rejected completions.
        config: the variant and its hyper-parameters.
        chosen_token_counts: ``[B]`` completion lengths; required for ``ipo``, which divides
            every summed log-prob by its completion's length (TRL's convention), else unused.
        rejected_token_counts: ``[B]`` same for the rejected completions.

    Returns:
        :class:`DPOOutput` (mean loss, per-pair losses and detached reward metrics).
    """
    inputs = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
        "reference_chosen_logps": reference_chosen_logps,
        "reference_rejected_logps": reference_rejected_logps,
    }
    shape = policy_chosen_logps.shape
    for name, value in inputs.items():
        if value.dim() != 1 or value.shape != shape:
            raise ValueError(
                f"dpo_loss: {name} must be 1-D with the shape of policy_chosen_logps "
                f"{tuple(shape)}, got {tuple(value.shape)}"
            )
    policy_chosen, policy_rejected = policy_chosen_logps, policy_rejected_logps
    reference_chosen = reference_chosen_logps.detach()
    reference_rejected = reference_rejected_logps.detach()
    if config.loss_type == "ipo":
        chosen_counts = _token_counts(chosen_token_counts, "chosen_token_counts", shape)
        rejected_counts = _token_counts(rejected_token_counts, "rejected_token_counts", shape)
        policy_chosen = policy_chosen / chosen_counts
        reference_chosen = reference_chosen / chosen_counts
        policy_rejected = policy_rejected / rejected_counts
        reference_rejected = reference_rejected / rejected_counts

    chosen_logratios = policy_chosen - reference_chosen
    rejected_logratios = policy_rejected - reference_rejected
    h = chosen_logratios - rejected_logratios
    beta = config.beta
    if config.loss_type == "sigmoid":
        smoothing = config.label_smoothing
        losses = -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
    elif config.loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1 - beta * h)

    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    margins = chosen_rewards - rejected_rewards
    return DPOOutput(
        loss=losses.mean(),
        losses=losses,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margins=margins,
        accuracies=(margins > 0).float(),
    )


def _token_counts(counts: Tensor | None, name: str, shape: torch.Size) -> Tensor:
    """Validated completion lengths (ipo averages log-probs over them)."""
    if counts is None:
        raise ValueError(f"dpo_loss: loss_type='ipo' averages per token and needs {name}")
    if counts.shape != shape:
        raise ValueError(
            f"dpo_loss: {name} must have shape {tuple(shape)}, got {tuple(counts.shape)}"
        )
    if bool((counts <= 0).any()):
        raise ValueError(f"dpo_loss: {name} must be > 0 (an empty completion has no average)")
    return counts
