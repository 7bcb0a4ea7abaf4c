"""Grading a repository against hidden pytest tests, out of the repository's reach.

``grade_repository`` takes the agent's working tree after the episode and:

1. copies it into a fresh directory, regular files only, leaving out what could carry the
   original or tamper with a test run: ``__pycache__``/``.pyc``/``.pyo``, compiled modules,
   ``.git`` and other VCS folders, ``build``/``dist``/``*.egg-info``, tool caches,
   ``conftest.py``, ``sitecustomize.py``/``usercustomize.py``, ``.pth`` files, symlinks and
   special files;
2. runs a split test run (``composer_tune.rewards.split``): the copy is imported by a solution
   process (``python -I -S``, the copy mounted read-only, no pytest, no site-packages), and the
   hidden tests run under pytest in a grader process that holds the original test tree and
   pytest but no file of the agent's; the tests' ``import pkg`` resolves to proxies of the
   solution process's modules (``composer_tune.rewards.bridge``), so the agent's code never
   runs where the tests, their expected values or pytest's reporting live;
3. counts a hidden test as passed only when the grader saw it pass (a test it never reports,
   a skipped test, a setup or teardown error and a test during which the bridge broke all
   count as failed).

The same function validates generated tasks (the original must score 1, the deleted
snapshot 0), so a task only exists when this grader can decide it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from composer_tune.rewards.sandbox import Mount, SandboxLimits, private_root_available
from composer_tune.rewards.split import pytest_runtime, run_split

# Where the private root shows the trees (without one, their host paths are used).
REPO_TARGET = "/repo"
TESTS_TARGET = "/tests"
PYTEST_TARGET = "/opt/pytest-runtime"

_SKIPPED_DIRS = {
    "__pycache__",
    ".git",
    ".hg",
    ".svn",
    ".bzr",
    "build",
    "dist",
    ".eggs",
    ".tox",
    ".nox",
    ".venv",
    "venv",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "node_modules",
}
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".pth", ".egg-info", ".dist-info")
_SKIPPED_NAMES = {"conftest.py", "sitecustomize.py", "usercustomize.py"}
MAX_COPY_FILES = 5000
MAX_COPY_BYTES = 64 * 2**20


class TreeTooLarge(ValueError):
    """The working tree exceeds the copy limits."""


def scrubbed_copy(source: Path, destination: Path) -> list[str]:
    """Copy ``source`` to ``destination`` as described in the module docstring; returns what
    was left out (relative paths). Raises TreeTooLarge past ``MAX_COPY_FILES`` files or
    ``MAX_COPY_BYTES`` bytes."""
    left_out: list[str] = []
    files = size = 0
    destination.mkdir(parents=True)
    for directory, dirnames, filenames in os.walk(source):
        relative = Path(directory).relative_to(source)
        kept = []
        for name in sorted(dirnames):
            path = Path(directory, name)
            if name in _SKIPPED_DIRS or name.endswith(_SKIPPED_SUFFIXES) or path.is_symlink():
                left_out.append(str(relative / name) + "/")
            else:
                kept.append(name)
                (destination / relative / name).mkdir()
        dirnames[:] = kept
        for name in sorted(filenames):
            path = Path(directory, name)
            info = path.lstat()
            if (
                not stat.S_ISREG(info.st_mode)
                or name in _SKIPPED_NAMES
                or name.endswith(_SKIPPED_SUFFIXES)
            ):
                left_out.append(str(relative / name))
                continue
            files += 1
            size += info.st_size
            if files > MAX_COPY_FILES or size > MAX_COPY_BYTES:
                raise TreeTooLarge(
                    f"the working tree has more than {MAX_COPY_FILES} files or "
                    f"{MAX_COPY_BYTES // 2**20} MiB"
                )
            shutil.copyfile(path, destination / relative / name, follow_symlinks=False)
    for path in [destination, *destination.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return left_out


@dataclass(frozen=True)
class HiddenTestsResult:
    """The hidden tests' verdict: ``outcomes`` maps every hidden node id to "passed", "failed",
    "skipped" or "missing"; ``feedback`` is the first failure's pytest report (or why nothing
    ran); ``left_out`` what the scrubbed copy dropped."""

    passed: int
    total: int
    outcomes: dict[str, str]
    feedback: str
    left_out: list[str] = field(default_factory=list)
    # Why the sandbox could not run the grade (it says nothing of the tree), or None.
    sandbox_failure: str | None = None

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def grade_repository(
    tree: Path,
    *,
    tests_tree: Path,
    import_root: str,
    packages: Sequence[str],
    node_ids: Sequence[str],
    limits: SandboxLimits,
    per_test_timeout_s: float | None = None,
) -> HiddenTestsResult:
    """Run ``node_ids`` of ``tests_tree`` (the original test files, no package) against the
    package in ``tree`` (see the module docstring). ``import_root``: the folder of ``tree``
    that holds ``packages`` ("" or "src")."""
    with tempfile.TemporaryDirectory(prefix="composer-grade-") as scratch:
        copy = Path(scratch) / "repo"
        try:
            left_out = scrubbed_copy(Path(tree), copy)
        except TreeTooLarge as error:
            return HiddenTestsResult(
                0, len(node_ids), dict.fromkeys(node_ids, "missing"), str(error)
            )
        jailed = private_root_available()
        repo = REPO_TARGET if jailed else str(copy)
        tests = TESTS_TARGET if jailed else str(tests_tree)
        lib = PYTEST_TARGET if jailed else str(pytest_runtime())
        run = run_split(
            grader_entry="pytest_grader",
            grader_config={
                "lib": lib,
                "rootdir": tests,
                "node_ids": list(node_ids),
                "packages": list(packages),
                "per_test_timeout_s": per_test_timeout_s,
                "time_budget_s": limits.wall_time_s,
            },
            solution_entry="package_solution",
            solution_arguments={"import_root": os.path.join(repo, import_root).rstrip("/")},
            limits=_with_slack(limits),
            grader_mounts=[
                Mount(str(tests_tree), tests),
                Mount(str(pytest_runtime()), lib),
            ]
            if jailed
            else [],
            solution_mounts=[Mount(str(copy), repo)] if jailed else [],
            nonce=secrets.token_hex(16),
        )
    report = run.report or {}
    reported = report.get("outcomes") if isinstance(report.get("outcomes"), dict) else {}
    outcomes = {node: str(reported.get(node, "missing")) for node in node_ids}
    passed = sum(outcome == "passed" for outcome in outcomes.values())
    if run.report is None:
        feedback = f"the grader failed ({run.grader.status}: {run.grader.detail})"
    elif report.get("load_error"):
        feedback = str(report["load_error"])
        if run.solution.stderr.strip():
            feedback += "\n" + run.solution.stderr.strip()[-1500:]
    else:
        feedback = str(report.get("failure") or "")
        missing = [node for node, outcome in outcomes.items() if outcome == "missing"]
        if missing and not feedback:
            feedback = f"{len(missing)} hidden tests did not run (e.g. {missing[0]})"
    if run.sandbox_failure is not None:
        feedback = run.sandbox_failure
    return HiddenTestsResult(
        passed, len(node_ids), outcomes, feedback, left_out, run.sandbox_failure
    )


def _with_slack(limits: SandboxLimits) -> SandboxLimits:
    """The sandboxes' wall clock: the tests' budget plus time for pytest to start and report."""
    from dataclasses import replace

    return replace(limits, wall_time_s=limits.wall_time_s + 10.0)
