"""The GRPO-family objectives, advantages and KL estimators against values worked out by hand.

Every expected number below is written as explicit arithmetic on the inputs (never by calling
the code under test). The shared batch has three completions whose per-token importance ratios
are chosen so that each clip side binds or not:

    row 0, A = +1.0, ratios 1.5 (high clip binds), 0.7 (below 1-eps but A > 0: no clip), 1.0
    row 1, A = -2.0, ratios 0.5 (low clip binds), 1.1, 1.3 (above 1+eps but A < 0: no clip)
    row 2, A = +0.5, ratios 1.25 (binds at eps_high=0.2, not at 0.28), 0.9, and a masked token
           with a wild ratio of 5.0 that must never count.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from composer_tune.losses import (
    PolicyLossConfig,
    apply_kl_to_rewards,
    compute_advantages,
    kl_penalty,
    needs_reference_model,
    policy_loss,
)

RATIOS = [[1.5, 0.7, 1.0], [0.5, 1.1, 1.3], [1.25, 0.9, 5.0]]
OLD_LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5], [-0.8, -1.2, -3.0]]
ADVANTAGES = [1.0, -2.0, 0.5]
MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0]]
ACTIVE_TOKENS = 8


def make_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp with grad, old_logp, advantages, mask) in float64 for the shared batch."""
    old = torch.tensor(OLD_LOGP, dtype=torch.float64)
    logp = (old + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_(True)
    return (
        logp,
        old,
        torch.tensor(ADVANTAGES, dtype=torch.float64),
        torch.tensor(MASK, dtype=torch.bool),
    )


def run(
    cfg: PolicyLossConfig, **kwargs: object
) -> tuple[float, list[list[float]], dict[str, torch.Tensor]]:
    """Loss value, d loss / d logp, and metrics for the shared batch."""
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(logp, old, adv, mask, cfg, **kwargs)
    loss.backward()
    return loss.item(), logp.grad.tolist(), metrics


def assert_grad(actual: list[list[float]], expected: list[list[float]]) -> None:
    for row_actual, row_expected in zip(actual, expected, strict=True):
        assert row_actual == pytest.approx(row_expected, abs=1e-12)


# Token losses -min(r*A, clip(r, 0.8, 1.2)*A) of the shared batch with eps 0.2/0.2.
ROW0_EPS02 = -1.2 * 1.0 + -0.7 * 1.0 + -1.0 * 1.0  # 1.5 clipped to 1.2
ROW1_EPS02 = 0.8 * 2.0 + 1.1 * 2.0 + 1.3 * 2.0  # 0.5 clipped to 0.8; 1.3 unclipped (A < 0)
ROW2_EPS02 = -1.2 * 0.5 + -0.9 * 0.5  # 1.25 clipped to 1.2; masked token excluded
SUM_EPS02 = ROW0_EPS02 + ROW1_EPS02 + ROW2_EPS02


def test_grpo_value_gradient_and_clip_metrics() -> None:
    loss, grad, metrics = run(PolicyLossConfig(objective="grpo"))
    assert loss == pytest.approx((ROW0_EPS02 / 3 + ROW1_EPS02 / 3 + ROW2_EPS02 / 2) / 3)
    # d/dlogp of -r*A is -r*A where the unclipped branch is the min, 0 where the clip binds;
    # scaled by 1 / (B * tokens in the row).
    assert_grad(
        grad,
        [
            [0.0, -0.7 * 1.0 / 9, -1.0 * 1.0 / 9],
            [0.0, 1.1 * 2.0 / 9, 1.3 * 2.0 / 9],
            [0.0, -0.9 * 0.5 / 6, 0.0],
        ],
    )
    assert metrics["clip_ratio/low"].item() == pytest.approx(1 / 8)  # row 1, ratio 0.5
    assert metrics["clip_ratio/high"].item() == pytest.approx(2 / 8)  # 1.5 and 1.25
    assert metrics["clip_ratio/region"].item() == pytest.approx(3 / 8)
    assert metrics["ratio/mean"].item() == pytest.approx(
        (1.5 + 0.7 + 1.0 + 0.5 + 1.1 + 1.3 + 1.25 + 0.9) / 8
    )
    assert metrics["num_tokens"].item() == ACTIVE_TOKENS


def test_bnpo_normalises_by_local_active_tokens() -> None:
    loss, grad, _ = run(PolicyLossConfig(objective="bnpo"))
    assert loss == pytest.approx(SUM_EPS02 / 8)
    assert grad[0][1] == pytest.approx(-0.7 / 8)
    assert grad[2][2] == 0.0


def test_dr_grpo_normalises_by_batch_times_max_length() -> None:
    loss, grad, _ = run(PolicyLossConfig(objective="dr_grpo", max_completion_length=4))
    assert loss == pytest.approx(SUM_EPS02 / (3 * 4))
    assert grad[1][2] == pytest.approx(1.3 * 2.0 / 12)


def test_dapo_clip_higher_and_global_token_normaliser() -> None:
    # eps_high = 0.28: ratio 1.25 no longer clips, 1.5 clips to 1.28.
    token_sum = (-1.28 - 0.7 - 1.0) + (0.8 * 2.0 + 1.1 * 2.0 + 1.3 * 2.0) + (-1.25 * 0.5 - 0.45)
    local, _, metrics = run(PolicyLossConfig(objective="dapo"))
    assert local == pytest.approx(token_sum / ACTIVE_TOKENS)
    assert metrics["clip_ratio/high"].item() == pytest.approx(1 / 8)
    # The whole generation batch (all micro-batches and ranks) had 20 active tokens.
    global_loss, grad, _ = run(PolicyLossConfig(objective="dapo"), num_items_in_batch=20)
    assert global_loss == pytest.approx(token_sum / 20)
    assert grad[2][0] == pytest.approx(-1.25 * 0.5 / 20)


def test_cispo_caps_detached_weight_and_keeps_every_gradient() -> None:
    eps_max = 1.2
    loss, grad, metrics = run(PolicyLossConfig(objective="cispo", epsilon_high=eps_max))
    logp = [[OLD_LOGP[i][t] + math.log(RATIOS[i][t]) for t in range(3)] for i in range(3)]
    weights = [[min(r, eps_max) for r in row] for row in RATIOS]  # 1.5, 1.3, 1.25 capped at 1.2
    token_sum = sum(
        -weights[i][t] * ADVANTAGES[i] * logp[i][t]
        for i in range(3)
        for t in range(3)
        if MASK[i][t]
    )
    assert loss == pytest.approx(token_sum / ACTIVE_TOKENS)
    # Stop-gradient weight: d/dlogp = -min(r, eps_max) * A / N, also where the cap binds and
    # where a clipped objective would have zeroed the gradient (row 1's ratio 0.5).
    assert_grad(
        grad,
        [
            [-1.2 * 1.0 / 8, -0.7 * 1.0 / 8, -1.0 * 1.0 / 8],
            [0.5 * 2.0 / 8, 1.1 * 2.0 / 8, 1.2 * 2.0 / 8],
            [-1.2 * 0.5 / 8, -0.9 * 0.5 / 8, 0.0],
        ],
    )
    assert metrics["clip_ratio/cispo"].item() == pytest.approx(2 / 8)  # 1.5 and 1.25, A > 0
    assert "clip_ratio/low" not in metrics


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    # Token log-ratios; GSPO's ratio is exp(mean over the row's active tokens).
    log_ratios = [
        [2e-4, -1e-4, 0.0],  # s = exp(1e-4 / 3), inside (1 - 3e-4, 1 + 4e-4): unclipped
        [1e-3, 1e-3, 7.0],  # s = exp(1e-3) > 1 + 4e-4 with A > 0: clipped; 7.0 is masked
        [-1e-3, -1e-3, -1e-3],  # s = exp(-1e-3) < 1 - 3e-4 with A < 0: clipped
        [1e-3, 1e-3, 1e-3],  # s = exp(1e-3) > 1 + 4e-4 but A < 0: unclipped
    ]
    adv = [2.0, 1.0, -1.0, -3.0]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    old = torch.full((4, 3), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor(log_ratios, dtype=torch.float64)).requires_grad_(True)
    loss, metrics = policy_loss(
        logp,
        old,
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.bool),
        PolicyLossConfig(objective="gspo"),
    )
    loss.backward()
    s0, s3 = math.exp(1e-4 / 3), math.exp(1e-3)
    per_sequence = [-s0 * 2.0, -(1 + 4e-4) * 1.0, (1 - 3e-4) * 1.0, s3 * 3.0]
    assert loss.item() == pytest.approx(sum(per_sequence) / 4, rel=1e-12)
    # d(-s*A)/dlogp_t = -s*A / n for each of the row's n active tokens; clipped rows get 0.
    assert_grad(
        logp.grad.tolist(),
        [
            [-s0 * 2.0 / 3 / 4] * 3,
            [0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0],
            [s3 * 3.0 / 3 / 4] * 3,
        ],
    )
    # Metrics count sequences, one ratio each.
    assert metrics["clip_ratio/high"].item() == pytest.approx(1 / 4)
    assert metrics["clip_ratio/low"].item() == pytest.approx(1 / 4)
    assert metrics["ratio/mean"].item() == pytest.approx(
        (s0 + math.exp(1e-3) + math.exp(-1e-3) + s3) / 4
    )


@pytest.mark.parametrize("objective", ["grpo", "bnpo", "dapo", "gspo", "cispo"])
def test_on_policy_ratio_one_gives_plain_policy_gradient(objective: str) -> None:
    """With logp == old_logp every objective reduces to -A * logp under its aggregation."""
    logp = torch.tensor(OLD_LOGP, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.bool)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask, PolicyLossConfig(objective))
    loss.backward()
    lengths = [3, 3, 2]
    if objective in ("grpo", "gspo"):
        token_weight = [[1 / (3 * lengths[i])] * 3 for i in range(3)]
    else:  # bnpo, dapo and cispo all divide by the 8 active tokens here
        token_weight = [[1 / 8] * 3 for _ in range(3)]
    if objective == "cispo":  # its loss value is -A * logp itself
        value = sum(
            -ADVANTAGES[i] * OLD_LOGP[i][t] * token_weight[i][t]
            for i in range(3)
            for t in range(3)
            if MASK[i][t]
        )
    else:  # the surrogate's value is -A * ratio = -A
        value = sum(
            -ADVANTAGES[i] * token_weight[i][t] for i in range(3) for t in range(3) if MASK[i][t]
        )
    assert loss.item() == pytest.approx(value)
    expected_grad = [
        [-ADVANTAGES[i] * token_weight[i][t] * MASK[i][t] for t in range(3)] for i in range(3)
    ]
    assert_grad(logp.grad.tolist(), expected_grad)
    assert metrics["ratio/mean"].item() == pytest.approx(1.0)


def test_identical_rewards_give_zero_advantage_and_zero_gradient() -> None:
    # Group 0's rewards are identical; in float32 their mean is not exactly 0.9, which without
    # special care leaves a residue that the division by (0 + 1e-4) would amplify.
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 0.0])
    assert (rewards[:3] - rewards[:3].mean()).abs().max().item() > 0.0
    adv = compute_advantages(rewards, group_size=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    logp = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(6, 4, dtype=torch.float64)
    for objective in ("grpo", "cispo", "gspo"):
        logp.grad = None
        loss, _ = policy_loss(
            logp,
            old,
            adv.double(),
            torch.ones(6, 4, dtype=torch.bool),
            PolicyLossConfig(objective),
        )
        loss.backward()
        assert logp.grad[:3].abs().max().item() == 0.0, objective
        assert logp.grad[3:].abs().max().item() > 0.0, objective


def test_compute_advantages_group_batch_and_none() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0]
    tensor = torch.tensor(rewards, dtype=torch.float64)
    group_std = [math.sqrt(4 * 0.5**2 / 3), math.sqrt((9 + 1 + 1 + 9) / 3)]  # unbiased
    centred = [0.5, -0.5, -0.5, 0.5, -3.0, -1.0, 1.0, 3.0]
    by_group = compute_advantages(tensor, group_size=4, scale="group")
    expected = [c / (group_std[i // 4] + 1e-4) for i, c in enumerate(centred)]
    assert by_group.tolist() == pytest.approx(expected)
    batch_std = statistics.stdev(rewards)  # over all 8 rewards, unbiased
    by_batch = compute_advantages(tensor, group_size=4, scale="batch")
    assert by_batch.tolist() == pytest.approx([c / (batch_std + 1e-4) for c in centred])
    assert compute_advantages(tensor, 4, "none").tolist() == pytest.approx(centred)
    # One completion per prompt: nothing to compare against, so no advantage.
    assert compute_advantages(tensor, 1, "group").tolist() == [0.0] * 8


def test_compute_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="not a whole number of groups"):
        compute_advantages(torch.zeros(7), group_size=4)
    with pytest.raises(ValueError, match="scale"):
        compute_advantages(torch.zeros(4), group_size=2, scale="global")
    with pytest.raises(ValueError, match=r"rewards must be \[B\]"):
        compute_advantages(torch.zeros(2, 2), group_size=2)


def test_masked_tokens_do_not_count() -> None:
    """Changing the masked token's log-probs changes nothing, and it gets no gradient."""
    logp, old, adv, mask = make_batch()
    loss_a, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig("bnpo"))
    wild = logp.detach().clone()
    wild[2, 2] = 40.0
    loss_b, _ = policy_loss(wild, old, adv, mask, PolicyLossConfig("bnpo"))
    assert loss_a.item() == loss_b.item()


def test_mask_truncated_completions_excludes_rows() -> None:
    truncated = torch.tensor([False, True, False])
    loss, grad, metrics = run(
        PolicyLossConfig("grpo", mask_truncated_completions=True), truncated=truncated
    )
    # TRL keeps B in the mean over sequences; the truncated row contributes 0.
    assert loss == pytest.approx((ROW0_EPS02 / 3 + 0.0 + ROW2_EPS02 / 2) / 3)
    assert grad[1] == [0.0, 0.0, 0.0]
    assert metrics["num_tokens"].item() == 5
    bnpo, _, _ = run(PolicyLossConfig("bnpo", mask_truncated_completions=True), truncated=truncated)
    assert bnpo == pytest.approx((ROW0_EPS02 + ROW2_EPS02) / 5)
    with pytest.raises(ValueError, match="truncated"):
        run(PolicyLossConfig("grpo", mask_truncated_completions=True))


def test_kl_estimators_by_hand() -> None:
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.7], dtype=torch.float64)
    # log_ratio = logp - ref = [0.5, -0.3]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.3])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.5 * 0.25, 0.5 * 0.09])
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-0.5) - (-0.5) - 1, math.exp(0.3) - 0.3 - 1]
    )
    with pytest.raises(ValueError, match="unknown estimator"):
        kl_penalty(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_kl_estimates() -> None:
    """Averaged over samples from the policy, k1 and k3 approach the exact KL(p || q)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist(), strict=True))
    samples = torch.multinomial(p, 200_000, replacement=True, generator=generator)
    logp, ref = p.log()[samples], q.log()[samples]
    for estimator in ("k1", "k3"):
        assert kl_penalty(logp, ref, estimator).mean().item() == pytest.approx(exact, abs=5e-3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_loss_adds_beta_times_aggregated_kl(estimator: str) -> None:
    beta = 0.1
    ref = torch.tensor(OLD_LOGP, dtype=torch.float64) - 0.2  # log_ratio = log(r) + 0.2
    base, base_grad, _ = run(PolicyLossConfig("bnpo"))
    with_kl, grad, metrics = run(
        PolicyLossConfig("bnpo", beta=beta, kl_estimator=estimator), ref_logp=ref
    )
    log_ratios = [[math.log(RATIOS[i][t]) + 0.2 for t in range(3)] for i in range(3)]  # logp - ref

    def by_hand(x: float) -> tuple[float, float]:
        """(estimate, d estimate / d logp)"""
        if estimator == "k1":
            return x, 1.0
        if estimator == "k2":
            return 0.5 * x * x, x
        return math.exp(-x) + x - 1, 1 - math.exp(-x)

    kl_sum = sum(by_hand(log_ratios[i][t])[0] for i in range(3) for t in range(3) if MASK[i][t])
    assert with_kl == pytest.approx(base + beta * kl_sum / 8)
    assert metrics["kl"].item() == pytest.approx(kl_sum / 8)
    for i in range(3):
        for t in range(3):
            extra = beta * by_hand(log_ratios[i][t])[1] / 8 if MASK[i][t] else 0.0
            assert grad[i][t] == pytest.approx(base_grad[i][t] + extra, abs=1e-12)


def test_kl_in_reward_mode() -> None:
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.8], [-0.6, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    penalised = apply_kl_to_rewards(rewards, logp, ref, mask, beta=0.1)
    # k1 sums: row 0: 0.5 + (-0.2) = 0.3; row 1: 0.1 (the masked 8.9 is excluded)
    assert penalised.tolist() == pytest.approx([1.0 - 0.1 * 0.3, 0.0 - 0.1 * 0.1])
    assert not penalised.requires_grad
    # The loss itself then carries no KL term and needs no reference log-probs.
    cfg = PolicyLossConfig("grpo", beta=0.1, kl_mode="reward")
    assert cfg.kl_estimator == "k1"
    in_reward, _, _ = run(cfg)
    no_kl, _, _ = run(PolicyLossConfig("grpo"))
    assert in_reward == no_kl


def test_entropy_and_advantage_metrics() -> None:
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 100.0]])
    _, _, metrics = run(PolicyLossConfig("grpo"), entropy=entropy.double())
    assert metrics["entropy"].item() == pytest.approx((1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 8)
    assert metrics["advantages/mean"].item() == pytest.approx((1.0 - 2.0 + 0.5) / 3)
    assert metrics["advantages/min"].item() == -2.0
    assert metrics["advantages/max"].item() == 1.0
    assert "kl" not in metrics
    assert all(not value.requires_grad for value in metrics.values())


def test_config_defaults_and_reference_model_need() -> None:
    gspo = PolicyLossConfig("gspo")
    assert (gspo.epsilon_low, gspo.epsilon_high) == (3e-4, 4e-4)
    assert PolicyLossConfig("dapo").epsilon_high == 0.28
    cispo = PolicyLossConfig("cispo")
    assert (cispo.epsilon_low, cispo.epsilon_high) == (None, 5.0)
    assert PolicyLossConfig("dr_grpo", max_completion_length=8).scale_rewards == "none"
    assert PolicyLossConfig("grpo").kl_estimator == "k3"
    assert not needs_reference_model(PolicyLossConfig("grpo"))
    assert needs_reference_model(PolicyLossConfig("grpo", beta=0.04))
    assert needs_reference_model(PolicyLossConfig("grpo", beta=0.04, kl_mode="reward"))


def test_config_errors_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="max_completion_length is required"):
        PolicyLossConfig("dr_grpo")
    with pytest.raises(ValueError, match="epsilon_low has no effect"):
        PolicyLossConfig("cispo", epsilon_low=0.2)
    with pytest.raises(ValueError, match="objective must be one of"):
        PolicyLossConfig("ppo")
    with pytest.raises(ValueError, match=r"policy_loss: unknown key\(s\) \['epsilon_hgh'\]"):
        PolicyLossConfig.from_mapping({"objective": "dapo", "epsilon_hgh": 0.3})
    with pytest.raises(ValueError, match="rl.loss: PolicyLossConfig.beta"):
        PolicyLossConfig.from_mapping({"beta": -1.0}, source="rl.loss")
    assert PolicyLossConfig.from_mapping({"objective": "dapo"}).epsilon_high == 0.28


def test_policy_loss_rejects_bad_shapes_and_missing_reference() -> None:
    logp, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match="old_logp has shape"):
        policy_loss(logp, old[:, :2], adv, mask, PolicyLossConfig())
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logp, old, adv[:2], mask, PolicyLossConfig())
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig(beta=0.1))
    with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig("dapo"), num_items_in_batch=0)


# --------------------------------------------------------------------- unscorable (NaN) rewards


def test_nan_reward_gets_zero_advantage_and_keeps_its_group_mates() -> None:
    nan = float("nan")
    advantages = compute_advantages(torch.tensor([1.0, 0.0, nan, 1.0]), group_size=4)
    # Scored rewards 1, 0, 1: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2).
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    expected = [(1 / 3) / (std + 1e-4), (-2 / 3) / (std + 1e-4), 0.0, (1 / 3) / (std + 1e-4)]
    assert advantages.tolist() == pytest.approx(expected)


def test_nan_rewards_in_one_group_leave_the_other_groups_unchanged() -> None:
    nan = float("nan")
    clean = torch.tensor([0.0, 1.0, 1.0, 0.5])
    rewards = torch.cat([clean, torch.tensor([nan, nan, 1.0, nan])])
    advantages = compute_advantages(rewards, group_size=4)
    # float32 statistics computed another way: equal to rounding.
    assert advantages[:4].tolist() == pytest.approx(
        compute_advantages(clean, group_size=4).tolist(), rel=1e-6
    )
    assert advantages[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # one scored row: no signal
    assert not torch.isnan(advantages).any()


def test_nan_rewards_batch_and_no_scaling() -> None:
    nan = float("nan")
    rewards = torch.tensor([1.0, nan, 0.0, 0.0])
    centred = [1.0 - 1 / 3, 0.0, -1 / 3, -1 / 3]  # group of 4 holding every reward
    assert compute_advantages(rewards, 4, "none").tolist() == pytest.approx(centred)
    batch_std = statistics.stdev([1.0, 0.0, 0.0])
    assert compute_advantages(rewards, 4, "batch").tolist() == pytest.approx(
        [value / (batch_std + 1e-4) for value in centred]
    )


def test_unscorable_rows_match_trl_from_reward_parts_to_advantages() -> None:
    """TRL 1.16's ``_generate_and_score_completions`` on the same reward-function outputs:
    weighted ``nansum`` over functions, a row NaN in every function marked unscorable (NaN),
    group ``nanmean``/``nanstd`` over the scorable rows, ``nan_to_num`` on the advantages. The
    project's path is CompositeReward's score, then compute_advantages."""
    from composer_tune.rewards import CompositeReward, RewardResult

    nan = float("nan")
    # Two groups of 4; columns: an answer reward (weight 1) and a format bonus (weight 0.1).
    parts = [
        [1.0, 0.5], [nan, 1.0], [0.0, nan], [nan, nan],
        [1.0, 1.0], [0.0, 0.0], [1.0, nan], [0.0, 1.0],
    ]  # fmt: skip
    weights = [1.0, 0.1]

    def fixed(column: int):
        def reward(completions, samples):
            return [RewardResult(score=row[column]) for row in parts[: len(completions)]]

        return reward

    composite = CompositeReward(
        [{"reward": fixed(i), "weight": weight} for i, weight in enumerate(weights)]
    )
    scores = [result.score for result in composite(["c"] * 8, [{}] * 8)]
    ours = compute_advantages(torch.tensor(scores, dtype=torch.float64), group_size=4)

    # TRL 1.16, step by step (trl/trainer/grpo_trainer.py and trl.trainer.utils.nanstd).
    per_func = torch.tensor(parts, dtype=torch.float64)
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)
    rewards[unscorable] = nan
    grouped = rewards.view(-1, 4)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    std = (torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1)).sqrt()
    trl = torch.nan_to_num((grouped - mean) / (std + 1e-4), nan=0.0).reshape(-1)

    assert ours.tolist() == pytest.approx(trl.tolist(), rel=1e-12)
    assert ours[3] == 0.0 and ours[1] != 0.0  # all parts NaN: unscorable; one NaN part: scored


# ------------------------------------------------------------------------- step normalisation


def test_step_normalization_completes_every_objective() -> None:
    from composer_tune.losses import StepNormalization

    step = StepNormalization(active_tokens=20, world_size=2, num_micro_batches=4)
    alone, _, _ = run(PolicyLossConfig("grpo"))
    in_step, grad, _ = run(PolicyLossConfig("grpo"), normalization=step)
    assert in_step == pytest.approx(alone / 4)  # one of 4 accumulated micro-batches
    assert grad[0][1] == pytest.approx(-0.7 * 1.0 / 9 / 4)
    # dapo divides by the step's tokens per rank (FSDP's average divides by 2 again).
    token_sum = (-1.28 - 0.7 - 1.0) + (0.8 * 2.0 + 1.1 * 2.0 + 1.3 * 2.0) + (-1.25 * 0.5 - 0.45)
    dapo, _, _ = run(PolicyLossConfig("dapo"), normalization=step)
    assert dapo == pytest.approx(token_sum / (20 / 2))
    no_tokens = StepNormalization(active_tokens=0, world_size=1, num_micro_batches=1)
    assert run(PolicyLossConfig("cispo"), normalization=no_tokens)[0] != 0.0  # divisor >= 1
    with pytest.raises(ValueError, match="not both"):
        run(PolicyLossConfig("dapo"), normalization=step, num_items_in_batch=20)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        StepNormalization(active_tokens=1, world_size=1, num_micro_batches=0)


# ------------------------------------------------------------------- objectives beyond the six


def test_delta_caps_the_unclipped_ratio_of_negative_advantages() -> None:
    # Row 1 (A = -2) has ratio 1.3 above 1 + eps: with delta 1.25 its term is capped at 1.25.
    loss, grad, _ = run(PolicyLossConfig("bnpo", delta=1.25))
    capped_sum = SUM_EPS02 - 1.3 * 2.0 + 1.25 * 2.0
    assert loss == pytest.approx(capped_sum / 8)
    assert grad[1][2] == 0.0  # the cap is constant in logp
    assert grad[1][1] == pytest.approx(1.1 * 2.0 / 8)  # below delta: unchanged
    with pytest.raises(ValueError, match="delta must be > 1 \\+ epsilon_high"):
        PolicyLossConfig("grpo", delta=1.1)
    with pytest.raises(ValueError, match="delta applies to the clipped objectives"):
        PolicyLossConfig("cispo", delta=6.0)


def test_sapo_soft_gate_value_and_gradient() -> None:
    loss, grad, metrics = run(PolicyLossConfig("sapo"))

    def gate(ratio: float, advantage: float) -> tuple[float, float]:
        """Token loss and d/dlogp for temperature 1.0 (A > 0) or 1.05 (A <= 0)."""
        tau = 1.0 if advantage > 0 else 1.05
        sig = 1 / (1 + math.exp(-tau * (ratio - 1)))
        return -sig * 4 / tau * advantage, -advantage * 4 * sig * (1 - sig) * ratio

    rows = [[gate(RATIOS[i][t], ADVANTAGES[i]) for t in range(3) if MASK[i][t]] for i in range(3)]
    assert loss == pytest.approx(sum(sum(v for v, _ in row) / len(row) for row in rows) / 3)
    assert grad[1][0] == pytest.approx(rows[1][0][1] / (3 * 3))
    assert grad[2][1] == pytest.approx(rows[2][1][1] / (3 * 2))
    assert "clip_ratio/low" not in metrics
    with pytest.raises(ValueError, match="no effect for objective 'sapo'"):
        PolicyLossConfig("sapo", epsilon_high=0.2)


def test_sequence_level_ratio_for_a_clipped_objective() -> None:
    cfg = PolicyLossConfig("bnpo", importance_sampling_level="sequence")
    assert cfg.sequence_level_ratio and not PolicyLossConfig("bnpo").sequence_level_ratio
    loss, _, metrics = run(cfg)
    # One ratio per row: the geometric mean of its active tokens' ratios, clipped to [0.8, 1.2].
    seq = [
        math.exp(sum(math.log(RATIOS[i][t]) for t in range(3) if MASK[i][t]) / sum(MASK[i]))
        for i in range(3)
    ]
    token_sum = 0.0
    for i in range(3):
        clipped = min(max(seq[i], 0.8), 1.2)
        term = -min(seq[i] * ADVANTAGES[i], clipped * ADVANTAGES[i])
        token_sum += term * sum(MASK[i])
    assert loss == pytest.approx(token_sum / 8)
    assert metrics["ratio/mean"].item() == pytest.approx(sum(seq) / 3)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        PolicyLossConfig("grpo", importance_sampling_level="batch")


def test_top_entropy_quantile_trains_only_high_entropy_tokens() -> None:
    # Active tokens get entropies 1..8 in order; the masked token's 100 must not count.
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 100.0]])
    cfg = PolicyLossConfig("bnpo", top_entropy_quantile=0.5)
    loss, grad, metrics = run(cfg, entropy=entropy.double())
    # Median of 1..8 is 4.5 (linear interpolation): tokens with entropy 5..8 train.
    kept_sum = (1.1 * 2.0 + 1.3 * 2.0) + (-1.2 * 0.5 - 0.9 * 0.5)
    assert loss == pytest.approx(kept_sum / 8)  # still divided by every active token
    assert grad[0][1] == 0.0 and grad[1][0] == 0.0
    assert grad[1][1] == pytest.approx(1.1 * 2.0 / 8)
    assert metrics["entropy_mask/fraction"].item() == pytest.approx(4 / 8)
    with pytest.raises(ValueError, match="needs the token entropies"):
        run(cfg)
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        PolicyLossConfig("grpo", top_entropy_quantile=0.0)


def test_kl_bias_correction_multiplies_k3_by_the_ratio_even_on_policy() -> None:
    # On-policy (ratio 1 in value), A = 0: only the KL term has a gradient.
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.8]], dtype=torch.float64)
    zero_adv = torch.zeros(1, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)

    def grad_of(cfg: PolicyLossConfig) -> list[float]:
        logp.grad = None
        loss, _ = policy_loss(logp, logp.detach(), zero_adv, mask, cfg, ref_logp=ref)
        loss.backward()
        return logp.grad[0].tolist()

    beta = 0.5
    plain = grad_of(PolicyLossConfig("bnpo", beta=beta))
    corrected = grad_of(PolicyLossConfig("bnpo", beta=beta, kl_bias_correction=True))
    for t, (lp, rf) in enumerate(((-1.0, -1.5), (-2.0, -1.8))):
        k3 = math.exp(rf - lp) - (rf - lp) - 1
        dk3 = 1 - math.exp(rf - lp)
        assert plain[t] == pytest.approx(beta * dk3 / 2)
        # d(k3 * w)/dlogp = dk3 * w + k3 * w with w = 1.
        assert corrected[t] == pytest.approx(beta * (dk3 + k3) / 2)
