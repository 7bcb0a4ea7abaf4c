"""SDPO teacher contexts: the student's own completion, re-read in a prompt that carries a hint.

Channel 2 of the Composer recipe (SDPO, arXiv 2601.20802; OPSD, arXiv 2601.18734). The teacher is
the policy itself (or an EMA copy of it) given the same chat prompt plus a hint; it re-scores the
SAME completion tokens the student sampled, and :func:`composer_tune.losses.distill.distill_loss`
pulls the student toward it. This module builds the teacher's token sequences:

    teacher tokens = chat_template(prompt with the hint inserted, generation prompt)
                     + the student's completion ids, verbatim

The completion is appended as ids and never re-tokenised from text, so the teacher scores exactly
the tokens the student produced: ``tokens[b, prediction_positions[b, j] + 1]`` is completion
token ``j`` of row ``b``.

Hint sources (``TeacherContextConfig.sources``, tried in order):

* ``feedback``: the verifier's message (``RewardResult.feedback``) on this attempt;
* ``sibling``: a successful completion of the same prompt from the rollout group -- the first
  successful sibling in batch order other than the row itself (SDPO's "successful rollouts as
  implicit feedback"; a success never gets its own completion as the hint);
* ``reference``: the dataset's ``solution`` field (GSM8K's rationale, the synthetic task's
  column working; OPSD's privileged solution).

``combine="first"`` uses the first available source (with ``["sibling", "feedback"]`` that is
SDPO's default: feedback only when no sibling succeeded); ``"all"`` joins every available one.
Each source's text goes through its template, then the hint is placed in the last user message
(``placement="user"``) or the system prompt (``placement="system"``).

Thinking: ``strip_thinking`` is passed to the chat template (Qwen3 drops the reasoning of
assistant turns before the last user query) and must match how the student's prompt was
rendered, otherwise the teacher's context differs from the student's by more than the hint.
``strip_thinking_from_hint`` removes ``<think>...</think>`` from a sibling's completion before
it becomes a hint (SDPO's ``remove_thinking_from_demonstration``).

HAZARD on agent traces, where each step is often nothing but reasoning and a tool call:

* stripping earlier turns leaves those steps as bare tool calls, and a sibling step stripped of
  its reasoning (or cut off inside it, with no ``</think>``) leaves an empty demonstration --
  such siblings are passed over, so the row may end with no hint and, with
  ``skip_if_no_hint``, no teacher. There is nothing left to distil; on agent traces prefer
  ``strip_thinking: false`` for the student's and the teacher's prompts alike, and watch the
  ``sdpo/hint_*`` coverage metrics;
* the hint goes into the last *real* user query, never into a user turn that only wraps a tool
  response (``<tool_response>...</tool_response>``): turning a tool response into the "last
  query" would make Qwen3's template strip the reasoning of every agent step before it.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from composer_tune.data.qwen3_chat_template import (
    THINK_END,
    THINK_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.rewards.base import RewardResult

HINT_SOURCES = ("feedback", "sibling", "reference")
COMBINE_MODES = ("first", "all")
PLACEMENTS = ("user", "system")
APPLY_TO = ("failed", "all")
DISTILL_TURNS = ("all", "error_turn", "from_error_turn")

# The named fields each template may use; the first one of each entry is required.
TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "feedback_template": ("feedback",),
    "sibling_template": ("sibling",),
    "reference_template": ("solution",),
    "user_template": ("hint", "content"),
    "system_template": ("hint", "content"),
}


@dataclass
class TeacherContextConfig:
    """How the teacher's context is built (a YAML section of the SDPO recipe).

    Fields are plain ``str``/``list``/``bool`` so the dataclass can serve as an OmegaConf
    structured-config section; :meth:`validate` (run on construction) checks the choices and
    templates.

    sources: hint sources in priority order, from ``feedback``, ``sibling``, ``reference``.
    combine: ``first`` available source, or ``all`` available ones joined by a blank line.
    feedback_template / sibling_template / reference_template: ``str.format`` templates of each
        source's hint, with the field ``{feedback}``, ``{sibling}`` or ``{solution}``.
    placement: ``user`` (the hint goes into the last user query through ``user_template``) or
        ``system`` (into the system prompt through ``system_template``; a system message is
        inserted first when the prompt has none, and the result is then stripped).
    user_template / system_template: fields ``{content}`` (the message's original text) and
        ``{hint}``.
    apply_to: ``failed`` (only unsuccessful rows get a teacher) or ``all`` (SDPO distils
        successes too, toward another success).
    success_threshold: a row succeeded when ``RewardResult.correct`` is True; where ``correct``
        is None, when ``score >= success_threshold``.
    skip_if_no_hint: a row with no available hint gets no teacher (masked out of the loss);
        False gives it the unmodified prompt as the teacher context instead.
    strip_thinking: passed to the chat template (see the module docstring).
    strip_thinking_from_hint: drop reasoning from sibling completions used as hints.
    enable_thinking: passed to the chat template; must match the student's generation prompt.
    max_teacher_tokens: rows whose teacher sequence (prompt + completion) would be longer get
        no teacher; None = no limit.
    distill_turns: on agent episodes, which of the model's turns are distilled: ``all``,
        ``error_turn`` (the turn where the episode went wrong: its first failing tool call,
        else its final answer; ``EpisodeRecord.error_turn``) or ``from_error_turn`` (that
        turn and every later one). The teacher reads the hinted prompt and the episode
        verbatim up to those turns; tool output is never distilled. Single-turn rows have one
        turn, distilled in every setting.
    """

    sources: list[str] = field(default_factory=lambda: ["sibling", "feedback"])
    combine: str = "first"
    feedback_template: str = (
        "The following is feedback from your unsuccessful earlier attempt:\n\n{feedback}"
    )
    sibling_template: str = "Correct solution:\n\n{sibling}"
    reference_template: str = "Correct solution:\n\n{solution}"
    placement: str = "user"
    user_template: str = "{content}\n\n{hint}\n\nCorrectly solve the original question."
    system_template: str = "{content}\n\n{hint}"
    apply_to: str = "all"
    success_threshold: float = 0.5
    skip_if_no_hint: bool = True
    strip_thinking: bool = True
    strip_thinking_from_hint: bool = True
    enable_thinking: bool = True
    max_teacher_tokens: int | None = None
    distill_turns: str = "all"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field at fault (unknown choice, bad template)."""
        if not self.sources:
            raise ValueError("TeacherContextConfig.sources must list at least one hint source")
        for source in self.sources:
            if source not in HINT_SOURCES:
                raise ValueError(
                    f"TeacherContextConfig.sources: unknown hint source {source!r}; "
                    f"choose from {HINT_SOURCES}"
                )
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"TeacherContextConfig.sources lists a source twice: {self.sources}")
        for name, choices in (
            ("combine", COMBINE_MODES),
            ("placement", PLACEMENTS),
            ("apply_to", APPLY_TO),
            ("distill_turns", DISTILL_TURNS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"TeacherContextConfig.{name} must be one of {choices}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.max_teacher_tokens is not None and self.max_teacher_tokens < 1:
            raise ValueError(
                f"TeacherContextConfig.max_teacher_tokens must be >= 1 or None, "
                f"got {self.max_teacher_tokens}"
            )
        for name, fields in TEMPLATE_FIELDS.items():
            _check_template(name, getattr(self, name), fields)


def _check_template(name: str, template: str, fields: tuple[str, ...]) -> None:
    """A template may use only ``fields`` (by name) and must use the first of them."""
    where = f"TeacherContextConfig.{name}"
    try:
        used = [parsed[1] for parsed in string.Formatter().parse(template) if parsed[1] is not None]
    except ValueError as err:
        raise ValueError(f"{where} is not a valid str.format template: {err}") from err
    for field_name in used:
        # "{feedback.x}" / "{feedback[0]}" name the field "feedback".
        root = field_name.split(".", 1)[0].split("[", 1)[0]
        if root not in fields:
            shown = "{" + field_name + "}" if field_name else "{}"
            raise ValueError(
                f"{where} uses the field {shown}, which does not exist; "
                f"available fields: {', '.join('{' + f + '}' for f in fields)}"
            )
    if fields[0] not in used:
        raise ValueError(f"{where} must contain the field {{{fields[0]}}}: {template!r}")


@dataclass
class TeacherBatch:
    """Teacher sequences for one batch of student rollouts, row ``b`` for student row ``b``.

    tokens: ``long[B, T]``, teacher prompt + the student's completion ids, right-padded with
        ``pad_id`` (rows without a teacher are all padding). Right padding keeps the model's
        default causal mask and ``input_pos = arange(T)`` valid, as in ``PackedBatch``.
    padding_mask: ``bool[B, T]``, True on real tokens.
    prompt_lengths / completion_lengths: ``long[B]`` (0 for rows without a teacher).
    prediction_positions: ``long[B, C]`` (``C`` = the longest completion): the teacher's logits
        at ``prediction_positions[b, j]`` predict completion token ``j``, i.e.
        ``tokens[b, prediction_positions[b, j] + 1] == completions[b][j]``. 0 where
        ``completion_mask`` is False.
    completion_mask: ``bool[B, C]``, True on the completion tokens distilled: every one of a
        row with a teacher (on agent episodes, the model's tokens of the distilled turns).
    has_teacher: ``bool[B]``.
    hint_sources: per row, the sources its hint came from ('' for an unmodified prompt with
        ``skip_if_no_hint=False``), or None for rows without a teacher.
    no_teacher_reasons: per row, why it has no teacher (``succeeded``, ``no_hint``,
        ``too_long``), or None.
    error_turns: agent episodes only: per row with a teacher, what its distilled error turn
        is (``tool_error``: a failing tool call; ``final_answer``), else None; None for
        single-turn rollouts.
    """

    tokens: Tensor
    padding_mask: Tensor
    prompt_lengths: Tensor
    completion_lengths: Tensor
    prediction_positions: Tensor
    completion_mask: Tensor
    has_teacher: Tensor
    hint_sources: list[str | None]
    no_teacher_reasons: list[str | None]
    error_turns: list[str | None] | None = None

    def metrics(self) -> dict[str, float]:
        """Share of rows with a teacher, per hint source and, on agent episodes, per kind of
        error turn (``sdpo/error_turn_tool_fraction``: a failing tool call), for logging."""
        rows = max(len(self.hint_sources), 1)
        metrics = {"sdpo/teacher_fraction": float(self.has_teacher.double().sum()) / rows}
        for source in HINT_SOURCES:
            used = sum(1 for names in self.hint_sources if names and source in names.split("+"))
            metrics[f"sdpo/hint_{source}_fraction"] = used / rows
        if self.error_turns is not None:
            for kind, name in (("tool_error", "tool"), ("final_answer", "answer")):
                used = sum(1 for turn in self.error_turns if turn == kind)
                metrics[f"sdpo/error_turn_{name}_fraction"] = used / rows
        return metrics


def succeeded(result: RewardResult, success_threshold: float) -> bool:
    """``result.correct`` when the reward defines it, else ``score >= success_threshold``."""
    if result.correct is not None:
        return bool(result.correct)
    return result.score >= success_threshold


def strip_reasoning(text: str) -> str:
    """``text`` without its ``<think>`` block: the part after the last ``</think>``; a reasoning
    block that never closed (a cut-off completion) is dropped with everything after it."""
    if THINK_END in text:
        return text.split(THINK_END)[-1].strip()
    if THINK_START in text:
        return text.split(THINK_START)[0].strip()
    return text.strip()


def build_hints(
    config: TeacherContextConfig,
    samples: Sequence[Mapping[str, Any]],
    results: Sequence[RewardResult],
    texts: Sequence[str],
    group_ids: Sequence[Any],
) -> list[tuple[str, str] | None]:
    """Per row, ``(hint text, "+"-joined source names)``, or None when no source is available.

    Rows that ``apply_to`` excludes also get None; :func:`build_teacher_batch` tells them apart.
    """
    success = [succeeded(result, config.success_threshold) for result in results]
    hints: list[tuple[str, str] | None] = []
    for row in range(len(samples)):
        found: list[tuple[str, str]] = []
        for source in config.sources:
            text = _source_text(source, row, config, samples, results, texts, group_ids, success)
            if text:
                found.append((source, text))
                if config.combine == "first":
                    break
        if not found:
            hints.append(None)
            continue
        hint = "\n\n".join(text for _, text in found)
        hints.append((hint, "+".join(source for source, _ in found)))
    return hints


def _source_text(
    source: str,
    row: int,
    config: TeacherContextConfig,
    samples: Sequence[Mapping[str, Any]],
    results: Sequence[RewardResult],
    texts: Sequence[str],
    group_ids: Sequence[Any],
    success: Sequence[bool],
) -> str | None:
    """One source's templated hint for ``row``, or None when that source has nothing."""
    if source == "feedback":
        feedback = results[row].feedback.strip()
        return config.feedback_template.format(feedback=feedback) if feedback else None
    if source == "sibling":
        for other in range(len(samples)):
            if other == row or group_ids[other] != group_ids[row] or not success[other]:
                continue
            demonstration = texts[other]
            demonstration = (
                strip_reasoning(demonstration)
                if config.strip_thinking_from_hint
                else demonstration.strip()
            )
            if demonstration:
                return config.sibling_template.format(sibling=demonstration)
        return None
    solution = samples[row].get("solution")
    if solution is not None and not isinstance(solution, str):
        raise TypeError(
            f"sample {_sample_name(samples[row], row)}: 'solution' must be a string, "
            f"got {type(solution).__name__}"
        )
    return config.reference_template.format(solution=solution.strip()) if solution else None


def insert_hint(
    messages: Sequence[Mapping[str, Any]], hint: str, config: TeacherContextConfig
) -> list[dict[str, Any]]:
    """A copy of ``messages`` with ``hint`` placed as ``config.placement`` says: in the last
    user query (not a wrapped tool response) or the system prompt."""
    messages = [dict(message) for message in messages]
    if config.placement == "system":
        if messages and messages[0].get("role") == "system":
            content = messages[0].get("content") or ""
            messages[0]["content"] = config.system_template.format(content=content, hint=hint)
        else:
            text = config.system_template.format(content="", hint=hint).strip()
            messages.insert(0, {"role": "system", "content": text})
        return messages
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") != "user":
            continue
        content = messages[index].get("content") or ""
        if not isinstance(content, str):
            raise TypeError(
                f"messages[{index}] (the last user message) has non-text content "
                f"{type(content).__name__}; the hint cannot be appended to it"
            )
        if content.startswith(TOOL_RESPONSE_START) and content.endswith(TOOL_RESPONSE_END):
            continue  # a wrapped tool result, not a query (see the module docstring)
        messages[index]["content"] = config.user_template.format(content=content, hint=hint)
        return messages
    raise ValueError("the prompt has no user query to append the hint to (placement='user')")


def build_teacher_batch(
    tokenizer: ChatTokenizer,
    config: TeacherContextConfig,
    *,
    samples: Sequence[Mapping[str, Any]],
    completions: Sequence[Sequence[int]],
    results: Sequence[RewardResult],
    texts: Sequence[str],
    group_ids: Sequence[Any],
    pad_id: int | None = None,
    device: torch.device | str | None = None,
) -> TeacherBatch:
    """Teacher sequences for a batch of student rollouts (row ``b`` of every argument is one).

    Args:
        tokenizer: the policy's tokenizer; must not truncate (``max_seq_len`` None or long
            enough), since a cut prompt would break the alignment.
        config: how hints are chosen, worded and placed.
        samples: the dataset samples: ``prompt`` (chat messages), optional ``tools``,
            ``solution`` (for the ``reference`` source) and ``id`` (named in errors).
        completions: the student's completion token ids, exactly as sampled.
        results: each completion's :class:`RewardResult` (success and verifier feedback).
        texts: each completion's decoded text (sibling hints are made from it).
        group_ids: rows with equal ids are completions of one prompt (siblings).
        pad_id: padding id; default ``tokenizer.pad_id``.
        device: where the tensors go.
    """
    batch = len(samples)
    for name, values in (
        ("completions", completions),
        ("results", results),
        ("texts", texts),
        ("group_ids", group_ids),
    ):
        if len(values) != batch:
            raise ValueError(
                f"build_teacher_batch: {name} has {len(values)} entries, samples has {batch}"
            )
    pad_id = tokenizer.pad_id if pad_id is None else pad_id
    hints = build_hints(config, samples, results, texts, group_ids)

    sequences: list[list[int]] = []
    prompt_lengths: list[int] = []
    hint_sources: list[str | None] = []
    reasons: list[str | None] = []
    for row, sample in enumerate(samples):
        completion = _completion_ids(completions[row], row)
        reason = None
        if config.apply_to == "failed" and succeeded(results[row], config.success_threshold):
            reason = "succeeded"
        elif hints[row] is None and config.skip_if_no_hint:
            reason = "no_hint"
        prompt: list[int] = []
        if reason is None:
            prompt = _teacher_prompt(tokenizer, config, sample, row, hints[row])
            if (
                config.max_teacher_tokens is not None
                and len(prompt) + len(completion) > config.max_teacher_tokens
            ):
                reason, prompt = "too_long", []
        reasons.append(reason)
        hint_sources.append(None if reason else (hints[row][1] if hints[row] else ""))
        prompt_lengths.append(len(prompt))
        sequences.append(prompt + completion if reason is None else [])

    has_teacher = [reason is None for reason in reasons]
    completion_lengths = torch.tensor(
        [len(completions[row]) if has_teacher[row] else 0 for row in range(batch)],
        dtype=torch.long,
    )
    prompt_lengths_tensor = torch.tensor(prompt_lengths, dtype=torch.long)
    # The same width as the student's positions for these completions, teacher or not.
    completion_width = max((len(completion) for completion in completions), default=1)
    positions, completion_mask = prediction_positions(
        prompt_lengths_tensor, completion_lengths, width=completion_width
    )
    width = max([1, *map(len, sequences)])
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    padding_mask = torch.arange(width) < (prompt_lengths_tensor + completion_lengths)[:, None]
    return TeacherBatch(
        tokens=tokens.to(device),
        padding_mask=padding_mask.to(device),
        prompt_lengths=prompt_lengths_tensor.to(device),
        completion_lengths=completion_lengths.to(device),
        prediction_positions=positions.to(device),
        completion_mask=completion_mask.to(device),
        has_teacher=torch.tensor(has_teacher, dtype=torch.bool, device=device),
        hint_sources=hint_sources,
        no_teacher_reasons=reasons,
    )


def prediction_positions(
    prompt_lengths: Tensor, completion_lengths: Tensor, *, width: int | None = None
) -> tuple[Tensor, Tensor]:
    """Where each completion token is predicted in right-padded ``prompt + completion`` rows.

    Token ``j`` of row ``b``'s completion sits at column ``prompt_lengths[b] + j`` and is
    predicted by the logits (hidden state) one column earlier. Works for the teacher's rows and,
    with ``PackedBatch.prompt_lengths`` / ``completion_lengths``, for the student's.

    Returns:
        ``(positions long[B, C], mask bool[B, C])`` with ``C = width`` or, by default,
        ``max(completion_lengths)`` (at least 1); ``positions`` is 0 where ``mask`` is False.
        Rows with a zero completion length are all masked.
    """
    if prompt_lengths.shape != completion_lengths.shape or prompt_lengths.dim() != 1:
        raise ValueError(
            f"prediction_positions: prompt_lengths {tuple(prompt_lengths.shape)} and "
            f"completion_lengths {tuple(completion_lengths.shape)} must be equal [B] shapes"
        )
    if bool(((prompt_lengths < 1) & (completion_lengths > 0)).any()):
        raise ValueError("prediction_positions: a row with a completion needs a non-empty prompt")
    longest = int(completion_lengths.max()) if completion_lengths.numel() else 0
    if width is None:
        width = max(longest, 1)
    elif width < longest:
        raise ValueError(f"prediction_positions: width={width} < longest completion {longest}")
    columns = torch.arange(width, device=prompt_lengths.device)
    mask = columns < completion_lengths[:, None]
    positions = torch.where(mask, prompt_lengths[:, None] + columns - 1, 0)
    return positions, mask


def _teacher_prompt(
    tokenizer: ChatTokenizer,
    config: TeacherContextConfig,
    sample: Mapping[str, Any],
    row: int,
    hint: tuple[str, str] | None,
) -> list[int]:
    """Token ids of the chat prompt with the hint inserted, ending in the generation prompt."""
    if "prompt" not in sample:
        raise KeyError(
            f"sample {_sample_name(sample, row)} has no 'prompt' (keys: {sorted(sample)})"
        )
    messages = sample["prompt"]
    try:
        if hint is not None:
            messages = insert_hint(messages, hint[0], config)
        ids, _ = tokenizer.tokenize_messages(
            messages,
            tools=sample.get("tools"),
            add_generation_prompt=True,
            strip_thinking=config.strip_thinking,
            enable_thinking=config.enable_thinking,
        )
    except (ValueError, TypeError) as err:
        raise type(err)(f"sample {_sample_name(sample, row)}: {err}") from err
    if tokenizer.max_seq_len is not None and len(ids) >= tokenizer.max_seq_len:
        raise ValueError(
            f"sample {_sample_name(sample, row)}: the teacher prompt reaches the tokenizer's "
            f"max_seq_len={tokenizer.max_seq_len} and may have been cut; use a tokenizer without "
            "max_seq_len and TeacherContextConfig.max_teacher_tokens instead"
        )
    return ids


def _completion_ids(completion: Sequence[int], row: int) -> list[int]:
    """The completion as a list of ints; a row must have at least one token."""
    ids = completion.tolist() if isinstance(completion, Tensor) else list(completion)
    if not ids:
        raise ValueError(f"build_teacher_batch: completions[{row}] is empty")
    return ids


def _sample_name(sample: Mapping[str, Any], row: int) -> str:
    """How errors name a sample: its ``id`` if it has one, else its row."""
    return repr(sample["id"]) if "id" in sample else f"at row {row}"
