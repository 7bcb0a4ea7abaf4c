"""Each channel's gradient, separated by swapping the parameters' ``.grad``
(composer_tune/channels/gradients.py), against autograd's per-loss gradients; and each
channel's logit gradient on the end-of-reply token, against autograd's gradient on a bias added
to that logit."""

import math

import pytest
import torch
from torch import nn

from composer_tune.channels.gradients import ChannelGradients
from composer_tune.losses.logprobs import token_logprobs


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


EOS, VOCAB = 3, 7


class _HeadModel(nn.Module):
    """A decoder stand-in: ``forward(x, head_fn=...)`` hands its hidden state and output
    projection to ``head_fn``, as composer_tune's CausalDecoder does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(4, 4)
        self.output = nn.Linear(4, VOCAB)

    def forward(self, inputs, head_fn=None, eos_bias=None):  # noqa: ANN001, ANN201
        hidden = torch.tanh(self.body(inputs))
        if head_fn is not None:
            return head_fn(hidden, self.output)
        logits = self.output(hidden)
        if eos_bias is not None:
            logits = logits + eos_bias * nn.functional.one_hot(torch.tensor(EOS), VOCAB)
        return logits


def _policy_loss(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return -(weights * logp).sum()


def test_the_end_of_reply_push_and_share_equal_autograd_on_a_bias_of_that_logit() -> None:
    """Each channel's logged push is minus the gradient of its loss on a bias added to the
    end-of-reply logit at every position, and its share the end-of-reply column's part of the
    absolute logit gradient: through checkpointed log-prob chunks (each chunk counted once), two
    forwards of one channel summed, and a no-grad forward (a teacher) not counted."""
    model = _HeadModel()
    torch.manual_seed(4)
    inputs = {name: torch.randn(2, 5, 4) for name in ("policy", "sdpo")}
    targets = {name: torch.randint(0, VOCAB, (2, 5)) for name in inputs}
    targets["policy"][0, 2] = EOS  # a reply that ends: the push has a sign to show
    weights = {name: torch.randn(2, 5) for name in inputs}

    def loss_through_head(module, name: str) -> torch.Tensor:  # noqa: ANN001
        logp = module(
            inputs[name],
            head_fn=lambda hidden, output: token_logprobs(
                hidden, output, targets[name], chunk_size=3
            ),
        )
        return _policy_loss(logp, weights[name])

    split = ChannelGradients(model.parameters(), eos_token=EOS)
    watched = split.watch(model)
    with split.channel("policy"):
        loss_through_head(watched, "policy").backward()
    with split.channel("sdpo"):
        with torch.no_grad():  # a teacher forward: no gradient, not counted
            watched(inputs["sdpo"], head_fn=lambda hidden, output: output(hidden))
        (0.5 * loss_through_head(watched, "sdpo")).backward()
        (0.5 * loss_through_head(watched, "sdpo")).backward()
    metrics = split.combine(distributed=False)

    for name in inputs:
        bias = torch.zeros((), requires_grad=True)
        logits = model(inputs[name], eos_bias=bias)
        logp = torch.log_softmax(logits, -1).gather(-1, targets[name][..., None])[..., 0]
        loss = _policy_loss(logp, weights[name])
        (bias_grad, logit_grad) = torch.autograd.grad(loss, [bias, logits])
        assert metrics[f"eos_push/{name}"] == pytest.approx(-float(bias_grad), rel=1e-5)
        share = logit_grad[..., EOS].abs().sum() / logit_grad.abs().sum()
        assert metrics[f"eos_share/{name}"] == pytest.approx(float(share), rel=1e-5)
    assert metrics["eos_push/policy"] != pytest.approx(metrics["eos_push/sdpo"])


def test_without_an_eos_token_nothing_is_watched() -> None:
    model = _HeadModel()
    split = ChannelGradients(model.parameters())
    assert split.watch(model) is model
    with split.channel("policy"):
        model(torch.randn(1, 2, 4)).sum().backward()
    assert not any(name.startswith("eos_") for name in split.combine(distributed=False))
