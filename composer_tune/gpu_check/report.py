"""Running a part, recording it with the machine it ran on, and the report (``report.json`` and
``report.md``) that each part's run updates."""

from __future__ import annotations

import datetime
import functools
import importlib
import importlib.metadata
import json
import math
import platform
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from composer_tune.gpu_check.async_steps import run_async
from composer_tune.gpu_check.common import (
    GIB,
    IMPORT_CHECKS,
    PACKAGES,
    PART_SECONDS_WARN,
    PARTS,
    REPO_ROOT,
    STATUS_ORDER,
    MissingDependency,
    PartResult,
    Settings,
)
from composer_tune.gpu_check.memory import run_memory
from composer_tune.gpu_check.muon import run_muon
from composer_tune.gpu_check.parity import run_parity
from composer_tune.gpu_check.peer import run_peer
from composer_tune.gpu_check.sampling import run_sampling
from composer_tune.gpu_check.speed import run_speed

PART_FUNCTIONS: dict[str, Callable[[Settings], PartResult]] = {
    "parity": run_parity,
    "memory": run_memory,
    "speed": run_speed,
    "sampling": run_sampling,
    "peer": run_peer,
    "muon": run_muon,
    "async": run_async,
}


def _git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown (no git checkout)"


@functools.cache
def import_checks() -> dict[str, str]:
    """``ok`` or the import error of each of :data:`IMPORT_CHECKS`."""
    results = {}
    for name in IMPORT_CHECKS:
        try:
            importlib.import_module(name)
            results[name] = "ok"
        except Exception as err:  # noqa: BLE001 - any failure is the finding
            results[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return results


def environment(settings: Settings, commit: str | None) -> dict[str, Any]:
    """Where and when a part ran: device, versions, date, commit."""
    if settings.device.type == "cuda":
        props = torch.cuda.get_device_properties(settings.device)
        device = f"{props.name} ({props.total_memory / GIB:.1f} GiB)"
    else:
        device = (
            f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or _git_commit(),
        "tiny": settings.tiny,
        "packages": versions,
        "imports": import_checks(),
    }


def run_part(name: str, settings: Settings, commit: str | None) -> dict[str, Any]:
    """Run one part; never raises: a skip or an error becomes the section's status."""
    print(f"[gpu_check] {name} ...", flush=True)
    section: dict[str, Any] = {"environment": environment(settings, commit)}
    start = time.perf_counter()
    try:
        result = PART_FUNCTIONS[name](settings)
    except (MissingDependency, ImportError) as err:
        section.update(status="SKIPPED", reason=str(err))
    except Exception as err:  # noqa: BLE001 - the other parts still run
        section.update(
            status="ERROR", reason=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()
        )
    else:
        statuses = {row["status"] for row in result.rows}
        status = next((s for s in STATUS_ORDER if s in statuses), "SKIPPED")
        section.update(
            status="FAIL" if status == "ERROR" else status,
            columns=[list(column) for column in result.columns],
            rows=result.rows,
            notes=result.notes,
        )
    section["seconds"] = time.perf_counter() - start
    if section["seconds"] > PART_SECONDS_WARN:
        section.setdefault("notes", []).append(
            f"took {section['seconds']:.0f} s: over the {PART_SECONDS_WARN} s budget per part"
        )
    print(
        f"[gpu_check] {name}: {section['status']} in {section['seconds']:.1f} s"
        + (f" ({section['reason']})" if "reason" in section else ""),
        flush=True,
    )
    return section


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, spec) if spec else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def render_markdown(report: dict[str, Any]) -> str:
    """The Markdown report, generated from the JSON report alone."""
    parts = report["parts"]
    latest = max(parts.values(), key=lambda s: s["environment"]["date"], default=None)
    lines = ["# composer-tune GPU check", ""]
    lines.append("Written by `python tools/gpu_check.py`; see docs/gpu/README.md.")
    lines.append("")
    if latest is not None:
        env = latest["environment"]
        lines += ["| | |", "| --- | --- |"]
        for key in ("device", "torch", "cuda", "python", "date", "commit"):
            lines.append(f"| {key} | {env[key]} |")
        packages = ", ".join(f"{k} {v}" for k, v in env["packages"].items())
        lines.append(f"| packages | {packages} |")
        imports = ", ".join(f"{k}: {v}" for k, v in env["imports"].items())
        lines.append(f"| imports | {_cell(imports, '')} |")
        if env["tiny"]:
            lines.append("| sizes | **--tiny** (a dry run: toy sizes, goals not judged) |")
        lines.append("")
    lines += ["## Summary", "", "| part | status | seconds | ran on | reason |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for name in PARTS:
        section = parts.get(name)
        if section is None:
            lines.append(f"| {name} | not run yet | | | |")
            continue
        env = section["environment"]
        ran_on = f"{env['device']}, torch {env['torch']}, {env['commit']}, {env['date']}"
        reason = _cell(section.get("reason", ""), "")
        lines.append(
            f"| {name} | {section['status']} | {section['seconds']:.1f} | {ran_on} | {reason} |"
        )
    for name in PARTS:
        section = parts.get(name)
        if section is None:
            continue
        lines += ["", f"## {name}", "", f"Status: **{section['status']}**"]
        if "reason" in section:
            lines += ["", f"Reason: {section['reason']}"]
        if section.get("rows"):
            columns = [c for c in section["columns"] if any(c[0] in r for r in section["rows"])]
            lines += ["", "| " + " | ".join(c[1] for c in columns) + " | status | note |"]
            lines.append("| " + " | ".join("---" for _ in range(len(columns) + 2)) + " |")
            for row in section["rows"]:
                cells = [_cell(row.get(key), spec) for key, _, spec in columns]
                cells += [row["status"], _cell(row.get("note", ""), "")]
                lines.append("| " + " | ".join(cells) + " |")
        for note in section.get("notes", []):
            lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    staging.replace(path)


def update_report(out_dir: Path, sections: dict[str, dict[str, Any]], fresh: bool) -> Path:
    """Merge ``sections`` into ``out_dir/report.json`` and regenerate ``report.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    report: dict[str, Any] = {"parts": {}}
    if json_path.is_file() and not fresh:
        report = json.loads(json_path.read_text())
    report["parts"].update(sections)
    _write(json_path, json.dumps(report, indent=1) + "\n")
    _write(out_dir / "report.md", render_markdown(report))
    return out_dir / "report.md"
