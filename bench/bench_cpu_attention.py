"""Why the native decoder runs its full-sequence attention in fp32 on a CPU under bf16 autocast:
SDPA on bf16 queries, keys and values as they are against the same tensors upcast to fp32 (the
casts there and back included), without and with autograd, causal and with a boolean mask, at one
training shape ``[rows, heads, positions, head_dim]``.

    OMP_NUM_THREADS=1 python bench/bench_cpu_attention.py              # SmolLM2's GRPO shape
    OMP_NUM_THREADS=1 python bench/bench_cpu_attention.py --shape 16 9 301 64
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F


def attention_ms(
    shape: tuple[int, int, int, int], *, upcast: bool, grad: bool, masked: bool, repeats: int
) -> float:
    """Median milliseconds of one attention call (and its backward with ``grad``)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_(grad)
        for _ in range(3)
    )
    positions = shape[2]
    mask = torch.ones(positions, positions, dtype=torch.bool).tril() if masked else None

    def call() -> None:
        inputs = [t.float() for t in (q, k, v)] if upcast else [q, k, v]
        out = F.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=not masked)
        out = out.to(torch.bfloat16)
        if grad:
            out.sum().backward()

    times = []
    with torch.set_grad_enabled(grad):
        for index in range(repeats + 2):  # two untimed warm-up calls
            start = time.perf_counter()
            call()
            if index >= 2:
                times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[16, 9, 173, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(args.shape)
    print(
        f"torch={torch.__version__} threads={args.threads} shape={list(shape)} "
        f"avx512_bf16={torch.cpu._is_avx512_bf16_supported()} repeats={args.repeats} (median)"
    )
    print("| pass | mask | bf16 ms | fp32 upcast ms | bf16 / upcast |")
    print("| --- | --- | --- | --- | --- |")
    for grad in (False, True):
        for masked in (False, True):
            bf16, upcast = (
                attention_ms(shape, upcast=u, grad=grad, masked=masked, repeats=args.repeats)
                for u in (False, True)
            )
            name = "forward + backward" if grad else "forward, no grad"
            kind = "boolean" if masked else "causal"
            print(f"| {name} | {kind} | {bf16:.1f} | {upcast:.1f} | {bf16 / upcast:.2f}x |")


if __name__ == "__main__":
    main()
