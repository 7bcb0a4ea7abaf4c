"""Reading back the metrics a recipe wrote with torchtune's ``DiskLogger``.

Every recipe logs through ``torchtune.training.metric_logging.DiskLogger``, which appends one line
per ``log_dict`` call to ``<log_dir>/log_<unix seconds>.txt``::

    Step 12 | loss:0.031 reward/mean:0.52 eval/accuracy:0.47

A resumed run opens a new file in the same folder, and one step can be logged on several lines
(training metrics, then the held-out evaluation), so a run's metrics are the union of every line of
every file, oldest file first, a later value of the same metric at the same step winning. The
ladder (tools/ladder.py) and the recipe tests read logs through this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

_STEP_LINE = re.compile(r"Step (\d+) \| (.*)")

Metrics = dict[int, dict[str, float]]
"""step -> {metric name: value}"""


def parse_metric_lines(lines: Iterable[str], *, source: str = "<lines>") -> Metrics:
    """Metrics of DiskLogger lines: step -> {name: value}; later lines win.

    Lines that are not ``Step N | ...`` lines are skipped (a log file holds only those, but a
    captured console may hold others).

    Raises:
        ValueError: naming ``source`` and the line number for an item that is not ``name:number``.
    """
    steps: Metrics = {}
    for number, line in enumerate(lines, start=1):
        match = _STEP_LINE.match(line)
        if match is None:
            continue
        values = steps.setdefault(int(match.group(1)), {})
        for item in match.group(2).split():
            # Metric names may hold ':' (none do today); values never do.
            name, _, value = item.rpartition(":")
            try:
                values[name] = float(value)
            except ValueError:
                name = ""
            if not name:
                raise ValueError(
                    f"{source}:{number}: cannot read metric {item!r} (expected name:number)"
                )
    return steps


def log_files(log_dir: str | Path) -> list[Path]:
    """A DiskLogger folder's ``log_*.txt`` files, oldest first.

    Raises:
        FileNotFoundError: naming ``log_dir`` when it holds no log file.
    """
    log_dir = Path(log_dir)
    files = sorted(log_dir.glob("log_*.txt"), key=lambda path: (path.stat().st_mtime, path.name))
    if not files:
        raise FileNotFoundError(f"no DiskLogger file (log_*.txt) in {log_dir}")
    return files


def read_metrics(log_dir: str | Path) -> Metrics:
    """Every metric logged in a DiskLogger folder (all its files, oldest first): step -> values."""
    steps: Metrics = {}
    for path in log_files(log_dir):
        for step, values in parse_metric_lines(
            path.read_text().splitlines(), source=str(path)
        ).items():
            steps.setdefault(step, {}).update(values)
    return steps


def series(metrics: Metrics, name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one metric at every step that logged it, in step order; NaNs kept."""
    return [(step, values[name]) for step, values in sorted(metrics.items()) if name in values]
