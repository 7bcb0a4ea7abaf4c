"""Plots of agent-episode runs: held-out success, and turns and tool calls per episode, over
training steps, one line per run (the DiskLogger logs under ``<run>/logs``); prints each run's
held-out figures at its first and last evaluation, and the mean and spread of the last ones.

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
    ("eval_sampled/accuracy", "held-out episode success (sampled, mean of k)"),
    ("eval/accuracy", "held-out episode success (greedy)"),
    ("reward/mean", "training episode reward (sampled)"),
    ("episode/turns", "assistant turns per episode (training)"),
    ("episode/tool_calls", "tool calls per episode (training)"),
    ("episode/tool_errors", "failed tool calls per episode (training)"),
)


def first_and_last(metrics: dict[int, dict[str, float]], key: str) -> tuple[float, float]:
    """``key`` at the first and the last step that logged it."""
    steps = sorted(step for step, values in metrics.items() if key in values)
    if not steps:
        raise SystemExit(f"no {key} in the run's logs")
    return metrics[steps[0]][key], metrics[steps[-1]][key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run output directories")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    finals: list[float] = []
    for run in args.runs:
        metrics = read_metrics(run / "logs")
        greedy = first_and_last(metrics, "eval/accuracy")
        sampled = first_and_last(metrics, "eval_sampled/accuracy")
        tools = first_and_last(metrics, "eval_sampled/tool_use_rate")
        finals.append(sampled[1])
        print(
            f"{run.name}: held-out greedy {greedy[0]:.3f} -> {greedy[1]:.3f}, "
            f"sampled {sampled[0]:.3f} -> {sampled[1]:.3f} (tool use {tools[0]:.3f} -> "
            f"{tools[1]:.3f})"
        )
        for axis, (key, title) in zip(axes.flat, PANELS, strict=True):
            steps = sorted(step for step, values in metrics.items() if key in values)
            if steps:
                axis.plot(steps, [metrics[s][key] for s in steps], marker="o", label=run.name)
            axis.set_title(title)
            axis.set_xlabel("step")
    mean = sum(finals) / len(finals)
    spread = (sum((x - mean) ** 2 for x in finals) / max(len(finals) - 1, 1)) ** 0.5
    print(f"last sampled success over these runs: {mean:.3f} +- {spread:.3f} (sample std)")
    axes.flat[0].legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
