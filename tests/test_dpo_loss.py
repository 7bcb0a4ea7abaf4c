"""DPO-family losses against torchtune's DPOLoss and hand-worked values; completion log-probs
against a full log_softmax; a tiny DPO run whose held-out preference accuracy must improve."""

from __future__ import annotations

import pytest
import torch
from torchtune.rlhf.loss import DPOLoss

from composer_tune.channels.dpo_reference import completion_logps, completion_targets
from composer_tune.losses.dpo import DPOLossConfig, DPOOutput, dpo_loss
from composer_tune.models import qwen3_tiny
from composer_tune.rollout.generation import PackedBatch, pack_sequences


def random_logps(batch: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [-torch.rand(batch, generator=generator, dtype=torch.float64) * 50 for _ in range(4)]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_matches_torchtune_dpo_loss(beta: float, label_smoothing: float) -> None:
    logps = random_logps(16, seed=int(beta * 10 + label_smoothing * 100))
    ours = dpo_loss(*logps, DPOLossConfig("sigmoid", beta, label_smoothing))
    losses, chosen_rewards, rejected_rewards = DPOLoss(beta, label_smoothing)(*logps)
    torch.testing.assert_close(ours.losses, losses, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.loss, losses.mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.chosen_rewards, chosen_rewards, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.rejected_rewards, rejected_rewards, rtol=0, atol=1e-12)
    margins = chosen_rewards - rejected_rewards
    torch.testing.assert_close(ours.margins, margins, rtol=0, atol=1e-12)
    assert ours.accuracies.tolist() == (margins > 0).double().tolist()


def test_ipo_averages_per_token_and_matches_hand_values() -> None:
    # Pair 0, averages: policy chosen -6/3 = -2, ref chosen -9/3 = -3, policy rejected
    # -8/4 = -2, ref rejected -4/4 = -1, so h = (-2 + 3) - (-2 + 1) = 2.
    # Pair 1: chosen -4/2 vs -4/2 (ratio 0), rejected -3/1 vs -6/1 (ratio 3): h = -3.
    policy_chosen = torch.tensor([-6.0, -4.0])
    reference_chosen = torch.tensor([-9.0, -4.0])
    policy_rejected = torch.tensor([-8.0, -3.0])
    reference_rejected = torch.tensor([-4.0, -6.0])
    out = dpo_loss(
        policy_chosen,
        policy_rejected,
        reference_chosen,
        reference_rejected,
        DPOLossConfig("ipo", beta=0.5),  # target 1 / (2 * 0.5) = 1
        chosen_token_counts=torch.tensor([3, 2]),
        rejected_token_counts=torch.tensor([4, 1]),
    )
    torch.testing.assert_close(out.losses, torch.tensor([(2 - 1) ** 2, (-3 - 1) ** 2.0]))
    torch.testing.assert_close(out.loss, torch.tensor(8.5))
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.5 * 1, 0.0]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([0.5 * -1, 0.5 * 3]))
    torch.testing.assert_close(out.margins, torch.tensor([1.0, -1.5]))
    assert out.accuracies.tolist() == [1.0, 0.0]
    # Summed log-probs would give pair 0 h = 3 - (-4) = 7, so averaging changes the loss.
    assert out.losses[0].item() != pytest.approx((7 - 1) ** 2)


def test_hinge_matches_hand_values() -> None:
    # h = (policy - ref)_chosen - (policy - ref)_rejected: 2 - (-1) = 3, 25 - 0 = 25, -4 - 1 = -5.
    out = dpo_loss(
        torch.tensor([-10.0, -5.0, -14.0]),
        torch.tensor([-7.0, -30.0, -9.0]),
        torch.tensor([-12.0, -30.0, -10.0]),
        torch.tensor([-6.0, -30.0, -10.0]),
        DPOLossConfig("hinge", beta=0.1),
    )
    torch.testing.assert_close(out.losses, torch.tensor([1 - 0.3, 0.0, 1 + 0.5]))
    torch.testing.assert_close(out.margins, torch.tensor([0.3, 2.5, -0.5]))
    assert out.accuracies.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_gradients_raise_chosen_and_lower_rejected(loss_type: str) -> None:
    """Gradient descent on the loss must raise log pi(chosen) and lower log pi(rejected)."""
    policy_chosen = torch.tensor([-20.0, -12.0], requires_grad=True)
    policy_rejected = torch.tensor([-15.0, -11.0], requires_grad=True)
    reference = torch.tensor([-18.0, -12.0])
    out = dpo_loss(
        policy_chosen,
        policy_rejected,
        reference,
        reference,
        DPOLossConfig(loss_type, beta=0.1),
        chosen_token_counts=torch.tensor([5, 4]),
        rejected_token_counts=torch.tensor([5, 4]),
    )
    out.loss.backward()
    assert (policy_chosen.grad < 0).all() and (policy_rejected.grad > 0).all()
    # ... and a small step along the negative gradient of chosen lowers the loss.
    with torch.no_grad():
        stepped = dpo_loss(
            policy_chosen + 0.1,
            policy_rejected,
            reference,
            reference,
            DPOLossConfig(loss_type, beta=0.1),
            chosen_token_counts=torch.tensor([5, 4]),
            rejected_token_counts=torch.tensor([5, 4]),
        )
    assert stepped.loss < out.loss


def test_reference_gets_no_gradient() -> None:
    reference = torch.tensor([-3.0, -2.0], requires_grad=True)
    out = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), reference, reference,
                   DPOLossConfig())  # fmt: skip
    assert not out.loss.requires_grad


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="loss_type"):
        DPOLossConfig("kto")
    with pytest.raises(ValueError, match="beta"):
        DPOLossConfig(beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOLossConfig("ipo", label_smoothing=0.1)
    logps = [torch.zeros(3)] * 4
    with pytest.raises(ValueError, match="chosen_token_counts"):
        dpo_loss(*logps, DPOLossConfig("ipo"))
    with pytest.raises(ValueError, match="rejected_token_counts"):
        dpo_loss(*logps, DPOLossConfig("ipo"), chosen_token_counts=torch.ones(3),
                 rejected_token_counts=torch.tensor([1, 0, 1]))  # fmt: skip
    with pytest.raises(ValueError, match="reference_rejected_logps"):
        dpo_loss(*logps[:3], torch.zeros(2), DPOLossConfig())


# ---------------------------------------------------------------------- completion log-probs


def test_completion_logps_equal_full_log_softmax_sums() -> None:
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=40, initializer_range=0.5)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    completions = [[11, 12], [13, 14, 15, 16], [17]]
    batch = pack_sequences(prompts, completions, pad_id=0)
    targets = completion_targets(batch)
    logps, counts = completion_logps(model, batch, chunk_size=3)
    assert counts.tolist() == [2, 4, 1]
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        # Each row alone, unpadded, through the full logits: padding must not matter.
        tokens = torch.tensor([prompt + completion])
        log_softmax = torch.log_softmax(model(tokens).float(), dim=-1)[0]
        expected = sum(
            log_softmax[len(prompt) + i - 1, token] for i, token in enumerate(completion)
        )
        torch.testing.assert_close(logps[row], expected, rtol=0, atol=1e-5)
        assert targets[row, len(prompt) - 1].item() == completion[0]
    logps.sum().backward()  # the policy path carries gradients
    assert model.tok_embeddings.weight.grad is not None


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_training_improves_heldout_preference_accuracy(loss_type: str) -> None:
    """Chosen completions use even token ids, rejected ones odd ids. After DPO on training
    pairs, held-out pairs (new prompts, new chosen/rejected combinations) must be ranked correctly
    far more often than by the untrained policy, which ties with the reference (margin 0)."""
    torch.manual_seed(0)
    vocab, pairs_per_batch = 48, 16
    policy = qwen3_tiny(vocab_size=vocab, num_layers=1)
    reference = qwen3_tiny(vocab_size=vocab, num_layers=1)
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    generator = torch.Generator().manual_seed(1)

    def make_batch() -> tuple[PackedBatch, int]:
        prompts = torch.randint(2, vocab, (pairs_per_batch, 5), generator=generator).tolist()
        picks = torch.randint(1, vocab // 2, (2, pairs_per_batch), generator=generator)
        chosen = [[2 * int(k), 1] for k in picks[0]]  # even
        rejected = [[2 * int(k) + 1, 1] for k in picks[1]]  # odd
        return pack_sequences(prompts + prompts, chosen + rejected, pad_id=0), pairs_per_batch

    def loss_of(batch: PackedBatch, n: int) -> DPOOutput:
        logps, counts = completion_logps(policy, batch)
        with torch.no_grad():
            ref_logps, _ = completion_logps(reference, batch)
        return dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], config,
                        chosen_token_counts=counts[:n], rejected_token_counts=counts[n:])  # fmt: skip

    config = DPOLossConfig(loss_type, beta=0.5)
    heldout = make_batch()
    with torch.no_grad():
        baseline = loss_of(*heldout).accuracies.mean().item()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    for _ in range(15):
        out = loss_of(*make_batch())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = loss_of(*heldout).accuracies.mean().item()
    assert baseline == 0.0  # policy == reference: every margin is exactly 0
    assert accuracy >= 0.8, f"held-out preference accuracy {accuracy:.2f} (baseline {baseline})"
