"""Write (and validate) the synthetic Python function-synthesis tasks of the code ladder.

Generates every split of ``composer_tune.data.code_tasks`` (train, heldout_templates,
heldout_params), runs each task through the split grader (the reference passes every hidden
test; an empty body, ``return None`` and returning the first argument each fail), and writes
one JSONL file per split plus ``manifest.json`` (counts per split, category and difficulty).
A task that does not validate stops the tool with its id and reason; nothing is written.

    python tools/make_code_tasks.py                       # tests/assets/code_tasks (shipped)
    python tools/make_code_tasks.py --out /tmp/tasks --train-per-template 16 --seed 1
    python tools/make_code_tasks.py --check               # re-grade the shipped files
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/make_code_tasks.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from composer_tune.data.code_tasks import (  # noqa: E402
    SPLITS,
    GenerationSettings,
    generate_tasks,
    read_tasks,
    split_path,
    validate_tasks,
    write_tasks,
)
from composer_tune.rewards import CodeExecutionReward  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "tests" / "assets" / "code_tasks"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = GenerationSettings()
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the JSONL files")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--train-per-template", type=int, default=defaults.train_per_template)
    parser.add_argument("--heldout-per-template", type=int, default=defaults.heldout_per_template)
    parser.add_argument("--heldout-per-param", type=int, default=defaults.heldout_per_param)
    parser.add_argument("--min-tests", type=int, default=defaults.min_tests)
    parser.add_argument("--workers", type=int, default=2, help="grader runs at once")
    parser.add_argument("--check", action="store_true", help="only re-grade the files in --out")
    args = parser.parse_args(argv)
    if min(args.train_per_template, args.heldout_per_template, args.heldout_per_param) < 1:
        parser.error("the per-template and per-parameter counts must be >= 1")
    if args.min_tests < 5:
        parser.error("--min-tests must be >= 5")
    return args


def manifest(splits: dict[str, list[dict]], settings: GenerationSettings) -> dict:
    """Counts per split, category and difficulty, and the settings that made them."""
    return {
        "settings": dataclasses.asdict(settings),
        "command": "python tools/make_code_tasks.py",
        "splits": {
            split: {
                "tasks": len(tasks),
                "templates": len({task["template"] for task in tasks}),
                "by_category": dict(
                    sorted(collections.Counter(t["category"] for t in tasks).items())
                ),
                "by_difficulty": dict(
                    sorted(collections.Counter(str(t["difficulty"]) for t in tasks).items())
                ),
            }
            for split, tasks in splits.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reward = CodeExecutionReward(max_workers=args.workers)
    if args.check:
        splits = {split: read_tasks(split_path(args.out, split)) for split in SPLITS}
    else:
        settings = GenerationSettings(
            train_per_template=args.train_per_template,
            heldout_per_template=args.heldout_per_template,
            heldout_per_param=args.heldout_per_param,
            min_tests=args.min_tests,
            seed=args.seed,
        )
        splits = generate_tasks(settings)
    started = time.monotonic()
    tasks = [task for split in SPLITS for task in splits[split]]
    report = validate_tasks(tasks, reward)
    elapsed = time.monotonic() - started
    if not report.ok:
        for task_id, reason in report.refused.items():
            print(f"refused {task_id}: {reason}", file=sys.stderr)
        print(
            f"error: {len(report.refused)} of {report.checked} tasks do not validate",
            file=sys.stderr,
        )
        return 1
    print(f"{report.checked} tasks validate through the split grader ({elapsed:.0f} s)")
    if not args.check:
        write_tasks(splits, args.out)
        summary = manifest(splits, settings)
        (args.out / "manifest.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}: " + ", ".join(f"{s} {len(splits[s])}" for s in SPLITS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
