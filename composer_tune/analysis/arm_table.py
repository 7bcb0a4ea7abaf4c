"""Arms compared across ladders: held-out accuracy per arm, from ``tools/ladder.py`` results.

``tools/ladder.py`` writes ``results.json`` (every metric series of every run). A row of this
table is one ladder arm in one or more results files (ladders run side by side, one per arm and
seed, or the same arm under different overrides: an optimizer, a staleness), so each source
names its file and arm key, and the sources of one label make one row. The held-out columns are
the evaluation series the runs logged: greedy (``eval/accuracy``) and sampled
(``eval_sampled/accuracy``), whole or per split (``eval/accuracy/heldout_templates``: the code
ladder's). Each cell is mean ± sample std over seeds at the last evaluation; A0 is step 0 (the
base model), read from every run that evaluated it. ``kept_runs`` is the record of every run a
table used, in the same format, so that a table can be rebuilt from the repository after the
ladder folders are gone. ``paired`` compares two arms seed by seed: runs of one seed share their
tasks' order and sampling seeds, so the per-seed difference is the sharper test of whether a
change helps than two rows' means side by side.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_tune.ladder.arms import ACCURACY, LENGTH, REWARD, TRUNCATED
from composer_tune.ladder.figures import all_series, fmt_mean_std, metric, value_at

MODES = {"greedy": ACCURACY, "sampled": "eval_sampled/accuracy"}
# Splits in this order first (the code ladder's), any other after them by name.
KNOWN_SPLITS = ("heldout_templates", "heldout_params")
LAST_STEPS = 5  # reply length and truncation are averaged over the last steps
TRAINING_SERIES = (LENGTH, TRUNCATED, REWARD)


@dataclass(frozen=True)
class Column:
    """A held-out column: ``split`` None for a whole-set series (``eval/accuracy``)."""

    split: str | None
    mode: str

    @property
    def series(self) -> str:
        prefix = MODES[self.mode]
        return prefix if self.split is None else f"{prefix}/{self.split}"

    @property
    def title(self) -> str:
        where = "held-out" if self.split is None else self.split.replace("heldout_", "held-out ")
        return f"{where.replace('_', ' ')}, {self.mode}"


def _column_of(name: str) -> Column | None:
    for mode, prefix in MODES.items():
        if name == prefix:
            return Column(None, mode)
        if name.startswith(prefix + "/"):
            return Column(name.removeprefix(prefix + "/"), mode)
    return None


def is_kept(name: str) -> bool:
    """Whether a series is one the tables and plots read (kept in runs.json)."""
    return name in TRAINING_SERIES or _column_of(name) is not None


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
    the series ``is_kept`` names (a few KB per run)."""
    kept = {}
    for label, runs in grouped.items():
        for run in runs:
            record = {key: value for key, value in run.items() if key != "metrics"}
            record["arm"] = label
            record["metrics"] = [
                {name: points for name, points in all_series(run).items() if is_kept(name)}
            ]
            kept[f"{label}/seed{run['seed']}"] = record
    return {"runs": kept}


def columns(grouped: Grouped) -> list[Column]:
    """The held-out columns the runs logged: by split (KNOWN_SPLITS first, then the rest by
    name), greedy before sampled; the whole set only where no run logged a split (it is then
    their mixture, which the splits' columns already show)."""
    found = {
        column
        for runs in grouped.values()
        for run in runs
        for name in all_series(run)
        if (column := _column_of(name)) is not None
    }
    if any(column.split is not None for column in found):
        found = {column for column in found if column.split is not None}

    def order(column: Column) -> tuple[int, str, int]:
        split = column.split or ""
        rank = KNOWN_SPLITS.index(split) if split in KNOWN_SPLITS else len(KNOWN_SPLITS)
        return rank, split, list(MODES).index(column.mode)

    return sorted(found, key=order)


def at_step(series: Sequence[Sequence[float]], step: int | None) -> float | None:
    """The value logged at ``step`` (None: the last one), or None."""
    if step is None:
        return series[-1][1] if series else None
    return value_at(series, step)


def last_steps_mean(series: Sequence[Sequence[float]], count: int = LAST_STEPS) -> float | None:
    finite = [value for _, value in series[-count:] if math.isfinite(value)]
    return statistics.fmean(finite) if finite else None


def heldout_values(
    runs: Sequence[Mapping[str, Any]], shown: Sequence[Column], step: int | None
) -> list[list[float | None]]:
    """Per column, one value per run at ``step`` (None: the last evaluation)."""
    return [[at_step(metric(run, column.series), step) for run in runs] for column in shown]


def header(shown: Sequence[Column], before: Sequence[str], after: Sequence[str] = ()) -> str:
    """A markdown table's header: ``before``, the held-out columns' titles, ``after``."""
    titles = [*before, *(column.title for column in shown), *after]
    return "| " + " | ".join(titles) + " |\n|" + "---|" * len(titles)


def table(grouped: Grouped) -> str:
    """The markdown table: A0 (step 0 of the runs that evaluated it), then each arm at its last
    evaluation, its reply length and truncation over the last steps and its wall time."""
    shown = columns(grouped)
    after = ["reply tokens / truncated (last 5 steps)", "wall / run (s)"]
    rows, base_runs = [], []
    for label, runs in grouped.items():
        base_runs += runs
        length = [last_steps_mean(metric(run, LENGTH)) for run in runs]
        truncated = [last_steps_mean(metric(run, TRUNCATED)) for run in runs]
        rows.append(
            f"| {label} | {len(runs)} | "
            + " | ".join(fmt_mean_std(values, 3) for values in heldout_values(runs, shown, None))
            + f" | {fmt_mean_std(length, 1)} / {fmt_mean_std(truncated, 2)} | "
            + f"{fmt_mean_std([run.get('wall_s') for run in runs], 0)} |"
        )
    base = heldout_values(base_runs, shown, 0)
    measured = max((sum(v is not None for v in values) for values in base), default=0)
    base_row = (
        f"| A0 base model (step 0, measured in {measured} of the {len(base_runs)} runs) | – | "
        + " | ".join(fmt_mean_std(values, 3) for values in base)
        + " | | |"
    )
    return "\n".join([header(shown, ["arm", "seeds"], after), base_row, *rows])


def per_seed(grouped: Grouped) -> str:
    """One line per run: its seed and every held-out figure before and after."""
    shown = columns(grouped)
    lines = [header(shown, ["arm", "seed", "step"], ["wall (s)"])]
    for label, runs in grouped.items():
        for run in runs:
            for step in (0, None):
                figures = " | ".join(
                    fmt_mean_std(values, 3) for values in heldout_values([run], shown, step)
                )
                lines.append(
                    f"| {label} | {run['seed']} | {'0' if step == 0 else 'last'} | {figures} | "
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
    shown = columns(grouped)
    first_values = heldout_values([first_runs[seed] for seed in seeds], shown, None)
    second_values = heldout_values([second_runs[seed] for seed in seeds], shown, None)
    cells = [
        signed_cell(
            [a - b for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None]
        )
        for ours, theirs in zip(first_values, second_values, strict=True)
    ]
    return f"| {first} − {second} | {', '.join(map(str, seeds))} | " + " | ".join(cells) + " |"


def paired_table(grouped: Grouped, comparisons: Sequence[tuple[str, str]]) -> str:
    """The ``paired`` rows of ``comparisons`` under the table's held-out columns."""
    rows = [paired(grouped, a, b) for a, b in comparisons]
    return "\n".join([header(columns(grouped), ["difference", "seeds"]), *rows])
