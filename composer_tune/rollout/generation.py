"""Batched autoregressive sampling with a KV cache: the rollout engine's generator.

``generate`` turns a batch of token-id prompts of different lengths into sampled completions
for any torchtune-style decoder (``TransformerDecoder`` or anything with the same KV-cache API:
``setup_caches``, ``caches_are_setup``, ``caches_are_enabled`` and
``forward(tokens, mask=bool[b, s, N], input_pos=long[b, s])`` returning logits ``[b, s, vocab]``).

Layout: prompts are left-padded to a common length ``P`` so that every row's next token sits in
the same column, which lets one forward per step serve the whole batch with a single shared
cache position. Padding is made invisible by (1) masking pad keys out of attention and (2)
giving each row its own position ids that start at 0 on its first real token, so a row's
result does not depend on what else is in the batch.

``pack_sequences`` then lays prompt + completion rows out right-padded for the training forward.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules import TiedLinear
from torchtune.modules.common_utils import local_kv_cache

from composer_tune.distributed import min_over_ranks
from composer_tune.rollout.step_capture import (
    CapturedSteps,
    StepCapture,
    cuda_graph_capture,
    span_bucket,
)

# Prompt tokens fed to the model per prefill forward. Bounds the prefill's activations and mask
# and, for models without a ``head_fn`` (see _last_logits), its logits: [b, chunk, vocab] float32
# instead of [b, P, vocab], ~40 GB for 32 prompts of 2k tokens with Qwen3's 152k vocabulary.
DEFAULT_PREFILL_CHUNK = 256
# Tokens per block of the two-level inverse CDF used for sampling (see _draw_categorical).
_CDF_BLOCK = 1024
# Most likely tokens ranked first when looking for the top-p nucleus (see _most_likely_first).
_NUCLEUS_HEAD = 1024
# Decode steps between the host's checks whether every row has finished, on CUDA: each check
# waits for the GPU to drain, which a loop of captured steps otherwise never does.
CUDA_SYNC_EVERY = 16


@dataclass
class GenerationOutput:
    """Result of :func:`generate`, one entry per prompt, in prompt order.

    Attributes:
        completions: sampled token ids without the prompt; a row that emitted a stop token ends
            with it, a truncated row has exactly ``max_new_tokens`` ids.
        completion_lengths: ``long[b]``, ``len(completions[i])``.
        truncated: ``bool[b]``, True for rows that hit ``max_new_tokens`` without a stop token.
        logprobs: only with ``return_logprobs``: ``float32[len(completions[i])]`` per row, the
            log-probability of each sampled token under the distribution it was sampled from
            (after temperature, top-k and top-p). Greedy decoding samples from a point mass, so
            its log-probabilities are all 0.
    """

    completions: list[list[int]]
    completion_lengths: torch.Tensor
    truncated: torch.Tensor
    logprobs: list[torch.Tensor] | None = None


@dataclass
class PackedBatch:
    """Prompt + completion rows, right-padded, ready for a (non-cached) training forward.

    Right padding keeps every real token ahead of the padding, so the model's default causal
    mask already stops real tokens from attending to pads and ``input_pos`` is plain
    ``arange(T)`` for every row.

    Attributes:
        tokens: ``long[b, T]``, ``prompt_i + completion_i`` followed by ``pad_id``.
        input_pos: ``long[b, T]``, position id of each token (``t`` in column ``t``).
        padding_mask: ``bool[b, T]``, True on real (prompt or completion) tokens.
        completion_mask: ``bool[b, T]``, True where ``tokens[i, t]`` is a completion token, i.e.
            a training *target*. The model predicts ``tokens[:, t]`` from ``logits[:, t - 1]``,
            so a per-token loss is ``loss(logits[:, :-1], tokens[:, 1:])`` weighted by
            ``completion_mask[:, 1:]``. Column 0 is always False (prompts are non-empty).
        prompt_lengths: ``long[b]``, number of prompt tokens per row.
        completion_lengths: ``long[b]``, number of completion tokens per row.
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    padding_mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_lengths: torch.Tensor


def _validate_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ``ValueError`` naming the offending sampling argument."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def _validate_prompts(prompts: list[list[int]], pad_id: int, vocab_size: int | None) -> None:
    """Raise ``ValueError`` naming the first empty prompt or out-of-vocabulary token."""
    if pad_id < 0 or (vocab_size is not None and pad_id >= vocab_size):
        # The pad id is fed to the model (prompt padding, finished rows), so it must embed.
        raise ValueError(f"pad_id {pad_id} is outside the model's vocabulary [0, {vocab_size})")
    if not prompts:
        raise ValueError("prompts is empty: need at least one prompt")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{row}] is empty: every prompt needs at least one token")
        low, high = min(prompt), max(prompt)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            raise ValueError(
                f"prompts[{row}] holds token id {bad}, outside the model's vocabulary "
                f"[0, {vocab_size})"
            )


def _left_pad(
    prompts: list[list[int]], width: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to ``width`` (at least the longest prompt's length).

    Returns:
        ``tokens`` ``long[b, width]`` and ``is_real`` ``bool[b, width]`` (False on padding).
    """
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    is_real = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        is_real[row, width - len(prompt) :] = True
    return tokens.to(device), is_real.to(device)


def _draw_categorical(
    probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of ``probs`` ``[b, n]`` (non-negative, rows sum to ~1) by inverse CDF.

    ``torch.multinomial`` spends time proportional to ``n`` generating random numbers, and a
    float64 cumulative sum over a 150k vocabulary is nearly as slow; a float32 one would blur
    the CDF by ~6e-8 per token, far more than a rare token's probability. So the CDF is taken
    in two levels: over blocks of ``_CDF_BLOCK`` tokens (float32 block sums, float64 prefix
    sums), then within the one block the target falls in. One random number per row. Nothing
    is read back to the host, so the draw can run inside a captured CUDA graph.

    Returns:
        ``long[b, 1]`` column indices (a zero-probability column is never drawn) and
        ``bool[b]``: rows whose probabilities are not finite (NaN logits); their index is
        clamped into range and meaningless.
    """
    batch, width = probs.shape
    whole = width - width % _CDF_BLOCK
    # Block sums over whole blocks, plus the (possibly empty, hence massless) ragged tail.
    block_mass = torch.cat(
        [
            probs[:, :whole].reshape(batch, whole // _CDF_BLOCK, _CDF_BLOCK).sum(dim=-1),
            probs[:, whole:].sum(dim=-1, keepdim=True),
        ],
        dim=-1,
    ).double()
    block_cdf = block_mass.cumsum(dim=-1)
    total = block_cdf[:, -1:]
    nonfinite = ~torch.isfinite(total[:, 0])
    uniform = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator)
    # Strictly below the total, so the block (and below, the token) found by searchsorted is the
    # first whose CDF exceeds the target: it has positive mass, as zero mass never raises a CDF.
    # (The clamps only matter for non-finite rows, whose search may run off the end.)
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_mass.shape[-1] - 1)
    mass = block_mass.gather(-1, block)
    # Where the target sits inside its block, as a fraction of the block's mass.
    fraction = ((target - block_cdf.gather(-1, block) + mass) / mass).clamp(min=0.0)
    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)
    in_range = columns < width
    inner = probs.gather(-1, columns.clamp(max=width - 1)) * in_range
    inner_cdf = inner.double().cumsum(dim=-1)
    inner_total = inner_cdf[:, -1:]
    inner_target = torch.minimum(
        fraction * inner_total, torch.nextafter(inner_total, torch.zeros_like(inner_total))
    )
    inner_index = torch.searchsorted(inner_cdf, inner_target, right=True)
    return (block * _CDF_BLOCK + inner_index).clamp(max=width - 1), nonfinite


def _most_likely_first(
    probs: torch.Tensor, top_p: float, host_checks: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` ``[b, n]`` sorted most likely first, far enough to hold every row's nucleus.

    The nucleus is usually a few tokens, and sorting a 150k vocabulary per step costs far more
    than the forward of a small model on a CPU; so with ``host_checks`` only the
    ``_NUCLEUS_HEAD`` most likely tokens are ranked when they hold ``top_p`` of every row's mass
    (any token beyond them then already has ``top_p`` of mass ahead of it and is outside the
    nucleus), the whole row otherwise. Without (inside a CUDA graph, where that check cannot
    be read back) the whole row is sorted: on a GPU that costs little.

    Returns:
        The sorted probabilities and their column indices.
    """
    if host_checks and probs.shape[-1] > _NUCLEUS_HEAD:
        head_probs, head_ids = torch.topk(probs, _NUCLEUS_HEAD, dim=-1)
        if bool((head_probs.sum(dim=-1) >= top_p).all()):
            return head_probs, head_ids
    return torch.sort(probs, dim=-1, descending=True)


@dataclass(frozen=True)
class _Sampling:
    """How the next token is drawn (see :func:`sample_next_token`); ``host_checks``: whether
    the sampler may read values back to the host (not inside a captured CUDA graph)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    host_checks: bool = True


def _sample(
    logits: torch.Tensor, sampling: _Sampling, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_next_token` without the host read-back: also returns ``bool[b]``, the
    rows whose logits were not finite (always False for greedy rows, which take the argmax)."""
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
        return tokens, zeros, zeros.bool()

    scaled = (
        logits.float() if sampling.temperature == 1.0 else logits.float() / sampling.temperature
    )
    candidate_ids = None  # None: candidates are the whole vocabulary, in id order
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        # Work on the k survivors only: sorting / sampling over k instead of the vocabulary.
        scaled, candidate_ids = torch.topk(scaled, sampling.top_k, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        if candidate_ids is None:
            probs, candidate_ids = _most_likely_first(probs, sampling.top_p, sampling.host_checks)
            scaled = scaled.gather(-1, candidate_ids)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # The first candidate has mass_before == 0 < top_p, so at least one token survives.
        scaled = scaled.masked_fill(mass_before >= sampling.top_p, float("-inf"))

    logprobs = torch.log_softmax(scaled, dim=-1)
    choice, nonfinite = _draw_categorical(logprobs.exp(), generator)
    chosen_logprobs = logprobs.gather(-1, choice).squeeze(-1)
    tokens = choice if candidate_ids is None else candidate_ids.gather(-1, choice)
    return tokens.squeeze(-1), chosen_logprobs, nonfinite


def _raise_nonfinite(nonfinite: torch.Tensor) -> None:
    bad_rows = nonfinite.nonzero().flatten().tolist()
    raise ValueError(f"sampling rows {bad_rows}: the logits hold NaN or infinite values")


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` ``[b, vocab]``.

    The sampling distribution is ``softmax(logits / temperature)`` restricted to the ``top_k``
    most likely tokens (exactly ``k``; ties at the k-th value are broken by ``torch.topk``),
    then to the nucleus: the smallest most-likely-first prefix whose mass reaches ``top_p``
    (the most likely token is always kept), renormalised. ``temperature == 0`` is argmax.

    Returns:
        ``tokens`` ``long[b]`` and ``logprobs`` ``float32[b]``: the log-probability of each
        sampled token under that distribution (0 for greedy, which samples from a point mass).

    Raises:
        ValueError: on an invalid sampling argument, or non-finite logits in a sampled row.
    """
    _validate_sampling_args(temperature, top_k, top_p)
    tokens, logprobs, nonfinite = _sample(logits, _Sampling(temperature, top_k, top_p), generator)
    if bool(nonfinite.any()):
        _raise_nonfinite(nonfinite)
    return tokens, logprobs


def _model_device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and compute dtype of the model (where and how to build caches): its parameters'
    floating dtype, or the autocast dtype :func:`~composer_tune.models.build.enable_autocast`
    recorded (its keys and values are computed in that dtype)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.device, getattr(model, "autocast_dtype", param.dtype)
    raise ValueError("model has no floating-point parameters to infer the cache dtype from")


def _vocab_size(model: nn.Module) -> int | None:
    """Input vocabulary size if the model exposes a torchtune-style ``tok_embeddings``."""
    return getattr(getattr(model, "tok_embeddings", None), "num_embeddings", None)


def _last_position_head(hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
    """``head_fn`` projecting only the last position: float32 logits ``[b, vocab]``."""
    return output(hidden[:, -1]).float()


def _last_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    mask: torch.Tensor,
    input_pos: torch.Tensor,
    use_head_fn: bool,
) -> torch.Tensor:
    """Next-token logits ``[b, vocab]`` after ``tokens`` ``[b, s]``.

    With ``use_head_fn`` (models whose forward takes a ``head_fn``, like composer_tune's Qwen3)
    only the last position is projected: a prefill chunk never materialises ``[b, s, vocab]``.
    """
    if use_head_fn:
        return model(tokens, mask=mask, input_pos=input_pos, head_fn=_last_position_head)
    return model(tokens, mask=mask, input_pos=input_pos)[:, -1]


def _agree_on_shapes(width: int, max_new_tokens: int, device: torch.device) -> int:
    """Across ranks: check ``max_new_tokens`` is the same and return the widest prompt width.

    Sharded (FSDP) forwards are collectives, so every rank must run the same number of them:
    the same prefill chunks (hence a common padded width) and the same decode steps.
    """
    # One all-reduce (MAX) answers both: the widest width and whether max_new_tokens differs.
    stats = torch.tensor([width, max_new_tokens, -max_new_tokens], device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if int(stats[1]) != -int(stats[2]):
        raise ValueError(
            f"sync_ranks=True needs the same max_new_tokens on every rank; this rank has "
            f"{max_new_tokens}, others range over [{-int(stats[2])}, {int(stats[1])}]"
        )
    return int(stats[0])


@dataclass
class _DecodeState:
    """Every tensor a decode step reads or writes, allocated once per call: a step changes them
    in place and reads nothing back to the host, so that it can be captured as a CUDA graph.

    Attributes:
        logits: ``float32[b, vocab]``, the next token's logits.
        key_visible: ``bool[b, cache_len]``, may row i's queries attend to cache slot k?
            Prompt padding never is; a completion token's slot is switched on as it is fed.
        next_pos: ``long[b]``, the position id of each row's first completion token.
        generated: ``long[b, max_new_tokens]`` (``pad_id`` after a row finished).
        logprobs: ``float32[b, max_new_tokens]``.
        lengths: ``long[b]``; finished: ``bool[b]`` (the row emitted a stop token).
        nonfinite: ``bool[b]``, rows whose logits were not finite when sampled.
        column: ``long[1]``, the completion column sampled next.
    """

    logits: torch.Tensor
    key_visible: torch.Tensor
    next_pos: torch.Tensor
    generated: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor
    nonfinite: torch.Tensor
    column: torch.Tensor
    prompt_width: int
    pad: torch.Tensor
    stop_tokens: torch.Tensor


def _sample_column(
    state: _DecodeState, sampling: _Sampling, generator: torch.Generator | None
) -> None:
    """Sample the next column from ``state.logits`` and record it (pad for finished rows)."""
    tokens, token_logprobs, nonfinite = _sample(state.logits, sampling, generator)
    active = ~state.finished
    state.generated.index_copy_(1, state.column, torch.where(active, tokens, state.pad)[:, None])
    state.logprobs.index_copy_(1, state.column, (token_logprobs * active)[:, None])
    state.lengths += active
    state.nonfinite |= nonfinite
    # Finished rows stay finished. (Not torch.isin: for larger sets it sorts with a sync.)
    state.finished |= (tokens[:, None] == state.stop_tokens[None, :]).any(dim=-1)
    state.column += 1


def _feed_last_column(model: nn.Module, state: _DecodeState, span: int, use_head_fn: bool) -> None:
    """Forward the last sampled column (pad for finished rows: their outputs are discarded),
    reading the first ``span`` cache slots, into ``state.logits``."""
    fed = state.column - 1
    state.key_visible.index_fill_(1, fed + state.prompt_width, True)
    logits = _last_logits(
        model,
        state.generated.index_select(1, fed),
        mask=state.key_visible[:, None, :span],
        input_pos=(state.next_pos + fed)[:, None],
        use_head_fn=use_head_fn,
    )
    state.logits.copy_(logits)


def _host_check(state: _DecodeState, sync_ranks: bool) -> bool:
    """Whether every row has finished (with ``sync_ranks``: on every rank), read back in one
    transfer with the non-finite flags.

    Raises:
        ValueError: naming the rows whose logits were not finite.
    """
    done, nonfinite = torch.stack([state.finished.all(), state.nonfinite.any()]).tolist()
    if nonfinite:
        _raise_nonfinite(state.nonfinite)
    return bool(min_over_ranks(int(done), state.finished.device, sync_ranks))


# no_grad rather than inference_mode: FSDP2 allocates its all-gather buffers lazily, and ones
# first made under inference_mode are inference tensors that the next training forward may not
# write into ("Inplace update to inference tensor outside InferenceMode").
@torch.no_grad()
def _decode(
    model: nn.Module,
    prompt_tokens: torch.Tensor,
    prompt_is_real: torch.Tensor,
    *,
    cache_len: int,
    max_new_tokens: int,
    sampling: _Sampling,
    stop_tokens: torch.Tensor,
    pad_id: int,
    generator: torch.Generator | None,
    prefill_chunk: int,
    sync_ranks: bool,
    sync_every: int,
    capture: StepCapture | None,
) -> _DecodeState:
    """Prefill + decode on a model whose KV caches are set up for the batch.

    Each decode step feeds the last sampled column and samples the next one, on the device;
    the host reads back whether every row has finished (and whether any logits were not
    finite) every ``sync_every`` steps only, so up to ``sync_every - 1`` steps may run after
    the last row finished (finished rows only ever record padding). With ``capture`` the steps
    are replayed as captured graphs, one per span bucket (:mod:`.step_capture`); without, each
    step reads exactly the filled cache slots (a model without ``reads_cache_span``: all).

    Returns:
        The final :class:`_DecodeState`.
    """
    batch, prompt_width = prompt_tokens.shape
    device = prompt_tokens.device
    key_visible = torch.zeros((batch, cache_len), dtype=torch.bool, device=device)
    key_visible[:, :prompt_width] = prompt_is_real
    # Each row counts positions from its own first real token (pads get 0; they are masked).
    prompt_pos = (prompt_is_real.long().cumsum(dim=-1) - 1).clamp(min=0)

    slots = torch.arange(cache_len, device=device)
    use_head_fn = "head_fn" in inspect.signature(model.forward).parameters
    # Models whose cached forward reads only the slots its mask spans; others (torchtune's own
    # attention) take a mask over the whole cache.
    spans = getattr(model, "reads_cache_span", False)
    last_logits = None
    for start in range(0, prompt_width, prefill_chunk):
        end = min(start + prefill_chunk, prompt_width)
        query_slots = slots[start:end]
        span = end if spans else cache_len
        causal = slots[None, :span] <= query_slots[:, None]  # [chunk, span]
        mask = causal[None] & key_visible[:, None, :span]
        # A left-pad query would otherwise see no key at all. PyTorch's SDPA returns zeros for
        # such a row, but kernels that return NaN there would leak it through later layers
        # (0 * NaN in the masked value sum), so every query sees at least itself.
        mask[:, torch.arange(end - start, device=device), query_slots] = True
        last_logits = _last_logits(
            model,
            prompt_tokens[:, start:end],
            mask=mask,
            input_pos=prompt_pos[:, start:end],
            use_head_fn=use_head_fn,
        )

    state = _DecodeState(
        logits=last_logits.float(),
        key_visible=key_visible,
        next_pos=prompt_is_real.sum(dim=-1),
        generated=torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device),
        logprobs=torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device),
        lengths=torch.zeros(batch, dtype=torch.long, device=device),
        finished=torch.zeros(batch, dtype=torch.bool, device=device),
        nonfinite=torch.zeros(batch, dtype=torch.bool, device=device),
        column=torch.zeros(1, dtype=torch.long, device=device),
        prompt_width=prompt_width,
        pad=torch.tensor(pad_id, dtype=torch.long, device=device),
        stop_tokens=stop_tokens,
    )
    _sample_column(state, replace(sampling, host_checks=True), generator)

    def step(span: int) -> None:
        _feed_last_column(model, state, span, use_head_fn)
        _sample_column(state, sampling, generator)

    run_step = step if capture is None else CapturedSteps(step, capture, device)
    for column in range(1, max_new_tokens):
        if (column - 1) % sync_every == 0 and _host_check(state, sync_ranks):
            break
        # The step writes slot prompt_width + column - 1 and reads every slot before it.
        filled = prompt_width + column
        if not spans:
            run_step(cache_len)
        else:
            run_step(filled if capture is None else span_bucket(filled, cache_len))
    if bool(state.nonfinite.any()):
        _raise_nonfinite(state.nonfinite)
    return state


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    sync_ranks: bool = False,
    cuda_graphs: bool | None = None,
    sync_every: int | None = None,
) -> GenerationOutput:
    """Sample up to ``max_new_tokens`` tokens after each prompt, batched, with a KV cache.

    Prompts may differ in length; each row's completion is the same as if it were decoded
    alone (up to floating-point rounding). KV caches sized for this batch are created on entry
    and deleted on exit, and the model's train/eval flags are restored, so the model can be
    trained right after. Dropout is off while generating. A model whose forward runs under
    autocast (:func:`~composer_tune.models.build.enable_autocast`) has its weights cast once
    per call, not once per token.

    Args:
        model: torchtune-style decoder without KV caches set up.
        prompts: token ids per prompt, each non-empty.
        max_new_tokens: upper bound on completion length.
        pad_id: id written after a finished row's last token (and used as prompt padding,
            which is masked out, so any valid id works).
        temperature: softmax temperature; 0 means greedy (argmax).
        greedy: shorthand for ``temperature=0``.
        top_k: keep only the k most likely tokens (None: no limit).
        top_p: nucleus sampling threshold in (0, 1] (None or 1: no limit).
        stop_tokens: ids that end a row; the stop token is kept as its last completion token.
        generator: source of randomness for reproducible sampling; must live on the model's
            device.
        return_logprobs: also return each sampled token's log-probability under the
            temperature / top-k / top-p processed distribution it was drawn from.
        prefill_chunk: prompt tokens per prefill forward (bounds prefill memory).
        sync_ranks: make every rank of the default process group run the same number of
            forwards (pad prompts to the widest prompt on any rank, stop only when all ranks'
            rows are done), as a model sharded with FSDP needs; ``max_new_tokens``,
            ``prefill_chunk`` and the other settings must match across ranks.
        cuda_graphs: replay the decode steps as CUDA graphs (:mod:`.step_capture`). None: on
            CUDA, for composer-tune's dense decoders (native, or a ``transformers`` model
            without experts), unless ``sync_ranks`` (a sharded model's forwards are
            collectives).
        sync_every: decode steps between the host's checks whether every row has finished.
            None: :data:`CUDA_SYNC_EVERY` on CUDA, 1 elsewhere (a CPU loses nothing by it).

    Returns:
        A :class:`GenerationOutput`.

    Raises:
        ValueError: on an invalid sampling argument, an empty or out-of-vocabulary prompt, a
            prompt + completion longer than ``model.max_seq_len``, a model whose caches
            are already set up, ``sync_ranks`` without a process group or with differing
            ``max_new_tokens`` across ranks, or ``cuda_graphs`` off CUDA or with ``sync_ranks``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _validate_sampling_args(temperature, top_k, top_p)
    _validate_prompts(prompts, pad_id, _vocab_size(model))
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if sync_every is not None and sync_every < 1:
        raise ValueError(f"sync_every must be >= 1 or None, got {sync_every}")
    if model.caches_are_setup():
        raise ValueError(
            "generate() sets up its own KV caches sized for the batch, but the model already "
            "has caches set up: delete them first (torchtune.modules.delete_kv_caches)"
        )
    if sync_ranks and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("sync_ranks=True needs an initialised torch.distributed process group")
    device, dtype = _model_device_and_dtype(model)
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and not sync_ranks and _capturable(model)
    capture = _step_capture(device, cuda_graphs, sync_ranks, generator)
    if sync_every is None:
        sync_every = CUDA_SYNC_EVERY if device.type == "cuda" else 1
    width = max(len(p) for p in prompts)
    if sync_ranks:
        width = _agree_on_shapes(width, max_new_tokens, device)
    prompt_tokens, prompt_is_real = _left_pad(prompts, width, pad_id, device)
    # The last sampled token is never fed back, hence the - 1.
    cache_len = prompt_tokens.shape[1] + max_new_tokens - 1
    max_seq_len = getattr(model, "max_seq_len", None)
    if max_seq_len is not None and cache_len > max_seq_len:
        raise ValueError(
            f"longest prompt ({prompt_tokens.shape[1]} tokens) + max_new_tokens "
            f"({max_new_tokens}) - 1 = {cache_len} exceeds model.max_seq_len ({max_seq_len})"
        )

    training_flags = {module: module.training for module in model.modules()}
    model.eval()
    try:
        # A model with a cache of its own (the transformers backend) sets it up itself.
        cache_for = getattr(model, "local_kv_cache", None) or partial(local_kv_cache, model)
        with (
            _weights_cast_once(model, device),
            _packed_cpu_linears(model, device, dtype),
            cache_for(
                batch_size=len(prompts),
                device=device,
                dtype=dtype,
                decoder_max_seq_len=cache_len,
            ),
        ):
            state = _decode(
                model,
                prompt_tokens,
                prompt_is_real,
                cache_len=cache_len,
                max_new_tokens=max_new_tokens,
                sampling=_Sampling(
                    0.0 if greedy else temperature, top_k, top_p, host_checks=capture is None
                ),
                stop_tokens=torch.tensor(list(stop_tokens), dtype=torch.long, device=device),
                pad_id=pad_id,
                generator=generator,
                prefill_chunk=prefill_chunk,
                sync_ranks=sync_ranks,
                sync_every=sync_every,
                capture=capture,
            )
    finally:
        for module, was_training in training_flags.items():
            module.training = was_training

    lengths = state.lengths.cpu()
    rows = state.generated.cpu().tolist()
    completions = [row[:length] for row, length in zip(rows, lengths.tolist(), strict=True)]
    row_logprobs = None
    if return_logprobs:
        logprobs = state.logprobs.cpu()
        row_logprobs = [logprobs[row, :length] for row, length in enumerate(lengths.tolist())]
    return GenerationOutput(
        completions=completions,
        completion_lengths=lengths,
        truncated=~state.finished.cpu(),
        logprobs=row_logprobs,
    )


def _capturable(model: nn.Module) -> bool:
    """Whether ``model``'s decode step can be captured: a cached forward that reads a fixed span
    of its cache and writes it at a device-side position (composer-tune's decoders), and no
    data-dependent shapes (a mixture of experts routes tokens by value)."""
    return getattr(model, "reads_cache_span", False) and getattr(model, "moe", None) is None


def _step_capture(
    device: torch.device,
    cuda_graphs: bool,
    sync_ranks: bool,
    generator: torch.Generator | None,
) -> StepCapture | None:
    """How decode steps are captured for replay (None: they run eagerly)."""
    if not cuda_graphs:
        return None
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a model on a CUDA device, not {device}")
    if sync_ranks:
        raise ValueError("cuda_graphs=True cannot capture a sharded model's forwards (sync_ranks)")
    return cuda_graph_capture(generator)


# Rows the CPU's packed weights are laid out for (oneDNN's blocking hint; any batch works).
_PACKING_ROWS = 16


@contextlib.contextmanager
def _packed_cpu_linears(
    model: nn.Module, device: torch.device, dtype: torch.dtype
) -> Iterator[None]:
    """On a CPU that multiplies bf16 natively, a model computing in bf16: every linear layer
    (the tied output head included) multiplies, for this call, by a copy of its weight cast to
    bf16 and reordered once into oneDNN's blocked layout. A plain bf16 matmul reorders the
    weight on every call, which at a decode step's few rows costs a fifth to a third of the
    multiply (SmolLM2, 16 rows: decode steps ~25 % faster, the same tokens). Not for a sharded
    model (its layers' weights are gathered per forward)."""
    if (
        device.type != "cpu"
        or dtype != torch.bfloat16
        or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        or any(isinstance(p, DTensor) for p in model.parameters())
    ):
        yield
        return
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    tied_head = getattr(model, "output", None)
    tied_head = tied_head if isinstance(tied_head, TiedLinear) else None
    try:
        for linear in linears:
            linear.forward = partial(_packed_linear, _pack(linear.weight), linear.bias)
        if tied_head is not None:
            model.output = partial(_packed_linear, _pack(tied_head.tied_module.weight), None)
        yield
    finally:
        for linear in linears:
            linear.__dict__.pop("forward", None)
        if tied_head is not None:
            model.output = tied_head


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16(), _PACKING_ROWS)


def _packed_linear(
    packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    if bias is not None:
        bias = bias.detach().bfloat16()
    return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed, bias, "none", [], "")


def _weights_cast_once(model: nn.Module, device: torch.device) -> AbstractContextManager:
    """For a model whose forward runs under autocast: one autocast region around the whole
    call, so that autocast's cache keeps each weight's low-precision copy from the first
    forward on (each forward's own region would otherwise cast every weight again: half of a
    SmolLM2 decode step on a CPU). Not for a sharded model, whose cache would then hold every
    layer's gathered weights at once."""
    dtype = getattr(model, "autocast_dtype", None)
    if dtype is None or any(isinstance(p, DTensor) for p in model.parameters()):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def pack_sequences(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int
) -> PackedBatch:
    """Concatenate each prompt with its completion and right-pad the rows into one batch.

    See :class:`PackedBatch` for the meaning of each field, in particular which column of
    ``completion_mask`` marks which target.

    Raises:
        ValueError: if the two lists differ in length or a prompt is empty.
    """
    if len(prompts) != len(completions):
        raise ValueError(
            f"got {len(prompts)} prompts but {len(completions)} completions: one each per row"
        )
    if not prompts:
        raise ValueError("prompts is empty: need at least one row")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{row}] is empty: every prompt needs at least one token")
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    completion_lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    total_lengths = prompt_lengths + completion_lengths
    width = int(total_lengths.max())

    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens[row, : len(prompt) + len(completion)] = torch.tensor(
            prompt + completion, dtype=torch.long
        )
    columns = torch.arange(width)[None, :]
    padding_mask = columns < total_lengths[:, None]
    completion_mask = padding_mask & (columns >= prompt_lengths[:, None])
    return PackedBatch(
        tokens=tokens,
        input_pos=columns.expand(len(prompts), width).clone(),
        padding_mask=padding_mask,
        completion_mask=completion_mask,
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
    )


def encode_prompts(
    tokenizer: Any, samples: Sequence[Mapping[str, Any]], *, enable_thinking: bool
) -> list[list[int]]:
    """Chat-template token ids of each sample's prompt, ending with the assistant header."""
    return [
        tokenizer.tokenize_messages(
            sample["prompt"], add_generation_prompt=True, enable_thinking=enable_thinking
        )[0]
        for sample in samples
    ]
