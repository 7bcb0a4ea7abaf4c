"""Time per optimizer step: composer_tune.optim.Muon against torch.optim.AdamW on the same
parameters, at Qwen3-8B's layer shape (``--layers`` of its 36; the vocabulary ``--vocab``, by
default a small one: the embeddings and head stay on AdamW under both optimizers).

    OMP_NUM_THREADS=1 python bench/bench_muon_step.py                    # 1 layer, CPU, 1 thread
    python bench/bench_muon_step.py --device cuda --layers 36 --vocab 151936 --dtype bf16

Both optimizers step the same model with the same gradients (set once: an optimizer step does not
depend on their values' source), one after the other, AdamW first; ``--warmup`` untimed steps
each (state allocation), then the median of ``--repeats``. Muon's step is dominated by its
Newton-Schulz iteration (5 steps of ``4 m^2 n + 2 m^3`` FLOPs for an ``m x n`` matrix,
``m <= n``), printed with the rate it ran at. One device, one process: the FSDP2 exchange of whole
matrices (docs/muon.md) is not in these figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="Qwen3-8B layers (of 36)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary (Qwen3-8B: 151936)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="parameters")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--tiny", action="store_true", help="a toy shape (the smoke test)")
    return parser.parse_args(argv)


def model_shape(args: argparse.Namespace) -> Any:
    from composer_tune.models import DecoderArgs, qwen3_8b

    if args.tiny:
        return DecoderArgs(
            vocab_size=args.vocab, num_layers=args.layers, num_heads=4, num_kv_heads=2,
            embed_dim=64, intermediate_dim=192, head_dim=16, max_seq_len=64,
        )  # fmt: skip
    with torch.device("meta"):
        full = qwen3_8b().config
    return dataclasses.replace(full, num_layers=args.layers, vocab_size=args.vocab)


def newton_schulz_flops(model: torch.nn.Module, steps: int = 5) -> float:
    """FLOPs of Muon's Newton-Schulz iterations over ``model``'s matrices (Muon's split)."""
    from composer_tune.optim import split_parameters

    total = 0.0
    for _, param in split_parameters(model.named_parameters())[0]:
        m, n = sorted(param.shape[-2:])
        total += param[..., 0, 0].numel() * steps * (4 * m * m * n + 2 * m**3)
    return total


def _median_step_seconds(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> float:
    device = torch.device(args.device)
    times = []
    for index in range(args.warmup + args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds per step of each optimizer, their ratio and the setup."""
    from torchtune import training

    from composer_tune.models import decoder_from_args
    from composer_tune.optim import Muon, newton_schulz_dtype, split_parameters

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = model_shape(args)
    torch.manual_seed(0)
    with training.set_default_dtype(DTYPES[args.dtype]), device:
        model = decoder_from_args(shape)
    generator = torch.Generator(device=device).manual_seed(0)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator, device=device, dtype=param.dtype)
    fused = True if device.type == "cuda" else None  # the GPU configs' AdamW
    results = {}
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)
    results["adamw_s"] = _median_step_seconds(adamw, args)
    del adamw
    muon = Muon(model.named_parameters(), lr=1e-6, fused=fused)
    results["muon_s"] = _median_step_seconds(muon, args)
    del muon
    matrices = sum(p.numel() for _, p in split_parameters(model.named_parameters())[0])
    flops = newton_schulz_flops(model)
    return {
        **results,
        "ratio": results["muon_s"] / results["adamw_s"],
        "ns_tflops": flops / results["muon_s"] / 1e12,
        "setup": {
            "shape": "a toy layer shape" if args.tiny else "Qwen3-8B's layer shape",
            "layers": shape.num_layers,
            "vocab": shape.vocab_size,
            "params": sum(p.numel() for p in model.parameters()),
            "muon_params": matrices,
            "dtype": args.dtype,
            "ns_dtype": str(newton_schulz_dtype("auto", device)).removeprefix("torch."),
            "device": args.device,
            "threads": args.threads,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "ns_tflop_per_step": flops / 1e12,
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    setup = result["setup"]
    print(
        f"torch={torch.__version__} device={setup['device']} threads={setup['threads']} "
        f"{setup['shape']} x {setup['layers']} layers, vocab {setup['vocab']}: "
        f"{setup['params'] / 1e6:.1f}M parameters ({setup['muon_params'] / 1e6:.1f}M on Muon), "
        f"{setup['dtype']} parameters, Newton-Schulz in {setup['ns_dtype']} "
        f"({setup['ns_tflop_per_step']:.2f} TFLOP per step); median of {setup['repeats']} "
        f"steps after {setup['warmup']} warm-up"
    )
    print("| optimizer | s / step | Muon / AdamW | Newton-Schulz TFLOP/s |")
    print("| --- | --- | --- | --- |")
    print(f"| torch.optim.AdamW | {result['adamw_s']:.4g} | | |")
    print(
        f"| composer_tune.optim.Muon | {result['muon_s']:.4g} | {result['ratio']:.2f}x "
        f"| {result['ns_tflops']:.3f} |"
    )


if __name__ == "__main__":
    main()
