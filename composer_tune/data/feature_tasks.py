"""Feature-deletion tasks: the task format, the snapshot store, and chat samples.

A task is a real repository with one feature removed (a function's, method's or class's body,
or a module's) that the agent must put back, graded by the tests that failed once it was gone
(hidden from the agent) while the rest of the suite (which it may run) kept passing. The same
format holds the second kind, procedural bugs (``feature.kind == "bug"``: one small change
inside a function, ``composer_tune.data.procedural_bugs``), which the agent must find and
undo. Tasks are made by ``tools/make_feature_tasks.py``
(``composer_tune.data.feature_generator``).

Store layout (each source once, tasks as small edits of it)::

    <store>/tasks.jsonl                one task per line (see FeatureTask)
    <store>/counts.json                per source repository: candidates found, tasks kept
                                       (and a model's memorisation: feature_memorisation.py)
    <store>/sources/<repo>.tar.gz      the original repository, filtered (no caches, no VCS)
    <store>/sources/<repo>.LICENSE     its licence, kept beside it

A task's working tree (what the agent gets) is its source with the deletion applied and the
hidden tests' functions cut out of the test files; its tests tree (what the grader gets) is
the source without the package. Both are rebuilt from the archive on demand.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

DEFAULT_SYSTEM_PROMPT = (
    "You are a software engineer working in a Python repository. Use the tools to read and "
    "search the code, edit files and run the tests. When the feature works, reply with a "
    "short summary of what you changed and no tool call."
)
TASKS_FILE = "tasks.jsonl"
COUNTS_FILE = "counts.json"
KINDS = ("function", "method", "class", "module", "bug")


class FeatureTaskError(ValueError):
    """A malformed task store; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class LineEdit:
    """Replace lines ``start``..``end`` (1-based, inclusive) of ``file`` with ``replacement``;
    ``original_sha256`` is the hash of the replaced text, checked before applying."""

    file: str
    start: int
    end: int
    replacement: str
    original_sha256: str


@dataclass(frozen=True)
class Feature:
    """What was removed: ``kind`` (function, method, class, module), where, and how it reads;
    or, for a procedural bug (``kind`` "bug", composer_tune/data/procedural_bugs.py), the
    function it is in and the ``mutation`` that made it."""

    kind: str
    file: str
    qualname: str
    signature: str
    docstring: str
    lines: int
    mutation: str = ""


@dataclass(frozen=True)
class FeatureTask:
    """One task (one JSONL line).

    Attributes:
        id: unique, ``<repo>:<file>:<qualname>``.
        repo: the source's name (``<project>-<version>``), its archive ``sources/<repo>.tar.gz``.
        source_sha256: the archive's hash.
        import_root: the folder holding the package ("" or "src").
        packages: the top-level import names the package provides.
        feature: what was removed; deletion: the edit that removes it.
        test_removals: edits that cut the hidden tests out of the agent's test files.
        hidden_tests: the pytest node ids that decide the reward.
        visible_tests: the test files the agent may run (all pass without the feature).
        statement: the task as the agent reads it.
        validation: the generator's checks (counts of passing / failing tests per tree).
    """

    id: str
    repo: str
    source_sha256: str
    import_root: str
    packages: tuple[str, ...]
    feature: Feature
    deletion: LineEdit
    test_removals: tuple[LineEdit, ...]
    hidden_tests: tuple[str, ...]
    visible_tests: tuple[str, ...]
    statement: str
    validation: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        row = asdict(self)
        if not row["feature"]["mutation"]:  # deletions: the format as it was before bugs
            del row["feature"]["mutation"]
        return json.dumps(row, sort_keys=True)


def _relative(path: Any, what: str) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a non-empty relative path")
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"{what} must stay inside the repository, got {path!r}")
    return path


def _edit(row: Any, what: str) -> LineEdit:
    if not isinstance(row, Mapping):
        raise ValueError(f"{what} must be an object")
    try:
        edit = LineEdit(**row)
    except TypeError as err:
        raise ValueError(f"{what}: {err}") from None
    _relative(edit.file, f"{what}.file")
    if not (
        isinstance(edit.start, int) and isinstance(edit.end, int) and 1 <= edit.start <= edit.end
    ):
        raise ValueError(f"{what}: start/end must be line numbers with start <= end")
    if not isinstance(edit.replacement, str) or not isinstance(edit.original_sha256, str):
        raise ValueError(f"{what}: replacement and original_sha256 must be strings")
    return edit


def parse_task(row: Any) -> FeatureTask:
    """Validate one decoded line; raises ValueError naming the bad field."""
    if not isinstance(row, Mapping):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    expected = {f for f in FeatureTask.__dataclass_fields__}
    missing = sorted(expected - set(row) - {"validation"})
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    unknown = sorted(set(row) - expected)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    for key in ("id", "repo", "source_sha256", "statement"):
        if not isinstance(row[key], str) or not row[key].strip():
            raise ValueError(f"field '{key}' must be a non-empty string")
    if "/" in row["repo"] or row["repo"].startswith("."):
        raise ValueError(f"field 'repo' must be a plain name, got {row['repo']!r}")
    if row["import_root"] not in ("", "src"):
        raise ValueError(f"field 'import_root' must be '' or 'src', got {row['import_root']!r}")
    for key in ("packages", "hidden_tests", "visible_tests"):
        value = row[key]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"field '{key}' must be a list of strings")
    if not row["packages"] or not row["hidden_tests"]:
        raise ValueError("fields 'packages' and 'hidden_tests' must not be empty")
    feature = row["feature"]
    try:
        feature = Feature(**feature) if isinstance(feature, Mapping) else None
    except TypeError as err:
        raise ValueError(f"field 'feature': {err}") from None
    if feature is None:
        raise ValueError("field 'feature' must be an object")
    if feature.kind not in KINDS:
        raise ValueError(f"field 'feature.kind' must be one of {KINDS}, got {feature.kind!r}")
    for path in row["visible_tests"]:
        _relative(path, "visible test")
    removals = row["test_removals"]
    if not isinstance(removals, (list, tuple)):
        raise ValueError("field 'test_removals' must be a list")
    return FeatureTask(
        id=row["id"],
        repo=row["repo"],
        source_sha256=row["source_sha256"],
        import_root=row["import_root"],
        packages=tuple(row["packages"]),
        feature=feature,
        deletion=_edit(row["deletion"], "field 'deletion'"),
        test_removals=tuple(_edit(r, f"test_removals[{i}]") for i, r in enumerate(removals)),
        hidden_tests=tuple(row["hidden_tests"]),
        visible_tests=tuple(row["visible_tests"]),
        statement=row["statement"],
        validation=dict(row.get("validation") or {}),
    )


def load_feature_tasks(store: str | Path) -> list[FeatureTask]:
    """Read and validate ``<store>/tasks.jsonl`` (ids unique, every archive present).

    Raises FeatureTaskError naming the file, the line number and the problem.
    """
    store = Path(store)
    path = store / TASKS_FILE
    if not path.is_file():
        raise FeatureTaskError(
            f"{path}: no such file (make tasks with tools/make_feature_tasks.py)"
        )
    tasks: list[FeatureTask] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                task = parse_task(json.loads(line))
            except ValueError as err:  # includes json.JSONDecodeError
                raise FeatureTaskError(f"{path}:{number}: {err}") from err
            if task.id in seen:
                raise FeatureTaskError(
                    f"{path}:{number}: duplicate id {task.id!r} (first on line {seen[task.id]})"
                )
            if not archive_path(store, task.repo).is_file():
                raise FeatureTaskError(
                    f"{path}:{number}: missing source {archive_path(store, task.repo)}"
                )
            seen[task.id] = number
            tasks.append(task)
    if not tasks:
        raise FeatureTaskError(f"{path}: no tasks found")
    return tasks


def sample_tasks(tasks: Sequence[FeatureTask], per_source: int) -> list[FeatureTask]:
    """``per_source`` tasks of each source, evenly spaced over its tasks in store order."""
    chosen = []
    for repo in dict.fromkeys(task.repo for task in tasks):
        own = [task for task in tasks if task.repo == repo]
        chosen += own[:: max(1, len(own) // per_source)][:per_source]
    return chosen


def archive_path(store: str | Path, repo: str) -> Path:
    return Path(store) / "sources" / f"{repo}.tar.gz"


def license_path(store: str | Path, repo: str) -> Path:
    return Path(store) / "sources" / f"{repo}.LICENSE"


# --------------------------------------------------------------------------------------------
# Archives


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_archive(tree: Path, destination: Path) -> str:
    """Pack ``tree``'s regular files into a reproducible .tar.gz (sorted, zero times and owners,
    modes 644/755); returns its sha256."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(p for p in Path(tree).rglob("*") if p.is_file() and not p.is_symlink()):
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(tree).as_posix())
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            archive.addfile(info, io.BytesIO(data))
    destination.parent.mkdir(parents=True, exist_ok=True)
    with open(destination, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed:
        packed.write(buffer.getvalue())
    return file_sha256(destination)


def extract_archive(archive: Path, destination: Path, sha256: str | None = None) -> None:
    """Unpack ``archive`` (regular files only, paths kept inside) into ``destination``."""
    if sha256 is not None and file_sha256(archive) != sha256:
        raise FeatureTaskError(f"{archive}: sha256 does not match the task's source_sha256")
    destination.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as packed:
        for member in packed.getmembers():
            if not member.isfile():
                continue
            relative = _relative(member.name, f"{archive} member")
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            source = packed.extractfile(member)
            assert source is not None
            with open(target, "wb") as handle:
                shutil.copyfileobj(source, handle)


# --------------------------------------------------------------------------------------------
# Edits and trees


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def apply_edits(tree: Path, edits: Sequence[LineEdit]) -> None:
    """Apply ``edits`` to the files of ``tree`` (per file from the bottom up, so that line
    numbers refer to the original). Raises FeatureTaskError when a replaced span's text is not
    what the edit was made for."""
    by_file: dict[str, list[LineEdit]] = {}
    for edit in edits:
        by_file.setdefault(edit.file, []).append(edit)
    for relative, file_edits in by_file.items():
        path = tree / relative
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for edit in sorted(file_edits, key=lambda e: e.start, reverse=True):
            span = "".join(lines[edit.start - 1 : edit.end])
            if edit.end > len(lines) or text_sha256(span) != edit.original_sha256:
                raise FeatureTaskError(
                    f"{relative}:{edit.start}-{edit.end}: the text to replace is not the original"
                )
            lines[edit.start - 1 : edit.end] = [edit.replacement] if edit.replacement else []
        path.write_text("".join(lines), encoding="utf-8")


def package_paths(tree: Path, import_root: str, packages: Sequence[str]) -> list[Path]:
    """The package's directories and modules in ``tree``."""
    base = tree / import_root if import_root else tree
    found = []
    for name in packages:
        for candidate in (base / name, base / f"{name}.py"):
            if candidate.exists():
                found.append(candidate)
    return found


def materialize_agent_tree(store: str | Path, task: FeatureTask, destination: Path) -> None:
    """The agent's working copy: the source, the feature removed, the hidden tests cut out."""
    extract_archive(archive_path(store, task.repo), destination, task.source_sha256)
    apply_edits(destination, [task.deletion, *task.test_removals])


def materialize_tests_tree(store: str | Path, task: FeatureTask, destination: Path) -> None:
    """The grader's tree: the original source without the package (tests, conftest, data)."""
    extract_archive(archive_path(store, task.repo), destination, task.source_sha256)
    for path in package_paths(destination, task.import_root, task.packages):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


# --------------------------------------------------------------------------------------------
# Samples


def read_source_file(store: str | Path, task: FeatureTask, relative: str) -> str:
    """One file of ``task``'s original source, read from its archive."""
    with tarfile.open(archive_path(store, task.repo), "r:gz") as packed:
        member = packed.extractfile(relative)
        if member is None:
            raise FeatureTaskError(f"{task.repo}: no file {relative!r} in its archive")
        return member.read().decode("utf-8")


def removed_code(task: FeatureTask, original_file: str) -> str:
    """The text the deletion removed, from the original file's text."""
    lines = original_file.splitlines(keepends=True)
    return "".join(lines[task.deletion.start - 1 : task.deletion.end])


def task_to_sample(
    task: FeatureTask,
    store: str | Path,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    original_file: str | None = None,
) -> dict[str, Any]:
    """The sample dict rollouts and the repository environment consume: ``prompt`` (chat
    messages), ``task`` (the task as a JSON-able dict), ``store`` (where its source is) and
    ``solution`` (the removed code in its file's context, for SDPO's reference hint; read from
    the archive unless ``original_file`` gives the feature file's original text)."""
    if original_file is None:
        original_file = read_source_file(store, task, task.deletion.file)
    what = "original code where the bug is" if task.feature.kind == "bug" else "removed code"
    solution = (
        f"The {what} of `{task.feature.qualname}` in `{task.deletion.file}` "
        f"(lines {task.deletion.start}-{task.deletion.end}):\n```python\n"
        f"{removed_code(task, original_file)}```"
    )
    return {
        "id": task.id,
        "prompt": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": task.statement},
        ],
        "task": asdict(task),
        "store": str(Path(store).resolve()),
        "solution": solution,
    }


def load_feature_task_dataset(
    store: str | Path,
    repos: Sequence[str] | None = None,
    exclude_repos: Sequence[str] = (),
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """The store's tasks as samples, optionally only ``repos`` (by name prefix, e.g.
    ``inflection``) and never ``exclude_repos``: a held-out set is the tasks of other repos.
    Each sample's ``harder_than`` lists the chosen tasks it is a harder variant of."""

    def matches(repo: str, names: Sequence[str]) -> bool:
        return any(repo == name or repo.startswith(f"{name}-") for name in names)

    tasks = load_feature_tasks(store)
    chosen = [
        task
        for task in tasks
        if (repos is None or matches(task.repo, repos)) and not matches(task.repo, exclude_repos)
    ]
    if not chosen:
        known = sorted({task.repo for task in tasks})
        raise FeatureTaskError(
            f"{store}: no tasks for repos={repos} exclude={exclude_repos}; has {known}"
        )
    files: dict[tuple[str, str], str] = {}
    samples = []
    for task in chosen:
        key = (task.repo, task.deletion.file)
        if key not in files:
            files[key] = read_source_file(store, task, task.deletion.file)
        sample = task_to_sample(task, store, system_prompt, files[key])
        sample["harder_than"] = harder_than(task, chosen)
        samples.append(sample)
    return samples


def harder_than(task: FeatureTask, tasks: Sequence[FeatureTask]) -> list[str]:
    """The ids of ``tasks`` whose deletion ``task``'s contains (a class deleted whole holds its
    methods' deletions, a module its functions'): ``task`` is a harder variant of those, as
    the task sampler (composer_tune/run/task_sampler.py) reads ``harder_than``. Deletions
    only: a bug is no part of a feature."""
    mine = task.deletion
    if task.feature.kind == "bug":
        return []
    return [
        other.id
        for other in tasks
        if other.feature.kind != "bug"
        and other.repo == task.repo
        and other.deletion.file == mine.file
        and mine.start <= other.deletion.start <= other.deletion.end <= mine.end
        and (other.deletion.start, other.deletion.end) != (mine.start, mine.end)
    ]


def task_from_sample(sample: Mapping[str, Any]) -> tuple[FeatureTask, Path]:
    """The task and store path a sample carries (see task_to_sample)."""
    if "task" not in sample or "store" not in sample:
        raise ValueError(
            f"sample {sample.get('id')!r} is not a feature task (no 'task'/'store'; "
            "use composer_tune.data.feature_tasks.load_feature_task_dataset)"
        )
    return parse_task(sample["task"]), Path(os.fspath(sample["store"]))
