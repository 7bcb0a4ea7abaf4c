"""The code ladder's table: held-out pass@1 per arm on each held-out split, from ladder results.

``tools/ladder.py`` writes ``results.json`` (every metric series of every run). An arm of the
code ladder is one ladder arm in one or more results files (one ladder per arm and seed, run
side by side), so each source names its file and arm key, and the sources of one label make one
row. Each cell is mean ± sample std over seeds; A0 is step 0 (the base model), read from every
run. ``kept_runs`` is the record of every run a table used, in the same format, so that a table
can be rebuilt from the repository after the ladder folders are gone. ``paired`` compares two
arms seed by seed: runs of one seed share their tasks' order and sampling seeds, so the per-seed
difference is the sharper test of whether a channel helps than two rows' means side by side.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLITS = ("heldout_templates", "heldout_params")
MODES = {"greedy": "eval/accuracy/", "sampled": "eval_sampled/accuracy/"}
# Sampled training replies: mean length and the share cut off at max_new_tokens.
LENGTH, TRUNCATED, REWARD = "completion_length/mean", "truncation_rate", "reward/mean"
LAST_STEPS = 5  # reply length and truncation are averaged over the last steps
# The series a kept record holds: everything the table and the plots read.
KEPT_SERIES = (
    *(prefix + split for prefix in MODES.values() for split in SPLITS),
    LENGTH,
    TRUNCATED,
    REWARD,
)


@dataclass(frozen=True)
class ArmSource:
    """A row of the table: ``label`` is what it shows; ``results`` a ladder's results.json;
    ``arm`` its key there (``a1``, ``a2``, ...)."""

    label: str
    results: Path
    arm: str

    @classmethod
    def parse(cls, text: str) -> ArmSource:
        """``LABEL=PATH:ARM`` (PATH a ladder folder or its results.json)."""
        label, sep, rest = text.partition("=")
        path, colon, arm = rest.rpartition(":")
        if not sep or not colon or not label or not arm:
            raise ValueError(f"arm {text!r}: expected LABEL=PATH:ARM")
        results = Path(path)
        return cls(label, results / "results.json" if results.is_dir() else results, arm)


def load_runs(source: ArmSource) -> list[dict[str, Any]]:
    """The arm's completed runs (status ok), by seed; ValueError naming what is missing."""
    if not source.results.is_file():
        raise ValueError(f"{source.label}: no results file {source.results}")
    runs = json.loads(source.results.read_text())["runs"].values()
    ok = sorted(
        (r for r in runs if r["arm"] == source.arm and r["status"] == "ok"), key=lambda r: r["seed"]
    )
    if not ok:
        raise ValueError(f"{source.label}: no completed {source.arm} run in {source.results}")
    return ok


def runs_by_label(sources: Sequence[ArmSource]) -> dict[str, list[dict[str, Any]]]:
    """Each label's completed runs from all its sources, by seed (labels in first-seen order);
    ValueError when a label has the same seed twice."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for source in sources:
        grouped.setdefault(source.label, []).extend(load_runs(source))
    for label, runs in grouped.items():
        seeds = [run["seed"] for run in runs]
        repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
        if repeated:
            raise ValueError(f"{label}: seed(s) {repeated} come from more than one source")
        runs.sort(key=lambda run: run["seed"])
    return grouped


Grouped = Mapping[str, Sequence[Mapping[str, Any]]]  # runs_by_label's: label -> runs by seed


def kept_runs(grouped: Grouped) -> dict[str, Any]:
    """Every run the table reads, as a results file whose arm keys are the labels, holding only
    the series in KEPT_SERIES (a few KB per run)."""
    kept = {}
    for label, runs in grouped.items():
        for run in runs:
            series = run["metrics"][0] if run["metrics"] else {}
            record = {key: value for key, value in run.items() if key != "metrics"}
            record["arm"] = label
            record["metrics"] = [{name: series[name] for name in KEPT_SERIES if name in series}]
            kept[f"{label}/seed{run['seed']}"] = record
    return {"runs": kept}


def metric(run: Mapping[str, Any], name: str) -> list[list[float]]:
    """A run's series ``[[step, value], ...]`` of ``name`` (replica 0's)."""
    return run["metrics"][0].get(name, []) if run["metrics"] else []


def at_step(series: Sequence[Sequence[float]], step: int | None) -> float | None:
    """The value logged at ``step`` (None: the last one), or None."""
    if not series:
        return None
    if step is None:
        return series[-1][1]
    found = [value for at, value in series if at == step]
    return found[-1] if found else None


def last_steps_mean(series: Sequence[Sequence[float]], count: int = LAST_STEPS) -> float | None:
    finite = [value for _, value in series[-count:] if math.isfinite(value)]
    return statistics.fmean(finite) if finite else None


def cell(values: Sequence[float | None], digits: int = 3) -> str:
    """``mean ± std`` over the values present ("–" when none; the mean alone for one)."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    mean = statistics.fmean(present)
    if len(present) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(present):.{digits}f}"


def arm_values(runs: Sequence[Mapping[str, Any]], step: int | None) -> dict[str, list]:
    """Per column, one value per run: accuracy on each split and mode, reply length and
    truncation over the last steps (at ``step``: the held-out ones only)."""
    columns: dict[str, list] = {}
    for mode, prefix in MODES.items():
        for split in SPLITS:
            columns[f"{mode}/{split}"] = [at_step(metric(r, prefix + split), step) for r in runs]
    columns["reply_tokens"] = [last_steps_mean(metric(r, LENGTH)) for r in runs]
    columns["truncated"] = [last_steps_mean(metric(r, TRUNCATED)) for r in runs]
    return columns


def table(grouped: Grouped) -> str:
    """The markdown table: A0 (step 0 of the runs that evaluated it), then each arm at its last
    evaluation."""
    header = (
        "| arm | seeds | held-out templates, greedy | held-out templates, sampled | "
        "held-out params, greedy | held-out params, sampled | reply tokens / truncated "
        "(last 5 steps) |\n|---|---|---|---|---|---|---|"
    )
    rows, base_runs = [], []
    for label, runs in grouped.items():
        base_runs += runs
        values = arm_values(runs, None)
        rows.append(
            f"| {label} | {len(runs)} | "
            + " | ".join(cell(values[f"{m}/{s}"]) for s in SPLITS for m in MODES)
            + f" | {cell(values['reply_tokens'], 1)} / {cell(values['truncated'], 2)} |"
        )
    base = arm_values(base_runs, 0)
    measured = sum(value is not None for value in base[f"{next(iter(MODES))}/{SPLITS[0]}"])
    base_row = (
        f"| A0 base model (step 0, measured in {measured} of the {len(base_runs)} runs) | – | "
        + " | ".join(cell(base[f"{m}/{s}"]) for s in SPLITS for m in MODES)
        + " | |"
    )
    return "\n".join([header, base_row, *rows])


def per_seed(grouped: Grouped) -> str:
    """One line per run: its seed and every held-out figure before and after."""
    lines = [
        "| arm | seed | step | "
        + " | ".join(f"{s} {m}" for s in SPLITS for m in MODES)
        + " | wall (s) |\n|---|---|---|"
        + "---|" * (len(SPLITS) * len(MODES) + 1)
    ]
    for label, runs in grouped.items():
        for run in runs:
            for step in (0, None):
                values = arm_values([run], step)
                shown = "0" if step == 0 else "last"
                figures = " | ".join(cell(values[f"{m}/{s}"]) for s in SPLITS for m in MODES)
                lines.append(
                    f"| {label} | {run['seed']} | {shown} | {figures} | "
                    f"{run.get('wall_s', float('nan')):.0f} |"
                )
    return "\n".join(lines)


def signed_cell(values: Sequence[float]) -> str:
    """``+mean ± std`` of differences ("–" when none; the signed value alone for one)."""
    if not values:
        return "–"
    mean = f"{statistics.fmean(values):+.3f}"
    return mean if len(values) == 1 else f"{mean} ± {statistics.stdev(values):.3f}"


def paired(grouped: Grouped, first: str, second: str) -> str:
    """A table row of ``first`` minus ``second`` at their last evaluations, seed by seed over the
    seeds both ran: the seeds, then mean ± sample std of the differences per held-out column;
    ValueError naming a label that is not in ``grouped`` or two arms without a common seed."""
    for label in (first, second):
        if label not in grouped:
            raise ValueError(f"paired: no arm labelled {label!r} (labels: {', '.join(grouped)})")
    first_runs, second_runs = ({run["seed"]: run for run in grouped[x]} for x in (first, second))
    seeds = sorted(first_runs.keys() & second_runs.keys())
    if not seeds:
        raise ValueError(f"paired: {first!r} and {second!r} share no seed")
    first_values = arm_values([first_runs[seed] for seed in seeds], None)
    second_values = arm_values([second_runs[seed] for seed in seeds], None)
    cells = []
    for split in SPLITS:
        for mode in MODES:
            column = f"{mode}/{split}"
            differences = [
                a - b
                for a, b in zip(first_values[column], second_values[column], strict=True)
                if a is not None and b is not None
            ]
            cells.append(signed_cell(differences))
    return f"| {first} − {second} | {', '.join(map(str, seeds))} | " + " | ".join(cells) + " |"


def paired_table(grouped: Grouped, comparisons: Sequence[tuple[str, str]]) -> str:
    """The ``paired`` rows of ``comparisons`` under the table's held-out columns."""
    header = (
        "| difference | seeds | held-out templates, greedy | held-out templates, sampled | "
        "held-out params, greedy | held-out params, sampled |\n|---|---|---|---|---|---|"
    )
    return "\n".join([header, *(paired(grouped, a, b) for a, b in comparisons)])
