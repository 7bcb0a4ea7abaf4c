"""The ``speed`` part: forward+backward tokens/s and MFU of a Qwen3-8B layer stack, eager and
compiled, with and without activation checkpointing, on both backends."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from composer_tune.gpu_check.common import (
    MFU_GOAL,
    PEAK_BF16_TFLOPS,
    PartResult,
    Settings,
    error_row,
    free_memory,
    require,
    synchronize,
)


def peak_tflops(settings: Settings) -> float | None:
    """The device's dense bf16 peak: ``--peak-tflops``, else from its name (None: unknown)."""
    if settings.peak_tflops is not None:
        return settings.peak_tflops
    if settings.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(settings.device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def fitting_qwen3_8b(
    settings: Settings, max_seq_len: int, fits: Callable[[Any, float], bool]
) -> Any:
    """Qwen3-8B's shape with as many layers as ``fits(args, capacity_gib)`` allows on this
    device (all of them when its memory is unknown); a toy Qwen3 with ``--tiny``."""
    from composer_tune.models import DecoderArgs, qwen3_8b

    if settings.tiny:
        return DecoderArgs(
            vocab_size=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            embed_dim=64,
            intermediate_dim=128,
            head_dim=16,
            max_seq_len=max_seq_len,
        )
    with torch.device("meta"):
        full = qwen3_8b(max_seq_len=max_seq_len).config
    capacity = settings.device_gib()
    for layers in range(full.num_layers, 0, -1):
        args = dataclasses.replace(full, num_layers=layers)
        if capacity is None or fits(args, capacity):
            return args
    raise RuntimeError(f"not even one Qwen3-8B layer fits {capacity:.1f} GiB")


def speed_shape(settings: Settings, batch: int, seq_len: int) -> Any:
    """Qwen3-8B's layer shape with as many layers as fit this GPU (estimated without activation
    checkpointing, gradients but no optimizer); a toy shape with ``--tiny``."""
    from composer_tune.analysis import memory

    plan = memory.MemoryPlan(
        micro_batch_size=batch,
        seq_len=seq_len,
        activation_checkpointing=False,
        optimizer_states=0,
        optimizer_impl="fused",
    )

    def fits(args: Any, capacity: float) -> bool:
        # 10 % of the card held back beyond fit_report's margins: compiled kernels' workspaces.
        estimate = memory.estimate_memory(args, plan)
        return memory.fit_report(estimate, capacity_gib=0.9 * capacity).fits

    return fitting_qwen3_8b(settings, seq_len, fits)


def _model_node(args: Any) -> Any:
    """A config ``model`` node building exactly ``args`` (a Qwen3 shape)."""
    from omegaconf import OmegaConf

    fields = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if f.name not in ("family", "rope_scaling")
    }
    return OmegaConf.create({"_component_": "composer_tune.models.qwen3", **fields})


def _transformers_node(args: Any) -> Any:
    """A config ``model`` node building ``args``' shape on the transformers backend
    (``Qwen3ForCausalLM``): a ``config.json`` in a temporary folder, random weights."""
    from omegaconf import OmegaConf

    from composer_tune.checkpointing.hf_checkpoint import CONFIG_NAME, hf_config_from_decoder_args

    directory = Path(tempfile.mkdtemp(prefix="gpu_check_shape_"))
    config = hf_config_from_decoder_args(args, torch.bfloat16)
    (directory / CONFIG_NAME).write_text(json.dumps(config))
    return OmegaConf.create(
        {
            "_component_": "composer_tune.models.from_pretrained",
            "path": str(directory),
            "max_seq_len": args.max_seq_len,
            "backend": "transformers",
        }
    )


def build_stack(
    args: Any, device: torch.device, checkpointing: bool, backend: str = "native"
) -> torch.nn.Module:
    from composer_tune.distributed import DistInfo
    from composer_tune.models.build import build_decoder

    node = _model_node(args) if backend == "native" else _transformers_node(args)
    return build_decoder(
        node,
        checkpoint=None,
        dtype=torch.bfloat16,
        dist_info=DistInfo(world_size=1, rank=0, device=device),
        seed=0,
        activation_checkpointing=checkpointing,
        fsdp_cpu_offload=False,
    )


def _time_forward_backward(
    args: Any,
    settings: Settings,
    checkpointing: bool,
    compiled: bool,
    batch: int,
    steps: int,
    backend: str = "native",
) -> float:
    """Median seconds of forward (chunked log-prob head) + backward over ``steps`` timed steps."""
    from torchtune import training

    from composer_tune.losses import logprob_head

    device = settings.device
    model = build_stack(args, device, checkpointing, backend).train()
    if compiled and backend == "native":
        training.compile_model(model, verbose=False)
    elif compiled:  # per decoder layer, as torchtune compiles its own
        for layer in model.decoder_layers():
            layer.compile()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, args.max_seq_len), generator=generator)
    tokens = tokens.to(device)
    head = logprob_head(torch.roll(tokens, -1, dims=1), chunk_size=1024)
    times = []
    for step in range(3 + steps):  # three warm-ups (compilation, autotuning, allocator)
        synchronize(device)
        start = time.perf_counter()
        (-model(tokens, head_fn=head).mean()).backward()
        synchronize(device)
        if step >= 3:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    del model
    return statistics.median(times)


def run_speed(settings: Settings) -> PartResult:
    require("torchtune", "omegaconf")
    from composer_tune.analysis import memory

    batch, seq_len, steps = (2, 64, 2) if settings.tiny else (4, 2048, 5)
    args = speed_shape(settings, batch, seq_len)
    peak = peak_tflops(settings)
    tokens = batch * seq_len
    attention = 6 * args.num_layers * seq_len * args.num_heads * args.head_dim
    flops = tokens * (6 * memory.count_matmul_params(args) + attention)
    backend = os.environ.get("TORCH_COMPILE_BACKEND", "inductor")
    rows: list[dict[str, Any]] = []
    best_mfu = None
    # The native decoder with and without activation checkpointing; transformers' Qwen3 (the
    # transformers backend) without, eager and compiled: the comparison that decides auto.
    variants = [("native", ac, compiled) for ac in (False, True) for compiled in (False, True)]
    variants += [("transformers", False, compiled) for compiled in (False, True)]
    for model_backend, checkpointing, compiled in variants:
        mode = f"compiled ({backend})" if compiled else "eager"
        ac = "on" if checkpointing else "off"
        row: dict[str, Any] = {
            "what": f"fwd+bwd, {args.num_layers} layers, AC {ac}, {mode}",
            "backend": model_backend,
            "shape": f"{batch} x {seq_len}",
        }
        try:
            seconds = _time_forward_backward(
                args, settings, checkpointing, compiled, batch, steps, model_backend
            )
        except ImportError:
            raise
        except Exception as err:  # noqa: BLE001 - e.g. a compile failure: next variant
            rows.append(error_row(row, err))
            continue
        finally:
            free_memory(settings.device)
        row.update(
            {
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "tflops": flops / seconds / 1e12,
            }
        )
        if peak is not None:
            row["mfu"] = row["tflops"] / peak
            best_mfu = max(best_mfu or 0.0, row["mfu"])
        row["status"] = "INFO"
        rows.append(row)
    if best_mfu is not None:
        rows.append(
            {
                "what": f"best MFU vs goal {MFU_GOAL:.0%}",
                "mfu": best_mfu,
                "status": settings.verdict(best_mfu >= MFU_GOAL),
            }
        )
    peak_text = f"{peak:g} TFLOP/s" if peak is not None else "unknown (no --peak-tflops)"
    return PartResult(
        columns=[
            ("what", "what", ""),
            ("backend", "model.backend", ""),
            ("shape", "batch x seq", ""),
            ("seconds", "s / step", ".3f"),
            ("tokens_per_s", "tokens/s", ",.0f"),
            ("tflops", "TFLOP/s", ".1f"),
            ("mfu", "MFU", ".1%"),
        ],
        rows=rows,
        notes=[
            f"Model: {args.num_layers} layers of dim {args.embed_dim}, {args.num_heads}/"
            f"{args.num_kv_heads} heads of {args.head_dim}, ffn {args.intermediate_dim}, vocab "
            f"{args.vocab_size} (at full size Qwen3-8B's shape, as many layers as fit), bf16, "
            f"chunked log-prob head; median of {steps} "
            "steps after 3 warm-ups. FLOPs per step: tokens x (6 N + 6 L s H d_head) "
            f"= {flops / 1e12:.1f} TFLOP (recomputation not counted); peak {peak_text}.",
            f"torch.compile: torchtune's per-layer compile_model, backend {backend} "
            "(TORCH_COMPILE_BACKEND).",
        ],
    )
