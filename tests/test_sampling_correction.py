"""Truncated importance sampling between the sampler's and the trainer's log-probs (TRL 1.16's
``vllm_importance_sampling_correction``), checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from composer_tune.losses import PolicyLossConfig, policy_loss
from composer_tune.losses.sampling_correction import (
    sampling_correction_weights,
    sampling_mismatch_metrics,
)

CAP = 2.0
# old_logp - sampling_logp per token; row 0's last token is not trained on.
GAPS = [[0.5, 1.0, 7.0], [-0.2, 0.3, 0.1]]
MASK = torch.tensor([[True, True, False], [True, True, True]])


def _logps() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]], dtype=torch.float64)
    return old, old - torch.tensor(GAPS, dtype=torch.float64)


# Each mode's weights, one number at a time: exp of the gap (per token) or of the row's summed
# active gaps (per sequence: row 0 sums 0.5 + 1.0, row 1 sums 0.2), past CAP clipped or zeroed;
# an inactive token keeps weight 1 in token modes.
EXPECTED = {
    "token_truncate": [[math.exp(0.5), CAP, 1.0], [math.exp(-0.2), math.exp(0.3), math.exp(0.1)]],
    "token_mask": [[math.exp(0.5), 0.0, 1.0], [math.exp(-0.2), math.exp(0.3), math.exp(0.1)]],
    "sequence_truncate": [[CAP] * 3, [math.exp(0.2)] * 3],
    "sequence_mask": [[0.0] * 3, [math.exp(0.2)] * 3],
}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_weights_of_each_mode_by_hand(mode: str) -> None:
    old, sampling = _logps()
    weights, past_cap = sampling_correction_weights(old, sampling, MASK, mode, CAP)
    torch.testing.assert_close(weights, torch.tensor(EXPECTED[mode], dtype=torch.float64))
    if mode.startswith("token"):
        assert past_cap.tolist() == [[False, True, False], [False, False, False]]
    else:
        assert past_cap.tolist() == [[True], [False]]


def test_mismatch_metrics_are_over_active_tokens() -> None:
    old, sampling = _logps()
    metrics = sampling_mismatch_metrics(old, sampling, MASK)
    active = [0.5, 1.0, -0.2, 0.3, 0.1]
    assert float(metrics["sampling/logp_diff_abs"]) == pytest.approx(
        sum(abs(g) for g in active) / 5
    )
    assert float(metrics["sampling/ratio"]) == pytest.approx(sum(math.exp(g) for g in active) / 5)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_policy_loss_weights_the_policy_term_and_not_the_kl_term(mode: str) -> None:
    """On-policy grpo: each token's policy loss is -A, times its weight; the k3 KL term is added
    after weighting (TRL's order). Loss = mean over rows of the row's token mean."""
    old, sampling = _logps()
    ref = old - 0.25
    advantages = torch.tensor([1.5, -0.5], dtype=torch.float64)
    beta = 0.1
    cfg = PolicyLossConfig(beta=beta, sampling_correction=mode, sampling_correction_cap=CAP)
    logp = old.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logp, old, advantages, MASK, cfg, ref_logp=ref, sampling_logp=sampling
    )
    k3 = math.exp(-0.25) + 0.25 - 1.0  # exp(ref - logp) - (ref - logp) - 1
    expected_rows = []
    for row in range(2):
        tokens = [t for t in range(3) if MASK[row, t]]
        token_losses = [
            -float(advantages[row]) * EXPECTED[mode][row][t] + beta * k3 for t in tokens
        ]
        expected_rows.append(sum(token_losses) / len(tokens))
    assert float(loss.detach()) == pytest.approx(sum(expected_rows) / 2, rel=1e-12)
    active_weights = [EXPECTED[mode][r][t] for r in range(2) for t in range(3) if MASK[r, t]]
    assert float(metrics["sampling/weight"]) == pytest.approx(sum(active_weights) / 5)
    past = 1 / 5 if mode.startswith("token") else 1 / 2  # one token / one sequence of two
    assert float(metrics["sampling/past_cap_fraction"]) == pytest.approx(past)


def test_without_the_correction_the_loss_is_unchanged_and_the_gap_is_logged() -> None:
    old, sampling = _logps()
    advantages = torch.tensor([1.5, -0.5], dtype=torch.float64)
    cfg = PolicyLossConfig()
    plain, plain_metrics = policy_loss(old.clone(), old, advantages, MASK, cfg)
    logged, metrics = policy_loss(old.clone(), old, advantages, MASK, cfg, sampling_logp=sampling)
    assert torch.equal(plain, logged)
    assert "sampling/logp_diff_abs" not in plain_metrics
    assert float(metrics["sampling/logp_diff_abs"]) == pytest.approx(2.1 / 5)
    assert "sampling/weight" not in metrics


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="sampling_correction must be one of"):
        PolicyLossConfig(sampling_correction="token")
    with pytest.raises(ValueError, match="sampling_correction_cap must be > 0"):
        PolicyLossConfig(sampling_correction="token_mask", sampling_correction_cap=0.0)
    old, sampling = _logps()
    cfg = PolicyLossConfig(sampling_correction="token_truncate")
    with pytest.raises(ValueError, match="needs sampling_logp"):
        policy_loss(old.clone(), old, torch.zeros(2, dtype=torch.float64), MASK, cfg)
    with pytest.raises(ValueError, match="sampling_logp has shape"):
        policy_loss(
            old.clone(),
            old,
            torch.zeros(2, dtype=torch.float64),
            MASK,
            cfg,
            sampling_logp=old[:, :2],
        )


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_a_nan_sampler_logp_is_a_token_with_weight_one(mode: str) -> None:
    """vLLM can report NaN for a token's log-prob; TRL 1.16 maps its log-ratio to 0 (weight 1,
    nothing added to its sequence's sum). The loss and gradient must be those of the same batch
    with that token's sampler log-prob equal to the trainer's, not NaN."""
    old, sampling = _logps()
    with_nan = sampling.clone()
    with_nan[1, 1] = math.nan  # an active token
    with_nan[0, 2] = math.nan  # an inactive one
    weight_one = sampling.clone()
    weight_one[1, 1] = old[1, 1]
    weight_one[0, 2] = old[0, 2]
    advantages = torch.tensor([1.5, -0.5], dtype=torch.float64)
    cfg = PolicyLossConfig(sampling_correction=mode, sampling_correction_cap=CAP)
    # Off-policy by a little, so the gradient depends on every ratio.
    shift = torch.tensor([[0.05, -0.1, 0.0], [0.02, 0.07, -0.03]], dtype=torch.float64)

    def loss_and_grad(sampling_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logp = (old + shift).requires_grad_(True)
        loss, metrics = policy_loss(logp, old, advantages, MASK, cfg, sampling_logp=sampling_logp)
        loss.backward()
        return loss.detach(), logp.grad, metrics

    loss, grad, metrics = loss_and_grad(with_nan)
    expected_loss, expected_grad, _ = loss_and_grad(weight_one)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    # The logged gap leaves the unscored token out (TRL's sampling_logp_difference).
    active = [0.5, 1.0, -0.2, 0.1]
    assert float(metrics["sampling/logp_diff_abs"]) == pytest.approx(
        sum(abs(g) for g in active) / 4
    )
    assert float(metrics["sampling/ratio"]) == pytest.approx(sum(math.exp(g) for g in active) / 4)
