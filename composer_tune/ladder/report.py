"""A ladder's results as tables and plots: held-out accuracy per arm at the report steps (mean ±
std over seeds), per-channel gradients, each A4 channel's contribution, the markdown of
``results.md``, the PNG plots, and ladders of other arms or seeds combined into one."""

from __future__ import annotations

import math
import shlex
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_tune.ladder.arms import (
    ACCURACY,
    ARMS,
    CHANNEL_NORM,
    CHANNEL_SHARE,
    EOS_PUSH,
    EOS_SHARE,
    LENGTH,
    REWARD,
    STEP_NORM,
    TITLED_ARMS,
    TRUNCATED,
)
from composer_tune.ladder.figures import fmt_mean_std, mean_std, metric, value_at
from composer_tune.ladder.runs import generated_tokens, write_json_atomic

# ------------------------------------------------------------------------------ aggregation


def report_steps(steps: int, eval_every: int) -> list[int]:
    """The steps the table reports: 0, the last evaluation at or before steps/2, and the final."""
    mid = (steps // 2) // eval_every * eval_every
    return sorted({0, mid, steps})


def ok_records(results: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    """An arm's completed runs, by seed (failed runs stay out of the table and plots)."""
    return sorted(
        (r for r in results["runs"].values() if r["arm"] == arm and r["status"] == "ok"),
        key=lambda r: r["seed"],
    )


def accuracy_series(record: dict[str, Any]) -> list[list[float]]:
    """Held-out accuracy of a run (DiLoCo: replica 0's, which evaluates the global weights)."""
    return metric(record, ACCURACY)


def accuracy_by_tokens(record: dict[str, Any]) -> list[list[float]]:
    """Held-out accuracy against the completion tokens generated before it: ``[[tokens, acc]]``
    (:func:`generated_tokens` up to the evaluation's step)."""
    return [
        [generated_tokens(record["metrics"], until=step), accuracy]
        for step, accuracy in accuracy_series(record)
    ]


def replica_mean_series(record: dict[str, Any], name: str) -> list[list[float]]:
    """A training metric per step, averaged over process replicas (each samples its own
    rollouts and takes its own steps)."""
    by_step: dict[int, list[float]] = {}
    for metrics in record["metrics"]:
        for step, value in metrics.get(name, []):
            by_step.setdefault(int(step), []).append(value)
    return [[step, statistics.fmean(values)] for step, values in sorted(by_step.items())]


def reward_series(record: dict[str, Any]) -> list[list[float]]:
    """Training reward per step, averaged over process replicas."""
    return replica_mean_series(record, REWARD)


def gradient_channels(records: Sequence[dict[str, Any]]) -> list[str]:
    """The loss channels whose gradients the runs logged (``log_channel_gradients``), sorted."""
    return sorted(
        {
            name.removeprefix(CHANNEL_NORM)
            for record in records
            for metrics in record["metrics"]
            for name in metrics
            if name.startswith(CHANNEL_NORM)
        }
    )


def finite_points(points: Sequence[Sequence[float]]) -> list[Sequence[float]]:
    """A series without its non-finite steps (a skipped optimiser step logs NaN)."""
    return [point for point in points if math.isfinite(point[1])]


def run_average(points: Sequence[Sequence[float]]) -> float | None:
    """The mean of a series over its finite steps; None when it logged no finite value."""
    finite = finite_points(points)
    return statistics.fmean(value for _, value in finite) if finite else None


def fmt_standard_error(values: Sequence[float], digits: int) -> str:
    """A table cell: the standard error of the mean (sample std / sqrt(n)); "–" below 2 values."""
    if len(values) < 2:
        return "–"
    return f"{statistics.stdev(values) / math.sqrt(len(values)):.{digits}f}"


def table_rows(results: dict[str, Any], arms: Sequence[str], steps: Sequence[int]) -> list[str]:
    """The markdown table: per arm, accuracy at ``steps`` (mean ± std), the standard error of
    the final accuracy, wall time, tokens, seeds."""
    header = (
        "| arm | "
        + " | ".join(f"held-out acc @ step {step}" for step in steps)
        + " | final acc std error | wall time / run (s) | generated tokens / run | seeds |"
    )
    rows = [header, "|" + " --- |" * (len(steps) + 5)]
    for key in arms:
        records = ok_records(results, key)
        cells = [TITLED_ARMS[key].title]
        at_step: list[float | None] = []
        for step in steps:
            at_step = [value_at(accuracy_series(r), step) for r in records]
            cells.append(fmt_mean_std(at_step, 3))
        cells.append(fmt_standard_error([v for v in at_step if v is not None], 3))
        cells.append(fmt_mean_std([r["wall_s"] for r in records], 0))
        cells.append(fmt_mean_std([r["generated_tokens"] for r in records], 0))
        failed = sorted(
            r["seed"] for r in results["runs"].values() if r["arm"] == key and r["status"] != "ok"
        )
        seeds = str(len(records)) + (f" ({len(failed)} failed: {failed})" if failed else "")
        cells.append(seeds)
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def channel_gradient_rows(results: dict[str, Any], arms: Sequence[str]) -> list[str]:
    """The channel-gradient table (empty when no run logged them): per arm and channel, its
    gradient norm before clipping and its share of the step, each run averaged over its steps,
    then mean ± std over seeds; the step's own norm before clipping beside them."""
    rows: list[str] = []
    for key in arms:
        records = ok_records(results, key)
        channels = gradient_channels(records)
        if not channels:
            continue
        step_norms = [run_average(replica_mean_series(r, STEP_NORM)) for r in records]
        for channel in channels:
            cells = [TITLED_ARMS[key].title, channel]
            for prefix in (CHANNEL_NORM, CHANNEL_SHARE, EOS_PUSH, EOS_SHARE):
                averages = [run_average(replica_mean_series(r, prefix + channel)) for r in records]
                cells.append(fmt_mean_std(averages, 3))
            cells.append(fmt_mean_std(step_norms, 3))
            cells.append(str(len(records)))
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return []
    header = (
        "| arm | channel | gradient norm before clipping | share of the step "
        "| push on the end-of-reply logit | share of the logit gradient on the end of reply "
        "| step's gradient norm before clipping | seeds |"
    )
    return [header, "|" + " --- |" * 8, *rows]


def final_training_value(record: dict[str, Any], name: str, step: int) -> float | None:
    """A training metric at ``step`` (replicas averaged), None where the run did not log it."""
    return value_at(replica_mean_series(record, name), step)


def contribution_rows(results: dict[str, Any], arms: Sequence[str]) -> list[str]:
    """The A4 ablation table (empty without A4 and an "A4 minus one channel" arm): per arm
    (A1 and A4 beside the ablations), the final held-out accuracy, generated tokens, and the
    sampled completions' mean length and truncated share at the final step, each mean ± std over
    seeds; for an ablation arm, the channel it leaves out and that channel's contribution, A4's
    mean minus the arm's (what the channel adds to A4)."""
    ablations = [key for key in arms if ARMS.get(key) and ARMS[key].without is not None]
    if "a4" not in arms or not ablations or not ok_records(results, "a4"):
        return []
    final = results["settings"]["steps"]

    def figures(key: str) -> dict[str, list[float]]:
        records = ok_records(results, key)
        values = {
            "accuracy": [value_at(accuracy_series(r), final) for r in records],
            "tokens": [r["generated_tokens"] for r in records],
            "length": [final_training_value(r, LENGTH, final) for r in records],
            "truncated": [final_training_value(r, TRUNCATED, final) for r in records],
        }
        return {name: [v for v in found if v is not None] for name, found in values.items()}

    a4 = figures("a4")
    digits = {"accuracy": 3, "tokens": 0, "length": 1, "truncated": 2}
    rows = []
    for key in [k for k in ("a1", "a4") if k in arms] + ablations:
        own = figures(key)
        cells = [TITLED_ARMS[key].title, ARMS[key].without or "–"]
        for name, places in digits.items():
            cells.append(fmt_mean_std(own[name], places))
            if ARMS[key].without is None:
                cells.append("–")
            elif own[name] and a4[name]:
                change = statistics.fmean(a4[name]) - statistics.fmean(own[name])
                cells.append(f"{change:+.{places}f}")
            else:
                cells.append("–")
        cells.append(str(len(ok_records(results, key))))
        rows.append("| " + " | ".join(cells) + " |")
    header = (
        f"| arm | channel left out | held-out acc @ step {final} | its contribution "
        "| generated tokens / run | its contribution "
        f"| completion length @ step {final} | its contribution "
        f"| truncated @ step {final} | its contribution | seeds |"
    )
    return [header, "|" + " --- |" * 11, *rows]


def render_markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    steps = report_steps(settings["steps"], settings["eval_every"])
    lines = [
        "# Ladder results",
        "",
        f"Command: `{settings['command']}`",
        "",
        f"Warm start: `{results.get('warm_start', {}).get('path', '?')}`; every arm "
        f"{settings['steps']} optimizer steps (DiLoCo: inner steps per replica), seeds "
        f"{settings['seeds']}, held-out evaluation every {settings['eval_every']} steps on "
        f"{', '.join(f'{k}={v}' for k, v in settings['heldout'].items())} (held-out problems "
        "are distinct: num_samples counts them).",
        "",
        *table_rows(results, settings["arms"], steps),
        "",
        "Held-out accuracy: greedy, mean ± sample std over the seeds that finished; its standard "
        "error is the final step's sample std / sqrt(seeds). Wall time: the "
        "whole `tune run` (start-up and evaluations included). Generated tokens: completion tokens "
        "sampled, the runs' logged `tokens/generated` (summed over replicas); prompt tokens and "
        "DPO pairs not included.",
    ]
    lines += _section(
        "Channel gradients",
        channel_gradient_rows(results, settings["arms"]),
        "Logged with `log_channel_gradients=true`: each channel's gradient norm before the "
        "clip and its share `<g_c, g> / |g|^2` of the step (the shares sum to 1; clipping "
        "scales every channel alike). Each run's values averaged over its steps, then mean ± "
        "std over seeds; per step in channel_gradients.png. Where logged, each channel's "
        "push on the end-of-reply logit, `-sum dL_c/dz_eos` over the positions it scores "
        "(> 0: its step makes replies end sooner; < 0: later), and the share of its logit "
        "gradient's absolute mass on that token.",
    )
    lines += _section(
        "What each A4 channel adds",
        contribution_rows(results, settings["arms"]),
        "An ablation arm is A4 with one channel's weight at 0 and nothing else changed; a "
        "channel's contribution is A4's mean minus that arm's (what adding the channel to the "
        "other two gives). Completion length and truncated share: the sampled training "
        "completions of the final step (truncated: cut off at max_new_tokens). Per step in "
        "completion_length.png and truncation.png.",
    )
    failed = [r for r in results["runs"].values() if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed runs", ""]
        for record in sorted(failed, key=lambda r: (r["arm"], r["seed"])):
            lines.append(
                f"- {record['arm']} seed {record['seed']}: exit status {record['returncode']}"
                f"{'; ' + record['metrics_error'] if 'metrics_error' in record else ''} "
                f"(log: `{record['log']}`; tail in results.json)"
            )
    return "\n".join(lines) + "\n"


def _section(title: str, rows: list[str], note: str) -> list[str]:
    """A results.md section: its title, table and note; nothing for no rows."""
    return ["", f"## {title}", "", *rows, "", note] if rows else []


def band_series(
    per_seed: Sequence[Sequence[Sequence[float]]],
) -> tuple[list[int], list[float], list[float]]:
    """Steps every seed logged, with the mean and std (0 for one seed) over seeds."""
    if not per_seed:
        return [], [], []
    common = set.intersection(*({int(step) for step, _ in points} for points in per_seed))
    steps = sorted(common)
    means, stds = [], []
    for step in steps:
        mean, std = mean_std([value_at(points, step) for points in per_seed])
        means.append(mean)
        stds.append(std or 0.0)
    return steps, means, stds


def require_matplotlib() -> Any:
    """matplotlib's pyplot (Agg backend), or a clear error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "the ladder's plots need matplotlib: pip install -e '.[dev]' (or pass --no-plots)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict[str, Any], out: Path, plt: Any) -> list[Path]:
    """accuracy.png and reward.png: per arm, the mean over seeds with a ±1 std band;
    accuracy_vs_tokens.png: each run's held-out accuracy against its generated tokens;
    channel_gradients.png where runs logged per-channel gradients."""
    written = [_plot_accuracy_vs_tokens(results, out, plt)]
    gradients = _plot_channel_gradients(results, out, plt)
    if gradients is not None:
        written.append(gradients)
    for name, title, series_of, marker in (
        ("accuracy.png", "held-out accuracy", accuracy_series, "o"),  # a few evaluations
        ("reward.png", "training reward (reward/mean)", reward_series, None),  # every step
        (
            "completion_length.png",
            "mean sampled completion length (tokens)",
            lambda record: replica_mean_series(record, LENGTH),
            None,
        ),
        (
            "truncation.png",
            "sampled completions cut off at max_new_tokens",
            lambda record: replica_mean_series(record, TRUNCATED),
            None,
        ),
    ):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for key in results["settings"]["arms"]:
            records = ok_records(results, key)
            steps, means, stds = band_series([series_of(r) for r in records if series_of(r)])
            if not steps:
                continue
            (line,) = axes.plot(
                steps, means, marker=marker, label=f"{TITLED_ARMS[key].title} (n={len(records)})"
            )
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
        axes.set_xlabel("optimizer step")
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.set_ylabel(title)
        axes.set_title(f"{title}: mean over seeds, band ±1 std")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        written.append(out / name)
    return written


def _plot_channel_gradients(results: dict[str, Any], out: Path, plt: Any) -> Path | None:
    """Per arm and channel, its gradient norm before clipping and its share of the step at every
    step (mean over seeds, band ±1 std); None when no run logged them."""
    curves = []
    for key in results["settings"]["arms"]:
        records = ok_records(results, key)
        for channel in gradient_channels(records):
            curves.append((key, channel, records))
    if not curves:
        return None
    eos = any(
        name.startswith(EOS_PUSH)
        for _, _, records in curves
        for record in records
        for metrics in record["metrics"]
        for name in metrics
    )
    figure, panels = plt.subplots(1, 3 if eos else 2, figsize=(18 if eos else 12, 4.5))
    norm_axes, share_axes = panels[:2]
    prefixes = [CHANNEL_NORM, CHANNEL_SHARE, EOS_PUSH][: len(panels)]
    for key, channel, records in curves:
        label = f"{TITLED_ARMS[key].title}: {channel} (n={len(records)})"
        for axes, prefix in zip(panels, prefixes, strict=True):
            per_seed = [finite_points(replica_mean_series(r, prefix + channel)) for r in records]
            steps, means, stds = band_series([points for points in per_seed if points])
            if not steps:
                continue
            (line,) = axes.plot(steps, means, label=label)
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    norm_axes.set_ylabel("gradient norm before clipping")
    norm_axes.set_yscale("log")
    plain = plt.FuncFormatter(lambda value, _: f"{value:g}")
    norm_axes.yaxis.set_major_formatter(plain)
    norm_axes.yaxis.set_minor_formatter(plain)
    share_axes.set_ylabel("share of the step  <g_c, g> / |g|^2")
    share_axes.axhline(0.0, color="grey", linewidth=0.8)
    if eos:
        panels[2].set_ylabel("push on the end-of-reply logit  -sum dL_c/dz_eos")
        panels[2].axhline(0.0, color="grey", linewidth=0.8)
    for axes in panels:
        axes.set_xlabel("optimizer step")
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle("per-channel gradients: mean over seeds, band ±1 std")
    figure.tight_layout()
    path = out / "channel_gradients.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _plot_accuracy_vs_tokens(results: dict[str, Any], out: Path, plt: Any) -> Path:
    """One line per run (seeds of an arm share a colour): sample efficiency at equal tokens."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, key in enumerate(results["settings"]["arms"]):
        for number, record in enumerate(ok_records(results, key)):
            points = accuracy_by_tokens(record)
            if not points:
                continue
            label = f"{TITLED_ARMS[key].title} (n={len(ok_records(results, key))})"
            axes.plot(
                [tokens for tokens, _ in points],
                [accuracy for _, accuracy in points],
                marker="o",
                color=colours[index % len(colours)],
                alpha=0.7,
                label=label if number == 0 else None,
            )
    axes.set_xlabel("generated rollout tokens")
    axes.set_ylabel("held-out accuracy")
    axes.set_title("held-out accuracy at equal generated tokens (one line per seed)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / "accuracy_vs_tokens.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def settings_clash(reference: dict[str, Any], other: dict[str, Any]) -> str | None:
    """Why ``other``'s runs cannot share a table with ``reference``'s (two results files): the
    first differing ``settings`` key of "steps", "eval_every", "heldout", or "warm_start";
    None when they compare."""
    for key in ("steps", "eval_every", "heldout"):
        if other["settings"][key] != reference["settings"][key]:
            return key
    if other.get("warm_start", {}).get("path") != reference.get("warm_start", {}).get("path"):
        return "warm_start"
    return None


def arm_command(runs: dict[str, Any], arm: str) -> list[str] | None:
    """The command an arm's runs share: without the per-seed ``output_dir=`` and ``seed=`` of a
    recipe, or ``--seed`` and ``--out`` of a peer's tool."""
    for record in runs.values():
        if record["arm"] != arm:
            continue
        shared, args = [], iter(record["command"])
        for arg in args:
            if arg in ("--seed", "--out"):
                next(args, None)
            elif not arg.startswith(("output_dir=", "seed=")):
                shared.append(arg)
        return shared
    return None


def combine_results(parts: Sequence[dict[str, Any]], sources: Sequence[Path]) -> dict[str, Any]:
    """One results file from ladders with identical settings that ran different arms or
    different seeds of an arm (e.g. in parallel, one per core); the table counts each arm's
    seeds, and the combined ``seeds`` is their union.

    Raises:
        ValueError: naming the folder whose settings or warm start clash with the first's, that
            holds a run (arm and seed) already combined, or whose arm ran another command (another
            config or overrides) than the same arm in an earlier folder.
    """
    first = parts[0]
    combined: dict[str, Any] = {
        "settings": {**first["settings"], "arms": [], "command": []},
        "warm_start": first.get("warm_start", {}),
        "runs": {},
    }
    for part, source in zip(parts, sources, strict=True):
        if "settings" not in part:
            raise ValueError(f"{source}: no ladder results (results.json has no settings)")
        clash = settings_clash(first, part)
        if clash == "warm_start":
            raise ValueError(f"{source}: another warm start than {sources[0]}'s")
        if clash:
            raise ValueError(
                f"{source}: {clash} {part['settings'][clash]} differs from {sources[0]}'s "
                f"{first['settings'][clash]}: only ladders with equal settings combine"
            )
        overlap = set(part["runs"]) & set(combined["runs"])
        if overlap:
            raise ValueError(f"{source}: runs {sorted(overlap)} are in two of the ladders")
        for arm in part["settings"]["arms"]:
            earlier, this = arm_command(combined["runs"], arm), arm_command(part["runs"], arm)
            if earlier is not None and earlier != this:
                raise ValueError(
                    f"{source}: arm {arm} ran another command than in an earlier folder "
                    f"({shlex.join(this or [])} against "
                    f"{shlex.join(earlier)}): only runs of the same arm settings combine"
                )
        combined["settings"]["arms"] += part["settings"]["arms"]
        combined["settings"]["seeds"] = sorted(
            set(combined["settings"]["seeds"]) | set(part["settings"]["seeds"])
        )
        combined["settings"]["command"].append(part["settings"]["command"])
        combined["runs"].update(part["runs"])
    arms = combined["settings"]["arms"]
    combined["settings"]["arms"] = [key for key in TITLED_ARMS if key in arms]
    combined["settings"]["command"] = "` and `".join(combined["settings"]["command"])
    return combined


# ------------------------------------------------------------------------------ main


def save(results: dict[str, Any], out: Path, plt: Any | None) -> None:
    """results.json (atomically), results.md and the plots, from everything finished so far."""
    write_json_atomic(out / "results.json", results)
    (out / "results.md").write_text(render_markdown(results))
    if plt is not None:
        write_plots(results, out, plt)
