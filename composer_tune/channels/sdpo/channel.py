"""The SDPO channel of one training micro-batch: teacher contexts, teacher forward, student loss.

Channel 2 of the Composer recipe replication (SDPO, "targeted RL with textual feedback"; SDPO
arXiv 2601.20802, OPSD arXiv 2601.18734). Every recipe that trains with channel 2 (A2
``recipes/sdpo.py``, A4 ``composer_full``) calls the functions here, so they share one
definition of what the SDPO term of a micro-batch is:

1. :func:`build_sdpo_teacher_batch`: the teacher's sequences for a batch of rollouts -- the
   prompt with a hint (verifier feedback, a successful sibling, the reference solution) followed
   by the student's own completion ids (:mod:`composer_tune.channels.sdpo.contexts`). Build it once per
   generation batch so every row sees its whole group of siblings, then take each micro-batch's
   rows with :func:`select_teacher_rows`.
2. The teacher's forward, under ``torch.no_grad()``: the current policy itself
   (``teacher="current"``), or an :class:`~composer_tune.losses.distill.EMATeacher`'s module
   (``teacher="ema"``).
3. The student's forward with a ``head_fn`` that computes
   :func:`~composer_tune.losses.distill.distill_loss` from the final hidden states, so that under
   FSDP2 the output projection runs where its weight is gathered.

:func:`sdpo_channel_loss` does the three for a recipe whose only student forward is the SDPO one;
:func:`logprobs_with_sdpo` returns the GRPO log-probs and entropy (exactly
:func:`~composer_tune.rollout.rollouts.sequence_logprobs`'s) AND the SDPO loss from ONE student
forward, for recipes that train both channels. With ``weight == 0`` neither builds a teacher batch
nor runs a teacher forward: the channel costs nothing and changes nothing.

Both return the loss already multiplied by ``weight``. Metrics are per micro-batch; combine a
step's with :func:`reduce_sdpo_metrics` (token-weighted, over micro-batches and ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from composer_tune.channels.sdpo.contexts import (
    TeacherBatch,
    TeacherContextConfig,
    build_teacher_batch,
    prediction_positions,
)
from composer_tune.distributed import all_reduce_sum
from composer_tune.losses.distill import DistillConfig, DistillOutput, distill_loss, teacher_topk
from composer_tune.rewards.base import RewardResult
from composer_tune.rollout.rollouts import RolloutBatch, rollout_logprobs

TEACHERS = ("current", "ema")
# Per-micro-batch metrics that are means over valid (distilled) tokens, and over rows.
_TOKEN_MEANS = (
    "sdpo/divergence",
    "sdpo/teacher_minus_student_logp",
    "sdpo/clipped_fraction",
    "sdpo/is_weight",
    "sdpo/top1_disagreement",
)
_ROW_MEANS_PREFIX = ("sdpo/teacher_fraction", "sdpo/hint_")


@dataclass
class SDPOChannelConfig:
    """The ``sdpo`` section of a recipe config (an OmegaConf structured section).

    weight: the SDPO loss is added to the policy loss times this; 0 switches the channel off
        (no teacher batch, no teacher forward).
    context: how the teacher's context (hint) is built.
    loss: the divergence (alpha, top-k, clipping; see ``DistillConfig``).
    teacher: ``"current"`` (the policy being trained, re-run with the hint under no_grad) or
        ``"ema"`` (an exponential moving average of the policy, SDPO's published choice). A plain
        ``str``, not a ``Literal``, so OmegaConf accepts the dataclass; checked on construction.
    ema_rate: the EMA teacher's rate per optimiser step (SDPO: 0.05); unused with ``current``.
    """

    weight: float = 0.0
    context: TeacherContextConfig = field(default_factory=TeacherContextConfig)
    loss: DistillConfig = field(default_factory=DistillConfig)
    teacher: str = "current"
    ema_rate: float = 0.05

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"SDPOChannelConfig.weight must be >= 0, got {self.weight}")
        if self.teacher not in TEACHERS:
            raise ValueError(
                f"SDPOChannelConfig.teacher must be one of {TEACHERS}, got {self.teacher!r}"
            )
        if not 0.0 < self.ema_rate <= 1.0:
            raise ValueError(f"SDPOChannelConfig.ema_rate must be in (0, 1], got {self.ema_rate}")

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> SDPOChannelConfig:
        """The config from a plain (resolved) mapping, e.g. a recipe's parsed ``sdpo`` section;
        unknown keys and bad values raise ValueError, naming the section and the key."""
        schema = OmegaConf.structured(cls)
        try:
            return OmegaConf.to_object(OmegaConf.merge(schema, section))
        except (OmegaConfBaseException, ValueError) as err:  # schema errors, __post_init__ checks
            raise ValueError(f"sdpo: {str(err).splitlines()[0]}") from None

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    @property
    def uses_ema_teacher(self) -> bool:
        """The channel distils from an EMA of the policy (a float32 copy the recipe builds)."""
        return self.enabled and self.teacher == "ema"


def build_sdpo_teacher_batch(
    rollouts: RolloutBatch, *, tokenizer: Any, cfg: SDPOChannelConfig
) -> TeacherBatch:
    """The teacher's sequences for every row of ``rollouts`` (hints from the rows' rewards,
    feedback, group siblings and samples), on the rollouts' device.

    Rows whose reward has no notion of success (``RolloutBatch.correct_known`` False) are
    judged by ``sdpo.context.success_threshold`` on their score, as the contexts module does.
    On agent episodes the ``feedback`` hint is the environment's text at the episode's error
    turn (the failing tool call's observation, or the reward's feedback on the final answer),
    and only the model's tokens of the turns ``sdpo.context.distill_turns`` names are
    distilled (``TeacherBatch.completion_mask``). With ``sdpo.loss.end_of_reply: exclude`` the
    end-of-reply tokens are not distilled either (nor counted in the loss's token mean).
    """
    known = (
        rollouts.correct_known.tolist()
        if rollouts.correct_known is not None
        else [True] * len(rollouts)
    )
    feedback = (
        rollouts.feedback
        if rollouts.episodes is None
        else [record.feedback for record in rollouts.episodes]
    )
    results = [
        RewardResult(score=float(score), correct=bool(correct) if is_known else None, feedback=text)
        for score, correct, is_known, text in zip(
            rollouts.rewards.tolist(), rollouts.correct.tolist(), known, feedback, strict=True
        )
    ]
    prompt_lengths = rollouts.prompt_lengths.tolist()
    completion_lengths = rollouts.completion_lengths.tolist()
    completions = [
        rollouts.tokens[row, start : start + length].tolist()
        for row, (start, length) in enumerate(zip(prompt_lengths, completion_lengths, strict=True))
    ]
    batch = build_teacher_batch(
        tokenizer,
        cfg.context,
        samples=rollouts.samples,
        completions=completions,
        results=results,
        texts=rollouts.texts,
        group_ids=rollouts.group_ids.tolist(),
        device=rollouts.tokens.device,
    )
    if rollouts.episodes is not None:
        batch = _distil_episode_turns(batch, rollouts, cfg.context.distill_turns)
    if cfg.loss.end_of_reply == "exclude":
        batch = _without_end_of_reply(batch, tokenizer.eos_id)
    return batch


def _without_end_of_reply(batch: TeacherBatch, end_of_reply_token: int) -> TeacherBatch:
    """``batch`` with the completion positions that hold ``end_of_reply_token`` undistilled."""
    # Masked entries point at column 1, which a batch without any teacher may lack.
    columns = (batch.prediction_positions + 1).clamp(max=batch.tokens.shape[1] - 1)
    completion_tokens = batch.tokens.gather(1, columns)
    return dataclasses.replace(
        batch, completion_mask=batch.completion_mask & (completion_tokens != end_of_reply_token)
    )


def _distil_episode_turns(
    batch: TeacherBatch, rollouts: RolloutBatch, distill_turns: str
) -> TeacherBatch:
    """``batch`` with its completion mask cut to the turns ``distill_turns`` names (each turn
    span holds exactly the model's tokens), and each teacher row's kind of error turn."""
    selected = torch.zeros_like(batch.completion_mask)
    for row, (record, prompt_length) in enumerate(
        zip(rollouts.episodes, rollouts.prompt_lengths.tolist(), strict=True)
    ):
        spans = record.turn_spans
        if distill_turns == "error_turn":
            spans = spans[record.error_turn : record.error_turn + 1]
        elif distill_turns == "from_error_turn":
            spans = spans[record.error_turn :]
        for start, end in spans:
            selected[row, start - prompt_length : end - prompt_length] = True
    error_turns = [
        ("tool_error" if record.tool_errors else "final_answer") if has_teacher else None
        for record, has_teacher in zip(rollouts.episodes, batch.has_teacher.tolist(), strict=True)
    ]
    return dataclasses.replace(
        batch, completion_mask=batch.completion_mask & selected, error_turns=error_turns
    )


def select_teacher_rows(batch: TeacherBatch, rows: slice) -> TeacherBatch:
    """Rows ``rows`` of ``batch`` (e.g. one micro-batch of a generation batch's teacher batch),
    with trailing all-padding token columns dropped."""
    lengths = batch.prompt_lengths[rows] + batch.completion_lengths[rows]
    width = max(int(lengths.max()) if lengths.numel() else 0, 1)
    return TeacherBatch(
        tokens=batch.tokens[rows, :width],
        padding_mask=batch.padding_mask[rows, :width],
        prompt_lengths=batch.prompt_lengths[rows],
        completion_lengths=batch.completion_lengths[rows],
        prediction_positions=batch.prediction_positions[rows],
        completion_mask=batch.completion_mask[rows],
        has_teacher=batch.has_teacher[rows],
        hint_sources=batch.hint_sources[rows],
        no_teacher_reasons=batch.no_teacher_reasons[rows],
        error_turns=batch.error_turns[rows] if batch.error_turns is not None else None,
    )


@dataclass
class _Alignment:
    """Where the student's completion tokens are predicted, in both sequences (``[B, C]``)."""

    student_positions: Tensor  # into the student's hidden states over tokens[:, :-1]
    teacher_positions: Tensor
    targets: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor | None  # only for importance-ratio clipping


def _align(
    rollouts: RolloutBatch, teacher_batch: TeacherBatch, *, need_old_logprobs: bool
) -> _Alignment:
    """Student and teacher positions of each completion token, cut to the micro-batch's width."""
    if len(teacher_batch.has_teacher) != len(rollouts):
        raise ValueError(
            f"teacher_batch has {len(teacher_batch.has_teacher)} rows, rollouts {len(rollouts)}"
        )
    width = max(int(rollouts.completion_lengths.max()), 1)
    if teacher_batch.prediction_positions.shape[1] < width:
        raise ValueError(
            f"teacher_batch covers completions of {teacher_batch.prediction_positions.shape[1]} "
            f"tokens, the rollouts have up to {width}: build it from these rollouts"
        )
    positions, mask = prediction_positions(
        rollouts.prompt_lengths, rollouts.completion_lengths, width=width
    )
    # Column p + 1 of the rollout (target) frame holds the token predicted at position p.
    targets = torch.where(mask, rollouts.tokens.gather(1, positions + 1), 0)
    old_logprobs = None
    if need_old_logprobs:
        if rollouts.old_logp is None:
            raise ValueError(
                "sdpo.loss.is_clip needs the sampling policy's log-probs: collect the rollouts "
                "with compute_old_logp=True"
            )
        old_logprobs = torch.where(mask, rollouts.old_logp.gather(1, positions + 1), 0.0)
    return _Alignment(
        student_positions=positions,
        teacher_positions=teacher_batch.prediction_positions[:, :width],
        targets=targets,
        # The teacher batch says which tokens are distilled (on episodes: the model's own).
        completion_mask=mask & teacher_batch.completion_mask[:, :width],
        old_logprobs=old_logprobs,
    )


@torch.no_grad()
def _teacher_view(
    teacher_model: nn.Module,
    teacher_batch: TeacherBatch,
    alignment: _Alignment,
    cfg: SDPOChannelConfig,
    *,
    own_projection: bool,
    end_of_reply_token: int | None,
) -> tuple[Any, Any]:
    """Run the teacher; returns ``(hidden states or TeacherTopK, its output module or None)``.

    The current policy hands over hidden states (the student's head projects them with the same
    weights). An EMA teacher hands over its top-k side computed in its own ``head_fn`` when the
    config allows it (the only option under FSDP2, where its projection runs only inside its
    forward), else its hidden states and output module (unsharded models only).
    """
    tokens = teacher_batch.tokens
    if not own_projection:
        return teacher_model(tokens, head_fn=lambda hidden, _output: hidden), None
    if cfg.loss.top_k is not None and cfg.loss.top_k_support == "teacher":
        valid = alignment.completion_mask & teacher_batch.has_teacher[:, None]
        return (
            teacher_model(
                tokens,
                head_fn=lambda hidden, output: teacher_topk(
                    hidden,
                    output,
                    positions=alignment.teacher_positions,
                    targets=alignment.targets,
                    valid=valid,
                    config=cfg.loss,
                    end_of_reply_token=end_of_reply_token,
                ),
            ),
            None,
        )
    if any(isinstance(parameter, DTensor) for parameter in teacher_model.parameters()):
        raise ValueError(
            "an EMA teacher sharded with FSDP2 needs sdpo.loss.top_k set and "
            "sdpo.loss.top_k_support=teacher (its projection can only run in its own forward)"
        )
    return teacher_model(tokens, head_fn=lambda hidden, output: (hidden, output))


def _distill_head(
    teacher_view: tuple[Any, Any],
    teacher_batch: TeacherBatch,
    alignment: _Alignment,
    cfg: SDPOChannelConfig,
    normalizer: float | Tensor | None,
    end_of_reply_token: int | None,
) -> Callable[[Tensor, Any], DistillOutput]:
    """The student's ``head_fn`` computing the distillation loss from its hidden states."""
    teacher, teacher_output = teacher_view

    def head(hidden: Tensor, output: Any) -> DistillOutput:
        return distill_loss(
            hidden,
            teacher,
            output,
            student_positions=alignment.student_positions,
            teacher_positions=alignment.teacher_positions,
            targets=alignment.targets,
            completion_mask=alignment.completion_mask,
            has_teacher=teacher_batch.has_teacher,
            config=cfg.loss,
            old_logprobs=alignment.old_logprobs,
            teacher_output_module=teacher_output,
            normalizer=normalizer,
            end_of_reply_token=end_of_reply_token,
        )

    return head


def _prepare(
    model: nn.Module,
    rollouts: RolloutBatch,
    tokenizer: Any,
    cfg: SDPOChannelConfig,
    teacher_model: nn.Module | None,
    normalizer: float | Tensor | None,
    teacher_batch: TeacherBatch | None,
) -> tuple[Callable[[Tensor, Any], DistillOutput], TeacherBatch]:
    """Teacher batch and teacher forward; returns the student's distillation head."""
    if cfg.teacher == "ema" and teacher_model is None:
        raise ValueError("sdpo.teacher=ema needs teacher_model (the EMATeacher's module)")
    if cfg.teacher == "current" and teacher_model is not None and teacher_model is not model:
        raise ValueError("sdpo.teacher=current uses the policy itself; pass no teacher_model")
    if teacher_batch is None:
        teacher_batch = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
    alignment = _align(rollouts, teacher_batch, need_old_logprobs=cfg.loss.is_clip is not None)
    # Only the end_of_reply="exclude" setting reads the token.
    end_of_reply_token = tokenizer.eos_id if cfg.loss.end_of_reply == "exclude" else None
    view = _teacher_view(
        teacher_model if cfg.teacher == "ema" else model,
        teacher_batch,
        alignment,
        cfg,
        own_projection=cfg.teacher == "ema",
        end_of_reply_token=end_of_reply_token,
    )
    head = _distill_head(view, teacher_batch, alignment, cfg, normalizer, end_of_reply_token)
    return head, teacher_batch


def _metrics(result: DistillOutput, teacher_batch: TeacherBatch) -> dict[str, float]:
    """The micro-batch's SDPO metrics (see :func:`reduce_sdpo_metrics`)."""
    metrics = {
        name.replace("distill/", "sdpo/"): value
        for name, value in result.metrics.items()
        if name != "distill/teacher_fraction"  # the same as the teacher batch's
    }
    metrics.update(teacher_batch.metrics())
    metrics["sdpo/rows"] = float(len(teacher_batch.has_teacher))
    return metrics


def sdpo_channel_loss(
    model: nn.Module,
    rollouts: RolloutBatch,
    *,
    tokenizer: Any,
    cfg: SDPOChannelConfig,
    teacher_model: nn.Module | None = None,
    normalizer: float | Tensor | None = None,
    teacher_batch: TeacherBatch | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``cfg.weight`` times the SDPO loss of one micro-batch, and its metrics.

    Args:
        model: the policy (student); with ``teacher="current"`` also the teacher.
        rollouts: the micro-batch (samples, completions, rewards and feedback, group ids).
        tokenizer: the policy's tokenizer (renders the teacher's prompts; must not truncate).
        cfg: the channel's settings.
        teacher_model: the EMA teacher's module with ``teacher="ema"``; None otherwise.
        normalizer: the distillation loss's denominator (``distill_loss``): for a token mean over
            a whole optimiser step, the distilled tokens of every micro-batch on every rank
            divided by the number of ranks. None: this micro-batch's own token count.
        teacher_batch: these rows' teacher batch, built beforehand over the whole generation
            batch (siblings) and cut with :func:`select_teacher_rows`; None builds it from
            ``rollouts`` alone.

    Returns:
        ``(weight * loss, metrics)``; with ``weight == 0`` a zero tensor and no metrics, without
        any forward.
    """
    if not cfg.enabled:
        return torch.zeros((), device=rollouts.tokens.device), {}
    head, teacher_batch = _prepare(
        model, rollouts, tokenizer, cfg, teacher_model, normalizer, teacher_batch
    )
    # The student reads the rollout exactly as sequence_logprobs does: tokens[:, :-1].
    result = model(rollouts.tokens[:, :-1], input_pos=rollouts.input_pos[:, :-1], head_fn=head)
    return cfg.weight * result.loss, _metrics(result, teacher_batch)


def logprobs_with_sdpo(
    model: nn.Module,
    rollouts: RolloutBatch,
    *,
    tokenizer: Any,
    cfg: SDPOChannelConfig,
    temperature: float,
    chunk_size: int,
    teacher_model: nn.Module | None = None,
    normalizer: float | Tensor | None = None,
    teacher_batch: TeacherBatch | None = None,
    shared_prefix: bool = False,
) -> tuple[Tensor, Tensor, Tensor, dict[str, float]]:
    """The policy's log-probs and entropy AND the SDPO loss from one student forward.

    ``(logp, entropy)`` are exactly ``rollout_logprobs(model, rollouts, shared_prefix=...,
    temperature=..., chunk_size=..., return_entropy=True)`` (the same forward, which also feeds
    the distillation head as its ``row_head``: with ``shared_prefix`` each group's prompt runs
    once and the head still reads the states in the plain forward's layout); the rest is as in
    :func:`sdpo_channel_loss`. Returns ``(logp, entropy, weight * loss, metrics)``. With
    ``weight == 0`` it is that plain ``rollout_logprobs`` call plus a zero loss.
    """
    logprob_args = {"temperature": temperature, "chunk_size": chunk_size, "return_entropy": True}
    if not cfg.enabled:
        logp, entropy = rollout_logprobs(
            model, rollouts, shared_prefix=shared_prefix, **logprob_args
        )
        return logp, entropy, torch.zeros((), device=rollouts.tokens.device), {}
    distill_head, teacher_batch = _prepare(
        model, rollouts, tokenizer, cfg, teacher_model, normalizer, teacher_batch
    )
    (logp, entropy), result = rollout_logprobs(
        model, rollouts, shared_prefix=shared_prefix, row_head=distill_head, **logprob_args
    )
    return logp, entropy, cfg.weight * result.loss, _metrics(result, teacher_batch)


def reduce_sdpo_metrics(
    per_micro_batch: Sequence[Mapping[str, float]], device: torch.device | str = "cpu"
) -> dict[str, float]:
    """One optimiser step's SDPO metrics over its micro-batches and every rank (collective).

    Token means are weighted by each micro-batch's distilled tokens, row means by its rows, so
    the result is the mean over every distilled token (row) of the step; a token mean over no
    distilled token is NaN. ``sdpo/valid_tokens`` becomes the step's total.
    """
    if not per_micro_batch:
        return {}
    row_names = [name for name in per_micro_batch[0] if name.startswith(_ROW_MEANS_PREFIX)]
    token_names = [name for name in _TOKEN_MEANS if name in per_micro_batch[0]]
    sums = torch.zeros(2 + len(token_names) + len(row_names), dtype=torch.float64)
    for metrics in per_micro_batch:
        tokens, rows = metrics["sdpo/valid_tokens"], metrics["sdpo/rows"]
        values = [tokens, rows]
        values += [metrics[name] * tokens if tokens else 0.0 for name in token_names]
        values += [metrics[name] * rows for name in row_names]
        sums += torch.tensor(values, dtype=torch.float64)
    tokens, rows, *rest = all_reduce_sum(sums.to(device)).cpu().tolist()
    reduced = {"sdpo/valid_tokens": tokens}
    for name, total in zip(token_names, rest[: len(token_names)], strict=True):
        reduced[name] = total / tokens if tokens else float("nan")
    for name, total in zip(row_names, rest[len(token_names) :], strict=True):
        reduced[name] = total / max(rows, 1.0)
    return reduced


def distilled_token_count(teacher_batch: TeacherBatch) -> Tensor:
    """Completion tokens of the rows with a teacher (float64 scalar)."""
    return teacher_batch.completion_mask.sum().double()


def loss_normalizer_count(teacher_batch: TeacherBatch, loss: DistillConfig) -> Tensor:
    """What ``loss.averaging`` averages over (float64 scalar): the distilled tokens, or every
    row (``row``, TRL's: rows without a teacher count). Summed over an optimiser step's
    micro-batches and ranks, the ``normalizer`` of the mean over the step."""
    if loss.averaging == "row":
        has_teacher = teacher_batch.has_teacher
        return torch.tensor(float(len(has_teacher)), dtype=torch.float64, device=has_teacher.device)
    return distilled_token_count(teacher_batch)
