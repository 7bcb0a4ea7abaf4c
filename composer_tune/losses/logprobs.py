"""Per-token log-probabilities without materialising ``[B, T, V]`` logits.

With a large vocabulary (Qwen3's has 151,936 entries, Llama 3's 128,256) the float32 logits of
4,096 tokens alone take 2.5 GB, and a naive ``log_softmax`` plus its backward keeps several such
tensors alive. Here the final
projection, the float32 log-softmax and the target gather run over chunks of rows of the
flattened ``[B*T, D]`` hidden states, each chunk under activation checkpointing, so forward and
backward each hold one chunk's logits at a time; only ``[B, T]`` results and the hidden states
stay alive between them. A hand-written backward for the log-softmax-and-gather step builds a
chunk's logit gradient in one buffer, where autograd's would allocate three to five.

The project's decoder (every family) accepts ``head_fn`` and returns
``head_fn(h_normed, output_module)`` instead of its logits; :func:`logprob_head` builds that
callable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Maps hidden states [..., D] to logits [..., V]: an nn.Linear or torchtune's TiedLinear.
OutputModule = Callable[[Tensor], Tensor]
LogprobResult = Tensor | tuple[Tensor, Tensor]

# torchtune's CROSS_ENTROPY_IGNORE_IDX: label positions that carry no target.
IGNORE_INDEX = -100

# On a CPU, a chunk's float32 logits are written and read a dozen times (upcast, log-softmax,
# entropy, then all again in backward). Past glibc's 32 MiB mmap threshold every such buffer
# is fresh memory from the kernel, page-faulted in on every pass, and it no longer fits the
# last-level cache: chunks are therefore cut to rows whose logits take at most this much, but
# not below CPU_MIN_CHUNK_ROWS rows (each chunk reads the whole output weight). SmolLM2's
# 49,152-entry vocabulary: 128 rows instead of 1024, its GRPO head (4096 targets, forward +
# backward, bf16 autocast, 1 thread) 22 s -> 15-16 s (/tmp bench on a loaded 2-core machine).
CPU_CHUNK_BYTES = 24 * 2**20
CPU_MIN_CHUNK_ROWS = 64


def token_logprobs(
    hidden: Tensor,
    output_module: OutputModule,
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> LogprobResult:
    """``log softmax(output_module(hidden) / temperature)[target]`` per position, chunk by chunk.

    Args:
        hidden: ``[B, T, D]`` final (normed) hidden states, any float dtype.
        output_module: the output projection, ``[n, D] -> [n, V]``.
        targets: ``[B, T]`` token ids; ``targets[b, t]`` is the token predicted from
            ``hidden[b, t]`` (the caller shifts). Positions equal to ``ignore_index`` get
            log-probability 0.
        chunk_size: rows of the flattened ``[B*T, D]`` input per chunk (on a CPU at most
            :data:`CPU_CHUNK_BYTES` of float32 logits, see there). Working memory is about two
            ``chunk_size x V`` float32 buffers (the logits and, in backward, their gradient;
            one more for the entropy), plus the output weight's gradient.
        temperature: logits are divided by it, matching sampling at that temperature.
        return_entropy: also return the entropy of each position's distribution.
        ignore_index: target value marking positions without a target.

    Returns:
        ``[B, T]`` log-probabilities in float32 (float64 for float64 inputs), or
        ``(logprobs, entropy)`` with ``return_entropy``. With grad enabled every chunk is
        checkpointed (its logits are recomputed in backward); under ``torch.no_grad()`` chunks
        run directly.
    """
    if hidden.dim() != 3:
        raise ValueError(f"token_logprobs: hidden must be [B, T, D], got {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"token_logprobs: targets has shape {tuple(targets.shape)}, expected hidden's "
            f"[B, T] = {tuple(hidden.shape[:2])}"
        )
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    batch, seq_len, dim = hidden.shape
    if hidden.device.type == "cpu":
        chunk_size = min(chunk_size, _cpu_chunk_rows(output_module))
    flat_hidden = hidden.reshape(-1, dim)
    flat_targets = targets.reshape(-1)
    run_chunk = partial(
        _chunk_logprobs,
        output_module=output_module,
        temperature=temperature,
        return_entropy=return_entropy,
        ignore_index=ignore_index,
        seq_len=seq_len,
    )
    use_checkpoint = torch.is_grad_enabled()
    logprob_chunks: list[Tensor] = []
    entropy_chunks: list[Tensor] = []
    for start in range(0, flat_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (flat_hidden[rows], flat_targets[rows], start)
        if use_checkpoint:
            outputs = checkpoint(run_chunk, *args, use_reentrant=False)
        else:
            outputs = run_chunk(*args)
        logprob_chunks.append(outputs[0])
        if return_entropy:
            entropy_chunks.append(outputs[1])
    # Not views: an FSDP2 root that returns a view warns (an in-place op on it would drop the
    # pre-backward hook that all-gathers the weights), and [B, T] floats cost nothing to copy.
    logprobs = torch.cat(logprob_chunks).view(batch, seq_len).clone()
    if return_entropy:
        return logprobs, torch.cat(entropy_chunks).view(batch, seq_len).clone()
    return logprobs


def _cpu_chunk_rows(output_module: OutputModule) -> int:
    """Rows per chunk whose float32 logits fit :data:`CPU_CHUNK_BYTES` (at least
    :data:`CPU_MIN_CHUNK_ROWS`), from the vocabulary size of the output weight (an
    ``nn.Linear``, torchtune's ``TiedLinear`` or the transformers backend's ``OutputHead``);
    no limit when it has none."""
    for owner in (output_module, *(getattr(output_module, name, None) for name in _WEIGHT_OWNERS)):
        weight = getattr(owner, "weight", None)
        if isinstance(weight, Tensor):
            return max(CPU_MIN_CHUNK_ROWS, CPU_CHUNK_BYTES // (4 * weight.shape[0]))
    return sys.maxsize


# Attributes of an output module that hold its [V, D] weight's module.
_WEIGHT_OWNERS = ("tied_module", "lm_head")


def _chunk_logprobs(
    hidden: Tensor,
    targets: Tensor,
    first_row: int,
    *,
    output_module: OutputModule,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    seq_len: int,
) -> tuple[Tensor, ...]:
    """Log-probabilities (and entropies) of one chunk of flattened rows."""
    # Upcast after the projection: the softmax over ~152k entries needs float32 even when
    # the weights are bf16.
    logits = _at_least_float32(output_module(hidden))
    _check_targets(targets, logits.shape[-1], ignore_index, first_row, seq_len)
    has_target = targets != ignore_index
    safe_targets = torch.where(has_target, targets, torch.zeros_like(targets))
    outputs = _TargetLogSoftmax.apply(logits, safe_targets, has_target, temperature, return_entropy)
    return outputs if return_entropy else (outputs,)


class _TargetLogSoftmax(torch.autograd.Function):
    """``log softmax(z / tau)[target]`` (and the entropy) per row of ``[n, V]`` logits ``z``.

    Autograd's own backward of logsumexp + gather (+ entropy) allocates three to five
    ``[n, V]`` tensors; this one builds the logits' gradient in a single buffer (two when the
    entropy needs a gradient), which is what bounds a chunk's peak memory in backward.
    With ``p = softmax(z / tau)``, ``H = -sum p log p``, upstream gradients ``g`` (log-prob)
    and ``e`` (entropy):

        dL/dz = (g * onehot(target) - p * (g + e * (log p + H))) / tau
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        has_target: Tensor,
        temperature: float,
        with_entropy: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        scaled = logits / temperature if temperature != 1.0 else logits
        log_normaliser = torch.logsumexp(scaled, dim=-1)
        target_scaled = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        logprobs = torch.where(has_target, target_scaled - log_normaliser, 0.0)
        entropy = None
        if with_entropy:
            # H = logsumexp(z) - sum_v p_v z_v; the [n, V] product is formed in place in p.
            probs = torch.exp(scaled - log_normaliser.unsqueeze(-1))
            entropy = log_normaliser - probs.mul_(scaled).sum(dim=-1)
        ctx.save_for_backward(logits, targets, has_target, log_normaliser, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None = None
    ) -> tuple[Tensor | None, None, None, None, None]:
        logits, targets, has_target, log_normaliser, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_normaliser)
        # Ignored positions output a constant 0: no gradient flows from them.
        grad_target = torch.where(has_target, grad_logprobs, 0.0).unsqueeze(-1)
        # log p = z / tau - lse = (z - tau * lse) / tau, built in one fresh buffer.
        grad = logits - (temperature * log_normaliser).unsqueeze(-1)
        if temperature != 1.0:
            grad.div_(temperature)
        if grad_entropy is None:
            grad.exp_().mul_(-grad_target)
        else:
            probs = grad.exp()
            grad.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            grad.add_(grad_target).mul_(probs).neg_()
            del probs
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_target)
        if temperature != 1.0:
            grad.div_(temperature)
        return grad, None, None, None, None


def _at_least_float32(tensor: Tensor) -> Tensor:
    """Upcast bf16/fp16 to float32; leave float32 and float64 as they are."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _check_targets(
    targets: Tensor, vocab_size: int, ignore_index: int, first_row: int, seq_len: int
) -> None:
    """Raise on a target id outside ``[0, vocab_size)`` (a CUDA gather would only assert)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        row = first_row + int(bad.nonzero()[0, 0])
        value = int(targets[row - first_row])
        raise ValueError(
            f"token_logprobs: targets[{row // seq_len}, {row % seq_len}] = {value} is outside "
            f"the vocabulary [0, {vocab_size}) and is not ignore_index={ignore_index}"
        )


def logprob_head(
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> Callable[[Tensor, OutputModule], LogprobResult]:
    """The ``head_fn`` for ``model(tokens, ..., head_fn=...)``: token log-probs, not logits.

    The model calls it as ``head_fn(h_normed [B, T, D], output_module)``; it returns what
    :func:`token_logprobs` returns for ``targets`` with these settings.
    """

    def head_fn(hidden: Tensor, output_module: OutputModule) -> LogprobResult:
        return token_logprobs(
            hidden,
            output_module,
            targets,
            chunk_size=chunk_size,
            temperature=temperature,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
        )

    return head_fn


def naive_token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Reference implementation: one full float32 ``log_softmax`` over ``[B, T, V]`` logits.

    Same semantics as :func:`token_logprobs` (0 at ``ignore_index`` positions); used by the
    tests and the memory benchmark, not by training.
    """
    logprobs = torch.log_softmax(_at_least_float32(logits) / temperature, dim=-1)
    has_target = targets != ignore_index
    safe_targets = torch.where(has_target, targets, torch.zeros_like(targets))
    picked = logprobs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(has_target, picked, 0.0)
