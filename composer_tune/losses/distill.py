"""The SDPO / OPSD distillation loss: generalized JSD between student and teacher, chunk by chunk.

Channel 2 of the Composer recipe (SDPO, arXiv 2601.20802; OPSD, arXiv 2601.18734): a teacher
re-scores the student's own completion tokens in a context that adds a hint
(:mod:`composer_tune.channels.sdpo.contexts`), and a token-level divergence pulls the student's
next-token distribution toward the teacher's, with stop-gradient through the teacher.

Divergence, following TRL's GKD ``generalized_jsd_loss`` (Agarwal et al., arXiv 2306.13649, Eq. 1)
and SDPO's reference implementation. With student ``S``, teacher ``T`` (both at ``temperature``)
and interpolation ``alpha``:

* ``alpha = 0``: forward KL, ``KL(T || S) = sum_v T_v log(T_v / S_v)`` (mode covering);
* ``alpha = 1``: reverse KL, ``KL(S || T) = sum_v S_v log(S_v / T_v)`` (mode seeking, as in
  on-policy distillation);
* ``0 < alpha < 1``: ``alpha KL(T || M) + (1 - alpha) KL(S || M)`` with the mixture
  ``M = alpha T + (1 - alpha) S``; ``alpha = 0.5`` is the ordinary Jensen-Shannon divergence.

The generalized JSD itself tends to 0 at both ends, so -- exactly as TRL does -- the two ends
are defined as the KLs above rather than as the limit.

Options (SDPO's ``self_distillation`` config has the same knobs; its published values are
``alpha=0.5``, ``top_k=100`` over the student's top tokens with the tail bucket, ``is_clip=2``
and an EMA teacher at rate 0.05; the defaults here leave every option off):

* ``top_k``: the divergence is taken over ``top_k + 1`` outcomes, the ``top_k`` tokens of the
  support distribution (the teacher's by default, as OPSD does; SDPO's code takes the
  student's: ``top_k_support="student"``) plus one tail bucket holding each distribution's
  remaining mass, so both sides stay proper distributions. The tail mass is a log-sum-exp over
  the other tokens, not ``1 - sum(top-k)``, so it keeps its precision when tiny.
* ``token_clip``: each token's divergence is clamped to at most this (no gradient beyond it),
  so a few "pivot" tokens where the hint changes everything cannot dominate a step.
* ``is_clip``: off-policy correction for later optimisation steps on one generation batch:
  each token is weighted by ``sg(min(exp(logp_student - logp_old), is_clip))`` where
  ``logp_*`` are the student's token log-probs of the sampled token now and at sampling time
  (the log-ratio is clamped to [-20, 20] first, as SDPO does).

Aggregation (``averaging``): ``token`` (the default), the sum of the (clipped, weighted)
per-token divergences over the valid tokens -- completion tokens of samples that have a teacher
-- divided by their number (or by ``normalizer``, e.g. the count over every micro-batch and rank
of one optimiser step); samples without a teacher contribute nothing and do not count. ``row``
(TRL 1.16's ``SDPOTrainer``): each sample's mean over its valid tokens, averaged over all samples
(or divided by ``normalizer``, a sample count), those without a teacher counting as 0.

``end_of_reply="exclude"``: the end-of-reply token (``<|im_end|>``, named by the caller) is
never distilled. Positions where the student ended its reply leave the loss, and at every other
position both distributions are renormalised over the remaining tokens (the student's
end-of-reply logit is set to a huge negative value, so it gets no gradient): the teacher teaches
what to say if the reply goes on, never when to stop. Why: a hinted teacher's context is longer
and ends in an instruction, and on SmolLM2 it puts less mass on ending than the student at the
student's own stopping position (docs/a4_channel_gradients/length.md), which the default
distils into longer replies.

``mode="sampled_token"`` (TRL 1.16's default ``distillation_mode``): instead of a divergence
over the vocabulary, each valid token contributes ``sg(log S(y) - log T(y)) * log S(y)`` for
the sampled token ``y``, whose gradient is a one-sample estimate of reverse KL's (``alpha`` must
be 1; no ``top_k`` or ``token_clip``). The logged divergence is then ``log S(y) - log T(y)``,
a one-sample estimate of ``KL(S || T)``.

Memory: Qwen3's vocabulary has 151,936 entries, so neither side's ``[B, T, V]`` logits are ever
formed. :func:`distill_loss` takes final hidden states and the output projection and, like
:func:`composer_tune.losses.logprobs.token_logprobs`, projects chunks of the valid rows under
activation checkpointing, with a hand-written backward for the divergence
(``_StudentDivergence``): forward and backward hold one chunk's ``[chunk, V]`` buffers at a
time (about seven of them at the peak), against about ten ``[rows, V]`` buffers for a plain
autograd computation over all rows (measured on CPU with V=32768, 1024 rows, 256-row chunks:
347 MiB peak against 1295 MiB). The price is compute: the projections and the chunk's forward
run again in backward, 1.5x the matmuls of the plain computation (2-2.5x its CPU wall time).
With the teacher's top-k support the teacher's side is bucketed once up front
(:func:`teacher_topk`), so only the student's projection is recomputed.

Calling it from a training step (teacher = the current policy)::

    with torch.no_grad():
        teacher_hidden = model(teacher_batch.tokens, head_fn=lambda h, _: h)
    out = model(student_tokens, head_fn=lambda h, output: distill_loss(
        h, teacher_hidden, output, student_positions=..., teacher_positions=
        teacher_batch.prediction_positions, targets=..., completion_mask=...,
        has_teacher=teacher_batch.has_teacher, config=config))
    out.loss.backward()

With an EMA teacher (``composer_tune.channels.sdpo.teacher.EMATeacher``: its own output projection) under FSDP2, where a projection can
only run inside its model's forward, the teacher's ``head_fn`` returns :func:`teacher_topk`
and the student's loss takes that :class:`TeacherTopK` instead of hidden states (top-k with the
teacher's support).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from composer_tune.losses.logprobs import OutputModule, _at_least_float32

TOP_K_SUPPORTS = ("teacher", "student")
MODES = ("logits", "sampled_token")
AVERAGINGS = ("token", "row")
END_OF_REPLY = ("distill", "exclude")
# The logit an excluded token gets: exp() of it is 0 in float32, and unlike -inf it keeps
# p * (log p - log q) at 0 instead of NaN where both sides exclude the token.
_EXCLUDED_LOGIT = -1.0e30
# SDPO clamps the log importance ratio to this range before exponentiating.
_MAX_LOG_RATIO = 20.0


@dataclass
class DistillConfig:
    """Settings of :func:`distill_loss` (a YAML section of the SDPO recipe).

    alpha: interpolation in [0, 1]: 0 = forward KL(teacher || student), 1 = reverse
        KL(student || teacher), in between the generalized JSD (see the module docstring).
    temperature: both sides' logits are divided by it (use the sampling temperature).
    top_k: restrict the divergence to ``top_k`` tokens plus a tail bucket; None = full vocab.
    top_k_support: whose top-k tokens: ``"teacher"`` (OPSD) or ``"student"`` (SDPO's code).
    token_clip: clamp each token's divergence to at most this; None = no clipping.
    is_clip: cap of the stop-gradient importance weight ``exp(logp - old_logp)``; None = no
        weighting (on-policy, one optimisation step per generation batch).
    chunk_size: rows (completion tokens) projected per chunk.
    mode: ``logits`` (a divergence over the vocabulary or its top-k) or ``sampled_token``
        (reverse KL through the sampled token, TRL's default; see the module docstring).
    averaging: ``token`` (mean over valid tokens) or ``row`` (mean over samples of each
        sample's token mean, TRL's).
    end_of_reply: ``distill`` (the end-of-reply token is distilled like any other) or
        ``exclude`` (never: see the module docstring; :func:`distill_loss` then needs
        ``end_of_reply_token``).
    """

    alpha: float = 0.5
    temperature: float = 1.0
    top_k: int | None = None
    # Plain str (not Literal) so the dataclass can be an OmegaConf structured-config section.
    top_k_support: str = "teacher"
    token_clip: float | None = None
    is_clip: float | None = None
    chunk_size: int = 256
    mode: str = "logits"
    averaging: str = "token"
    end_of_reply: str = "distill"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"DistillConfig.alpha must be in [0, 1], got {self.alpha}")
        if self.temperature <= 0:
            raise ValueError(f"DistillConfig.temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"DistillConfig.top_k must be >= 1 or None, got {self.top_k}")
        if self.top_k_support not in TOP_K_SUPPORTS:
            raise ValueError(
                f"DistillConfig.top_k_support must be one of {TOP_K_SUPPORTS}, "
                f"got {self.top_k_support!r}"
            )
        for name in ("token_clip", "is_clip"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"DistillConfig.{name} must be > 0 or None, got {value}")
        if self.chunk_size < 1:
            raise ValueError(f"DistillConfig.chunk_size must be >= 1, got {self.chunk_size}")
        for name, choices in (
            ("mode", MODES),
            ("averaging", AVERAGINGS),
            ("end_of_reply", END_OF_REPLY),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"DistillConfig.{name} must be one of {choices}, got {getattr(self, name)!r}"
                )
        if self.mode == "sampled_token":
            conflicts = {
                "alpha": self.alpha != 1.0,
                "top_k": self.top_k is not None,
                "token_clip": self.token_clip is not None,
            }
            for name, conflicting in conflicts.items():
                if conflicting:
                    raise ValueError(
                        f"DistillConfig.mode=sampled_token distils the sampled token by reverse "
                        f"KL: it needs alpha=1 and no top_k or token_clip, got "
                        f"{name}={getattr(self, name)}"
                    )


@dataclass
class DistillOutput:
    """Result of :func:`distill_loss`.

    loss: scalar, differentiable w.r.t. the student only.
    divergence: ``[B, C]`` per-token divergence before clipping and weighting (detached; 0 at
        invalid positions).
    valid: ``bool[B, C]``, the positions that entered the loss.
    metrics: floats for logging: ``distill/divergence`` (mean over valid tokens, before
        clipping), ``distill/teacher_fraction`` (samples with a teacher / samples),
        ``distill/teacher_minus_student_logp`` (mean over valid tokens of the teacher's minus
        the student's log-prob of the token the student produced: > 0 where the hint makes the
        student's own choice more likely), ``distill/clipped_fraction`` (valid tokens whose
        divergence hit ``token_clip``), ``distill/is_weight`` (mean importance weight),
        ``distill/top1_disagreement`` (valid tokens where the teacher's most likely token is
        not the student's: how often the hint would change a greedy choice), and
        ``distill/valid_tokens``. Means over no valid token are NaN.
    """

    loss: Tensor
    divergence: Tensor
    valid: Tensor
    metrics: dict[str, float]


@dataclass
class TeacherTopK:
    """The teacher's side of a top-k divergence at the completion positions, precomputed.

    indices: ``long[B, C, k]``, the teacher's top-k tokens at each position.
    logprobs: ``[B, C, k + 1]``, the teacher's log-probs of those tokens, then of the tail.
    target_logprobs: ``[B, C]``, the teacher's log-prob of the student's token.
    All zero where no teacher was computed.

    ``B * C * (2k + 2)`` numbers instead of hidden states plus a projection: what an EMA
    teacher (its own weights) hands to the student's loss under FSDP2, where each model's
    projection can only run inside its own forward.
    """

    indices: Tensor
    logprobs: Tensor
    target_logprobs: Tensor


def divergence_from_logprobs(student_logp: Tensor, teacher_logp: Tensor, alpha: float) -> Tensor:
    """Generalized JSD (module docstring) over the last dim of two log-distributions, per row.

    Inputs must be normalised log-probabilities with finite entries.
    """
    if alpha == 0.0:
        return _kl(teacher_logp, student_logp)
    if alpha == 1.0:
        return _kl(student_logp, teacher_logp)
    mixture = torch.logaddexp(student_logp + math.log1p(-alpha), teacher_logp + math.log(alpha))
    return alpha * _kl(teacher_logp, mixture) + (1.0 - alpha) * _kl(student_logp, mixture)


def _kl(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """``KL(p || q) = sum_v p_v (log p_v - log q_v)`` per row."""
    return (p_logp.exp() * (p_logp - q_logp)).sum(dim=-1)


def topk_with_tail(logp: Tensor, indices: Tensor) -> Tensor:
    """``[n, k + 1]``: ``logp`` at ``indices`` plus the log of the mass of every other token."""
    tail = logp.scatter(-1, indices, float("-inf")).logsumexp(dim=-1, keepdim=True)
    return torch.cat([logp.gather(-1, indices), tail], dim=-1)


def distill_loss(
    student_hidden: Tensor,
    teacher: Tensor | TeacherTopK,
    output_module: OutputModule,
    *,
    student_positions: Tensor,
    targets: Tensor,
    completion_mask: Tensor,
    has_teacher: Tensor,
    config: DistillConfig,
    teacher_positions: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    teacher_output_module: OutputModule | None = None,
    normalizer: float | Tensor | None = None,
    end_of_reply_token: int | None = None,
) -> DistillOutput:
    """The SDPO distillation loss from final hidden states, chunked and checkpointed.

    Args:
        student_hidden: ``[B, Ts, D]`` the student's final (normed) hidden states, e.g. what
            ``model(tokens, head_fn=...)`` passes to its ``head_fn``.
        teacher: the teacher's ``[B, Tt, D]`` hidden states, computed under ``torch.no_grad()``
            (detached here regardless: the teacher is a stop-gradient target); or its top-k
            side precomputed by :func:`teacher_topk` (top-k with teacher support only).
        output_module: the student's output projection ``[n, D] -> [n, V]``.
        student_positions: ``long[B, C]``: ``student_hidden[b, student_positions[b, j]]``
            predicts completion token ``j`` of row ``b``
            (:func:`composer_tune.channels.sdpo.prediction_positions` of the packed student batch).
        targets: ``long[B, C]``, the student's completion tokens (for the log-prob metrics and
            the importance ratio; entries at invalid positions are not read).
        completion_mask: ``bool[B, C]``, True on real completion tokens (False on padding).
        has_teacher: ``bool[B]``; rows without a teacher are left out of the loss.
        config: the divergence settings.
        teacher_positions: ``long[B, C]``, the same as ``student_positions`` for the teacher's
            sequence (``TeacherBatch.prediction_positions``); needed with hidden states.
        old_logprobs: ``[B, C]`` the sampling policy's log-probs of ``targets`` (at
            ``config.temperature``); required when ``config.is_clip`` is set.
        teacher_output_module: the teacher's projection when it is not the student's (an EMA
            teacher); None = ``output_module`` (the current policy as its own teacher).
        normalizer: divide the token sum by this instead of this call's valid-token count
            (``averaging="row"``: its sample count): for the mean over a whole optimiser step,
            the valid tokens (samples) of every micro-batch on every rank, divided by the number
            of ranks when the data-parallel backend averages gradients (as ``policy_loss``'s
            ``num_items_in_batch``).
        end_of_reply_token: the end-of-reply token id; required with
            ``config.end_of_reply="exclude"``, which leaves it out of the loss (positions whose
            target it is are not valid, and both distributions are renormalised without it).

    Returns:
        A :class:`DistillOutput`. With no valid token the loss is an exact 0 that still runs
        through the output projection, so every FSDP rank gives the same parameters a
        gradient.

    Under FSDP2 call it from inside the student's forward, i.e. from ``head_fn``, where the
    output projection's weight is gathered. A teacher with its own projection (EMA) cannot be
    projected there; run the teacher's forward first with a ``head_fn`` that returns
    :func:`teacher_topk`, and pass that.
    """
    if isinstance(teacher, TeacherTopK):
        _check_topk_teacher(teacher, targets, config)
        if teacher_output_module is not None:
            raise ValueError(
                "distill_loss: teacher_output_module has no use with a TeacherTopK teacher "
                "(its projection already ran in teacher_topk)"
            )
        teacher_hidden = None
    else:
        if teacher_positions is None:
            raise ValueError(
                "distill_loss: teacher_positions is required with teacher hidden states"
            )
        teacher_hidden = teacher
    _check_inputs(
        student_hidden,
        teacher_hidden,
        student_positions,
        teacher_positions,
        targets,
        completion_mask,
        has_teacher,
        old_logprobs,
        config,
    )
    excluded = _excluded_token(config, end_of_reply_token)
    batch, completion_len = targets.shape
    valid = completion_mask.bool() & has_teacher.bool().unsqueeze(-1)
    if excluded is not None:
        valid = valid & (targets != excluded)
    if (
        teacher_hidden is not None
        and config.top_k is not None
        and config.top_k_support == "teacher"
    ):
        # The teacher's side is small once bucketed: compute it once, outside the checkpointed
        # chunks, so backward does not run the teacher's projection again.
        teacher = teacher_topk(
            teacher_hidden,
            output_module if teacher_output_module is None else teacher_output_module,
            positions=teacher_positions,
            targets=targets,
            valid=valid,
            config=config,
            end_of_reply_token=end_of_reply_token,
        )
        teacher_hidden = None
    rows, columns = valid.nonzero(as_tuple=True)
    student_rows = student_hidden[rows, student_positions[rows, columns]]
    row_targets = targets[rows, columns]
    if teacher_hidden is None:
        teacher_rows: tuple[Tensor, ...] = (
            teacher.indices[rows, columns],
            teacher.logprobs[rows, columns],
            teacher.target_logprobs[rows, columns],
        )
        run_chunk = partial(
            _chunk_with_topk_teacher,
            output_module=output_module,
            config=config,
            excluded=excluded,
        )
    else:
        teacher_rows = (teacher_hidden.detach()[rows, teacher_positions[rows, columns]],)
        run_chunk = partial(
            _chunk_divergence,
            output_module=output_module,
            teacher_output_module=output_module
            if teacher_output_module is None
            else teacher_output_module,
            config=config,
            excluded=excluded,
        )
    use_checkpoint = torch.is_grad_enabled()
    pieces: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    for start in range(0, rows.numel(), config.chunk_size):
        chunk = slice(start, start + config.chunk_size)
        args = (student_rows[chunk], row_targets[chunk], *(part[chunk] for part in teacher_rows))
        pieces.append(
            checkpoint(run_chunk, *args, use_reentrant=False)
            if use_checkpoint
            else run_chunk(*args)
        )

    float_dtype = torch.promote_types(student_hidden.dtype, torch.float32)
    if pieces:
        objective, student_logp, teacher_logp, top1_differs = (
            torch.cat(parts) for parts in zip(*pieces, strict=True)
        )
    else:
        objective = student_logp = teacher_logp = student_hidden.new_zeros(0, dtype=float_dtype)
        top1_differs = torch.zeros(0, dtype=torch.bool, device=targets.device)

    if config.mode == "sampled_token":
        divergence = student_logp - teacher_logp  # one-sample KL(S || T), no gradient
        token_loss = divergence * objective
    else:
        divergence = token_loss = objective
    clipped = torch.zeros_like(divergence, dtype=torch.bool)
    if config.token_clip is not None:
        clipped = divergence.detach() > config.token_clip
        token_loss = divergence.clamp(max=config.token_clip)
    weight = None
    if config.is_clip is not None:
        log_ratio = (student_logp.detach() - old_logprobs[rows, columns].to(float_dtype)).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
        weight = log_ratio.exp().clamp(max=config.is_clip)
        token_loss = token_loss * weight

    count = rows.numel()
    if config.averaging == "row":
        token_loss = token_loss / valid.sum(-1).clamp(min=1)[rows]
        denominator = normalizer if normalizer is not None else max(batch, 1)
    else:
        denominator = normalizer if normalizer is not None else max(count, 1)
    if pieces:
        loss = token_loss.sum() / denominator
    else:
        # An exact 0 through the projection: ranks with and without valid tokens then give
        # the same parameters gradients, so FSDP's gradient reduction lines up.
        first_row = student_hidden[:1, :1].reshape(1, -1)
        loss = _at_least_float32(output_module(first_row)).sum() * 0.0

    per_token = torch.zeros(batch, completion_len, dtype=float_dtype, device=targets.device)
    per_token[rows, columns] = divergence.detach()
    metrics = _metrics(
        divergence, student_logp, teacher_logp, clipped, top1_differs, weight, has_teacher, count
    )
    return DistillOutput(loss=loss, divergence=per_token, valid=valid, metrics=metrics)


@torch.no_grad()
def teacher_topk(
    teacher_hidden: Tensor,
    output_module: OutputModule,
    *,
    positions: Tensor,
    targets: Tensor,
    valid: Tensor,
    config: DistillConfig,
    end_of_reply_token: int | None = None,
) -> TeacherTopK:
    """The teacher's top-k side (:class:`TeacherTopK`) from its hidden states, chunk by chunk.

    Args:
        teacher_hidden: ``[B, Tt, D]`` the teacher's final hidden states (e.g. in its
            ``head_fn``).
        output_module: the teacher's output projection.
        positions: ``long[B, C]``, ``TeacherBatch.prediction_positions``.
        targets: ``long[B, C]``, the student's completion tokens.
        valid: ``bool[B, C]``, where to compute (completion tokens of rows with a teacher).
        config: needs ``top_k`` set and ``top_k_support="teacher"``; temperature as for the
            loss.
        end_of_reply_token: as for :func:`distill_loss` (required with
            ``end_of_reply="exclude"``: the teacher's distribution is then renormalised
            without it).
    """
    if config.top_k is None or config.top_k_support != "teacher":
        raise ValueError(
            "teacher_topk: needs DistillConfig.top_k set and top_k_support='teacher', got "
            f"top_k={config.top_k}, top_k_support={config.top_k_support!r}"
        )
    for name, tensor in (("positions", positions), ("valid", valid)):
        if tensor.shape != targets.shape:
            raise ValueError(
                f"teacher_topk: {name} has shape {tuple(tensor.shape)}, expected targets' "
                f"{tuple(targets.shape)}"
            )
    excluded = _excluded_token(config, end_of_reply_token)
    batch, completion_len = targets.shape
    dtype = torch.promote_types(teacher_hidden.dtype, torch.float32)
    indices = torch.zeros(
        batch, completion_len, config.top_k, dtype=torch.long, device=targets.device
    )
    logprobs = torch.zeros(
        batch, completion_len, config.top_k + 1, dtype=dtype, device=targets.device
    )
    target_logprobs = torch.zeros(batch, completion_len, dtype=dtype, device=targets.device)
    rows, columns = valid.bool().nonzero(as_tuple=True)
    hidden_rows = teacher_hidden[rows, positions[rows, columns]]
    row_targets = targets[rows, columns]
    for start in range(0, rows.numel(), config.chunk_size):
        chunk = slice(start, start + config.chunk_size)
        buckets, top, target_logp = _teacher_side(
            hidden_rows[chunk], row_targets[chunk], output_module, config, dtype, excluded
        )
        where = (rows[chunk], columns[chunk])
        indices[where], logprobs[where], target_logprobs[where] = top, buckets, target_logp
    return TeacherTopK(indices=indices, logprobs=logprobs, target_logprobs=target_logprobs)


def _chunk_divergence(
    student_rows: Tensor,
    targets: Tensor,
    teacher_rows: Tensor,
    *,
    output_module: OutputModule,
    teacher_output_module: OutputModule,
    config: DistillConfig,
    excluded: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row objective (the divergence; with ``mode="sampled_token"`` the student's
    differentiable log-prob of its token), both sides' log-prob of ``targets`` (no gradient)
    and whether their most likely tokens differ, for one chunk of rows (``excluded``: a token
    left out of both distributions)."""
    student_logits = _without_token(_at_least_float32(output_module(student_rows)), excluded)
    teacher, indices, teacher_target_logp = _teacher_side(
        teacher_rows, targets, teacher_output_module, config, student_logits.dtype, excluded
    )
    # The teacher's full log-probs, or (teacher support) its top-k, most likely first.
    teacher_top1 = teacher.argmax(-1) if indices is None else indices[:, 0]
    top1_differs = student_logits.detach().argmax(-1) != teacher_top1
    if config.mode == "sampled_token":
        student_target_logp = (
            torch.log_softmax(student_logits / config.temperature, dim=-1)
            .gather(-1, targets.unsqueeze(-1))
            .squeeze(-1)
        )
        return student_target_logp, student_target_logp.detach(), teacher_target_logp, top1_differs
    student_top_k = config.top_k if config.top_k_support == "student" else None
    divergence, student_target_logp = _StudentDivergence.apply(
        student_logits, teacher, indices, targets, config.alpha, config.temperature, student_top_k
    )
    return divergence, student_target_logp, teacher_target_logp, top1_differs


def _chunk_with_topk_teacher(
    student_rows: Tensor,
    targets: Tensor,
    indices: Tensor,
    teacher_buckets: Tensor,
    teacher_target_logp: Tensor,
    *,
    output_module: OutputModule,
    config: DistillConfig,
    excluded: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_chunk_divergence` with the teacher's top-k side given (see :class:`TeacherTopK`;
    built without the ``excluded`` token when there is one)."""
    student_logits = _without_token(_at_least_float32(output_module(student_rows)), excluded)
    top1_differs = student_logits.detach().argmax(-1) != indices[:, 0]  # topk sorts
    divergence, student_target_logp = _StudentDivergence.apply(
        student_logits,
        teacher_buckets.to(student_logits.dtype),
        indices,
        targets,
        config.alpha,
        config.temperature,
        None,
    )
    return (
        divergence,
        student_target_logp,
        teacher_target_logp.to(student_logits.dtype),
        top1_differs,
    )


@torch.no_grad()
def _teacher_side(
    teacher_rows: Tensor,
    targets: Tensor,
    teacher_output_module: OutputModule,
    config: DistillConfig,
    dtype: torch.dtype,
    excluded: int | None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The teacher's log-probs of one chunk of rows: ``(log-probs [n, V], or bucketed
    [n, k + 1] when the teacher picks the top-k support; the top-k indices or None; the
    log-prob of each target)``, renormalised without the ``excluded`` token if one is given."""
    logits = _without_token(
        _at_least_float32(teacher_output_module(teacher_rows)).to(dtype), excluded
    )
    teacher = torch.log_softmax(logits / config.temperature, dim=-1)
    del logits
    target_logp = teacher.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if config.top_k is None:
        return teacher, None, target_logp
    vocab = teacher.shape[-1]
    if config.top_k >= vocab:
        raise ValueError(
            f"distill_loss: top_k={config.top_k} must be below the vocabulary size {vocab} "
            "(use top_k=None for the full vocabulary)"
        )
    if config.top_k_support == "student":
        return teacher, None, target_logp
    indices = teacher.topk(config.top_k, dim=-1).indices
    return topk_with_tail(teacher, indices), indices, target_logp


def _excluded_token(config: DistillConfig, end_of_reply_token: int | None) -> int | None:
    """The token ``config`` leaves out of the loss (None: none)."""
    if config.end_of_reply == "distill":
        return None
    if end_of_reply_token is None:
        raise ValueError(
            "distill_loss: DistillConfig.end_of_reply='exclude' needs end_of_reply_token "
            "(the end-of-reply token id)"
        )
    return end_of_reply_token


def _without_token(logits: Tensor, token: int | None) -> Tensor:
    """``logits`` ``[n, V]`` with ``token``'s column at :data:`_EXCLUDED_LOGIT` (out of place,
    so no gradient reaches that logit); ``logits`` itself for no token."""
    if token is None:
        return logits
    index = torch.tensor([token], device=logits.device)
    return logits.index_fill(-1, index, _EXCLUDED_LOGIT)


class _StudentDivergence(torch.autograd.Function):
    """Per-row divergence of the student's ``[n, V]`` logits from a fixed teacher, and the
    student's log-prob of ``targets`` (no gradient), with a hand-written backward.

    Autograd's backward through the mixture, the KLs and the log-softmax keeps a dozen
    ``[n, V]`` tensors alive; this one needs about four. The divergence ``D`` is a function of
    the student's bucket probabilities ``q_b`` (single tokens, or top-k tokens plus the tail).
    With ``a_b = q_b dD/dq_b`` (forward KL: ``-q_T``; reverse KL: ``q_S (log q_S - log q_T)``;
    JSD: ``(1 - alpha) q_S (log q_S - log M)``, constants dropped since they cancel) and
    ``p = softmax(z / tau)``:

        dD/dz_v = (p_v / q_b(v) * a_b(v) - p_v * sum_b a_b) / tau

    where ``p_v / q_b(v)`` is 1 for a single-token bucket.

    Args of ``apply``: student logits ``[n, V]``; the teacher's log-probs, ``[n, V]`` or, with
    ``indices`` ``[n, k]`` (teacher-chosen support), already bucketed ``[n, k + 1]``; targets
    ``[n]``; alpha; temperature; ``student_top_k`` (the student chooses the support: the
    teacher argument is then full ``[n, V]``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        teacher: Tensor,
        indices: Tensor | None,
        targets: Tensor,
        alpha: float,
        temperature: float,
        student_top_k: int | None,
    ) -> tuple[Tensor, Tensor]:
        student = torch.log_softmax(logits / temperature, dim=-1)
        target_logp = student.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if student_top_k is not None:
            indices = student.topk(student_top_k, dim=-1).indices
            teacher = topk_with_tail(teacher, indices)
        student_buckets = student if indices is None else topk_with_tail(student, indices)
        divergence = divergence_from_logprobs(student_buckets, teacher, alpha)
        ctx.save_for_backward(logits, teacher, indices)
        ctx.alpha, ctx.temperature = alpha, temperature
        ctx.mark_non_differentiable(target_logp)
        return divergence, target_logp

    @staticmethod
    def backward(
        ctx: Any, grad_divergence: Tensor, _grad_target_logp: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, teacher, indices = ctx.saved_tensors
        alpha, temperature = ctx.alpha, ctx.temperature
        student = torch.log_softmax(logits / temperature, dim=-1)
        buckets = student if indices is None else topk_with_tail(student, indices)
        if alpha == 0.0:
            weights = -teacher.exp()
        elif alpha == 1.0:
            weights = buckets.exp() * (buckets - teacher)
        else:
            mixture = torch.logaddexp(buckets + math.log1p(-alpha), teacher + math.log(alpha))
            weights = (1.0 - alpha) * buckets.exp() * (buckets - mixture)
            del mixture
        total = weights.sum(dim=-1, keepdim=True)
        if indices is None:
            grad = weights
        else:
            # Tail tokens share the tail bucket's weight in proportion p_v / q_tail.
            grad = (student - buckets[:, -1:]).exp_().mul_(weights[:, -1:])
            grad.scatter_(-1, indices, weights[:, :-1])
            del weights
        grad.sub_(student.exp_().mul_(total))
        grad.mul_((grad_divergence / temperature).unsqueeze(-1))
        return grad, None, None, None, None, None, None


def _metrics(
    divergence: Tensor,
    student_logp: Tensor,
    teacher_logp: Tensor,
    clipped: Tensor,
    top1_differs: Tensor,
    weight: Tensor | None,
    has_teacher: Tensor,
    count: int,
) -> dict[str, float]:
    """Logging scalars of :class:`DistillOutput` (NaN means where nothing was measured)."""
    nan = float("nan")

    def mean(values: Tensor) -> float:
        return float(values.detach().double().mean()) if count else nan

    return {
        "distill/divergence": mean(divergence),
        "distill/teacher_minus_student_logp": mean(teacher_logp - student_logp),
        "distill/clipped_fraction": mean(clipped.double()),
        "distill/is_weight": mean(weight) if weight is not None else 1.0,
        "distill/top1_disagreement": mean(top1_differs.double()),
        "distill/teacher_fraction": float(has_teacher.double().mean())
        if has_teacher.numel()
        else nan,
        "distill/valid_tokens": float(count),
    }


def _check_inputs(
    student_hidden: Tensor,
    teacher_hidden: Tensor | None,
    student_positions: Tensor,
    teacher_positions: Tensor | None,
    targets: Tensor,
    completion_mask: Tensor,
    has_teacher: Tensor,
    old_logprobs: Tensor | None,
    config: DistillConfig,
) -> None:
    """Shape and range checks with messages that name the argument at fault."""
    hidden_states = {"student_hidden": student_hidden}
    if teacher_hidden is not None:
        hidden_states["teacher_hidden"] = teacher_hidden
    for name, hidden in hidden_states.items():
        if hidden.dim() != 3:
            raise ValueError(f"distill_loss: {name} must be [B, T, D], got {tuple(hidden.shape)}")
    if targets.dim() != 2:
        raise ValueError(f"distill_loss: targets must be [B, C], got {tuple(targets.shape)}")
    batch = targets.shape[0]
    shaped = {"student_positions": student_positions, "completion_mask": completion_mask}
    if teacher_positions is not None:
        shaped["teacher_positions"] = teacher_positions
    if old_logprobs is not None:
        shaped["old_logprobs"] = old_logprobs
    for name, tensor in shaped.items():
        if tensor.shape != targets.shape:
            raise ValueError(
                f"distill_loss: {name} has shape {tuple(tensor.shape)}, expected targets' "
                f"[B, C] = {tuple(targets.shape)}"
            )
    if has_teacher.shape != (batch,):
        raise ValueError(
            f"distill_loss: has_teacher must be [B] = ({batch},), got {tuple(has_teacher.shape)}"
        )
    for name, hidden in hidden_states.items():
        if hidden.shape[0] != batch:
            raise ValueError(f"distill_loss: {name} has batch {hidden.shape[0]}, targets {batch}")
    if teacher_hidden is not None and student_hidden.shape[-1] != teacher_hidden.shape[-1]:
        raise ValueError(
            f"distill_loss: hidden sizes differ (student {student_hidden.shape[-1]}, "
            f"teacher {teacher_hidden.shape[-1]})"
        )
    valid = completion_mask.bool() & has_teacher.bool().unsqueeze(-1)
    checks = [("student_positions", student_positions, student_hidden)]
    if teacher_hidden is not None:
        checks.append(("teacher_positions", teacher_positions, teacher_hidden))
    for name, positions, hidden in checks:
        used = positions[valid]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= hidden.shape[1]):
            raise ValueError(
                f"distill_loss: {name} has entries outside [0, {hidden.shape[1]}) at valid positions"
            )
    if config.is_clip is not None and old_logprobs is None:
        raise ValueError("distill_loss: config.is_clip is set but old_logprobs was not given")


def _check_topk_teacher(teacher: TeacherTopK, targets: Tensor, config: DistillConfig) -> None:
    """A precomputed teacher must match the targets' shape and the config's top-k."""
    if config.top_k is None or config.top_k_support != "teacher":
        raise ValueError(
            "distill_loss: a TeacherTopK teacher needs DistillConfig.top_k set and "
            f"top_k_support='teacher', got top_k={config.top_k}, "
            f"top_k_support={config.top_k_support!r}"
        )
    expected = {
        "indices": (*targets.shape, config.top_k),
        "logprobs": (*targets.shape, config.top_k + 1),
        "target_logprobs": tuple(targets.shape),
    }
    for name, shape in expected.items():
        if tuple(getattr(teacher, name).shape) != shape:
            raise ValueError(
                f"distill_loss: TeacherTopK.{name} has shape "
                f"{tuple(getattr(teacher, name).shape)}, expected {shape}"
            )
