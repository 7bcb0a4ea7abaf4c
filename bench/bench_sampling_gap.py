"""How far the sampler's log-probs are from the trainer's, on SmolLM2-135M-Instruct (fp32).

Rollouts come from ``collect_rollouts`` (the native KV-cache engine); the trainer's log-probs
are its no-grad full forward (``old_logp``). Prints, per sampling setting, the mean and max
``|old_logp - sampling_logp|`` over the completion tokens and the range of their ratio, which
``loss.sampling_correction`` would reweight by. With ``top_k``/``top_p`` the sampler reports the
log-probs of the truncated distribution it drew from, the trainer those of the full one.

    .venv/bin/python bench/bench_sampling_gap.py --threads 1
"""

from __future__ import annotations

import argparse

import torch

from composer_tune.checkpointing import load_decoder_from_hf
from composer_tune.checkpointing.gguf_import import smollm2_checkpoint
from composer_tune.data.synthetic import SyntheticArithmetic
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout.rollouts import collect_rollouts

SETTINGS = (
    {"temperature": 1.0, "top_k": None, "top_p": None},
    {"temperature": 0.7, "top_k": None, "top_p": None},
    {"temperature": 1.0, "top_k": 50, "top_p": None},
    {"temperature": 1.0, "top_k": None, "top_p": 0.9},
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    checkpoint = smollm2_checkpoint()
    model = load_decoder_from_hf(checkpoint).eval()
    tokenizer = ChatTokenizer.from_dir(checkpoint)
    data = SyntheticArithmetic(split="train", num_samples=args.prompts, seed=0, min_digits=1)
    samples = [data[i] for i in range(args.prompts)]
    print(
        f"SmolLM2-135M-Instruct fp32, {args.prompts} prompts x {args.group_size}, "
        f"{args.threads} thread(s)"
    )
    print(
        "| temperature | top_k | top_p | tokens | mean abs gap | max abs gap | ratio min | ratio max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for setting in SETTINGS:
        batch = collect_rollouts(
            model,
            tokenizer,
            samples,
            MathAnswerReward(),
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            generator=torch.Generator().manual_seed(0),
            forward_batch_size=args.prompts,
            enable_thinking=True,  # SmolLM2's template has no thinking switch: send none
            **setting,
        )
        gap = (batch.old_logp - batch.sampling_logp)[batch.completion_mask].double()
        ratio = gap.exp()
        print(
            f"| {setting['temperature']} | {setting['top_k']} | {setting['top_p']} | "
            f"{gap.numel()} | {gap.abs().mean():.2e} | {gap.abs().max():.2e} | "
            f"{ratio.min():.4f} | {ratio.max():.4f} |"
        )


if __name__ == "__main__":
    main()
