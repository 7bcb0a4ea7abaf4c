"""Rollout tokens/s of the native engine (``composer_tune.rollout.generate``), ``transformers``'
``generate`` and, when it is installed, the vLLM engine (``rollout.engine: vllm``).

All run the same weights (random Qwen3 presets, or SmolLM2-135M-Instruct's real ones; saved as
a Hugging Face checkpoint for ``AutoModelForCausalLM``, pushed from our model into vLLM), the
same prompts of different lengths, and produce exactly ``--new-tokens`` tokens per row (no stop
token). Greedy runs also report how many rows each peer decodes identically to ours, a
cross-check of the KV-cache and padding logic.

    .venv/bin/python bench/bench_generation.py --batch-sizes 8 32 --new-tokens 64
    .venv/bin/python bench/bench_generation.py --preset smollm2 --batch-sizes 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from composer_tune.checkpointing import save_hf_checkpoint
from composer_tune.checkpointing.gguf_import import smollm2_checkpoint
from composer_tune.checkpointing.hf_checkpoint import load_decoder_from_hf
from composer_tune.distributed import DistInfo
from composer_tune.models import qwen3_tiny
from composer_tune.rollout import generate
from composer_tune.rollout.engines import VLLMSection, vllm_available

# Keyword arguments of qwen3_tiny; "small" is closer to real per-token costs (bigger matmuls,
# a larger vocabulary for the sampling step).
PRESETS = {
    # recipes/configs/grpo/cpu_smoke.yaml's model (head_dim 32: vLLM's CPU attention has no
    # kernel for qwen3_tiny's default 16).
    "tiny": {
        "vocab_size": 994,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 128,
        "intermediate_dim": 384,
        "head_dim": 32,
    },
    "small": {
        "vocab_size": 8192,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "embed_dim": 256,
        "intermediate_dim": 768,
        "head_dim": 32,
    },
    # Qwen3-0.6B's layer shape and vocabulary, 4 of its 28 layers.
    "qwen3-0.6b-4l": {
        "vocab_size": 151_936,
        "num_layers": 4,
        "num_heads": 16,
        "num_kv_heads": 8,
        "embed_dim": 1024,
        "intermediate_dim": 3072,
        "head_dim": 128,
    },
    "smollm2": None,  # SmolLM2-135M-Instruct's real weights (the README's set-up installs it)
}
PAD_ID = 0


def _best_times(runs: list[Callable[[], object]], repeats: int) -> tuple[list[float], list[object]]:
    """Fastest wall time of each run over ``repeats`` rounds (after a warm-up round).

    The runs take turns within each round, so a burst of load from other processes on a shared
    machine hits all of them alike rather than one.

    Returns:
        The best time and the last result of each run.
    """
    results = [run() for run in runs]
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for index, run in enumerate(runs):
            start = time.perf_counter()
            results[index] = run()
            best[index] = min(best[index], time.perf_counter() - start)
    return best, results


def _hf_generate(hf_model, prompts: list[list[int]], new_tokens: int, sampling: dict):
    """Left-pad for transformers and return the new tokens per row as lists."""
    width = max(len(p) for p in prompts)
    device = hf_model.device
    input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
    )
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=PAD_ID,
            eos_token_id=None,
            **sampling,
        )
    return out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument(
        "--prompt-len", type=int, default=32, help="longest prompt; others 50-100%%"
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    # One thread by default: on a shared machine, OpenMP workers waiting on each other swamp
    # the small kernels of a tiny model and make timings meaningless.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every engine on it)")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM engine out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    if args.preset == "smollm2":
        model = load_decoder_from_hf(smollm2_checkpoint()).eval()
    else:
        # A wide init keeps greedy decoding away from near-ties: the cross-check means more.
        preset = PRESETS[args.preset]
        model = qwen3_tiny(initializer_range=0.5, max_seq_len=1024, **preset).eval()
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        save_hf_checkpoint(model.state_dict(), model.config, checkpoint_dir)
        hf_model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    model.to(args.device)
    hf_model.to(args.device)
    engine = None
    if vllm_available() and not args.no_vllm:
        from composer_tune.rollout.vllm_engine import VLLMEngine

        dist_info = DistInfo(world_size=1, rank=0, device=torch.device(args.device))
        engine = VLLMEngine(model, dist_info, VLLMSection(), run_dtype="fp32", seed=0)
    vocab = model.config.vocab_size
    print(
        f"preset={args.preset} params={sum(p.numel() for p in model.parameters()):,} "
        f"prompt<= {args.prompt_len} new={args.new_tokens} threads={torch.get_num_threads()} "
        f"device={args.device} vllm={'yes' if engine else 'no'}"
    )
    modes = {
        "greedy": ({"greedy": True}, {"do_sample": False}),
        "sample": (
            {"temperature": 1.0, "top_p": 0.9},
            {"do_sample": True, "temperature": 1.0, "top_p": 0.9, "top_k": None},
        ),
    }
    print(
        f"{'mode':<7}{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>10}{'vLLM tok/s':>12}"
        f"{'HF/ours':>9}{'vLLM/ours':>11}  rows equal (HF, vLLM)"
    )
    for batch in args.batch_sizes:
        prompts = [
            torch.randint(
                1, vocab, (int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, ())),)
            ).tolist()
            for _ in range(batch)
        ]
        for mode, (ours_kwargs, hf_kwargs) in modes.items():
            runs = [
                functools.partial(
                    generate,
                    model,
                    prompts,
                    max_new_tokens=args.new_tokens,
                    pad_id=PAD_ID,
                    **ours_kwargs,
                ),
                functools.partial(_hf_generate, hf_model, prompts, args.new_tokens, hf_kwargs),
            ]
            if engine is not None:
                vllm_kwargs = {"temperature": 0.0} if mode == "greedy" else ours_kwargs
                runs.append(
                    functools.partial(
                        engine.generate, prompts, max_new_tokens=args.new_tokens, **vllm_kwargs
                    )
                )
            times, outputs = _best_times(runs, args.repeats)
            total = batch * args.new_tokens
            rates = [total / seconds for seconds in times] + [None] * (3 - len(times))
            equal = "-"
            if mode == "greedy":
                ours = outputs[0].completions
                peers = [outputs[1], *(out.completions for out in outputs[2:])]
                equal = ", ".join(
                    f"{sum(a == b for a, b in zip(ours, peer, strict=True))}/{batch}"
                    for peer in peers
                )
            vllm_rate = f"{rates[2]:>12.0f}" if rates[2] else f"{'-':>12}"
            vllm_ratio = f"{rates[2] / rates[0]:>10.2f}x" if rates[2] else f"{'-':>11}"
            print(
                f"{mode:<7}{batch:>6}{rates[0]:>12.0f}{rates[1]:>10.0f}{vllm_rate}"
                f"{rates[1] / rates[0]:>8.2f}x{vllm_ratio}  {equal}"
            )
    if engine is not None:
        engine.close()


if __name__ == "__main__":
    main()
