"""Making feature-deletion tasks (and procedural-bug tasks) from a Python repository with a
pytest suite.

For one repository (a folder: an unpacked sdist or a checkout):

1. **Layout**: the package (``src/`` or top-level packages and modules) and the test files
   (``test_*.py`` / ``*_test.py`` outside the package).
2. **Baseline**: the suite runs twice on the original, each test in the sandbox that
   training uses (stdlib and pytest only); tests that pass both times are the baseline.
3. **Candidates**: every function, method (no dunders), class and small module of the
   package with a body of at most ``MAX_FEATURE_LINES`` lines, in file and line order; for
   the bug kind, one procedural bug per function and operator
   (``composer_tune.data.procedural_bugs``), which then goes through the same steps.
4. **Deletion**: the body is replaced (``raise NotImplementedError`` for functions and
   methods, ``pass`` for classes, nothing for modules) and the whole suite runs again. The
   candidate is kept when the package still imports (no collection error), some baseline
   tests fail and at most ``max_failing_fraction`` of them do: those are the hidden tests.
5. **Grading check**: the hidden tests run through the split grader
   (``composer_tune.rewards.repository``) on the original (those it passes are kept; at least
   one must be) and on the agent's tree (all must fail); the agent's tree (the deletion plus
   the hidden tests' functions cut out of the test files) must pass every other baseline test.
6. **Leak check** (``composer_tune.data.task_leaks``): a candidate whose deleted code the
   sandbox shows outside the working copy (checked first, for every candidate at once) or
   that the agent's working copy still holds elsewhere is refused.
7. **Dedup**: one task per kind and set of hidden tests, in candidate order.

Everything runs in the sandbox, so a task validates in the environment it will be trained in.
"""

from __future__ import annotations

import ast
import copy
import functools
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from composer_tune.data.feature_tasks import (
    Feature,
    FeatureTask,
    LineEdit,
    apply_edits,
    package_paths,
    text_sha256,
)
from composer_tune.data.procedural_bugs import find_bug_sites
from composer_tune.data.task_leaks import (
    Fingerprint,
    candidate_fingerprints,
    find_leaks,
    sandbox_roots,
)
from composer_tune.rewards.harness import program
from composer_tune.rewards.repository import (
    PYTEST_TARGET,
    REPO_TARGET,
    HiddenTestsResult,
    grade_repository,
)
from composer_tune.rewards.sandbox import (
    Mount,
    SandboxLimits,
    private_root_available,
    run_python,
)
from composer_tune.rewards.split import parse_report, pytest_runtime

logger = logging.getLogger(__name__)

_NOT_PACKAGES = {
    "test",
    "tests",
    "testing",
    "doc",
    "docs",
    "example",
    "examples",
    "benchmark",
    "benchmarks",
    "bench",
    "scripts",
    "tools",
    "build",
    "dist",
    "site-packages",
}
_NOT_MODULES = {"setup", "conftest", "noxfile", "fabfile", "tasks", "conf", "manage", "ez_setup"}
_JUNK_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".nox", ".eggs", "build", "dist"}
_KEPT_TOP_LEVEL = (".py", ".toml", ".cfg", ".ini", ".txt", ".rst", ".md", "")
_TOP_LEVEL_MAX_BYTES = 64 * 2**10
MIN_BODY_LINES = 1
MAX_FEATURE_LINES = 200
LEAKED_OUTSIDE = "its deleted code is readable in the sandbox (a copy outside the working copy)"
LEAKED_INSIDE = "the working copy still holds the deleted code (elsewhere in the repository)"


class GenerationError(ValueError):
    """The repository cannot give tasks (layout, suite); the message says why."""


class SuiteDidNotReport(GenerationError):
    """A suite run ended without its report; ``status`` is the sandbox's ("timeout", "oom",
    "sandbox_error", ...)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Layout:
    """Where a repository keeps its package and its tests (paths relative to its root)."""

    import_root: str
    packages: tuple[str, ...]
    package_files: tuple[str, ...]
    test_files: tuple[str, ...]


def _is_test_file(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _walk_files(root: Path) -> Iterable[Path]:
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in _JUNK_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                yield path


def detect_layout(root: Path) -> Layout:
    """The package and test files of the repository at ``root``; GenerationError when there is
    no package or no test file outside it."""
    root = Path(root)
    import_root = ""
    if (root / "src").is_dir() and any(
        (p / "__init__.py").is_file() or p.suffix == ".py" for p in (root / "src").iterdir()
    ):
        import_root = "src"
    base = root / import_root if import_root else root
    packages = []
    for entry in sorted(base.iterdir()):
        name = entry.name
        if entry.is_dir() and (entry / "__init__.py").is_file() and name.isidentifier():
            if name not in _NOT_PACKAGES:
                packages.append(name)
        elif entry.suffix == ".py" and entry.stem.isidentifier() and not _is_test_file(name):
            if entry.stem not in _NOT_MODULES and not entry.stem.startswith("_"):
                packages.append(entry.stem)
    if not packages:
        raise GenerationError(f"{root}: no Python package or module found")
    package_paths_ = package_paths(root, import_root, packages)
    package_files = sorted(
        str(path.relative_to(root))
        for top in package_paths_
        for path in ([top] if top.is_file() else _walk_files(top))
        if path.suffix == ".py"
        and not _is_test_file(path.name)
        and not {"test", "tests", "testing"} & set(path.relative_to(root).parts[:-1])
    )
    inside = {Path(p) for p in package_paths_}
    test_files = sorted(
        str(path.relative_to(root))
        for path in _walk_files(root)
        if _is_test_file(path.name)
        and not any(parent in inside for parent in path.parents)
        and path.relative_to(root).parts[0] not in ("doc", "docs", "benchmark", "benchmarks")
    )
    if not test_files:
        inside_only = any(
            _is_test_file(Path(p).name)
            for top in package_paths_
            for p in ([] if top.is_file() else _walk_files(top))
        )
        raise GenerationError(
            f"{root}: no test files (test_*.py, *_test.py) outside the package"
            + (
                " (its tests live inside the package: not supported, since the grader keeps "
                "the tests and the package in separate processes)"
                if inside_only
                else ""
            )
        )
    return Layout(import_root, tuple(packages), tuple(package_files), tuple(test_files))


def filter_source(root: Path, destination: Path, layout: Layout) -> None:
    """Copy what a task needs into ``destination``: the package, every file under a folder that
    holds tests, conftest files, and small top-level files (licence, README, project files)."""
    root = Path(root)
    test_dirs = {Path(f).parent for f in layout.test_files if Path(f).parent != Path(".")}
    package = [
        p.relative_to(root) for p in package_paths(root, layout.import_root, layout.packages)
    ]
    keep: list[Path] = []
    for path in _walk_files(root):
        relative = path.relative_to(root)
        in_package = any(relative == top or relative.is_relative_to(top) for top in package)
        in_tests = any(relative.is_relative_to(d) for d in test_dirs)
        top_level = len(relative.parts) == 1 and (
            path.suffix in _KEPT_TOP_LEVEL and path.stat().st_size <= _TOP_LEVEL_MAX_BYTES
        )
        if path.suffix in (".pyc", ".pyo", ".so"):
            continue
        if in_package or in_tests or top_level or relative.name == "conftest.py":
            keep.append(relative)
    for relative in keep:
        (destination / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / relative, destination / relative)


# --------------------------------------------------------------------------------------------
# Running a suite


@dataclass(frozen=True)
class SuiteResult:
    outcomes: dict[str, str]
    failure: str
    collection_errors: tuple[str, ...]


SUITE_LIMITS = SandboxLimits(
    wall_time_s=300.0,
    cpu_time_s=300.0,
    memory_bytes=2 * 2**30,
    max_processes=64,
    max_open_files=256,
    max_output_bytes=16 * 2**20,
    disk_bytes=256 * 2**20,
)


def run_suite(
    tree: Path,
    layout: Layout,
    targets: Sequence[str],
    limits: SandboxLimits = SUITE_LIMITS,
    max_failures: int | None = None,
) -> SuiteResult:
    """Run pytest on ``targets`` (files or node ids) of ``tree`` in the sandbox, in one process
    with the code (trusted code only: the original and our deletions); ``max_failures`` stops
    it early (the tests it did not reach are then absent from the outcomes)."""
    jailed = private_root_available()
    repo = REPO_TARGET if jailed else str(tree)
    lib = PYTEST_TARGET if jailed else str(pytest_runtime())
    nonce = secrets.token_hex(16)
    code = program(
        "pytest_suite",
        import_root=os.path.join(repo, layout.import_root).rstrip("/"),
        rootdir=repo,
        lib=lib,
        node_ids=list(targets),
        nonce=nonce,
        max_failures=max_failures,
    )
    mounts = [Mount(str(tree), repo, writable=True), Mount(str(pytest_runtime()), lib)]
    result = run_python(code, limits=limits, mounts=mounts if jailed else [])
    report = parse_report(result.stdout, nonce)
    if report is None:
        raise SuiteDidNotReport(
            result.status,
            f"the test suite did not report ({result.status}: {result.detail}): "
            f"{result.stderr[-800:]}",
        )
    outcomes = {str(k): str(v) for k, v in report["outcomes"].items()}
    errors = tuple(
        sorted(node for node, o in outcomes.items() if "::" not in node and o == "failed")
    )
    return SuiteResult(outcomes, str(report.get("failure") or ""), errors)


# --------------------------------------------------------------------------------------------
# Candidates


@dataclass(frozen=True)
class Candidate:
    feature: Feature
    deletion: LineEdit


def docstring_node(body: list[ast.stmt]) -> bool:
    first = body[0] if body else None
    return (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )


def first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _signature(node: ast.AST) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        header = copy.copy(node)
        header.body, header.decorator_list = [ast.Expr(ast.Constant(...))], []
        return ast.unparse(header).split("\n", 1)[0].removesuffix(":")
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        return f"class {node.name}({bases})" if bases else f"class {node.name}"
    return ""


def _body_candidate(
    lines: list[str], file: str, node: ast.AST, kind: str, qualname: str
) -> Candidate | None:
    body = node.body  # type: ignore[attr-defined]
    rest = body[1:] if docstring_node(body) else body
    if not rest:
        return None
    start, end = first_line(rest[0]), node.end_lineno  # type: ignore[attr-defined]
    if start <= node.lineno or end - start + 1 < MIN_BODY_LINES:  # type: ignore[attr-defined]
        return None
    if end - start + 1 > MAX_FEATURE_LINES:
        return None
    indent = lines[rest[0].lineno - 1][: rest[0].col_offset]
    if kind == "class":
        replacement = f"{indent}pass\n"
    else:
        message = f"{qualname} was removed: implement it"
        replacement = f"{indent}raise NotImplementedError({message!r})\n"
    original = "".join(lines[start - 1 : end])
    feature = Feature(
        kind=kind,
        file=file,
        qualname=qualname,
        signature=_signature(node),
        docstring=(ast.get_docstring(node) or "")[:1500],  # type: ignore[arg-type]
        lines=end - start + 1,
    )
    return Candidate(feature, LineEdit(file, start, end, replacement, text_sha256(original)))


def _module_candidate(lines: list[str], file: str, tree: ast.Module) -> Candidate | None:
    if Path(file).name == "__init__.py":
        return None
    body = tree.body[1:] if docstring_node(tree.body) else tree.body
    body = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    if not body:
        return None
    start, end = first_line(body[0]), len(lines)
    if not MIN_BODY_LINES <= end - start + 1 <= MAX_FEATURE_LINES:
        return None
    module = ".".join(Path(file).with_suffix("").parts[-2:])
    feature = Feature(
        kind="module",
        file=file,
        qualname=module,
        signature=f"module {module}",
        docstring=(ast.get_docstring(tree) or "")[:1500],
        lines=end - start + 1,
    )
    original = "".join(lines[start - 1 : end])
    return Candidate(feature, LineEdit(file, start, end, "", text_sha256(original)))


def find_candidates(root: Path, layout: Layout) -> list[Candidate]:
    """Functions, methods (no dunders), classes and small modules of the package, in file
    and line order."""
    found: list[Candidate] = []
    for file in layout.package_files:
        text = (root / file).read_text(encoding="utf-8")
        try:
            module = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        in_file: list[Candidate] = []
        for node in module.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_file.append(_body_candidate(lines, file, node, "function", node.name))
            elif isinstance(node, ast.ClassDef):
                in_file.append(_body_candidate(lines, file, node, "class", node.name))
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        if member.name.startswith("__") and member.name.endswith("__"):
                            continue
                        qualname = f"{node.name}.{member.name}"
                        in_file.append(_body_candidate(lines, file, member, "method", qualname))
        in_file.append(_module_candidate(lines, file, module))
        found += sorted((c for c in in_file if c is not None), key=lambda c: c.deletion.start)
    return found


def find_bug_candidates(root: Path, layout: Layout) -> list[Candidate]:
    """Procedural bugs of the package's functions and methods (one per function and operator,
    round by round: composer_tune/data/procedural_bugs.py)."""
    return [
        Candidate(
            Feature(
                kind="bug",
                file=file,
                qualname=qualname,
                signature=_signature(function),
                docstring=(ast.get_docstring(function) or "")[:1500],  # type: ignore[arg-type]
                lines=edit.end - edit.start + 1,
                mutation=operator,
            ),
            edit,
        )
        for file, qualname, function, operator, edit in find_bug_sites(
            root, list(layout.package_files)
        )
    ]


# --------------------------------------------------------------------------------------------
# Hidden tests


def function_key(node_id: str) -> str:
    """``file::Class::function`` of a node id (parametrization dropped)."""
    return node_id.split("[", 1)[0]


def spans_of_test_functions(
    root: Path, test_files: Sequence[str]
) -> dict[str, tuple[int, int, int]]:
    """``file::[Class::]function`` -> (first line, last line, column) of each function defined
    in the test files (classes nested at any depth)."""
    spans: dict[str, tuple[int, int, int]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans[f"{prefix}::{node.name}"] = (
                    first_line(node),
                    node.end_lineno,
                    node.col_offset,
                )
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}::{node.name}")

    for file in test_files:
        try:
            visit(ast.parse((root / file).read_text(encoding="utf-8")).body, file)
        except (SyntaxError, UnicodeDecodeError):
            continue
    return spans


def removal_edits(root: Path, keys: Iterable[str]) -> list[LineEdit]:
    """Edits that delete the test functions ``keys`` (a class left empty keeps a ``pass``)."""
    keys = set(keys)
    edits: list[LineEdit] = []
    for file in sorted({key.split("::", 1)[0] for key in keys}):
        text = (root / file).read_text(encoding="utf-8")
        _removals(ast.parse(text).body, file, False, keys, text.splitlines(keepends=True), edits)
    return edits


def _removals(
    body: list[ast.stmt],
    prefix: str,
    in_class: bool,
    keys: set[str],
    lines: list[str],
    edits: list[LineEdit],
) -> None:
    removed = [
        n
        for n in body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{prefix}::{n.name}" in keys
    ]
    for index, node in enumerate(removed):
        start, end = first_line(node), node.end_lineno
        keep_pass = in_class and len(removed) == len(body) and index == 0
        replacement = " " * node.col_offset + "pass\n" if keep_pass else ""
        original = "".join(lines[start - 1 : end])
        file = prefix.split("::", 1)[0]
        edits.append(LineEdit(file, start, end, replacement, text_sha256(original)))
    for node in body:
        if isinstance(node, ast.ClassDef):
            _removals(node.body, f"{prefix}::{node.name}", True, keys, lines, edits)


def statement(repo: str, layout: Layout, feature: Feature, hidden: Sequence[str]) -> str:
    """The task as the agent reads it: what is missing, its signature and documentation, and
    the names of the tests that will check it (never their contents)."""
    packages = ", ".join(f"`{p}`" for p in layout.packages)
    names = sorted({function_key(node).split("::", 1)[1] for node in hidden})
    shown = ", ".join(f"`{name}`" for name in names[:12]) + (" ..." if len(names) > 12 else "")
    checks = (
        f"Hidden tests will check it: {shown}. The other tests of the suite pass now and "
        "must keep passing; run them with the run_tests tool."
    )
    if feature.kind == "bug":
        return (
            f"The repository `{repo}` (Python package {packages}) is in your working "
            f"directory. A bug has been introduced into `{feature.qualname}` in "
            f"`{feature.file}`: the package no longer behaves as it did. Find the bug and fix "
            f"it.\n\nSignature: `{feature.signature}`\n\n{checks}"
        )
    what = {
        "function": f"the body of the function `{feature.qualname}`",
        "method": f"the body of the method `{feature.qualname}`",
        "class": f"the body of the class `{feature.qualname}`",
        "module": f"the contents of the module `{feature.qualname}`",
    }[feature.kind]
    now = {
        "function": "It now raises NotImplementedError.",
        "method": "It now raises NotImplementedError.",
        "class": "Only its docstring and a `pass` are left.",
        "module": "Only its docstring is left.",
    }[feature.kind]
    parts = [
        f"The repository `{repo}` (Python package {packages}) is in your working directory. "
        f"A feature has been removed from it: {what} in `{feature.file}`. {now} "
        "Implement it again so that the package behaves as it did before.",
        f"Signature: `{feature.signature}`" if feature.signature else "",
        f'Documentation:\n"""\n{feature.docstring}\n"""' if feature.docstring else "",
        checks,
    ]
    return "\n\n".join(part for part in parts if part)


# --------------------------------------------------------------------------------------------
# The whole repository


@dataclass
class KindReport:
    """What the generator did with one kind of candidate ("feature": deletions, "bug":
    procedural bugs): candidates found, tasks kept, and why the others were rejected."""

    candidates: int = 0
    tasks: list[FeatureTask] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class RepoReport:
    """What the generator did with one repository, per kind of task."""

    repo: str
    baseline_passed: int = 0
    kinds: dict[str, KindReport] = field(default_factory=dict)

    @property
    def tasks(self) -> list[FeatureTask]:
        return [task for kind in self.kinds.values() for task in kind.tasks]


@dataclass(frozen=True)
class GenerationSettings:
    """kinds: which tasks to make ("feature": deletions, "bug": procedural bugs); max_tasks:
    stop after this many tasks of a kind; max_candidates: try at most this many of a kind;
    kind_limits: (max_tasks, max_candidates) of some kinds instead (a store regenerated as it
    was made); max_failing_fraction: a deletion that fails more of the suite is too central;
    min_hidden: hidden tests the grader must be able to decide; grade_limits: the grader's
    budget per run; workers: candidates tried at once."""

    kinds: tuple[str, ...] = ("feature",)
    max_tasks: int = 20
    max_candidates: int = 400
    kind_limits: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    max_failing_fraction: float = 0.5
    min_hidden: int = 1
    grade_limits: SandboxLimits = SandboxLimits(
        wall_time_s=120.0,
        cpu_time_s=120.0,
        memory_bytes=2 * 2**30,
        max_processes=64,
        max_open_files=256,
        max_output_bytes=16 * 2**20,
    )
    workers: int = 2

    def limits(self, kind: str) -> tuple[int, int]:
        """(max_tasks, max_candidates) of ``kind``."""
        return self.kind_limits.get(kind, (self.max_tasks, self.max_candidates))


def generate_tasks(
    source: Path,
    repo: str,
    source_sha256: str,
    settings: GenerationSettings = GenerationSettings(),
    progress: Callable[[str], None] = logger.info,
) -> RepoReport:
    """Tasks of the filtered repository at ``source`` (its archive's hash ``source_sha256``),
    in candidate order (see the module docstring)."""
    source = Path(source)
    layout = detect_layout(source)
    report = RepoReport(repo)
    with tempfile.TemporaryDirectory(prefix="composer-featuregen-") as scratch:
        scratch = Path(scratch)
        tests_tree = scratch / "tests"
        shutil.copytree(source, tests_tree)
        for path in package_paths(tests_tree, layout.import_root, layout.packages):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        first = run_suite(_fresh(source, scratch, "baseline1"), layout, layout.test_files)
        second = run_suite(_fresh(source, scratch, "baseline2"), layout, layout.test_files)
        passing = sorted(
            node
            for node, outcome in first.outcomes.items()
            if "::" in node and outcome == "passed" and second.outcomes.get(node) == "passed"
        )
        report.baseline_passed = len(passing)
        baseline_failures = sum(o == "failed" for o in first.outcomes.values())
        progress(
            f"{repo}: {len(passing)} tests pass on the original ({len(layout.test_files)} files)"
        )
        if not passing:
            raise GenerationError(f"{repo}: no test passes on the original: {first.failure[-800:]}")
        visible_files = tuple(sorted({node.split("::", 1)[0] for node in passing}))
        spans = spans_of_test_functions(source, visible_files)
        found = {
            "feature": lambda: find_candidates(source, layout),
            "bug": lambda: find_bug_candidates(source, layout),
        }
        candidates = {kind: found[kind]()[: settings.limits(kind)[1]] for kind in settings.kinds}
        # The leak check: a candidate whose deleted code the sandbox shows is no task.
        every = [c for kind in settings.kinds for c in candidates[kind]]
        prints = {
            print_.task_id: print_
            for print_ in candidate_fingerprints(
                source, [(_task_id(repo, c), c.feature, c.deletion) for c in every]
            )
        }
        reachable = (
            find_leaks(list(prints.values()), sandbox_roots()) if private_root_available() else {}
        )

        def attempt(candidate: Candidate) -> tuple[str, FeatureTask | None]:
            task_id = _task_id(repo, candidate)
            if task_id in reachable:
                progress(f"{repo}: {task_id}: a copy at {reachable[task_id][0]}")
                return LEAKED_OUTSIDE, None
            return _attempt(
                candidate,
                source,
                scratch,
                tests_tree,
                layout,
                repo,
                source_sha256,
                passing,
                baseline_failures,
                spans,
                visible_files,
                prints[task_id],
                settings,
            )

        with ThreadPoolExecutor(max_workers=settings.workers) as pool:
            for kind in settings.kinds:
                report.kinds[kind] = _try_candidates(
                    candidates[kind],
                    attempt,
                    pool,
                    settings.workers,
                    settings.limits(kind)[0],
                    lambda line: progress(f"{repo}: {line}"),
                )
    return report


def _try_candidates(
    candidates: Sequence[Candidate],
    attempt: Callable[[Candidate], tuple[str, FeatureTask | None]],
    pool: ThreadPoolExecutor,
    workers: int,
    max_tasks: int,
    progress: Callable[[str], None],
) -> KindReport:
    """Steps 4-7 of the module docstring for one kind's candidates, ``workers`` at a time,
    until ``max_tasks`` tasks are kept."""
    report = KindReport(candidates=len(candidates))
    seen_hidden: set[frozenset[str]] = set()
    for index in range(0, len(candidates), workers * 2):
        if len(report.tasks) >= max_tasks:
            break
        batch = candidates[index : index + workers * 2]
        for candidate, (verdict, task) in zip(batch, pool.map(attempt, batch), strict=True):
            name = f"{candidate.feature.file}:{candidate.feature.qualname}"
            if candidate.feature.mutation:
                name += f" ({candidate.feature.mutation})"
            if task is not None:
                key = frozenset(task.hidden_tests)
                if key in seen_hidden:
                    verdict, task = "same hidden tests as an earlier task", None
                elif len(report.tasks) >= max_tasks:
                    verdict, task = "max_tasks reached", None
                else:
                    seen_hidden.add(key)
                    report.tasks.append(task)
            if task is None:
                report.rejected[verdict] = report.rejected.get(verdict, 0) + 1
            progress(f"{name}: {verdict}")
    return report


def _candidate_suite(
    tree: Path, layout: Layout, targets: Sequence[str], max_failures: int | None = None
) -> SuiteResult | str:
    """run_suite on a candidate's tree, or the verdict when the change keeps the suite from
    reporting (a loop that never ends, memory, a crash): the candidate's doing, so a rejection.
    The sandbox failing to start is the machine's, and stops the source as in the baseline."""
    try:
        return run_suite(tree, layout, targets, max_failures=max_failures)
    except SuiteDidNotReport as err:
        if err.status == "sandbox_error":
            raise
        return f"the suite does not finish with it ({err.status})"


def _stop_unless_graded(result: HiddenTestsResult, repo: str, candidate: Candidate) -> None:
    """A grade the sandbox could not run says nothing of the candidate: counted as a rejection
    it would make the store depend on the machine's state, and "no hidden test passes without
    the feature" would accept a task nobody graded. So the source stops, its store unchanged."""
    if result.sandbox_failure is not None:
        raise GenerationError(
            f"{_task_id(repo, candidate)}: {result.sandbox_failure}; nothing of {repo} was "
            "written (run it again once the sandbox works)"
        )


def _task_id(repo: str, candidate: Candidate) -> str:
    feature = candidate.feature
    bug = f":{feature.mutation}" if feature.mutation else ""
    return f"{repo}:{feature.file}:{feature.qualname}{bug}"


def _fresh(source: Path, scratch: Path, name: str) -> Path:
    destination = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch))
    shutil.copytree(source, destination, dirs_exist_ok=True)
    return destination


def _attempt(
    candidate: Candidate,
    source: Path,
    scratch: Path,
    tests_tree: Path,
    layout: Layout,
    repo: str,
    source_sha256: str,
    passing: Sequence[str],
    baseline_failures: int,
    spans: dict[str, tuple[int, int, int]],
    visible_files: Sequence[str],
    print_: Fingerprint,
    settings: GenerationSettings,
) -> tuple[str, FeatureTask | None]:
    """One candidate through steps 4-5 of the module docstring: (verdict, task or None)."""
    deleted = _fresh(source, scratch, "deleted")
    allowed = int(settings.max_failing_fraction * len(passing))
    try:
        apply_edits(deleted, [candidate.deletion])
        # Past the allowed failures the candidate is too central: no need to run the rest.
        stop_after = baseline_failures + allowed + 1
        result = _candidate_suite(deleted, layout, layout.test_files, max_failures=stop_after)
        if isinstance(result, str):
            return result, None
        if result.collection_errors:
            return "the package no longer imports (collection errors)", None
        failing = [node for node in passing if result.outcomes.get(node) != "passed"]
        if not failing:
            return "no test fails without it", None
        if len(failing) > allowed:
            return "too central (fails too much of the suite)", None
        functions = {function_key(node) for node in failing}
        if not functions <= set(spans):
            return "a failing test is not a plain test function", None
        grade = functools.partial(
            grade_repository,
            tests_tree=tests_tree,
            import_root=layout.import_root,
            packages=layout.packages,
            limits=settings.grade_limits,
        )
        original = grade(source, node_ids=failing)
        _stop_unless_graded(original, repo, candidate)
        hidden = [node for node in failing if original.outcomes[node] == "passed"]
        if len(hidden) < settings.min_hidden:
            return "the grader cannot decide its tests", None
        removals = removal_edits(source, functions)
        apply_edits(deleted, removals)
        without = grade(deleted, node_ids=hidden)
        _stop_unless_graded(without, repo, candidate)
        if without.passed:
            return "a hidden test passes without the feature (split grader)", None
        visible = _candidate_suite(deleted, layout, visible_files)
        if isinstance(visible, str):
            return visible, None
        expected = [node for node in passing if function_key(node) not in functions]
        broken = [node for node in expected if visible.outcomes.get(node) != "passed"]
        if broken or visible.collection_errors:
            return "the visible tests fail once the hidden ones are cut out", None
        if find_leaks([print_], [(str(deleted), ())]):
            return LEAKED_INSIDE, None
        task = FeatureTask(
            id=_task_id(repo, candidate),
            repo=repo,
            source_sha256=source_sha256,
            import_root=layout.import_root,
            packages=layout.packages,
            feature=candidate.feature,
            deletion=candidate.deletion,
            test_removals=tuple(removals),
            hidden_tests=tuple(hidden),
            visible_tests=tuple(visible_files),
            statement=statement(repo, layout, candidate.feature, hidden),
            validation={
                "suite_passed_original": len(passing),
                "hidden_passed_original": len(hidden),
                "hidden_failed_deleted": len(hidden) - without.passed,
                "visible_passed_deleted": len(expected),
                "failing_not_gradable": len(failing) - len(hidden),
            },
        )
        return "task", task
    finally:
        shutil.rmtree(deleted, ignore_errors=True)
