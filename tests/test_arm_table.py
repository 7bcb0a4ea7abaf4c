"""The arms table (composer_tune.analysis.arm_table, tools/compare_arms.py) from ladder results
files written here, against values worked out by hand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from composer_tune.analysis.arm_table import (
    ArmSource,
    kept_runs,
    paired,
    per_seed,
    runs_by_label,
    table,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(arm: str, seed: int, start: float | None, end: float, status: str = "ok") -> dict:
    """A ladder record whose held-out accuracies are ``start`` at step 0 (None: not evaluated)
    and ``end`` at step 40 on every split and mode, offset per split and mode so that a column
    read from the wrong series shows."""
    metrics = {}
    for index, name in enumerate(
        [
            "eval/accuracy/heldout_templates",
            "eval_sampled/accuracy/heldout_templates",
            "eval/accuracy/heldout_params",
            "eval_sampled/accuracy/heldout_params",
        ]
    ):
        series = [] if start is None else [[0, start + index / 100]]
        metrics[name] = [*series, [40, end + index / 100]]
    metrics["completion_length/mean"] = [[step, 100.0 - step] for step in range(1, 41)]
    metrics["truncation_rate"] = [[step, 0.5] for step in range(1, 41)]
    return {"arm": arm, "seed": seed, "status": status, "wall_s": 10.0, "metrics": [metrics]}


def _ladder(path: Path, *runs: dict) -> Path:
    path.mkdir(parents=True)
    records = {f"{run['arm']}/seed{run['seed']}/{i}": run for i, run in enumerate(runs)}
    (path / "results.json").write_text(json.dumps({"runs": records}))
    return path


def test_table_is_the_mean_and_std_over_seeds_and_a0_counts_the_runs_that_measured_it(
    tmp_path: Path,
) -> None:
    a1 = _ladder(
        tmp_path / "a1",
        _run("a1", 1, None, 0.5),
        _run("a1", 0, 0.1, 0.3),
        _run("a1", 2, None, 0.0, status="failed"),  # not counted
    )
    flip = _ladder(tmp_path / "flip", _run("a1", 0, 0.2, 0.05))
    sources = [ArmSource.parse(f"A1={a1}:a1"), ArmSource.parse(f"flipped={flip}:a1")]
    lines = table(runs_by_label(sources)).splitlines()
    # A0: step 0 of the two runs that evaluated it (0.1 and 0.2), offsets .00/.01/.02/.03.
    assert lines[2] == (
        "| A0 base model (step 0, measured in 2 of the 3 runs) | – | "
        "0.150 ± 0.071 | 0.160 ± 0.071 | 0.170 ± 0.071 | 0.180 ± 0.071 | | |"
    )
    # A1: seeds 0 and 1 end at 0.3 and 0.5; length over steps 36-40 is 100 - 38 = 62.
    assert lines[3] == (
        "| A1 | 2 | 0.400 ± 0.141 | 0.410 ± 0.141 | 0.420 ± 0.141 | 0.430 ± 0.141 | "
        "62.0 ± 0.0 / 0.50 ± 0.00 | 10 ± 0 |"
    )
    assert lines[4] == "| flipped | 1 | 0.050 | 0.060 | 0.070 | 0.080 | 62.0 / 0.50 | 10 |"
    seeds = per_seed(runs_by_label(sources)).splitlines()
    assert "| A1 | 0 | 0 | 0.100 | 0.110 | 0.120 | 0.130 | 10 |" in seeds
    assert "| A1 | 1 | 0 | – | – | – | – | 10 |" in seeds  # no step-0 evaluation


def test_the_columns_are_the_evaluations_the_runs_logged(tmp_path: Path) -> None:
    def arithmetic(seed: int, end: float, wall_s: float) -> dict:
        series = {"eval/accuracy": [[0, 0.25], [20, 0.4], [40, end]]}
        series["async/staleness_mean"] = [[1, 1.0]]  # not a table's series
        return {"arm": "a1", "seed": seed, "status": "ok", "wall_s": wall_s, "metrics": [series]}

    sync = _ladder(tmp_path / "sync", arithmetic(0, 0.5, 300.0), arithmetic(1, 0.6, 500.0))
    stale = _ladder(tmp_path / "stale", arithmetic(0, 0.55, 200.0), arithmetic(1, 0.45, 200.0))
    grouped = runs_by_label(
        [ArmSource.parse(f"sync={sync}:a1"), ArmSource.parse(f"staleness 1={stale}:a1")]
    )
    lines = table(grouped).splitlines()
    assert lines[0] == (
        "| arm | seeds | held-out, greedy | reply tokens / truncated (last 5 steps) | "
        "wall / run (s) |"
    )
    assert lines[1] == "|---|---|---|---|---|"
    assert (
        lines[2]
        == "| A0 base model (step 0, measured in 4 of the 4 runs) | – | 0.250 ± 0.000 | | |"
    )
    assert lines[3] == "| sync | 2 | 0.550 ± 0.071 | – / – | 400 ± 141 |"
    assert (
        paired(grouped, "staleness 1", "sync") == "| staleness 1 − sync | 0, 1 | -0.050 ± 0.141 |"
    )
    kept = kept_runs(grouped)["runs"]["sync/seed0"]["metrics"][0]
    assert list(kept) == ["eval/accuracy"]
    # The code ladder's splits, templates before parameters, greedy before sampled; the whole
    # set's series (their mixture) not shown beside them.
    mixed = _run("a1", 0, 0.1, 0.3)
    mixed["metrics"][0]["eval/accuracy"] = [[40, 0.9]]
    code = _ladder(tmp_path / "code", mixed)
    header = table(runs_by_label([ArmSource.parse(f"A1={code}:a1")])).splitlines()[0]
    assert header.startswith(
        "| arm | seeds | held-out templates, greedy | held-out templates, sampled | "
        "held-out params, greedy | held-out params, sampled | reply tokens"
    )


def test_an_arm_without_a_completed_run_is_named(tmp_path: Path) -> None:
    ladder = _ladder(tmp_path / "a2", _run("a2", 0, 0.1, 0.2, status="running"))
    with pytest.raises(ValueError, match="A2: no completed a2 run"):
        runs_by_label([ArmSource.parse(f"A2={ladder}:a2")])
    with pytest.raises(ValueError, match="expected LABEL=PATH:ARM"):
        ArmSource.parse("A2 runs/x")


def test_sources_of_one_label_join_into_one_row_and_a_repeated_seed_is_refused(
    tmp_path: Path,
) -> None:
    seed0 = _ladder(tmp_path / "s0", _run("a1", 0, 0.1, 0.3))
    seed1 = _ladder(tmp_path / "s1", _run("a1", 1, None, 0.5), _run("a2", 1, None, 0.9))
    joined = [ArmSource.parse(f"A1={seed1}:a1"), ArmSource.parse(f"A1={seed0}:a1")]
    lines = table(runs_by_label(joined)).splitlines()
    assert lines[3].startswith("| A1 | 2 | 0.400 ± 0.141 | 0.410 ± 0.141 |"), lines
    assert len(lines) == 4  # one row for the label, the a2 run not read
    seeds = [line.split(" | ")[1] for line in per_seed(runs_by_label(joined)).splitlines()[2:]]
    assert seeds == ["0", "0", "1", "1"]  # by seed, whichever source came first
    with pytest.raises(ValueError, match=r"A1: seed\(s\) \[0\] come from more than one source"):
        runs_by_label([*joined, ArmSource.parse(f"A1={seed0}:a1")])


def test_paired_rows_are_per_seed_differences_over_the_seeds_both_arms_ran(
    tmp_path: Path,
) -> None:
    a2 = _ladder(tmp_path / "a2", _run("a2", 0, None, 0.4), _run("a2", 1, None, 0.3))
    a1 = _ladder(
        tmp_path / "a1", _run("a1", 0, 0.1, 0.3), _run("a1", 1, None, 0.3), _run("a1", 2, None, 0.9)
    )
    grouped = runs_by_label([ArmSource.parse(f"A2={a2}:a2"), ArmSource.parse(f"A1={a1}:a1")])
    # Seeds 0 and 1 only (A1's seed 2 has no partner): +0.1 and 0.0; the per-column offsets
    # cancel, so a column paired with the wrong one would show.
    row = "| A2 − A1 | 0, 1 | " + " | ".join(["+0.050 ± 0.071"] * 4) + " |"
    assert paired(grouped, "A2", "A1") == row
    assert paired(grouped, "A1", "A2").startswith("| A1 − A2 | 0, 1 | -0.050 ± 0.071 |")
    one_seed = runs_by_label([ArmSource.parse(f"A2={a2}:a2"), ArmSource.parse(f"A1={a1}:a1")])
    one_seed["A2"] = one_seed["A2"][:1]
    assert paired(one_seed, "A2", "A1").startswith("| A2 − A1 | 0 | +0.100 | +0.100 |")
    with pytest.raises(ValueError, match="no arm labelled 'A4'"):
        paired(grouped, "A4", "A1")
    lone = runs_by_label([ArmSource.parse(f"A1={a1}:a1")])
    lone["other"] = [run for run in lone["A1"] if run["seed"] == 2]
    lone["A1"] = lone["A1"][:2]
    with pytest.raises(ValueError, match="share no seed"):
        paired(lone, "A1", "other")


def _compare_arms(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/compare_arms.py", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_command_writes_the_table_plots_and_a_record_that_rebuilds_the_table(
    tmp_path: Path,
) -> None:
    first = _run("a1", 0, 0.1, 0.3)
    first["metrics"][0]["loss"] = [[1, 2.0]]  # not a series the table reads: not kept
    ladder = _ladder(tmp_path / "a1", first, _run("a2", 0, None, 0.6))
    out = tmp_path / "out"
    done = _compare_arms("--arm", f"A1={ladder}:a1", "--arm", f"A2={ladder}:a2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "| A1 | 1 | 0.300 | 0.310 | 0.320 | 0.330 | 62.0 / 0.50 | 10 |" in done.stdout
    assert (out / "results.md").is_file() and (out / "reward.png").is_file()
    kept = json.loads((out / "runs.json").read_text())["runs"]
    assert sorted(kept) == ["A1/seed0", "A2/seed0"]
    assert kept["A1/seed0"]["arm"] == "A1" and "loss" not in kept["A1/seed0"]["metrics"][0]
    # The ladder folder gone, the record alone gives the same table.
    shutil.rmtree(ladder)
    again = _compare_arms(
        "--arm", f"A1={out / 'runs.json'}:A1", "--arm", f"A2={out / 'runs.json'}:A2"
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == done.stdout
    # The record as a source of the table that rewrites it, beside a new seed of one label.
    seed1 = _ladder(tmp_path / "s1", _run("a1", 1, None, 0.5))
    kept = out / "runs.json"
    joined = _compare_arms(
        "--arm", f"A1={kept}:A1", "--arm", f"A1={seed1}:a1", "--arm", f"A2={kept}:A2",
        "--out", str(out),
    )  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    assert "| A1 | 2 | 0.400 ± 0.141 |" in joined.stdout
    # A paired row, in the printed table and results.md; an unknown label is an error line.
    compared = _compare_arms(
        "--arm", f"A1={kept}:A1", "--arm", f"A2={kept}:A2", "--paired", "A2", "A1",
        "--out", str(out),
    )  # fmt: skip
    assert compared.returncode == 0, compared.stderr
    row = "| A2 − A1 | 0 | +0.300 | +0.300 | +0.300 | +0.300 |"
    assert row in compared.stdout and row in (out / "results.md").read_text()
    assert '--paired "A2" "A1"' in (out / "results.md").read_text()
    wrong = _compare_arms("--arm", f"A1={kept}:A1", "--paired", "A2", "A1")
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: paired: no arm labelled")
    assert sorted(json.loads(kept.read_text())["runs"]) == ["A1/seed0", "A1/seed1", "A2/seed0"]
