"""A repository environment in TRL's ``environment_factory`` shape for feature-deletion tasks
(``composer_tune.data.feature_tasks``): each episode gets a fresh working copy of a real
repository with one feature removed; the agent lists, reads, searches and edits its files and
runs commands and the visible tests in the sandbox; ``get_reward()`` runs the hidden tests
through the split grader (``composer_tune.rewards.repository``), out of the working copy's
reach, and its failing test's report becomes the episode's feedback (SDPO's hint at the final
answer's error turn). ``reset`` refuses a task whose deleted code the sandbox shows anywhere
(``composer_tune.data.task_leaks``): the episode is then not scored.

```yaml
agent:
  environment:
    _component_: composer_tune.agents.repository.RepositoryEnvironment
    command_time_s: 30
reward:
  _component_: composer_tune.agents.repository.EnvironmentReward  # get_reward() decides
dataset:
  _component_: composer_tune.data.feature_tasks.load_feature_task_dataset
  store: tests/assets/feature_tasks
```
"""

from __future__ import annotations

import atexit
import math
import os
import shlex
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from composer_tune.data.feature_tasks import (
    FeatureTask,
    materialize_agent_tree,
    materialize_tests_tree,
    task_from_sample,
)
from composer_tune.data.task_leaks import refuse_reachable
from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.repository import (
    PYTEST_TARGET,
    REPO_TARGET,
    HiddenTestsResult,
    grade_repository,
)
from composer_tune.rewards.sandbox import (
    Mount,
    SandboxLimits,
    SandboxResult,
    isolation_in_effect,
    run_command,
)
from composer_tune.rewards.split import pytest_runtime

_LISTED_ENTRIES = 300
_SEARCH_MATCHES = 100
_MAX_WRITE_BYTES = 1 * 2**20
_SKIPPED_DIRS = {"__pycache__", ".git", ".pytest_cache"}


class EnvironmentReward:
    """The recipe reward of episodes an environment scores: NaN ("not applicable") for every
    final answer, so that ``get_reward()`` alone is the episode's reward (TRL's semantics
    when ``reward_funcs`` is omitted)."""

    def __call__(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        return [RewardResult(math.nan, None, "") for _ in completions]


_tests_trees: dict[tuple[str, str], Path] = {}
_tests_lock = threading.Lock()


def _tests_tree(store: Path, task: FeatureTask) -> Path:
    """The grader's tree of ``task``'s source, built once per process (read-only to runs)."""
    key = (str(store.resolve()), task.source_sha256)
    with _tests_lock:
        if key not in _tests_trees:
            root = Path(tempfile.mkdtemp(prefix="composer-hidden-tests-"))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            materialize_tests_tree(store, task, root / "tests")
            for path in [root, *root.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            _tests_trees[key] = root / "tests"
        return _tests_trees[key]


class RepositoryEnvironment:
    """One feature-deletion task per episode.

    Args:
        command_time_s: wall-clock and CPU budget of one run_command / search call.
        test_time_s: budget of one run_tests call.
        grade_time_s: budget of the hidden tests (get_reward).
        per_test_timeout_s: budget of each hidden test (None: only grade_time_s).
        memory_mb: address-space limit of each sandboxed process.
        partial_credit: reward the fraction of hidden tests passed (else 1 only when all pass).
        output_chars: the most characters of output one tool call returns.
        weaker_isolation: where the host cannot build the sandbox's private root (not root, no
            mount namespaces), construction fails unless this names the weaker isolation
            accepted instead: "host_filesystem" (commands see the host's files; a warning
            says so). See docs/sandbox.md.
    """

    def __init__(
        self,
        command_time_s: float = 30.0,
        test_time_s: float = 120.0,
        grade_time_s: float = 300.0,
        per_test_timeout_s: float | None = 30.0,
        memory_mb: int = 1024,
        partial_credit: bool = False,
        output_chars: int = 4000,
        weaker_isolation: str | None = None,
    ) -> None:
        for name, value in (
            ("command_time_s", command_time_s),
            ("test_time_s", test_time_s),
            ("grade_time_s", grade_time_s),
            ("memory_mb", memory_mb),
            ("output_chars", output_chars),
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"RepositoryEnvironment: {name} must be positive, got {value!r}")

        def limits(seconds: float) -> SandboxLimits:
            return SandboxLimits(
                wall_time_s=seconds,
                cpu_time_s=seconds,
                memory_bytes=int(memory_mb) * 2**20,
                max_processes=64,
                max_open_files=256,
                max_output_bytes=max(4 * output_chars, 64 * 2**10),
                disk_bytes=256 * 2**20,
            )

        self.command_limits = limits(command_time_s)
        self.test_limits = limits(test_time_s)
        self.grade_limits = replace(limits(grade_time_s), max_output_bytes=16 * 2**20)
        self.per_test_timeout_s = per_test_timeout_s
        self.partial_credit = partial_credit
        self.output_chars = output_chars
        self.isolation = isolation_in_effect(weaker_isolation, "RepositoryEnvironment")
        self.task: FeatureTask | None = None
        self.store: Path | None = None
        self.tree: Path | None = None
        self.reward_feedback = ""
        self.last_grade: HiddenTestsResult | None = None
        self._cleanup: weakref.finalize | None = None

    # ------------------------------------------------------------------ TRL's contract

    def reset(self, **sample: Any) -> str | None:
        """Start on ``sample`` (``load_feature_task_dataset``'s): a fresh working copy."""
        self.task, self.store = task_from_sample(sample)
        if self._cleanup is not None:
            self._cleanup()
        scratch = tempfile.mkdtemp(prefix="composer-repo-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, scratch, ignore_errors=True)
        self.tree = Path(scratch) / "repo"
        materialize_agent_tree(self.store, self.task, self.tree)
        self.tree.chmod(0o755)
        # A task whose deleted code the sandbox shows is no task: refuse the episode (unscored).
        if self.isolation == "private_root":
            refuse_reachable(self.store, self.task, self.tree)
        self.reward_feedback, self.last_grade = "", None
        visible = ", ".join(self.task.visible_tests[:20])
        return (
            "\n\nTools: list_files, read_file, search, write_file, replace_in_file, "
            f"run_command, run_tests. Paths are relative to the repository root. Visible test "
            f"files: {visible}."
        )

    def get_reward(self) -> float:
        """The hidden tests, run by the split grader on a scrubbed copy of the working tree (NaN,
        unscored, when the sandbox could not run them)."""
        task, tree = self._started()
        result = grade_repository(
            tree,
            tests_tree=_tests_tree(self.store, task),
            import_root=task.import_root,
            packages=task.packages,
            node_ids=task.hidden_tests,
            limits=self.grade_limits,
            per_test_timeout_s=self.per_test_timeout_s,
        )
        self.last_grade = result
        if result.sandbox_failure is not None:  # not the agent's failure: unscored
            self.reward_feedback = f"unscored: {result.sandbox_failure}"
            return math.nan
        if result.all_passed:
            self.reward_feedback = ""
            return 1.0
        self.reward_feedback = (
            f"{result.passed}/{result.total} hidden tests passed. First failure:\n{result.feedback}"
        )[-self.output_chars :]
        return result.passed / result.total if self.partial_credit else 0.0

    # ------------------------------------------------------------------ tools

    def list_files(self, path: str = ".") -> str:
        """List the files under a folder of the repository (recursively).

        Args:
            path: The folder, relative to the repository root.
        """
        folder = self._path(path)
        if not folder.is_dir():
            raise ValueError(f"{path}: not a folder")
        entries = []
        for directory, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
            for name in sorted(filenames):
                entries.append(str(Path(directory, name).relative_to(self._started()[1])))
            if len(entries) > _LISTED_ENTRIES:
                break
        more = (
            f"\n... ({len(entries) - _LISTED_ENTRIES} more)"
            if len(entries) > _LISTED_ENTRIES
            else ""
        )
        return "\n".join(entries[:_LISTED_ENTRIES]) + more if entries else "(no files)"

    def read_file(self, path: str, start_line: int = 1, end_line: int = 0) -> str:
        """Read a text file of the repository, with line numbers.

        Args:
            path: The file, relative to the repository root.
            start_line: The first line to show (1-based).
            end_line: The last line to show (0: up to the end, as far as the output limit allows).
        """
        file = self._path(path)
        if not file.is_file():
            raise ValueError(f"{path}: no such file")
        lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
        last = len(lines) if end_line <= 0 else min(end_line, len(lines))
        shown = [f"{n:5d}  {lines[n - 1]}" for n in range(max(start_line, 1), last + 1)]
        return self._clip("\n".join(shown) or "(empty)", keep="head")

    def search(self, pattern: str, path: str = ".") -> str:
        """Search the repository's files for a regular expression (grep -E), with line numbers.

        Args:
            pattern: The extended regular expression to look for.
            path: The file or folder to search, relative to the repository root.
        """
        self._path(path)
        argv = [
            "/bin/grep",
            "-rnIE",
            "--exclude-dir=__pycache__",
            "-m",
            str(_SEARCH_MATCHES),
            "-e",
            pattern,
            "--",
            path,
        ]
        result = self._run(argv, self.command_limits)
        if result.exit_code == 1 and not result.stdout:
            return "no matches"
        return self._clip(result.stdout or result.stderr, keep="head")

    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a file of the repository.

        Args:
            path: The file, relative to the repository root.
            content: The file's complete new text.
        """
        file = self._path(path)
        if file.exists() and not file.is_file():  # a folder, or a FIFO a command made
            raise ValueError(f"{path}: not a regular file")
        if len(content.encode("utf-8")) > _MAX_WRITE_BYTES:
            raise ValueError(f"content larger than {_MAX_WRITE_BYTES} bytes")
        file.parent.mkdir(parents=True, exist_ok=True)
        self._path(path)  # the folders just made must not lead outside either
        file.write_text(content, encoding="utf-8")
        return f"wrote {path} ({len(content.splitlines())} lines)"

    def replace_in_file(self, path: str, old: str, new: str) -> str:
        """Replace one exact occurrence of a text in a file of the repository.

        Args:
            path: The file, relative to the repository root.
            old: The exact text to replace; it must occur exactly once.
            new: The replacement text.
        """
        file = self._path(path)
        if not file.is_file():
            raise ValueError(f"{path}: no such file")
        text = file.read_text(encoding="utf-8")
        count = text.count(old) if old else 0
        if count != 1:
            raise ValueError(f"{path}: the text to replace occurs {count} times, not once")
        file.write_text(text.replace(old, new, 1), encoding="utf-8")
        return f"replaced 1 occurrence in {path}"

    def run_command(self, command: str) -> str:
        """Run a shell command in the repository (sandboxed: no network, time and memory limits).

        Args:
            command: The bash command line, e.g. "python -c 'import mypackage'".
        """
        return self._outcome(self._run(["/bin/bash", "-c", command], self.command_limits))

    def run_tests(self, tests: str = "") -> str:
        """Run the repository's visible tests with pytest and report the result.

        Args:
            tests: Space-separated test files or node ids to run (default: every visible test file).
        """
        task, _ = self._started()
        chosen = shlex.split(tests) if tests.strip() else list(task.visible_tests)
        for target in chosen:
            if target.split("::", 1)[0] not in task.visible_tests:
                raise ValueError(
                    f"{target}: not a visible test file ({', '.join(task.visible_tests)})"
                )
        argv = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", *chosen]
        command = " ".join(shlex.quote(part) for part in argv)
        return self._outcome(self._run(["/bin/bash", "-c", command], self.test_limits), keep="tail")

    # ------------------------------------------------------------------ helpers

    def _started(self) -> tuple[FeatureTask, Path]:
        if self.task is None or self.tree is None:
            raise RuntimeError("RepositoryEnvironment: reset() was not called")
        return self.task, self.tree

    def _path(self, path: str) -> Path:
        """``path`` inside the working copy; ValueError when it leads outside (also via links)."""
        _, tree = self._started()
        root = tree.resolve()
        target = (tree / path).resolve()
        if target != root and root not in target.parents:
            raise ValueError(f"{path}: outside the repository")
        return target

    def _run(self, argv: list[str], limits: SandboxLimits) -> SandboxResult:
        task, tree = self._started()
        jailed = self.isolation == "private_root"
        repo = REPO_TARGET if jailed else str(tree)
        lib = PYTEST_TARGET if jailed else str(pytest_runtime())
        root = os.path.join(repo, task.import_root).rstrip("/")
        env = {"PYTHONPATH": f"{root}:{lib}", "PYTHONDONTWRITEBYTECODE": "1"}
        mounts = [Mount(str(tree), repo, writable=True), Mount(str(pytest_runtime()), lib)]
        return run_command(argv, limits=limits, mounts=mounts if jailed else [], env=env, cwd=repo)

    def _outcome(self, result: SandboxResult, keep: str = "tail") -> str:
        status = result.status + (f" ({result.detail})" if result.detail else "")
        text = f"status: {status}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        return self._clip(text, keep=keep)

    def _clip(self, text: str, keep: str) -> str:
        if len(text) <= self.output_chars:
            return text
        cut = len(text) - self.output_chars
        if keep == "head":
            return text[: self.output_chars] + f"\n... ({cut} more characters)"
        return f"... ({cut} characters before)\n" + text[-self.output_chars :]
