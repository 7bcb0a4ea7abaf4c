"""Plots of agent-episode runs: held-out success, and turns and tool calls per episode, over
training steps, one line per run (the DiskLogger logs under ``<run>/logs``).

    python docs/agent_smollm2/plot_agent_runs.py outputs/agent_smollm2/a1_seed0 ... \
        --out docs/agent_smollm2/curves.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from composer_tune.analysis.metrics_log import read_metrics  # noqa: E402

PANELS = (
    ("eval/accuracy", "held-out episode success (greedy)"),
    ("reward/mean", "training episode reward (sampled)"),
    ("episode/turns", "assistant turns per episode (sampled)"),
    ("episode/tool_calls", "tool calls per episode (sampled)"),
    ("episode/tool_errors", "failed tool calls per episode (sampled)"),
    ("eval/tool_use_rate", "held-out episodes with a tool call"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run output directories")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for run in args.runs:
        metrics = read_metrics(run / "logs")
        for axis, (key, title) in zip(axes.flat, PANELS, strict=True):
            steps = sorted(step for step, values in metrics.items() if key in values)
            if steps:
                axis.plot(steps, [metrics[s][key] for s in steps], marker="o", label=run.name)
            axis.set_title(title)
            axis.set_xlabel("step")
    axes.flat[0].legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
