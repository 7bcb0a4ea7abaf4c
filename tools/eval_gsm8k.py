"""Pass@1 of a Hugging Face-format checkpoint (Llama, Qwen2 or Qwen3) on GSM8K (or a slice of it).

    python tools/eval_gsm8k.py outputs/grpo_cpu_smoke/checkpoints/step_0000040
    python tools/eval_gsm8k.py CKPT --source openai/gsm8k --limit 200 --max-new-tokens 512
    python tools/eval_gsm8k.py CKPT --temperature 0.7 --top-p 0.95 --seed 1   # sampled pass@1

Greedy decoding by default; ``--temperature > 0`` samples one completion per problem (sampled
pass@1, reproducible with ``--seed``). Completions are decoded with the KV-cache generator
(``composer_tune.rollout.generate``) in batches and judged exactly as training judges them:
``MathAnswerReward`` decides correctness, and the ``extracted`` column is its extractor's reading
of the final answer (``extract_answer`` after the last ``</think>``). Prints the accuracy and
writes one JSON line per problem: id, question, gold, completion, extracted, correct,
completion_tokens, truncated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/eval_gsm8k.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from composer_tune.checkpointing.run_state import MODEL_DIR  # noqa: E402
from composer_tune.data.gsm8k import GSM8K  # noqa: E402
from composer_tune.data.tokenizer import ChatTokenizer  # noqa: E402
from composer_tune.models.build import load_pretrained  # noqa: E402
from composer_tune.models.pretrained import BACKENDS  # noqa: E402
from composer_tune.rewards import MathAnswerReward  # noqa: E402
from composer_tune.rewards.answer import extract_answer, final_response  # noqa: E402
from composer_tune.rollout import encode_prompts, generate  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SOURCE = str(REPO_ROOT / "tests" / "assets" / "gsm8k")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint",
        help="Hugging Face directory (config.json + weights), or a run checkpoint holding one "
        "in model/",
    )
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's)")
    parser.add_argument(
        "--source", default=DEFAULT_SOURCE, help="GSM8K JSONL, directory or hub name"
    )
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--offset", type=int, default=0, help="first problem evaluated")
    parser.add_argument("--limit", type=int, help="problems evaluated from --offset (default all)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled pass@1"
    )
    parser.add_argument("--top-p", type=float, help="nucleus sampling (only with --temperature)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--enable-thinking",
        action="store_true",
        help="the chat template's enable_thinking (Qwen3's thinking mode)",
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="model backend (composer_tune.models.from_pretrained): auto, native or transformers",
    )
    parser.add_argument(
        "--threads", type=int, help="torch.set_num_threads (default: torch's; 1 on a busy CPU)"
    )
    parser.add_argument(
        "--output", default="outputs/eval_gsm8k.jsonl", help="per-example results (JSONL)"
    )
    args = parser.parse_args(argv)
    if args.offset < 0:
        parser.error(f"--offset must be >= 0, got {args.offset}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if min(args.batch_size, args.max_new_tokens, args.threads or 1) < 1:
        parser.error("--batch-size, --max-new-tokens and --threads must be >= 1")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_p is not None and args.temperature == 0:
        parser.error("--top-p only applies to sampling: also pass --temperature > 0")
    return args


def load_tokenizer(checkpoint: Path, tokenizer_dir: str | None) -> ChatTokenizer:
    """The tokenizer of ``--tokenizer``, else the one saved with the checkpoint.

    Raises:
        FileNotFoundError: naming the directory that lacks ``vocab.json``/``merges.txt``.
    """
    directory = Path(tokenizer_dir) if tokenizer_dir is not None else checkpoint
    missing = [name for name in ("vocab.json", "merges.txt") if not (directory / name).is_file()]
    if missing:
        hint = "" if tokenizer_dir is not None else "; pass --tokenizer DIR"
        raise FileNotFoundError(f"no tokenizer in {directory} ({', '.join(missing)} missing){hint}")
    return ChatTokenizer.from_dir(directory)


def select_problems(dataset: GSM8K, offset: int, limit: int | None) -> list[dict[str, Any]]:
    """Samples ``offset .. offset + limit - 1`` of ``dataset`` (to its end without a limit)."""
    if offset >= len(dataset):
        raise ValueError(
            f"--offset {offset} is past the end of the split ({len(dataset)} problems)"
        )
    end = len(dataset) if limit is None else min(offset + limit, len(dataset))
    return [dataset[index] for index in range(offset, end)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer: ChatTokenizer,
    samples: list[dict[str, Any]],
    *,
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float | None,
    generator: torch.Generator | None,
    enable_thinking: bool,
) -> list[dict[str, Any]]:
    """One completion per sample, judged by ``MathAnswerReward``; a record per sample, in order.

    Prompts are batched longest first, so similar lengths share a batch (less padding) and an
    out-of-memory error shows up in the first batch rather than the last.
    """
    reward = MathAnswerReward()
    prompts = encode_prompts(tokenizer, samples, enable_thinking=enable_thinking)
    order = sorted(range(len(samples)), key=lambda index: -len(prompts[index]))
    records: list[dict[str, Any] | None] = [None] * len(samples)
    for start in tqdm(range(0, len(order), batch_size), desc="gsm8k", unit="batch"):
        batch = order[start : start + batch_size]
        output = generate(
            model,
            [prompts[index] for index in batch],
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_id,
            temperature=temperature,
            top_p=top_p,
            stop_tokens=tokenizer.stop_tokens,
            generator=generator,
        )
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in output.completions]
        results = reward(texts, [samples[index] for index in batch])
        for row, index in enumerate(batch):
            sample = samples[index]
            records[index] = {
                "id": sample["id"],
                "question": sample["prompt"][-1]["content"],
                "gold": sample["answer"],
                "completion": texts[row],
                # The reward's own reading of the answer (it strips the reasoning first).
                "extracted": extract_answer(final_response(texts[row])),
                "correct": bool(results[row].correct),
                "completion_tokens": int(output.completion_lengths[row]),
                "truncated": bool(output.truncated[row]),
            }
    return [record for record in records if record is not None]


def main(argv: list[str] | None = None) -> float:
    """Run the evaluation; returns the accuracy."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {checkpoint}")
    if (checkpoint / MODEL_DIR / "config.json").is_file():  # a recipe's run checkpoint
        checkpoint = checkpoint / MODEL_DIR
    tokenizer = load_tokenizer(checkpoint, args.tokenizer)
    device = torch.device(args.device)
    model = load_pretrained(
        checkpoint, dtype=DTYPES[args.dtype], backend=args.backend, device=device
    )
    dataset = GSM8K(split=args.split, source=args.source)
    samples = select_problems(dataset, args.offset, args.limit)
    generator = None
    if args.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(args.seed)
    records = evaluate(
        model,
        tokenizer,
        samples,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        generator=generator,
        enable_thinking=args.enable_thinking,
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    correct = sum(record["correct"] for record in records)
    accuracy = correct / len(records)
    mode = (
        "greedy" if args.temperature == 0 else f"sampled (T={args.temperature}, seed={args.seed})"
    )
    print(
        f"GSM8K {args.split} [{args.offset}:{args.offset + len(records)}] {mode} pass@1: "
        f"accuracy {accuracy:.4f} ({correct}/{len(records)}); results in {output}"
    )
    return accuracy


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as err:  # bad paths or settings: say which, no trace
        sys.exit(f"eval_gsm8k: {err}")
