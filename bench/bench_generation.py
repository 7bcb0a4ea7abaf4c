"""Tokens/s of ``composer_tune.rollout.generate`` against ``transformers``' ``generate``.

Both run the same random Qwen3 weights (ours saved as a Hugging Face checkpoint and loaded with
``AutoModelForCausalLM``), the same left-padded prompts of different lengths, and produce
exactly ``--new-tokens`` tokens per row (no stop token). Greedy runs also report how many rows
the two implementations decode identically, a cross-check of the KV-cache and padding logic.

    .venv/bin/python bench/bench_generation.py --batch-sizes 8 32 --new-tokens 64
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
from composer_tune.models import qwen3_tiny
from composer_tune.rollout import generate

# Keyword arguments of qwen3_tiny; "small" is closer to real per-token costs (bigger matmuls,
# a larger vocabulary for the sampling step).
PRESETS = {
    "tiny": {"vocab_size": 512},
    "small": {
        "vocab_size": 8192,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "embed_dim": 256,
        "intermediate_dim": 768,
        "head_dim": 32,
    },
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
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt; others 50-100%")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    # One thread by default: on a shared machine, OpenMP workers waiting on each other swamp
    # the small kernels of a tiny model and make timings meaningless.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both models on it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    # A wide init keeps greedy decoding away from near-ties, so the cross-check is meaningful.
    model = qwen3_tiny(initializer_range=0.5, **PRESETS[args.preset]).eval()
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        save_hf_checkpoint(model.state_dict(), model.config, checkpoint_dir)
        hf_model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    model.to(args.device)
    hf_model.to(args.device)
    vocab = PRESETS[args.preset]["vocab_size"]
    print(
        f"preset={args.preset} params={sum(p.numel() for p in model.parameters()):,} "
        f"prompt<= {args.prompt_len} new={args.new_tokens} threads={torch.get_num_threads()} "
        f"device={args.device}"
    )
    modes = {
        "greedy": ({"greedy": True}, {"do_sample": False}),
        "sample": (
            {"temperature": 1.0, "top_p": 0.9},
            {"do_sample": True, "temperature": 1.0, "top_p": 0.9, "top_k": None},
        ),
    }
    print(f"{'mode':<7}{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>12}{'speed-up':>10}  rows equal")
    for batch in args.batch_sizes:
        prompts = [
            torch.randint(
                1, vocab, (int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, ())),)
            ).tolist()
            for _ in range(batch)
        ]
        for mode, (ours_kwargs, hf_kwargs) in modes.items():
            (ours_time, hf_time), (ours_out, hf_out) = _best_times(
                [
                    functools.partial(
                        generate,
                        model,
                        prompts,
                        max_new_tokens=args.new_tokens,
                        pad_id=PAD_ID,
                        **ours_kwargs,
                    ),
                    functools.partial(_hf_generate, hf_model, prompts, args.new_tokens, hf_kwargs),
                ],
                args.repeats,
            )
            total = batch * args.new_tokens
            equal = "-"
            if mode == "greedy":
                same = sum(a == b for a, b in zip(ours_out.completions, hf_out, strict=True))
                equal = f"{same}/{batch}"
            print(
                f"{mode:<7}{batch:>6}{total / ours_time:>12.0f}{total / hf_time:>12.0f}"
                f"{hf_time / ours_time:>9.2f}x  {equal}"
            )


if __name__ == "__main__":
    main()
