"""Arms compared across ladders (tools/ladder.py): one table, per-seed figures and plots.

    python tools/compare_arms.py --title "The code ladder" --out docs/ladder_smollm2_code \\
        --arm "A1 GRPO=runs/code_ladder_a1:a1" --arm "A2 SDPO=runs/code_ladder_a2:a2" \\
        --arm "A2 without the feedback=runs/code_ladder_a2_nofb:a2" \\
        --arm "A4 composer_full=runs/code_ladder_a4:a4" --arm "A1 flipped=runs/code_ladder_flip:a1" \\
        --paired "A2 SDPO" "A2 without the feedback"
    python tools/compare_arms.py --arm "A1 AdamW=runs/a1_adamw:a1" --arm "A1 Muon=runs/a1_muon:a1" \\
        --paired "A1 Muon" "A1 AdamW"

Each ``--arm LABEL=PATH:ARM`` is a source of one row: PATH a ladder's folder (or a results
file), ARM the arm key in it; repeat a label to join seeds from several ladders into its row, and
give one arm of two ladders two labels to compare runs that differ in an override (an optimizer,
a staleness), which ``tools/ladder.py --combine`` refuses. The columns are the held-out
evaluations the runs logged (greedy and sampled, whole or per split), mean ± std over seeds at
the last evaluation, A0 = step 0; then reply length, truncation and wall time. Each ``--paired
FIRST SECOND`` adds a row of FIRST's figures minus SECOND's, seed by seed over the seeds both ran
(mean ± std of the differences): whether a change helps, with the seed's own luck taken out.
With ``--out``, writes ``results.md`` (the table, then every run's figures), ``runs.json`` (every
run it read, the series the table and plots need, its arm keys the labels: ``--arm
"A1 GRPO=OUT/runs.json:A1 GRPO"`` reads it back when the ladder folders are gone) and
``reward.png`` / ``truncation.png`` (training reward and truncation per step, each arm's mean
over the seeds that logged it); prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/compare_arms.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from composer_tune.analysis.arm_table import (  # noqa: E402
    ArmSource,
    kept_runs,
    paired_table,
    per_seed,
    runs_by_label,
    table,
)
from composer_tune.ladder.arms import REWARD, TRUNCATED  # noqa: E402
from composer_tune.ladder.figures import metric  # noqa: E402


def plot(grouped: dict[str, list[dict]], name: str, ylabel: str, path: Path) -> None:
    """``name`` per step, each arm's mean over the seeds that logged it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, runs in grouped.items():
        by_step: dict[int, list[float]] = {}
        for run in runs:
            for step, value in metric(run, name):
                by_step.setdefault(int(step), []).append(value)
        steps = sorted(by_step)
        if not steps:  # runs kept without their series (read back from a table)
            continue
        axes.plot(steps, [statistics.fmean(by_step[s]) for s in steps], label=label)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(ylabel)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arm", action="append", required=True, help="LABEL=PATH:ARM")
    parser.add_argument("--out", type=Path, help="folder for results.md and the plots")
    parser.add_argument("--title", default="Arms compared", help="results.md's heading")
    parser.add_argument(
        "--paired",
        nargs=2,
        action="append",
        default=[],
        metavar=("FIRST", "SECOND"),
        help="a row of FIRST minus SECOND (two labels), seed by seed",
    )
    args = parser.parse_args(argv)
    try:
        sources = [ArmSource.parse(text) for text in args.arm]
        # Every source read once, before anything is written: --out's runs.json may be one.
        grouped = runs_by_label(sources)
        summary = table(grouped)
        if args.paired:
            summary += "\n\n## Paired by seed\n\n" + paired_table(grouped, args.paired)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = " ".join(
            [
                "python tools/compare_arms.py",
                f'--title "{args.title}"',
                *(f'--arm "{a}"' for a in args.arm),
                *(f'--paired "{a}" "{b}"' for a, b in args.paired),
            ]
        )
        (args.out / "results.md").write_text(
            f"# {args.title}\n\n`{command} --out {args.out}`\n\n{summary}\n\n"
            f"## Every run\n\n{per_seed(grouped)}\n"
        )
        (args.out / "runs.json").write_text(json.dumps(kept_runs(grouped), indent=1) + "\n")
        plot(grouped, REWARD, "training reward (mean over the batch)", args.out / "reward.png")
        plot(
            grouped, TRUNCATED, "sampled replies cut at max_new_tokens", args.out / "truncation.png"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
