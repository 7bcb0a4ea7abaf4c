"""What the split grader costs: CodeExecutionReward (solution and tests in two sandboxes joined
by a pipe, docs/grader.md) against the single-process harness it replaced (solution and tests in
one sandboxed interpreter, the negative control of tests/test_grader_hostile.py), on the shipped
coding problems' reference solutions, measured in the same run.

    .venv/bin/python bench/bench_split_grader.py --threads 1 --workers 2
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_tune.data.coding import load_coding_dataset  # noqa: E402
from composer_tune.rewards.coding import CodeExecutionReward  # noqa: E402
from composer_tune.rewards.sandbox import SandboxLimits, run_many  # noqa: E402
from tests.test_grader_hostile import _NAIVE_HARNESS  # noqa: E402

PROBLEMS = Path(__file__).resolve().parents[1] / "tests" / "assets" / "coding" / "problems.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="completions graded at once")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples = load_coding_dataset(PROBLEMS)
    limits = SandboxLimits(wall_time_s=20.0, cpu_time_s=20.0)
    reward = CodeExecutionReward(limits=limits, max_workers=args.workers)
    completions = [f"```python\n{s['solution']}\n```" for s in samples]
    programs = [
        _NAIVE_HARNESS.replace("ARGUMENTS", f"{s['solution']!r}, {s['tests']!r}") for s in samples
    ]
    print(f"{len(samples)} completions, {args.workers} at once, {args.threads} thread(s)")
    print(f"{'repeat':>6} {'split (s)':>10} {'single-process (s)':>19} {'ratio':>6}")
    for repeat in range(args.repeats):
        start = time.perf_counter()
        scores = [r.score for r in reward(completions, samples)]
        split = time.perf_counter() - start
        start = time.perf_counter()
        nonces = [secrets.token_hex(16) + "\n" for _ in programs]
        run_many(programs, limits=limits, max_workers=args.workers, stdins=nonces)
        single = time.perf_counter() - start
        assert scores == [1.0] * len(samples), scores
        print(f"{repeat:>6} {split:>10.2f} {single:>19.2f} {split / single:>6.2f}")


if __name__ == "__main__":
    main()
