"""Shared-prefix log-prob forward for group rollouts: each group's prompt runs once.

The rows of a GRPO group share their prompt (``RolloutBatch``: rows ``g*G .. g*G + G - 1``),
yet the plain forward (:func:`~composer_tune.rollout.rollouts.sequence_logprobs`) runs the
prompt once per row. Here, as in PrefixGrouper (arXiv 2506.05433), the rows of a group are
packed into one sequence ``[prompt, c1, c2, ...]`` whose completions attend to the prompt and
causally to themselves (a boolean ``[b, s, s]`` mask through the decoder's ``mask=``), with
position ids restarting after the prompt for every completion. The hidden state of the
prompt's last token predicts every completion's first token; a completion's tokens after its
last target predict nothing scored and are left out. Targets may skip tokens (an agent
episode's tool output), which are then context only. The log-prob head runs on the targets
only, not on the prompt and padding positions the plain forward also projects onto the
vocabulary.

A packed row's attention is dense in its length ``s``: SDPA skips the upper triangle of a
causal row but no masked block of an arbitrary mask, while the tokens packing saves grow with
the prompt, so long completions of a short prompt gain little. A group may therefore be split
over several packed rows (each with its own copy of the prompt); the number of completions per
row is chosen per call from the model's shape (:func:`choose_completions_per_row`), one
completion per row being the plain causal forward (no mask), still with the head on the
targets only. Rows never exceed the model's ``max_seq_len``. The mask costs ``R * S * S``
bytes (SDPA adds a float copy): 0.4 MB for SmolLM2's GRPO config (8 rows of ~230 tokens).
torchtune sends a flex-attention ``BlockMask`` (which would skip masked blocks) only on CUDA, to
a compiled kernel, so the CPU path is the boolean mask.

The result is the ``[N, T]`` target frame of ``sequence_logprobs``: the same log-probs (and
entropies) on ``completion_mask`` up to float rounding, and 0 elsewhere. ``sequence_logprobs``
leaves the head's entropy at prompt and padding positions; here it is 0 there (every consumer
masks the entropy with ``completion_mask``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from composer_tune.losses.logprobs import LogprobResult, OutputModule, token_logprobs

# Attention costs more per multiply-add than the projections' and MLP's GEMMs: measured 1.2-1.5x
# under a dense mask (SmolLM2's layer shape, 256-2048 tokens, fp32, 1 CPU thread, forward +
# backward; a causal SDPA skips half of the pairs at about the same rate).
ATTENTION_COST_FACTOR = 1.5


@dataclass(frozen=True)
class PackedGroups:
    """Where each token of the packed batch comes from and which hidden state predicts what.

    Attributes:
        source: ``long[R, S]`` flat index into the ``[N, T]`` rows (``n * T + t``) of each
            packed token; -1 for padding.
        segment: ``long[R, S]`` 0 on the prompt, ``i >= 1`` on the row's i-th completion,
            -1 on padding.
        predictor: ``long[M]`` flat index into the packed ``[R, S]`` hidden states of the state
            that predicts each completion token.
        target: ``long[M]`` flat index into the ``[N, T]`` rows of each completion token.
        completions_per_row: the largest number of completions in one packed row (1: no mask
            is needed, the rows are plain causal sequences).
    """

    source: Tensor
    segment: Tensor
    predictor: Tensor
    target: Tensor
    completions_per_row: int

    def attention_mask(self, device: torch.device) -> Tensor | None:
        """``bool[R, S, S]`` on ``device`` (True = may attend): the prompt causally, each
        completion to the prompt and causally to itself, padding to the prompt and itself;
        None when every packed row holds one completion (plain causal attention)."""
        if self.completions_per_row == 1:
            return None
        segment = self.segment.to(device)
        positions = torch.arange(segment.shape[1], device=device)
        causal = positions[None, :, None] >= positions[None, None, :]
        query, key = segment[:, :, None], segment[:, None, :]
        return causal & ((key == 0) | (key == query))


def _group_rows(group_ids: Tensor) -> list[list[int]]:
    """Row indices of each group id, in order of first appearance."""
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(group_ids.tolist()):
        rows.setdefault(group, []).append(row)
    return list(rows.values())


def _check_groups(
    tokens: Tensor,
    input_pos: Tensor,
    completion_mask: Tensor,
    prompt_lengths: Tensor,
    groups: list[list[int]],
) -> None:
    """Raises unless no target lies in a row's prompt and the rows of each group share their
    prompt tokens and positions."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    in_prompt = completion_mask & (columns < prompt_lengths[:, None])
    if bool(in_prompt.any()):
        row = int(in_prompt.any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"shared-prefix forward: row {row}'s completion_mask marks a token of its prompt "
            f"(prompt length {int(prompt_lengths[row])})"
        )
    for rows in groups:
        first, length = rows[0], int(prompt_lengths[rows[0]])
        same = prompt_lengths[rows] == length
        for values in (tokens, input_pos):
            same &= (values[rows, :length] == values[first, :length]).all(dim=1)
        if not bool(same.all()):
            row = rows[int((~same).nonzero()[0, 0])]
            raise ValueError(
                f"shared-prefix forward: rows {first} and {row} have the same group id but "
                "not the same prompt tokens and positions; use the plain forward "
                "(sequence_logprobs) for rows whose group does not share its prompt"
            )


def _scored_ends(completion_mask: Tensor) -> list[int]:
    """Per row, one past its last target column (0 for a row without targets)."""
    columns = torch.arange(1, completion_mask.shape[1] + 1, device=completion_mask.device)
    return (completion_mask * columns).amax(dim=1).tolist()


def _completion_inputs(prompt: int, end: int) -> int:
    """Packed tokens of a completion: from its prompt's end to its last target, which predicts
    nothing scored."""
    return end - 1 - prompt


def _row_cost(length: int, packed: bool, token_cost: float, pair_cost: float) -> float:
    """Estimated multiply-adds of one row of ``length`` tokens: per-token work plus attention
    over every pair (a dense mask) or half of them (causal, no mask)."""
    pairs = length * length if packed else length * (length + 1) / 2
    return length * token_cost + pairs * pair_cost


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def choose_completions_per_row(
    prompt_lengths: list[int],
    completion_inputs: list[list[int]],
    *,
    max_seq_len: int | None,
    token_cost: float,
    pair_cost: float,
) -> int:
    """Completions per packed row with the least estimated work for the whole batch.

    Every packed row is padded to the longest, so the cost of ``k`` completions per row is
    ``rows(k) * row_cost(longest(k))``. ``k`` values whose longest row exceeds ``max_seq_len``
    are not considered; ``k = 1`` (plain rows) always fits.

    Args:
        prompt_lengths: each group's prompt length.
        completion_inputs: each group's completions' packed lengths (:func:`pack_groups`).
        max_seq_len: the model's longest input (None: unbounded).
        token_cost: estimated multiply-adds of one token outside attention.
        pair_cost: estimated multiply-adds of one attended (query, key) pair.
    """
    most = max(len(inputs) for inputs in completion_inputs)
    best, best_cost = 1, math.inf
    for per_row in range(1, most + 1):
        lengths = [
            prompt + sum(chunk)
            for prompt, inputs in zip(prompt_lengths, completion_inputs, strict=True)
            for chunk in _chunks(inputs, per_row)
        ]
        longest = max(lengths)
        if per_row > 1 and max_seq_len is not None and longest > max_seq_len:
            continue
        cost = len(lengths) * _row_cost(longest, per_row > 1, token_cost, pair_cost)
        if cost < best_cost:
            best, best_cost = per_row, cost
    return best


def decoder_costs(args: Any) -> tuple[float, float]:
    """Multiply-adds per token outside attention (projections, MLP) and per attended pair, for
    a model's ``config`` (either backend's: its ``layer_widths()``)."""
    widths = args.layer_widths()
    per_token = widths.hidden * (2 * widths.query + 2 * widths.key_value + 3 * widths.mlp)
    per_pair = 2 * widths.query * ATTENTION_COST_FACTOR
    return args.num_layers * per_token, args.num_layers * per_pair


def pack_groups(
    prompts: list[int],
    completion_mask: Tensor,
    groups: list[list[int]],
    completions_per_row: int,
) -> PackedGroups:
    """The packed layout: each group's completions in consecutive packed rows of at most
    ``completions_per_row``, each row led by the group's prompt (``prompts``: each row's
    prompt length). A row's completion is everything from its prompt's end to its last target
    (so the targets may skip tokens, e.g. an agent episode's tool output); rows without
    targets are left out."""
    width = completion_mask.shape[1]
    mask = completion_mask.cpu()
    ends = _scored_ends(mask)
    sources: list[Tensor] = []
    segments: list[Tensor] = []
    predictor_rows: list[Tensor] = []
    predictor_columns: list[Tensor] = []
    target: list[Tensor] = []
    for rows in groups:
        first, prompt = rows[0], prompts[rows[0]]
        scored = [row for row in rows if ends[row] > 0]
        for chunk in _chunks(scored, completions_per_row):
            parts = [first * width + torch.arange(prompt)]
            labels = [torch.zeros(prompt, dtype=torch.long)]
            offset = prompt  # where the next completion's inputs start in the packed row
            for segment, row in enumerate(chunk, start=1):
                inputs = _completion_inputs(prompt, ends[row])
                parts.append(row * width + prompt + torch.arange(inputs))
                labels.append(torch.full((inputs,), segment, dtype=torch.long))
                columns = mask[row].nonzero()[:, 0]
                # Column t is predicted from column t - 1: the prompt's last state for the
                # first completion token, else the completion's own input t - 1.
                predictor_columns.append(
                    torch.where(columns == prompt, prompt - 1, offset + columns - 1 - prompt)
                )
                predictor_rows.append(torch.full(columns.shape, len(sources)))
                target.append(row * width + columns)
                offset += inputs
            sources.append(torch.cat(parts))
            segments.append(torch.cat(labels))
    length = max(len(row) for row in sources)
    pad = torch.nn.utils.rnn.pad_sequence
    return PackedGroups(
        source=pad(sources, batch_first=True, padding_value=-1),
        segment=pad(segments, batch_first=True, padding_value=-1),
        predictor=torch.cat(predictor_rows) * length + torch.cat(predictor_columns),
        target=torch.cat(target),
        completions_per_row=completions_per_row,
    )


def shared_prefix_logprobs(
    model: nn.Module,
    tokens: Tensor,
    input_pos: Tensor,
    completion_mask: Tensor,
    *,
    group_ids: Tensor,
    prompt_lengths: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    completions_per_row: int | None = None,
    row_head: Callable[[Tensor, OutputModule], Any] | None = None,
) -> LogprobResult | tuple[LogprobResult, Any]:
    """:func:`~composer_tune.rollout.rollouts.sequence_logprobs` with each group's prompt run
    once (see the module doc). Grad flows when it is enabled by the caller.

    Args:
        model: a decoder accepting ``forward(tokens, mask=..., input_pos=..., head_fn=...)``
            (``mask``: bool ``[b, s, s]``, True = may attend).
        tokens, input_pos, completion_mask: ``[N, T]`` right-padded prompt + completion rows,
            as in ``sequence_logprobs``; a row's targets lie after its prompt (they may skip
            tokens, e.g. an agent episode's tool output, which then only serve as context).
        group_ids: ``long[N]`` rows with equal ids share their prompt (any order; a slice may
            hold part of a group, a group may be one row).
        prompt_lengths: ``long[N]`` prompt tokens per row.
        temperature: logits are divided by it (the sampling temperature).
        chunk_size: completion tokens per chunk of the log-prob head.
        return_entropy: also return each target's entropy, same frame.
        completions_per_row: completions per packed row (None: the cheapest estimate for the
            model's shape, :func:`choose_completions_per_row`).
        row_head: also called, in the same forward, with the hidden states laid out as
            ``sequence_logprobs``' model sees them (``[N, T - 1, D]``: column ``t - 1`` holds
            the state predicting token ``t``; zero where no target is predicted) and the
            output module, for a second head on the same states (SDPO's distillation).

    Returns:
        ``float32[N, T]`` log-probs, 0 off ``completion_mask``, or ``(logprobs, entropy)``;
        with ``row_head``, ``(that, row_head's result)``.

    Raises:
        ValueError: shapes disagree, no row has a target, a target lies in its row's prompt,
            or rows of one group differ in their prompt tokens or positions.
    """
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"shared-prefix forward: tokens must be [N, T], T >= 2: {tokens.shape}")
    rows = tokens.shape[0]
    for name, value in (("input_pos", input_pos), ("completion_mask", completion_mask)):
        if value.shape != tokens.shape:
            raise ValueError(
                f"shared-prefix forward: {name} {tuple(value.shape)} must match tokens "
                f"{tuple(tokens.shape)}"
            )
    for name, value in (("group_ids", group_ids), ("prompt_lengths", prompt_lengths)):
        if value.shape != (rows,):
            raise ValueError(f"shared-prefix forward: {name} must be [{rows}], got {value.shape}")
    if not bool(completion_mask.any()):
        raise ValueError("shared-prefix forward: no row has a completion token to score")
    groups = _group_rows(group_ids)
    _check_groups(tokens, input_pos, completion_mask, prompt_lengths, groups)
    prompts = prompt_lengths.tolist()
    if completions_per_row is None:
        completions_per_row = _cheapest_layout(model, prompts, completion_mask, groups)
    layout = pack_groups(prompts, completion_mask, groups, completions_per_row)
    device = tokens.device
    source = layout.source.to(device)
    source_at = source.clamp(min=0)  # padding reads row 0's first token; the mask hides it
    packed_tokens = tokens.reshape(-1)[source_at]
    packed_pos = torch.where(source >= 0, input_pos.reshape(-1)[source_at], 0)
    target = layout.target.to(device)
    targets = tokens.reshape(-1)[target]
    predictor = layout.predictor.to(device)
    width = tokens.shape[1]
    # A target's predicting state in sequence_logprobs' [N, T - 1] frame: column t - 1 of row n.
    row_frame_index = target // width * (width - 1) + target % width - 1
    row_output: dict[str, Any] = {}

    def head(hidden: Tensor, output_module: OutputModule) -> LogprobResult:
        # Only the states that predict a completion token reach the vocabulary projection.
        picked = hidden.reshape(-1, hidden.shape[-1])[predictor]
        if row_head is not None:
            frame = picked.new_zeros(rows * (width - 1), picked.shape[-1])
            frame = frame.index_put((row_frame_index,), picked)
            row_output["result"] = row_head(frame.view(rows, width - 1, -1), output_module)
        return token_logprobs(
            picked[None],
            output_module,
            targets[None],
            chunk_size=chunk_size,
            temperature=temperature,
            return_entropy=return_entropy,
        )

    output = model(
        packed_tokens, mask=layout.attention_mask(device), input_pos=packed_pos, head_fn=head
    )

    def unpack(values: Tensor) -> Tensor:
        frame = values.new_zeros(rows * tokens.shape[1])
        return frame.index_put((target,), values[0]).view(rows, tokens.shape[1])

    result = (unpack(output[0]), unpack(output[1])) if return_entropy else unpack(output)
    return (result, row_output["result"]) if row_head is not None else result


def _cheapest_layout(
    model: nn.Module, prompts: list[int], completion_mask: Tensor, groups: list[list[int]]
) -> int:
    """:func:`choose_completions_per_row` for ``model``'s shape (a model without a
    ``DecoderArgs`` config packs whole groups, within its ``max_seq_len``)."""
    args = getattr(model, "config", None)
    token_cost, pair_cost = decoder_costs(args) if args is not None else (1.0, 0.0)
    ends = _scored_ends(completion_mask)
    inputs = [
        [_completion_inputs(prompts[row], ends[row]) for row in rows if ends[row] > 0]
        for rows in groups
    ]
    return choose_completions_per_row(
        [prompts[rows[0]] for rows in groups],
        inputs,
        max_seq_len=getattr(model, "max_seq_len", None),
        token_cost=token_cost,
        pair_cost=pair_cost,
    )
