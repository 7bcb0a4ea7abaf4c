"""The ``sampling`` part: tokens/s of the native engine (CUDA graphs and eager) against
``transformers``' static-cache ``generate`` and vLLM, each against the weight-read bound."""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from composer_tune.gpu_check.common import (
    GIB,
    PEAK_BANDWIDTH_TBS,
    SAMPLING_GOAL,
    MissingDependency,
    PartResult,
    Settings,
    error_row,
    free_memory,
    require,
    synchronize,
)
from composer_tune.gpu_check.speed import build_stack, fitting_qwen3_8b


def peak_bandwidth(settings: Settings) -> float | None:
    """The device's memory bandwidth in bytes/s: ``--peak-bandwidth`` (TB/s), else from its
    name (None: unknown)."""
    if settings.peak_bandwidth_tbs is not None:
        return settings.peak_bandwidth_tbs * 1e12
    if settings.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(settings.device)
    return next((tbs * 1e12 for key, tbs in PEAK_BANDWIDTH_TBS if key in name), None)


def sampling_shape(settings: Settings, max_seq_len: int, rows: int) -> Any:
    """Qwen3-8B with as many layers as fit the GPU with a KV cache for ``rows`` rows (a toy
    Qwen3 with ``--tiny``)."""
    from composer_tune.analysis import memory

    def fits(args: Any, capacity: float) -> bool:
        weights = 2 * memory.count_params(args)
        cache = 2 * 2 * args.num_layers * args.num_kv_heads * args.head_dim * max_seq_len * rows
        # Half the card: the model, its cache, the step's activations and logits, and the
        # peers' compiled graphs and memory pools.
        return weights + cache <= 0.5 * capacity * GIB

    return fitting_qwen3_8b(settings, max_seq_len, fits)


def _timed(device: torch.device, run: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``run()`` (after one untimed warm-up call: compilation, graphs, allocator)
    and its result."""
    run()
    synchronize(device)
    start = time.perf_counter()
    result = run()
    synchronize(device)
    return time.perf_counter() - start, result


def _native_sampling(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new: int,
    device: torch.device,
    cuda_graphs: bool,
    greedy: bool = False,
) -> tuple[float, Any]:
    from composer_tune.rollout.generation import generate

    sampler = torch.Generator(device=device).manual_seed(0)
    return _timed(
        device,
        lambda: generate(
            model,
            prompts,
            max_new_tokens=new,
            pad_id=0,
            greedy=greedy,
            generator=sampler,
            cuda_graphs=cuda_graphs,
        ),
    )


def _transformers_static_sampling(
    model: torch.nn.Module, prompts: list[list[int]], new: int, device: torch.device
) -> float:
    """Seconds of ``transformers``' ``generate`` with its static cache (on CUDA its decode step
    is compiled and replayed as CUDA graphs), every row to ``new`` tokens, temperature 1."""
    input_ids = torch.tensor(prompts, device=device)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": new,
        "min_new_tokens": new,
        "cache_implementation": "static",
        "pad_token_id": 0,
        "eos_token_id": None,
    }
    with torch.inference_mode():
        seconds, _ = _timed(device, lambda: model.generate(**kwargs))
    return seconds


def _measure_vllm(
    config: Any,
    prompts: dict[int, list[list[int]]],
    new: int,
    measure: Callable[[str, int, Callable[[], float]], None],
) -> None:
    """vLLM (random weights: ``load_format="dummy"``, CUDA graphs on) sampling the same rows,
    one engine for every batch; a SKIPPED row where vLLM is not installed."""
    from composer_tune.checkpointing.hf_checkpoint import CONFIG_NAME

    try:
        require("vllm")
    except MissingDependency:
        measure("vLLM", max(prompts), functools.partial(require, "vllm"))  # its SKIPPED row
        return
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="gpu_check_vllm_") as config_dir:
        (Path(config_dir) / CONFIG_NAME).write_text(json.dumps(config.to_dict()))
        llm = LLM(
            model=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=len(next(iter(prompts.values()))[0]) + new,
            gpu_memory_utilization=0.5,
            seed=0,
        )
    params = SamplingParams(temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True)
    for rows, batch in prompts.items():
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in batch]
        measure(
            "vLLM",
            rows,
            lambda requests=requests: _timed(
                torch.device("cuda"), lambda: llm.generate(requests, params, use_tqdm=False)
            )[0],
        )


def _greedy_rows_identical(settings: Settings) -> dict[str, Any]:
    """Greedy rows of the CUDA-graph loop against the eager loop on a small fp32 Qwen3 whose
    wide initialisation keeps the argmax away from ties (float rounding may not flip it)."""
    from composer_tune.models import qwen3_tiny

    row: dict[str, Any] = {"what": "greedy rows, CUDA graphs vs eager loop", "rows": 16}
    if settings.device.type != "cuda":
        return {**row, "status": "SKIPPED", "note": "CUDA graphs need a GPU"}
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=1024, num_layers=4, initializer_range=0.5, max_seq_len=512)
    model = model.to(settings.device).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, 1024, (int(length),), generator=generator).tolist()
        for length in torch.randint(8, 65, (16,), generator=generator)
    ]
    _, eager = _native_sampling(model, prompts, 300, settings.device, False, greedy=True)
    _, graphed = _native_sampling(model, prompts, 300, settings.device, True, greedy=True)
    same = sum(a == b for a, b in zip(eager.completions, graphed.completions, strict=True))
    return {
        **row,
        "identical": f"{same}/16",
        "status": "PASS" if same == 16 else "FAIL",
        "note": "fp32, 8-64 prompt tokens, 300 new tokens: spans of 1 and 2 graph buckets",
    }


def _measure_native(
    args: Any,
    settings: Settings,
    prompts: dict[int, list[list[int]]],
    new: int,
    measure: Callable[[str, int, Callable[[], float]], None],
    name: str,
    graphs: bool,
    backend: str = "native",
) -> None:
    """The native engine on ``backend``'s model at each batch of ``prompts`` (with graphs on
    the native model also its eager loop, the engine as it was before them)."""
    model = build_stack(args, settings.device, checkpointing=False, backend=backend)
    for rows, batch in prompts.items():
        measure(
            name,
            rows,
            lambda batch=batch: _native_sampling(model, batch, new, settings.device, graphs)[0],
        )
        if graphs and backend == "native":
            measure(
                "native engine, eager loop",
                rows,
                lambda batch=batch: _native_sampling(model, batch, new, settings.device, False)[0],
            )


def _measure_transformers(
    config: Any,
    settings: Settings,
    prompts: dict[int, list[list[int]]],
    new: int,
    measure: Callable[[str, int, Callable[[], float]], None],
) -> None:
    from transformers import AutoModelForCausalLM

    with settings.device:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    for rows, batch in prompts.items():
        measure(
            "transformers generate, static cache",
            rows,
            lambda batch=batch: _transformers_static_sampling(model, batch, new, settings.device),
        )


def run_sampling(settings: Settings) -> PartResult:
    require("transformers", "torchtune", "omegaconf")
    from transformers import Qwen3Config

    from composer_tune.analysis import memory
    from composer_tune.checkpointing.hf_checkpoint import hf_config_from_decoder_args

    device = settings.device
    prompt_len, new = (16, 16) if settings.tiny else (128, 128)
    batches = (2, 8) if settings.tiny else (8, 64)
    args = sampling_shape(settings, prompt_len + new, max(batches))
    bandwidth = peak_bandwidth(settings)
    # Bytes a decode step must read: every matmul weight (the embedding is looked up, not read).
    weight_bytes = 2 * memory.count_matmul_params(args)
    generator = torch.Generator().manual_seed(0)
    prompts = {
        rows: torch.randint(1, args.vocab_size, (rows, prompt_len), generator=generator).tolist()
        for rows in batches
    }
    graphs = device.type == "cuda"
    rows_out: list[dict[str, Any]] = []
    rates: dict[tuple[str, int], float] = {}

    def measure(name: str, rows: int, seconds_of: Callable[[], float]) -> None:
        row: dict[str, Any] = {"what": name, "rows": rows}
        try:
            seconds = seconds_of()
        except (ImportError, MissingDependency) as err:
            rows_out.append({**row, "status": "SKIPPED", "note": str(err)[:200]})
            return
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: the next peer
            rows_out.append(error_row(row, err))
            return
        finally:
            free_memory(device)
        rate = rows * new / seconds
        rates[(name, rows)] = rate
        row.update(seconds=seconds, tokens_per_s=rate, ms_per_step=1e3 * seconds / new)
        if bandwidth is not None:
            row["of_bound"] = rate / (rows * bandwidth / weight_bytes)
        rows_out.append({**row, "status": "INFO"})

    native_name = "native engine, CUDA graphs" if graphs else "native engine (no graphs off CUDA)"
    # One model on the device at a time; each is freed when its function returns.
    _measure_native(args, settings, prompts, new, measure, native_name, graphs)
    _measure_native(
        args,
        settings,
        {max(batches): prompts[max(batches)]},
        new,
        measure,
        "native engine on the transformers backend",
        graphs,
        backend="transformers",
    )
    config = Qwen3Config(**hf_config_from_decoder_args(args, torch.bfloat16))
    _measure_transformers(config, settings, prompts, new, measure)
    if device.type == "cuda":
        _measure_vllm(config, prompts, new, measure)
    for rows in batches:
        ours, theirs = (
            rates.get((native_name, rows)),
            rates.get(("transformers generate, static cache", rows)),
        )
        if ours is not None and theirs is not None:
            rows_out.append(
                {
                    "what": f"native engine / transformers static cache, goal >= {SAMPLING_GOAL:g}",
                    "rows": rows,
                    "ratio": ours / theirs,
                    "status": settings.verdict(ours / theirs >= SAMPLING_GOAL),
                }
            )
    rows_out.append(_greedy_rows_identical(settings))
    bound_text = f"{bandwidth / 1e12:g} TB/s" if bandwidth else "unknown (no --peak-bandwidth)"
    return PartResult(
        columns=[
            ("what", "what", ""),
            ("rows", "rows", "d"),
            ("seconds", "s", ".3f"),
            ("ms_per_step", "ms / token step", ".2f"),
            ("tokens_per_s", "tokens/s", ",.0f"),
            ("of_bound", "of weight-read bound", ".1%"),
            ("ratio", "ratio", ".2f"),
            ("identical", "identical", ""),
        ],
        rows=rows_out,
        notes=[
            f"Model: {args.num_layers} layers of Qwen3-8B's shape (at full size as many as "
            f"fit half the card with the cache; a toy Qwen3 with --tiny), random weights, bf16; "
            f"{prompt_len}-token prompts, every row sampled to {new} new tokens at temperature "
            "1 (no stop token); each figure is the second of two identical calls (the first "
            "compiles, captures and warms up).",
            f"Weight-read bound: rows x bandwidth / bytes of the matmul weights "
            f"({weight_bytes / GIB:.2f} GiB) per token step; bandwidth {bound_text}.",
            "transformers: generate(cache_implementation='static'), which on CUDA compiles the "
            "decode step and replays it as CUDA graphs. vLLM: load_format='dummy' (random "
            "weights), CUDA graphs on, where installed.",
        ],
    )
