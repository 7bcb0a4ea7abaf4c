"""Each channel's gradient, separated by swapping the parameters' ``.grad``
(composer_tune/channels/gradients.py), against autograd's per-loss gradients."""

import math

import pytest
import torch
from torch import nn

from composer_tune.channels.gradients import ChannelGradients


def _model_and_losses() -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    frozen = nn.Linear(3, 3).requires_grad_(False)  # a parameter that does not train
    model.append(frozen)
    inputs = torch.randn(4, 6)
    out = model(inputs)  # one shared forward, as channels 1 and 2 share the student's
    losses = {"policy": out[:, 0].square().mean(), "sdpo": -0.7 * out.sum()}
    return model, inputs, losses


def test_split_backward_gives_each_loss_its_own_gradient_and_their_sum() -> None:
    model, _, losses = _model_and_losses()
    trained = [p for p in model.parameters() if p.requires_grad]
    expected = {
        name: torch.autograd.grad(loss, trained, retain_graph=True) for name, loss in losses.items()
    }
    split = ChannelGradients(model.parameters())
    for index, (name, loss) in enumerate(losses.items()):
        with split.channel(name):
            loss.backward(retain_graph=index < len(losses) - 1)
        assert all(p.grad is None for p in trained)  # nothing leaks between channels
    metrics = split.combine(distributed=False)

    total = [sum(parts) for parts in zip(*expected.values(), strict=True)]
    for parameter, want in zip(trained, total, strict=True):
        torch.testing.assert_close(parameter.grad, want)
    total_sq = sum(float(g.double().square().sum()) for g in total)
    for name, grads in expected.items():
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        dot = sum(float((g.double() * t.double()).sum()) for g, t in zip(grads, total, strict=True))
        assert metrics[f"grad_norm/{name}"] == pytest.approx(norm, rel=1e-6)
        assert metrics[f"grad_share/{name}"] == pytest.approx(dot / total_sq, rel=1e-6)
    assert sum(metrics[f"grad_share/{n}"] for n in losses) == pytest.approx(1.0, abs=1e-6)


def test_a_channel_pulling_against_the_step_has_a_negative_share() -> None:
    model, inputs, _ = _model_and_losses()
    out = model(inputs)
    split = ChannelGradients(model.parameters())
    with split.channel("policy"):
        out.sum().backward(retain_graph=True)
    with split.channel("dpo"):
        (-0.25 * out.sum()).backward()
    metrics = split.combine(distributed=False)
    assert metrics["grad_share/policy"] == pytest.approx(4 / 3, rel=1e-6)
    assert metrics["grad_share/dpo"] == pytest.approx(-1 / 3, rel=1e-6)
    assert metrics["grad_norm/dpo"] == pytest.approx(0.25 * metrics["grad_norm/policy"], rel=1e-6)


def test_gradients_already_in_grad_stay_in_the_sum() -> None:
    model, _, losses = _model_and_losses()
    trained = [p for p in model.parameters() if p.requires_grad]
    for parameter in trained:
        parameter.grad = torch.ones_like(parameter)
    split = ChannelGradients(model.parameters())
    with split.channel("policy"):
        losses["policy"].backward()
    for parameter in trained:  # the outside gradient is back while no channel is open
        torch.testing.assert_close(parameter.grad, torch.ones_like(parameter))
    split.combine(distributed=False)
    model2, _, losses2 = _model_and_losses()
    grads = torch.autograd.grad(
        losses2["policy"], [p for p in model2.parameters() if p.requires_grad]
    )
    for parameter, grad in zip(trained, grads, strict=True):
        torch.testing.assert_close(parameter.grad, grad + 1)
