"""The RL progress bar shows what moves, not the on-policy GRPO loss (0 by construction)."""

from composer_tune.progress import progress_postfix


def test_grpo_step_shows_reward_and_accuracy_not_the_zero_loss() -> None:
    batch = {"reward/mean": 0.40625, "accuracy": 0.40625, "completion_length/mean": 11.5}
    loss = {"loss": 0.0, "entropy": 1.48, "grad_norm": 1.5}
    assert progress_postfix(batch, loss) == {"reward": "0.406", "acc": "0.406"}


def test_kl_and_channel_losses_appear_when_the_run_has_them() -> None:
    batch = {"reward/mean": 0.5, "accuracy": 0.25}
    loss = {"loss": 0.0, "kl": 0.00123, "sdpo/divergence": 0.0456, "dpo/loss": 0.6931}
    assert progress_postfix(batch, loss) == {
        "reward": "0.500",
        "acc": "0.250",
        "kl": "0.0012",
        "sdpo": "0.0456",
        "dpo": "0.6931",
    }


def test_later_metric_dicts_win_and_an_empty_step_shows_nothing() -> None:
    assert progress_postfix({"reward/mean": 0.1}, {"reward/mean": 0.2}) == {"reward": "0.200"}
    assert progress_postfix({}, {}) == {}
