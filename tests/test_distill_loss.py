"""The SDPO distillation loss against a full-vocabulary computation written from the definitions.

The reference below works on probabilities in float64 (``M = a T + (1 - a) S``,
``sum p log(p / q)``, the tail bucket as ``1 - sum(top-k)``), not on the log-space formulas the
implementation uses, and the two KL ends come from ``torch.distributions.kl_divergence``. The
slow test runs the EMA teacher and the top-k loss under FSDP2 on two gloo ranks against one
process.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributions import Categorical, kl_divergence

from composer_tune.channels.sdpo.teacher import EMATeacher
from composer_tune.distributed import DistInfo
from composer_tune.losses.distill import DistillConfig, distill_loss, teacher_topk
from composer_tune.models import qwen3_tiny
from tests.recipe_runs import run_torchrun

BATCH, STUDENT_LEN, TEACHER_LEN, DIM, VOCAB = 3, 7, 10, 16, 40
COMPLETION = 4


def make_inputs(seed: int = 0) -> dict:
    """Hidden states of both sides, a shared projection and the alignment of 4 completion tokens.

    Row 1 has no teacher; row 2's last completion slot is padding.
    """
    generator = torch.Generator().manual_seed(seed)
    output = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
    with torch.no_grad():
        output.weight.copy_(torch.randn(VOCAB, DIM, generator=generator, dtype=torch.float64))
    student_hidden = torch.randn(BATCH, STUDENT_LEN, DIM, generator=generator, dtype=torch.float64)
    # Teacher = student plus a perturbation, so the two distributions are close but distinct.
    teacher_hidden = torch.randn(BATCH, TEACHER_LEN, DIM, generator=generator, dtype=torch.float64)
    student_prompt = torch.tensor([2, 3, 2])
    teacher_prompt = torch.tensor([5, 6, 4])
    j = torch.arange(COMPLETION)
    student_positions = student_prompt[:, None] + j - 1
    teacher_positions = teacher_prompt[:, None] + j - 1
    completion_mask = torch.ones(BATCH, COMPLETION, dtype=torch.bool)
    completion_mask[2, 3] = False
    student_positions[2, 3] = 0  # padding slots hold arbitrary positions
    teacher_positions[2, 3] = 0
    return {
        "student_hidden": student_hidden.requires_grad_(True),
        "teacher_hidden": teacher_hidden,
        "output": output,
        "student_positions": student_positions,
        "teacher_positions": teacher_positions,
        "targets": torch.randint(0, VOCAB, (BATCH, COMPLETION), generator=generator),
        "completion_mask": completion_mask,
        "has_teacher": torch.tensor([True, False, True]),
        "old_logprobs": -torch.rand(BATCH, COMPLETION, generator=generator, dtype=torch.float64)
        * 4,
    }


def run(inputs: dict, config: DistillConfig, **overrides):
    args = {**inputs, **overrides}
    return distill_loss(
        args["student_hidden"],
        args["teacher_hidden"],
        args["output"],
        student_positions=args["student_positions"],
        teacher_positions=args["teacher_positions"],
        targets=args["targets"],
        completion_mask=args["completion_mask"],
        has_teacher=args["has_teacher"],
        old_logprobs=args["old_logprobs"],
        config=config,
        teacher_output_module=args.get("teacher_output"),
        normalizer=args.get("normalizer"),
        end_of_reply_token=args.get("end_of_reply_token"),
    )


def reference_divergence(student_p: torch.Tensor, teacher_p: torch.Tensor, alpha: float):
    """Per-row divergence from probabilities (rows sum to 1; 0 log 0 = 0)."""

    def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1)

    if alpha == 0.0:
        return kl(teacher_p, student_p)
    if alpha == 1.0:
        return kl(student_p, teacher_p)
    mixture = alpha * teacher_p + (1 - alpha) * student_p
    return alpha * kl(teacher_p, mixture) + (1 - alpha) * kl(student_p, mixture)


def restrict_to_topk(p: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``[n, k + 1]``: the probabilities at ``indices`` and a tail of ``1 - their sum``."""
    kept = p.gather(-1, indices)
    return torch.cat([kept, 1 - kept.sum(-1, keepdim=True)], dim=-1)


def without(p: torch.Tensor, token: int) -> torch.Tensor:
    """The distribution ``p`` conditioned on not being ``token``."""
    kept = torch.ones(p.shape[-1], dtype=p.dtype)
    kept[token] = 0.0
    return p * kept / (p * kept).sum(-1, keepdim=True)


def reference(inputs: dict, config: DistillConfig, end_of_reply: int | None = None) -> dict:
    """Loss, per-token divergence and token log-prob gap, from full [B, C, V] logits
    (``end_of_reply="exclude"``: that token's positions left out, both sides conditioned on
    not ending)."""
    valid = inputs["completion_mask"] & inputs["has_teacher"][:, None]
    rows = torch.arange(BATCH)[:, None].expand(BATCH, COMPLETION)
    student_h = inputs["student_hidden"][rows, inputs["student_positions"]]
    teacher_h = inputs["teacher_hidden"][rows, inputs["teacher_positions"]]
    weight = inputs["output"].weight
    student_p = torch.softmax(student_h @ weight.T / config.temperature, -1)
    # Stop-gradient: the teacher's logits use a detached copy of the shared weight.
    teacher_p = torch.softmax(teacher_h @ weight.detach().T / config.temperature, -1)
    if config.end_of_reply == "exclude":
        valid = valid & (inputs["targets"] != end_of_reply)
        student_p, teacher_p = without(student_p, end_of_reply), without(teacher_p, end_of_reply)
    if config.top_k is not None:
        support = teacher_p if config.top_k_support == "teacher" else student_p.detach()
        indices = support.topk(config.top_k, -1).indices
        student_q, teacher_q = (
            restrict_to_topk(student_p, indices),
            restrict_to_topk(teacher_p, indices),
        )
    elif config.end_of_reply == "exclude":  # over the other tokens (0 log 0 has no gradient)
        others = torch.tensor([token for token in range(VOCAB) if token != end_of_reply])
        student_q, teacher_q = student_p[..., others], teacher_p[..., others]
    else:
        student_q, teacher_q = student_p, teacher_p
    divergence = reference_divergence(student_q, teacher_q, config.alpha)
    token_loss = divergence
    if config.token_clip is not None:
        token_loss = token_loss.clamp(max=config.token_clip)
    target = inputs["targets"].unsqueeze(-1)
    student_logp = student_p.gather(-1, target).squeeze(-1).log()
    teacher_logp = teacher_p.gather(-1, target).squeeze(-1).log()
    if config.is_clip is not None:
        # SDPO clamps the log-ratio to [-20, 20] before exponentiating.
        ratio = (student_logp.detach() - inputs["old_logprobs"]).clamp(-20, 20).exp()
        token_loss = token_loss * ratio.clamp(max=config.is_clip)
    loss = token_loss[valid].sum() / valid.sum()
    top1_differs = student_p.argmax(-1) != teacher_p.argmax(-1)
    return {
        "loss": loss,
        "divergence": torch.where(valid, divergence, 0.0).detach(),
        "gap": (teacher_logp - student_logp)[valid].mean().item(),
        "top1_disagreement": top1_differs[valid].double().mean().item(),
    }


def grads(loss: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(
        loss, (inputs["student_hidden"], inputs["output"].weight), retain_graph=True
    )


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("top_k", [None, 5])
def test_matches_definition_values_and_gradients(alpha, temperature, top_k) -> None:
    inputs = make_inputs()
    config = DistillConfig(alpha=alpha, temperature=temperature, top_k=top_k, chunk_size=3)
    got = run(inputs, config)
    want = reference(inputs, config)
    torch.testing.assert_close(got.loss, want["loss"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.divergence, want["divergence"], rtol=1e-9, atol=1e-12)
    for mine, theirs in zip(grads(got.loss, inputs), grads(want["loss"], inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-12)
    assert got.metrics["distill/teacher_minus_student_logp"] == pytest.approx(want["gap"], 1e-10)
    assert got.metrics["distill/top1_disagreement"] == want["top1_disagreement"]
    assert got.metrics["distill/teacher_fraction"] == pytest.approx(2 / 3)
    assert got.metrics["distill/valid_tokens"] == 7  # row 0: 4, row 2: 3
    assert got.loss.item() > 0


@pytest.mark.parametrize("support", ["teacher", "student"])
def test_topk_support_and_tail(support: str) -> None:
    inputs = make_inputs(seed=3)
    config = DistillConfig(alpha=0.5, top_k=3, top_k_support=support)
    got = run(inputs, config)
    want = reference(inputs, config)
    torch.testing.assert_close(got.loss, want["loss"], rtol=1e-9, atol=1e-12)
    for mine, theirs in zip(grads(got.loss, inputs), grads(want["loss"], inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-12)
    assert got.metrics["distill/top1_disagreement"] == want["top1_disagreement"]
    # The top-k divergence is a coarsening of the full one: never larger (data processing).
    full = run(inputs, DistillConfig(alpha=0.5)).divergence
    assert torch.all(got.divergence <= full + 1e-12)


@pytest.mark.parametrize("alpha, direction", [(0.0, "forward"), (1.0, "reverse")])
def test_alpha_ends_are_the_two_kl_directions(alpha: float, direction: str) -> None:
    """alpha=0: KL(teacher || student); alpha=1: KL(student || teacher), as in TRL's GKD."""
    inputs = make_inputs(seed=5)
    got = run(inputs, DistillConfig(alpha=alpha, temperature=0.8)).divergence
    rows = torch.arange(BATCH)[:, None].expand(BATCH, COMPLETION)
    weight = inputs["output"].weight.detach()
    student = Categorical(
        logits=inputs["student_hidden"].detach()[rows, inputs["student_positions"]] @ weight.T / 0.8
    )
    teacher = Categorical(
        logits=inputs["teacher_hidden"][rows, inputs["teacher_positions"]] @ weight.T / 0.8
    )
    kl = (
        kl_divergence(teacher, student)
        if direction == "forward"
        else kl_divergence(student, teacher)
    )
    other = (
        kl_divergence(student, teacher)
        if direction == "forward"
        else kl_divergence(teacher, student)
    )
    valid = inputs["completion_mask"] & inputs["has_teacher"][:, None]
    torch.testing.assert_close(got[valid], kl[valid], rtol=1e-9, atol=1e-12)
    assert not torch.allclose(got[valid], other[valid])  # the directions really differ here


def test_token_clip_caps_divergence_and_zeroes_its_gradient() -> None:
    inputs = make_inputs(seed=1)
    unclipped = run(inputs, DistillConfig(alpha=1.0)).divergence
    valid = inputs["completion_mask"] & inputs["has_teacher"][:, None]
    cap = float(unclipped[valid].median())
    config = DistillConfig(alpha=1.0, token_clip=cap)
    got = run(inputs, config)
    want = reference(inputs, config)
    torch.testing.assert_close(got.loss, want["loss"], rtol=1e-9, atol=1e-12)
    for mine, theirs in zip(grads(got.loss, inputs), grads(want["loss"], inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-12)
    clipped = unclipped > cap
    assert got.metrics["distill/clipped_fraction"] == pytest.approx(
        clipped[valid].double().mean().item()
    )
    # A clipped token's hidden state gets no gradient.
    (hidden_grad,) = torch.autograd.grad(got.loss, inputs["student_hidden"])
    row, column = clipped.nonzero()[0].tolist()
    assert torch.all(hidden_grad[row, inputs["student_positions"][row, column]] == 0)


def test_importance_weight_matches_definition_and_needs_old_logprobs() -> None:
    inputs = make_inputs(seed=2)
    config = DistillConfig(alpha=0.5, is_clip=1.5, temperature=0.9)
    got = run(inputs, config)
    want = reference(inputs, config)
    torch.testing.assert_close(got.loss, want["loss"], rtol=1e-9, atol=1e-12)
    for mine, theirs in zip(grads(got.loss, inputs), grads(want["loss"], inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-12)
    # The weights matter here (they are neither all 1 nor all capped).
    assert got.loss.item() != pytest.approx(
        run(inputs, DistillConfig(alpha=0.5, temperature=0.9)).loss.item()
    )
    with pytest.raises(ValueError, match="old_logprobs"):
        run(inputs, config, old_logprobs=None)


def test_gradients_flow_only_into_the_student() -> None:
    inputs = make_inputs()
    teacher_hidden = inputs["teacher_hidden"].clone().requires_grad_(True)
    teacher_output = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
    got = run(
        inputs,
        DistillConfig(alpha=0.5),
        teacher_hidden=teacher_hidden,
        teacher_output=teacher_output,
    )
    got.loss.backward()
    assert teacher_hidden.grad is None
    assert teacher_output.weight.grad is None
    assert inputs["student_hidden"].grad.abs().sum() > 0
    assert inputs["output"].weight.grad.abs().sum() > 0


def test_separate_teacher_projection_is_used_for_the_teacher() -> None:
    inputs = make_inputs()
    teacher_output = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
    got = run(inputs, DistillConfig(alpha=0.0), teacher_output=teacher_output)
    # Reference with the teacher's projection substituted into a copy of the inputs.
    shared = run(inputs, DistillConfig(alpha=0.0))
    assert not torch.allclose(got.loss, shared.loss)
    rows = torch.arange(BATCH)[:, None].expand(BATCH, COMPLETION)
    student = Categorical(
        logits=inputs["student_hidden"].detach()[rows, inputs["student_positions"]]
        @ inputs["output"].weight.detach().T
    )
    teacher = Categorical(
        logits=teacher_output(inputs["teacher_hidden"][rows, inputs["teacher_positions"]]).detach()
    )
    valid = inputs["completion_mask"] & inputs["has_teacher"][:, None]
    torch.testing.assert_close(
        got.divergence[valid], kl_divergence(teacher, student)[valid], rtol=1e-9, atol=1e-12
    )


def test_precomputed_teacher_topk_equals_hidden_state_path() -> None:
    """An EMA-style teacher with its own projection, handed over as TeacherTopK."""
    inputs = make_inputs(seed=6)
    teacher_output = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
    config = DistillConfig(alpha=0.3, top_k=5, temperature=0.8, is_clip=2.0, chunk_size=2)
    direct = run(inputs, config, teacher_output=teacher_output)
    valid = inputs["completion_mask"] & inputs["has_teacher"][:, None]
    precomputed = teacher_topk(
        inputs["teacher_hidden"],
        teacher_output,
        positions=inputs["teacher_positions"],
        targets=inputs["targets"],
        valid=valid,
        config=config,
    )
    assert torch.all(precomputed.indices[~valid] == 0)
    # Each bucket row is a distribution, and the indices are the teacher's top tokens.
    torch.testing.assert_close(
        precomputed.logprobs[valid].exp().sum(-1), torch.ones(7, dtype=torch.float64)
    )
    rows = torch.arange(BATCH)[:, None].expand(BATCH, COMPLETION)
    logits = teacher_output(inputs["teacher_hidden"][rows, inputs["teacher_positions"]]).detach()
    top = logits.topk(5, dim=-1).indices
    assert torch.equal(precomputed.indices[valid], top[valid])
    got = run(inputs, config, teacher_hidden=precomputed, teacher_positions=None)
    torch.testing.assert_close(got.loss, direct.loss, rtol=1e-12, atol=1e-14)
    assert got.metrics == pytest.approx(direct.metrics)
    for mine, theirs in zip(grads(got.loss, inputs), grads(direct.loss, inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="top_k_support='teacher'"):
        run(inputs, DistillConfig(top_k=5, top_k_support="student"), teacher_hidden=precomputed)
    with pytest.raises(
        ValueError, match=r"TeacherTopK.indices has shape \(3, 4, 5\), expected \(3, 4, 6\)"
    ):
        run(inputs, DistillConfig(top_k=6, is_clip=2.0), teacher_hidden=precomputed)
    with pytest.raises(ValueError, match="teacher_output_module has no use"):
        run(inputs, config, teacher_hidden=precomputed, teacher_output=teacher_output)
    with pytest.raises(ValueError, match="teacher_positions is required"):
        run(inputs, config, teacher_positions=None)
    with pytest.raises(ValueError, match="teacher_topk: needs"):
        teacher_topk(
            inputs["teacher_hidden"],
            teacher_output,
            positions=inputs["teacher_positions"],
            targets=inputs["targets"],
            valid=valid,
            config=DistillConfig(),
        )


END_OF_REPLY = 7


@pytest.mark.parametrize(
    ("alpha", "top_k", "support"),
    [(0.5, None, "teacher"), (0.5, 5, "student"), (0.3, 5, "teacher"), (1.0, None, "teacher")],
)
def test_excluding_the_end_of_reply_distils_only_what_follows_if_the_reply_goes_on(
    alpha: float, top_k: int | None, support: str
) -> None:
    """``end_of_reply="exclude"``: the positions where the student ended are not distilled,
    elsewhere both sides are conditioned on not ending (the definition computed here), and the
    student's end-of-reply logit gets no gradient; the default distils it."""
    inputs = make_inputs(seed=8)
    inputs["targets"][0, 1] = END_OF_REPLY  # row 0 ends its reply there
    inputs["targets"][2, 0] = END_OF_REPLY
    config = DistillConfig(alpha=alpha, top_k=top_k, top_k_support=support, chunk_size=3)
    excluding = DistillConfig(**{**config.__dict__, "end_of_reply": "exclude"})
    got = run(inputs, excluding, end_of_reply_token=END_OF_REPLY)
    want = reference(inputs, excluding, end_of_reply=END_OF_REPLY)
    torch.testing.assert_close(got.loss, want["loss"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.divergence, want["divergence"], rtol=1e-9, atol=1e-12)
    distilled = inputs["completion_mask"] & inputs["has_teacher"][:, None]
    ended = int((distilled & (inputs["targets"] == END_OF_REPLY)).sum())
    assert ended >= 2 and got.metrics["distill/valid_tokens"] == 7 - ended
    assert not got.valid[0, 1] and not got.valid[2, 0]
    for mine, theirs in zip(grads(got.loss, inputs), grads(want["loss"], inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-12)
    (_, weight_grad) = grads(got.loss, inputs)
    assert torch.all(weight_grad[END_OF_REPLY] == 0)

    default = run(inputs, config)
    assert default.metrics["distill/valid_tokens"] == 7
    (_, weight_grad) = grads(default.loss, inputs)
    assert weight_grad[END_OF_REPLY].abs().sum() > 1e-6
    with pytest.raises(ValueError, match="end_of_reply='exclude' needs end_of_reply_token"):
        run(inputs, excluding)
    with pytest.raises(ValueError, match="end_of_reply must be one of"):
        DistillConfig(end_of_reply="student")


def test_excluding_the_end_of_reply_with_a_precomputed_teacher() -> None:
    """The EMA teacher's top-k side (TeacherTopK) built without the end-of-reply token gives
    the hidden-state path's loss and gradients."""
    inputs = make_inputs(seed=9)
    inputs["targets"][0, 2] = END_OF_REPLY
    teacher_output = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
    config = DistillConfig(alpha=0.5, top_k=5, end_of_reply="exclude")
    direct = run(inputs, config, teacher_output=teacher_output, end_of_reply_token=END_OF_REPLY)
    precomputed = teacher_topk(
        inputs["teacher_hidden"],
        teacher_output,
        positions=inputs["teacher_positions"],
        targets=inputs["targets"],
        valid=inputs["completion_mask"] & inputs["has_teacher"][:, None],
        config=config,
        end_of_reply_token=END_OF_REPLY,
    )
    assert not bool((precomputed.indices == END_OF_REPLY).any())
    got = run(
        inputs,
        config,
        teacher_hidden=precomputed,
        teacher_positions=None,
        end_of_reply_token=END_OF_REPLY,
    )
    torch.testing.assert_close(got.loss, direct.loss, rtol=1e-12, atol=1e-14)
    for mine, theirs in zip(grads(got.loss, inputs), grads(direct.loss, inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-14)


def test_masked_positions_contribute_nothing() -> None:
    inputs = make_inputs()
    config = DistillConfig(alpha=0.5, top_k=4)
    before = run(inputs, config)
    (hidden_grad,) = torch.autograd.grad(before.loss, inputs["student_hidden"])
    # Everything feeding row 1 (no teacher) and row 2's padding slot, on both sides.
    touched_student = {(1, int(p)) for p in inputs["student_positions"][1]}
    touched_teacher = {(1, int(p)) for p in inputs["teacher_positions"][1]}
    used_student = {
        (r, int(inputs["student_positions"][r, c])) for r, c in (before.valid).nonzero().tolist()
    }
    used_teacher = {
        (r, int(inputs["teacher_positions"][r, c])) for r, c in before.valid.nonzero().tolist()
    }
    student_hidden = inputs["student_hidden"].detach().clone()
    teacher_hidden = inputs["teacher_hidden"].clone()
    for row, position in touched_student - used_student:
        student_hidden[row, position] += 100.0
    for row, position in touched_teacher - used_teacher:
        teacher_hidden[row, position] -= 100.0
    student_hidden[2, 0] += 0 if (2, 0) in used_student else 50.0  # row 2's padding slot
    after = run(
        inputs,
        config,
        student_hidden=student_hidden.requires_grad_(True),
        teacher_hidden=teacher_hidden,
        targets=torch.where(before.valid, inputs["targets"], VOCAB + 5),  # never read there
    )
    torch.testing.assert_close(after.loss, before.loss, rtol=0, atol=0)
    for row, position in touched_student - used_student:
        assert torch.all(hidden_grad[row, position] == 0)
    assert torch.all(before.divergence[~before.valid] == 0)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 1000])
def test_chunked_equals_unchunked(chunk_size: int) -> None:
    inputs = make_inputs(seed=4)
    config = DistillConfig(alpha=0.3, top_k=6, token_clip=2.0, is_clip=2.0, temperature=0.7)
    whole = run(inputs, DistillConfig(**{**config.__dict__, "chunk_size": 10_000}))
    chunked = run(inputs, DistillConfig(**{**config.__dict__, "chunk_size": chunk_size}))
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-12, atol=1e-14)
    for mine, theirs in zip(grads(chunked.loss, inputs), grads(whole.loss, inputs), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-14)
    # Under no_grad the chunks run without checkpointing and give the same value.
    with torch.no_grad():
        torch.testing.assert_close(run(inputs, config).loss, whole.loss, rtol=1e-12, atol=1e-14)


def test_normalizer_and_empty_batch() -> None:
    inputs = make_inputs()
    config = DistillConfig(alpha=0.5)
    mean = run(inputs, config)
    summed = run(inputs, config, normalizer=1.0)
    torch.testing.assert_close(summed.loss, mean.loss * 7)
    nobody = run(inputs, config, has_teacher=torch.zeros(BATCH, dtype=torch.bool))
    assert nobody.loss.item() == 0.0
    hidden_grad, weight_grad = grads(nobody.loss, inputs)  # both reached, both zero
    assert torch.all(hidden_grad == 0) and torch.all(weight_grad == 0)
    assert nobody.metrics["distill/teacher_fraction"] == 0.0
    assert nobody.metrics["distill/valid_tokens"] == 0


def test_float32_model_dtype_and_identical_contexts_give_zero() -> None:
    """Teacher = student on the same hidden states: divergence 0 for every alpha."""
    inputs = make_inputs()
    output = nn.Linear(DIM, VOCAB, bias=False)
    hidden = inputs["student_hidden"].detach().float().requires_grad_(True)
    for alpha in (0.0, 0.5, 1.0):
        got = run(
            inputs,
            DistillConfig(alpha=alpha, top_k=7),
            student_hidden=hidden,
            teacher_hidden=hidden.detach(),
            teacher_positions=inputs["student_positions"],
            output=output,
            old_logprobs=None,
        )
        assert got.loss.dtype == torch.float32
        assert got.loss.abs().item() < 1e-6
        assert got.metrics["distill/teacher_minus_student_logp"] == pytest.approx(0, abs=1e-6)


def test_bf16_model_gives_float32_loss_close_to_float32_model() -> None:
    """bf16 hidden states and weights: the softmax runs in float32, the gradient is bf16."""
    inputs = make_inputs()
    output32 = nn.Linear(DIM, VOCAB, bias=False)
    output32.weight.data = inputs["output"].weight.data.float()
    output16 = nn.Linear(DIM, VOCAB, bias=False, dtype=torch.bfloat16)
    output16.weight.data = output32.weight.data.bfloat16()
    config = DistillConfig(alpha=0.5, top_k=5, is_clip=2.0)
    losses = []
    for output, dtype in ((output32, torch.float32), (output16, torch.bfloat16)):
        hidden = inputs["student_hidden"].detach().to(dtype).requires_grad_(True)
        got = run(
            inputs,
            config,
            student_hidden=hidden,
            teacher_hidden=inputs["teacher_hidden"].to(dtype),
            output=output,
            old_logprobs=inputs["old_logprobs"].float(),
        )
        got.loss.backward()
        assert got.loss.dtype == torch.float32 and hidden.grad.dtype == dtype
        losses.append(got.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=0.02)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"completion_mask": torch.ones(BATCH, COMPLETION + 1, dtype=torch.bool)},
            "completion_mask",
        ),
        ({"has_teacher": torch.ones(BATCH + 1, dtype=torch.bool)}, "has_teacher"),
        ({"teacher_positions": torch.full((BATCH, COMPLETION), TEACHER_LEN)}, "teacher_positions"),
        ({"student_hidden": torch.zeros(BATCH, DIM)}, "student_hidden"),
    ],
)
def test_bad_inputs_name_the_culprit(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(make_inputs(), DistillConfig(), **change)


def test_config_validation_and_topk_bound() -> None:
    for kwargs, field in [
        ({"alpha": 1.5}, "alpha"),
        ({"temperature": 0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k_support": "both"}, "top_k_support"),
        ({"token_clip": -1.0}, "token_clip"),
        ({"is_clip": 0.0}, "is_clip"),
        ({"chunk_size": 0}, "chunk_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            DistillConfig(**kwargs)
    with pytest.raises(ValueError, match="top_k=40"):
        run(make_inputs(), DistillConfig(top_k=VOCAB))


def test_ema_teacher_update_state_dict_and_no_grad() -> None:
    torch.manual_seed(0)
    student = qwen3_tiny(vocab_size=64)
    ema = EMATeacher(student, rate=0.25)
    start = {name: value.clone() for name, value in student.state_dict().items()}
    for name, value in ema.module.state_dict().items():
        torch.testing.assert_close(value, start[name], rtol=0, atol=0)
    assert all(not parameter.requires_grad for parameter in ema.module.parameters())
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(torch.randn_like(parameter))
    moved = {name: value.clone() for name, value in student.state_dict().items()}
    ema.update()
    ema.update()
    for name, value in ema.module.named_parameters():
        # Two steps of t <- 0.75 t + 0.25 s toward a fixed s: s + 0.75^2 (t0 - s).
        expected = moved[name] + 0.75**2 * (start[name] - moved[name])
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    assert ema.num_updates == 2

    saved = ema.state_dict(DistInfo(world_size=1, rank=0, device=torch.device("cpu")))
    restored = EMATeacher(qwen3_tiny(vocab_size=64), rate=0.25)
    restored.load_state_dict(saved, device=torch.device("cpu"))
    assert restored.num_updates == 2
    for name, value in restored.module.state_dict().items():
        torch.testing.assert_close(value, saved["weights"][name], rtol=0, atol=0)
    # The student's training never touches the teacher.
    tokens = torch.randint(0, 64, (2, 5))
    student(tokens).sum().backward()
    assert all(parameter.grad is None for parameter in ema.module.parameters())


def test_ema_teacher_follows_tensors_a_loader_assigned_after_rebind() -> None:
    """torchtune's loader assigns new tensors to the teacher (as ``assign=True`` does): updates
    reach them only after ``rebind()``."""
    torch.manual_seed(0)
    student = qwen3_tiny(vocab_size=64)
    ema = EMATeacher(student, rate=0.5)
    saved = {name: value.clone() for name, value in ema.module.state_dict().items()}
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(1.0)
    ema.module.load_state_dict({k: v.clone() for k, v in saved.items()}, assign=True)
    ema.update()
    name, weight = next(iter(ema.module.named_parameters()))
    torch.testing.assert_close(weight, saved[name], rtol=0, atol=0)  # stale pairs: frozen
    ema.rebind()
    ema.update()
    torch.testing.assert_close(weight, saved[name] + 0.5, rtol=1e-6, atol=1e-6)


def test_ema_teacher_rejects_bad_rate_and_mismatched_teacher() -> None:
    student = qwen3_tiny(vocab_size=64)
    with pytest.raises(ValueError, match="rate"):
        EMATeacher(student, rate=0.0)
    with pytest.raises(ValueError, match="shape"):
        EMATeacher(student, rate=0.1, teacher=qwen3_tiny(vocab_size=65))
    with pytest.raises(KeyError, match="num_updates"):
        EMATeacher(student, rate=0.1).load_state_dict({"model": {}}, device=torch.device("cpu"))


FSDP_WORKER = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from composer_tune.distributed import finish_process, setup_distributed, shard_decoder
from composer_tune.distributed import teardown_distributed
from composer_tune.channels.sdpo.teacher import EMATeacher
from composer_tune.distributed import DistInfo
from composer_tune.losses.distill import DistillConfig, distill_loss, teacher_topk
from composer_tune.models import qwen3_tiny

setup_distributed("cpu")
torch.manual_seed(0)
student = qwen3_tiny(vocab_size=64, initializer_range=0.5)
plain_student = copy.deepcopy(student)
teacher = qwen3_tiny(vocab_size=64)
shard_decoder(student)
shard_decoder(teacher)
ema, plain_ema = EMATeacher(student, 0.25, teacher=teacher), EMATeacher(plain_student, 0.25)
with torch.no_grad():
    for sharded, plain in zip(student.parameters(), plain_student.parameters()):
        sharded.mul_(1.5)
        plain.mul_(1.5)
ema.update()
plain_ema.update()
full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
ema_diff = max(
    (full(a) - b).abs().max().item()
    for a, b in zip(ema.module.parameters(), plain_ema.module.parameters())
)
generator = torch.Generator().manual_seed(1)
student_tokens = torch.randint(0, 64, (2, 9), generator=generator)
teacher_tokens = torch.randint(0, 64, (2, 12), generator=generator)
student_positions = torch.tensor([[3, 4, 5, 6], [4, 5, 6, 7]])
teacher_positions = student_positions + 3
targets = torch.randint(0, 64, (2, 4), generator=generator)
mask = torch.ones(2, 4, dtype=torch.bool)
config = DistillConfig(alpha=0.5, top_k=8)
results = []
for model, teacher_model in ((student, ema.module), (plain_student, plain_ema.module)):
    with torch.no_grad():
        top = teacher_model(teacher_tokens, head_fn=lambda h, out: teacher_topk(
            h, out, positions=teacher_positions, targets=targets, valid=mask, config=config))
    out = model(student_tokens, head_fn=lambda h, output: distill_loss(
        h, top, output, student_positions=student_positions, targets=targets,
        completion_mask=mask, has_teacher=torch.ones(2, dtype=torch.bool), config=config))
    out.loss.backward()
    results.append((out.loss.item(), [full(p.grad).clone() for p in model.parameters()]))
(loss, grads), (plain_loss, plain_grads) = results
if dist.get_rank() == 0:
    json.dump({
        "ema_diff": ema_diff,
        "loss": loss,
        "plain_loss": plain_loss,
        "grad_diff": max((a - b).abs().max().item() for a, b in zip(grads, plain_grads)),
        "grad_norm": sum(g.norm() ** 2 for g in plain_grads).sqrt().item(),
    }, open(sys.argv[1], "w"))
teardown_distributed()
finish_process(lambda: None)  # ends the process without finalizing: see finish_process
"""


@pytest.mark.slow
def test_fsdp2_ema_teacher_and_topk_loss_match_one_process(tmp_path) -> None:
    """Two gloo ranks: the EMA update on DTensor shards, and the distillation loss with an EMA
    teacher's TeacherTopK computed in its own sharded forward, equal the unsharded run."""
    worker, out = tmp_path / "worker.py", tmp_path / "result.json"
    worker.write_text(FSDP_WORKER)
    run_torchrun(worker, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["ema_diff"] < 1e-6
    assert result["loss"] == pytest.approx(result["plain_loss"], rel=1e-5)
    assert result["plain_loss"] > 1e-3 and result["grad_norm"] > 1e-3
    assert result["grad_diff"] < 1e-5 * max(1.0, result["grad_norm"])
