"""Replay recorded agent steps through several teacher models (trace-replay DPO, step 1 of 2).

Channel 3 of composer-tune's data is this project's own research addition, not part of Cursor's
published Composer recipe: every step of an agent trace (``Step`` JSONL from
``tools/ingest_traces.py``) is shown to several teacher models behind OpenAI-compatible APIs, each
proposes the next action, and ``tools/build_pairs.py`` turns their (dis)agreement with the action
the agent took into DPO preference pairs.

Example::

    export OPENROUTER_API_KEY=...        # the config names the variable, never the key
    python tools/replay_traces.py --steps steps.jsonl --teachers configs/teachers_example.yaml \\
        --cache-dir cache/replay --out replayed.jsonl --budget-usd 5 --limit 200

Every step is redacted (``composer_tune.data.redact``) before anything is sent. Answers are cached
per request under --cache-dir: rerunning the same command costs nothing, an interrupted or
budget-stopped run resumes where it stopped, and raising --limit or --budget-usd only pays for
the new work. Tool definitions are inferred per session from all the steps in --steps (not only
the first --limit), so changing --limit does not change any request.

Outputs: --out (one JSON line per step: redacted step, tools, each teacher's action or failure,
tokens, USD), <out>.failures.jsonl (each (step, teacher) that failed for good, with the reason),
<out>.report.json (requests, cache hits, failures, tokens, USD, latency p50/p95 per teacher).

Bias warning: if the model whose traces you replay is also a teacher, it tends to agree with its
own actions, which biases the disagreement signal; leave it out or exclude it when mining pairs.

Exit status: 0 when done, 3 when the spend budget stopped the run (rerun with a larger budget to
finish), 1 on a configuration or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from composer_tune.data.traces.schema import Step
from composer_tune.teachers.cache import ResponseCache
from composer_tune.teachers.config import RetryPolicy, TeacherConfigError, load_teachers
from composer_tune.teachers.engine import ReplayEngine
from composer_tune.teachers.redaction import RedactorUnavailableError, load_redactor

EXIT_BUDGET_STOPPED = 3


class StepsFileError(ValueError):
    """A line of the steps JSONL is not a valid ``Step``; the message names file and line."""


def read_steps(path: Path) -> Iterator[Step]:
    """Stream ``Step``s from a JSONL file (blank lines skipped)."""
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield Step.from_dict(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise StepsFileError(
                    f"{path}:{line_number}: not a valid Step: {error!r}"
                ) from error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=Path, required=True, help="Step JSONL to replay")
    parser.add_argument(
        "--teachers",
        type=Path,
        required=True,
        help="teacher YAML (see configs/teachers_example.yaml)",
    )
    parser.add_argument("--cache-dir", type=Path, required=True, help="response cache directory")
    parser.add_argument("--out", type=Path, required=True, help="replayed steps JSONL to write")
    parser.add_argument(
        "--budget-usd",
        type=float,
        required=True,
        help="stop issuing new requests once this much USD would be spent in this run "
        "(0 = answer from the cache only)",
    )
    parser.add_argument(
        "--redact-config",
        type=Path,
        default=None,
        help="redaction rules YAML (composer_tune.data.redact); default: built-in rules",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N steps")
    parser.add_argument("--max-attempts", type=int, default=5, help="HTTP attempts per request")
    parser.add_argument(
        "--base-delay-s", type=float, default=1.0, help="first retry backoff (doubles per attempt)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the replay; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.limit is not None and args.limit < 0:
        print("error: --limit must be >= 0", file=sys.stderr)
        return 1
    try:
        teachers = load_teachers(args.teachers)
        if args.budget_usd != 0:  # budget 0 answers from the cache only: no key needed
            for teacher in teachers:
                teacher.api_key()  # fail before any work if a key variable is missing
        engine = ReplayEngine(
            teachers,
            cache=ResponseCache(args.cache_dir),
            redactor=load_redactor(args.redact_config),
            budget_usd=args.budget_usd,
            retry=RetryPolicy(max_attempts=args.max_attempts, base_delay_s=args.base_delay_s),
        )
        # First pass: per-session tool catalogs and the step count for the progress bar.
        catalogs = engine.tool_catalogs(read_steps(args.steps))
        total = sum(1 for _ in read_steps(args.steps))
        if args.limit is not None:
            total = min(total, args.limit)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tqdm(total=total, unit="step", desc="replay") as bar:
            report = engine.replay(
                read_steps(args.steps),
                out_path=args.out,
                failures_path=args.out.with_name(args.out.name + ".failures.jsonl"),
                catalogs=catalogs,
                limit=args.limit,
                on_step_done=lambda: bar.update(1),
            )
    except (TeacherConfigError, RedactorUnavailableError, StepsFileError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report_path = args.out.with_name(args.out.name + ".report.json")
    report_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    print(report.format())
    print(f"wrote {args.out}, {report_path}")
    return EXIT_BUDGET_STOPPED if report.stopped_by_budget else 0


if __name__ == "__main__":
    sys.exit(main())
