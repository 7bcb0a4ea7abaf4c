"""Trainer side of a split test run: a grader process and a solution process, each in its own
sandbox, joined by two pipes and nothing else (see bridge.py and harness.py).

``run_split`` starts both, waits for the grader, then stops the solution. The grader's report
is the only thing read: the solution's exit status, output and files never decide a score.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from composer_tune.rewards.harness import program
from composer_tune.rewards.sandbox import Mount, SandboxLimits, SandboxResult, run_python

logger = logging.getLogger(__name__)

# Isolation a split run needs for its guarantee (docs/sandbox.md): the solution cannot read the
# grader's files, memory or the trainer's, and cannot see the original package installed.
REQUIRED_ISOLATION = frozenset({"private_uid", "pid_namespace", "private_root"})
_warned = threading.Event()


@dataclass(frozen=True)
class SplitRun:
    """The two sandbox results; ``report`` is the grader's JSON report (None if it gave none)."""

    grader: SandboxResult
    solution: SandboxResult
    report: dict | None

    @property
    def sandbox_failure(self) -> str | None:
        """Why the sandbox could not run one of the two programs (status "sandbox_error"), or
        None: such a run says nothing of the solution, so it must not be scored."""
        for side, result in (("grader", self.grader), ("solution", self.solution)):
            if result.status == "sandbox_error":
                return f"the sandbox could not run the {side} ({result.detail})"
        return None


def run_split(
    *,
    grader_entry: str,
    grader_config: Mapping[str, object],
    solution_entry: str,
    solution_arguments: Mapping[str, object],
    limits: SandboxLimits,
    grader_mounts: Sequence[Mount] = (),
    solution_mounts: Sequence[Mount] = (),
    nonce: str,
) -> SplitRun:
    """Run ``harness.<grader_entry>`` (its configuration on stdin) against
    ``harness.<solution_entry>(**solution_arguments)``; both get ``limits``."""
    to_solution_read, to_solution_write = os.pipe()
    to_grader_read, to_grader_write = os.pipe()
    stop_read, stop_write = os.pipe()
    solution_program = program(
        solution_entry, **solution_arguments, read_fd=to_solution_read, write_fd=to_grader_write
    )
    grader_program = program(grader_entry, read_fd=to_grader_read, write_fd=to_solution_write)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="split-solution") as pool:
            solution_future = pool.submit(
                run_python,
                solution_program,
                limits=limits,
                mounts=solution_mounts,
                pass_fds=(to_solution_read, to_grader_write),
                stop_fd=stop_read,
            )
            try:
                grader = run_python(
                    grader_program,
                    limits=limits,
                    stdin=json.dumps({**grader_config, "nonce": nonce}),
                    mounts=grader_mounts,
                    pass_fds=(to_grader_read, to_solution_write),
                )
            finally:
                os.close(stop_write)  # the solution has nobody left to answer
            solution = solution_future.result()
    finally:
        os.close(stop_read)
    if not REQUIRED_ISOLATION <= grader.isolation and not _warned.is_set():
        _warned.set()
        logger.warning(
            "split test runs lack %s here (not root, or no mount namespaces): the solution can "
            "read what the trainer's user can read; see docs/sandbox.md",
            sorted(REQUIRED_ISOLATION - grader.isolation),
        )
    return SplitRun(grader, solution, parse_report(grader.stdout, nonce))


def parse_report(stdout: str, nonce: str) -> dict | None:
    """The JSON object on the last line starting with ``nonce``; None when absent or garbled."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce):
            try:
                report = json.loads(line[len(nonce) :])
            except ValueError:
                return None
            return report if isinstance(report, dict) else None
    return None


_RUNTIME_DISTRIBUTIONS = (
    "pytest",
    "pluggy",
    "iniconfig",
    "packaging",
    "pygments",
    "exceptiongroup",
    "tomli",
)
_runtime_lock = threading.Lock()
_runtime: Path | None = None


def pytest_runtime() -> Path:
    """A directory holding only pytest and its requirements, copied once per process from this
    environment, for sandboxed programs to put on ``sys.path`` (the private root hides every
    site-packages, so the package under test cannot be imported from an installed copy)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            target = Path(tempfile.mkdtemp(prefix="composer-pytest-runtime-"))
            atexit.register(shutil.rmtree, target, ignore_errors=True)
            for name in _RUNTIME_DISTRIBUTIONS:
                try:
                    distribution = importlib.metadata.distribution(name)
                except importlib.metadata.PackageNotFoundError:
                    if name in _RUNTIME_DISTRIBUTIONS[:5]:
                        raise RuntimeError(f"pytest_runtime: {name} is not installed") from None
                    continue
                for file in distribution.files or ():
                    parts = file.parts  # dist-info kept: pytest reads its own version there
                    if parts[0] == ".." or parts[0].endswith(".egg-info"):
                        continue
                    if "__pycache__" in parts or file.suffix == ".pyc":
                        continue
                    destination = target.joinpath(*parts)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    # Times kept: the leak check's cache knows the runtime by them.
                    shutil.copy2(distribution.locate_file(file), destination)
            for path in [target, *target.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            _runtime = target
        return _runtime
