"""Correction for the gap between the sampler's and the trainer's log-probabilities.

The engine that samples the rollouts (the native KV-cache loop, or vLLM) and the trainer's
forward compute a completion's log-probabilities with different kernels, batch shapes and
precisions, so the sampled tokens come from a slightly different policy than ``old_logp``
describes. Truncated importance sampling reweights each token's policy loss by the detached
ratio ``exp(old_logp - sampling_logp)``. The semantics are TRL 1.16's
``vllm_importance_sampling_correction`` with ``vllm_importance_sampling_mode`` and ``_cap``:

* ``token_truncate``: one ratio per token, clipped from above at ``cap``;
* ``token_mask``: one ratio per token, set to 0 where it exceeds ``cap``;
* ``sequence_truncate`` / ``sequence_mask``: one ratio per completion,
  ``exp(sum_t (old_logp - sampling_logp))`` over its active tokens, broadcast to them, clipped or
  zeroed likewise.

Inactive tokens get ratio 1 (their log-prob gap is masked to 0 first, as in TRL); the policy
loss masks them anyway. A sampler log-prob of NaN (vLLM can report one for a token it could not
score; TRL maps a missing one to NaN) is treated as TRL treats it: that token's gap counts as 0,
so its token ratio is 1 and it adds nothing to its sequence's sum, instead of turning the whole
loss and gradient into NaN. :func:`composer_tune.losses.policy.policy_loss` multiplies the
policy term of each token's loss by these weights before adding the KL term, TRL's order.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

SamplingCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLING_CORRECTIONS: tuple[str, ...] = get_args(SamplingCorrection)


def sampling_correction_weights(
    old_logp: Tensor, sampling_logp: Tensor, mask: Tensor, mode: SamplingCorrection, cap: float
) -> tuple[Tensor, Tensor]:
    """The detached ``[B, T]`` weights of ``mode`` (module docstring) and a bool tensor marking
    the ratios past ``cap`` (``[B, T]`` for token modes, ``[B, 1]`` for sequence modes).

    Args:
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer's forward of the
            sampling policy.
        sampling_logp: ``[B, T]`` the same tokens' log-probs as the sampler reported them.
        mask: ``[B, T]`` bool, True on the tokens the loss trains on.
        mode: one of :data:`SAMPLING_CORRECTIONS`.
        cap: the bound ``C`` on the ratio (> 0).
    """
    if mode not in SAMPLING_CORRECTIONS:
        raise ValueError(
            f"sampling correction mode must be one of {SAMPLING_CORRECTIONS}, got {mode!r}"
        )
    if not cap > 0:
        raise ValueError(f"sampling correction cap must be > 0, got {cap}")
    if sampling_logp.shape != old_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(
            f"sampling_correction_weights: sampling_logp {tuple(sampling_logp.shape)} and mask "
            f"{tuple(mask.shape)} must match old_logp {tuple(old_logp.shape)}"
        )
    log_ratio = (old_logp.detach() - sampling_logp.detach()) * mask.to(old_logp.dtype)
    # TRL's exact step: an unscored (NaN) sampler log-prob gets no correction.
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    past_cap = ratio > cap
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, max=cap)
    else:
        ratio = ratio.masked_fill(past_cap, 0.0)
    return ratio.expand_as(old_logp), past_cap


@torch.no_grad()
def sampling_mismatch_metrics(
    old_logp: Tensor, sampling_logp: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the trainer's over the active tokens:
    ``sampling/logp_diff_abs`` (mean ``|old_logp - sampling_logp|``) and ``sampling/ratio``
    (mean ``exp(old_logp - sampling_logp)``); 0 and 1 when no token is active. Tokens whose
    sampler log-prob is NaN are left out, as TRL leaves them out of its logged gap: counting them
    as 0 would understate the gap, counting them at all would log NaN."""
    active = mask.bool() & ~torch.isnan(sampling_logp)
    diff = (old_logp - sampling_logp).float()[active]
    if diff.numel() == 0:
        return {"sampling/logp_diff_abs": torch.tensor(0.0), "sampling/ratio": torch.tensor(1.0)}
    return {"sampling/logp_diff_abs": diff.abs().mean(), "sampling/ratio": diff.exp().mean()}
