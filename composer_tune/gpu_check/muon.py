"""The ``muon`` part: Muon's optimizer step against fused AdamW on Qwen3-8B, and Muon's step on
one matrix against ``torch.optim.Muon``'s."""

from __future__ import annotations

from typing import Any

import torch

from composer_tune.gpu_check.common import GIB, PartResult, Settings, require
from composer_tune.gpu_check.speed import fitting_qwen3_8b

MUON_BYTES_PER_PARAM = 8  # bf16 weights + gradients, then 4 bytes of optimizer state


def muon_layers(settings: Settings) -> int:
    """Qwen3-8B layers whose parameters, gradients and one optimizer's state fit 70 % of the
    card (the rest: Newton-Schulz temporaries, the allocator); all 36 when its size is unknown."""
    from composer_tune.analysis import memory

    def fits(args: Any, capacity: float) -> bool:
        return MUON_BYTES_PER_PARAM * memory.count_params(args) / GIB <= 0.7 * capacity

    return fitting_qwen3_8b(settings, 4096, fits).num_layers


def _muon_equals_torch(settings: Settings) -> dict[str, Any]:
    """Two steps of composer_tune.optim.Muon and torch.optim.Muon on one matrix (Qwen3-8B's
    MLP shape; toy with --tiny) on the device, from the same weights and gradients."""
    from composer_tune.optim import Muon

    rows, cols = (192, 64) if settings.tiny else (12288, 4096)
    generator = torch.Generator(device=settings.device).manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator, device=settings.device)
    ours = torch.nn.Parameter(weight.clone())
    theirs = torch.nn.Parameter(weight.clone())
    ours_optimizer = Muon(
        [("mlp.w1.weight", ours)], lr=0.02, ns_dtype="bf16", adjust_lr_fn="original"
    )
    theirs_optimizer = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1)
    for _ in range(2):
        grad = torch.randn(rows, cols, generator=generator, device=settings.device)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        ours_optimizer.step()
        theirs_optimizer.step()
    difference = (ours - theirs).abs().max().item()
    moved = (ours - weight).abs().max().item()
    return {
        "optimizer": f"equal to torch.optim.Muon ({rows} x {cols}, 2 steps)",
        "max_abs_diff": difference,
        "status": "PASS" if difference <= 1e-6 and moved > 1e-3 else "FAIL",
    }


def run_muon(settings: Settings) -> PartResult:
    require("torchtune")
    from bench import bench_muon_step as bench

    if settings.tiny:
        sizes = ["--tiny", "--layers", "2", "--vocab", "128", "--repeats", "1"]
    else:
        sizes = ["--layers", str(muon_layers(settings)), "--vocab", "151936"]
        sizes += ["--dtype", "bf16", "--warmup", "2", "--repeats", "5"]
    args = bench.parse_args([*sizes, "--device", settings.device.type])
    result = bench.measure(args)
    setup = result["setup"]
    rows = [
        {"optimizer": "torch.optim.AdamW (fused on CUDA)", "step_s": result["adamw_s"]},
        {
            "optimizer": "composer_tune.optim.Muon",
            "step_s": result["muon_s"],
            "ratio": result["ratio"],
            "ns_tflops": result["ns_tflops"],
        },
    ]
    rows = [{**row, "status": "INFO"} for row in rows]
    rows.append(_muon_equals_torch(settings))
    return PartResult(
        columns=[
            ("optimizer", "optimizer", ""),
            ("step_s", "median s / step", ".4f"),
            ("ratio", "Muon / AdamW", ".2f"),
            ("ns_tflops", "Newton-Schulz TFLOP/s", ".1f"),
            ("max_abs_diff", "max abs diff", ".2e"),
        ],
        rows=rows,
        notes=[
            f"bench/bench_muon_step.py (imported): {setup['shape']} x {setup['layers']} layers, "
            f"vocabulary {setup['vocab']}, {setup['params'] / 1e9:.2f}B parameters "
            f"({setup['muon_params'] / 1e9:.2f}B on Muon), {setup['dtype']} weights, "
            f"Newton-Schulz in {setup['ns_dtype']} ({setup['ns_tflop_per_step']:.1f} TFLOP a "
            f"step); {setup['warmup']} warm-up + {setup['repeats']} timed steps each, AdamW "
            "first. One device: the FSDP2 exchange of whole matrices is not in these figures.",
        ],
    )
