"""The figures a ladder's tables show, read from its results records: a run's metric series, a
series' value at a step, mean ± std over seeds. The standard library only, so that
``tools/compare_arms.py`` (``composer_tune.analysis.arm_table``) reads results without importing
the runner and torch."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def all_series(run: Mapping[str, Any]) -> Mapping[str, list[list[float]]]:
    """A run's metric series by name (replica 0's, which evaluates DiLoCo's global weights;
    none for a run that logged nothing)."""
    return run["metrics"][0] if run["metrics"] else {}


def metric(run: Mapping[str, Any], name: str) -> list[list[float]]:
    """A run's series ``[[step, value], ...]`` of ``name`` (replica 0's)."""
    return all_series(run).get(name, [])


def value_at(points: Sequence[Sequence[float]], step: int) -> float | None:
    """The value a series logged at ``step`` (the last one, if several), else None."""
    found = [value for at, value in points if at == step]
    return found[-1] if found else None


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for a single value)."""
    if not values:
        raise ValueError("mean_std of no values")
    std = statistics.stdev(values) if len(values) > 1 else None
    return statistics.fmean(values), std


def fmt_mean_std(values: Sequence[float | None], digits: int) -> str:
    """A table cell over the values present (None: a run that has none): "mean ± std", the mean
    alone for one value, "–" for none."""
    present = [value for value in values if value is not None]
    if not present:
        return "–"
    mean, std = mean_std(present)
    if std is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"
