#!/usr/bin/env python
"""A model's memorisation of a feature-task store's sources, measured before training.

For K deletion tasks of each source (spread over its tasks; bug tasks are skipped, they delete
no code), the model at MODEL_DIR (a Hugging Face checkpoint directory) answers the task's
statement once, greedily, without tools; its code takes the deleted lines' place and the hidden
tests decide (pass without work). It also continues the original file up to the deleted lines
as plain text (verbatim recall: the share of the deleted code, in normalised characters, it
writes out before the first difference). Prints one line per task and a table per source:
tasks probed, pass rate, mean recall and the tasks the sandbox could not grade (unscored, never
counted as failures). How both are measured and their limits:
composer_tune/data/feature_memorisation.py; docs/feature_tasks.md.

--write-counts stores each probed source's summary in the store's counts.json under
"memorisation" (model, date, tasks, pass_rate, recall, unscored), the rest of the file as it
was; --out writes every task's measures and the table as JSON.

Examples:
    python tools/probe_memorisation.py ~/.cache/composer_tune/smollm2-135m-instruct-0.1.2-fp32 \
        --store tests/assets/feature_tasks --per-source 2 --threads 1 --write-counts
    python tools/probe_memorisation.py CKPT --store my_tasks --per-source 1 --out memo.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_tune.data import feature_memorisation as memo  # noqa: E402
from composer_tune.data.chat_template import add_no_thinking_argument  # noqa: E402
from composer_tune.data.feature_tasks import FeatureTaskError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    summary, details = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="HF checkpoint dir")
    parser.add_argument("--store", type=Path, required=True, help="the task store folder")
    parser.add_argument(
        "--per-source", type=int, default=2, metavar="K", help="deletion tasks per source"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=memo.RECALL_CONTEXT_TOKENS,
        help="recall: the file's last tokens before the deleted lines the model sees",
    )
    parser.add_argument(
        "--recall-tokens",
        type=int,
        default=memo.RECALL_MAX_TOKENS,
        help="recall: at most this many tokens of the deleted code are compared",
    )
    parser.add_argument(
        "--write-counts",
        action="store_true",
        help="store each source's summary in counts.json under 'memorisation'",
    )
    add_no_thinking_argument(parser)
    parser.add_argument("--out", type=Path, help="write the measures as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.per_source, args.threads, args.context_tokens, args.recall_tokens) < 1:
        print("error: --per-source, --threads and the token counts must be >= 1", file=sys.stderr)
        return 2
    if not (args.model_dir / "config.json").is_file():
        print(
            f"error: no Hugging Face checkpoint (config.json) in {args.model_dir}", file=sys.stderr
        )
        return 2
    model = memo.CheckpointModel(
        args.model_dir, args.threads, args.context_tokens, enable_thinking=not args.no_thinking
    )
    try:
        probes, skipped = memo.probe_store(
            model, args.store, args.per_source, max_recall_tokens=args.recall_tokens, progress=print
        )
    except FeatureTaskError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summaries = memo.per_source(probes)
    print(f"{skipped} bug tasks skipped (a bug deletes no code to recall)")
    print(f"{'source':32} {'tasks':>5} {'pass rate':>9} {'recall':>6} {'unscored':>8}")
    for row in summaries:
        rate = "-" if row.pass_rate is None else f"{row.pass_rate:.2f}"
        print(f"{row.repo:32} {row.tasks:5d} {rate:>9} {row.recall:6.2f} {row.unscored:8d}")
    model_name, date = args.model_dir.resolve().name, datetime.date.today().isoformat()
    if args.write_counts:
        memo.write_memorisation_counts(args.store, summaries, model_name, date)
        print(f"{args.store / 'counts.json'}: memorisation of {len(summaries)} sources stored")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "model": model_name,
            "date": date,
            "skipped_bug_tasks": skipped,
            "tasks": [dataclasses.asdict(probe) for probe in probes],
            "sources": [dataclasses.asdict(row) for row in summaries],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
