"""Feature-deletion tasks: the generator on a small repository it has not seen, the store format
and its errors, and the shipped store (tests/assets/feature_tasks)."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from composer_tune.data import feature_generator
from composer_tune.data.feature_generator import (
    LEAKED_INSIDE,
    LEAKED_OUTSIDE,
    GenerationError,
    GenerationSettings,
    detect_layout,
    find_candidates,
    function_key,
    generate_tasks,
    removal_edits,
    spans_of_test_functions,
)
from composer_tune.data.feature_tasks import (
    COUNTS_FILE,
    TASKS_FILE,
    FeatureTask,
    FeatureTaskError,
    apply_edits,
    archive_path,
    file_sha256,
    license_path,
    load_feature_task_dataset,
    load_feature_tasks,
    materialize_agent_tree,
    materialize_tests_tree,
    read_source_file,
    sample_tasks,
    text_sha256,
)
from composer_tune.data.procedural_bugs import OPERATORS, find_bug_sites
from composer_tune.rewards.repository import grade_repository
from composer_tune.rewards.sandbox import SandboxLimits, private_root_available
from tests.recipe_runs import load_tool

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED = REPO_ROOT / "tests" / "assets" / "feature_tasks"
GRADE_LIMITS = SandboxLimits(
    wall_time_s=60.0,
    cpu_time_s=60.0,
    memory_bytes=1024 * 2**20,
    max_processes=32,
    max_open_files=128,
    max_output_bytes=4 * 2**20,
)

# A src-layout package with a function, a class with methods, a helper every test needs, and
# a unittest-style test class: the generator has never seen it.
TINY = {
    "LICENSE": "MIT License\n\nPermission is hereby granted, free of charge, to any person ...\n",
    "pyproject.toml": '[project]\nname = "tinylib"\nversion = "0.1"\n',
    "src/tinylib/__init__.py": "from tinylib.text import Counter, initials, shout, wrap\n",
    "src/tinylib/text.py": '''"""Small text helpers."""


def _words(text):
    return text.split()


def initials(name):
    """The upper-case first letters of the words of ``name``."""
    letters = [word[0] for word in _words(name)]
    return "".join(letters).upper()


def shout(text, times=1):
    """``text`` in capitals followed by ``times`` exclamation marks."""
    return text.upper() + "!" * times


def wrap(text, width):
    """Split ``text`` into lines of at most ``width`` characters, breaking between words."""
    lines, current = [], ""
    for word in _words(text):
        candidate = f"{current} {word}".strip()
        if len(candidate) > width and current:
            lines.append(current)
            candidate = word
        current = candidate
    return lines + ([current] if current else [])


class Counter:
    """Counts words."""

    def __init__(self):
        self.counts = {}

    def add(self, text):
        """Count the words of ``text``."""
        for word in _words(text.lower()):
            self.counts[word] = self.counts.get(word, 0) + 1
        return self

    def most_common(self):
        """(word, count) pairs, most frequent first, ties alphabetical."""
        return sorted(self.counts.items(), key=lambda pair: (-pair[1], pair[0]))
''',
    # A copy of shout's code the agent's working copy would hold (indented, re-quoted): the
    # leak check refuses that task.
    "tests/reference.py": """class Reference:
    # shout as it was, kept for the docs
    @staticmethod
    def shout(text, times=1):
        '''``text`` in capitals followed by ``times`` exclamation marks.'''
        return text.upper() + '!' * times
""",
    "tests/test_text.py": """import unittest

import pytest

import tinylib


@pytest.mark.parametrize(("name", "expected"), [("ada lovelace", "AL"), ("Guido van Rossum", "GVR")])
def test_initials(name, expected):
    assert tinylib.initials(name) == expected


def test_shout():
    assert tinylib.shout("hi") == "HI!"
    assert tinylib.shout("hey", times=3) == "HEY!!!"


def test_wrap():
    assert tinylib.wrap("the quick brown fox", 10) == ["the quick", "brown fox"]
    assert tinylib.wrap("", 5) == []


class TestCounter(unittest.TestCase):
    def test_most_common(self):
        counter = tinylib.Counter().add("b a b").add("A c")
        self.assertEqual(counter.most_common(), [("a", 2), ("b", 2), ("c", 1)])

    def test_add_returns_the_counter(self):
        counter = tinylib.Counter()
        self.assertIs(counter.add("x"), counter)
""",
}


def _make_feature_tasks(*args: str) -> subprocess.CompletedProcess:
    """tools/make_feature_tasks.py with ``args``; fails the test unless it exits 0."""
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "make_feature_tasks.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return done


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny") / "tinylib-0.1"
    _write(root, TINY)
    return root


@pytest.fixture(scope="module")
def generated(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tool run on the folder, both kinds: (store, its deletion tasks by qualname, its
    counts, its output)."""
    store = tmp_path_factory.mktemp("store")
    done = _make_feature_tasks(
        str(tiny), "--store", str(store), "--kinds", "feature,bug", "--max-candidates", "8"
    )
    tasks = {t.feature.qualname: t for t in load_feature_tasks(store) if t.feature.kind != "bug"}
    counts = json.loads((store / COUNTS_FILE).read_text())["tinylib-0.1"]
    return store, tasks, counts, done.stdout


def test_layout_and_candidates_of_an_unseen_repository(tiny: Path) -> None:
    layout = detect_layout(tiny)
    assert (layout.import_root, layout.packages) == ("src", ("tinylib",))
    assert layout.test_files == ("tests/test_text.py",)
    names = [c.feature.qualname for c in find_candidates(tiny, layout)]
    assert names == [
        "tinylib.text",  # the module's body
        "_words",
        "initials",
        "shout",
        "wrap",
        "Counter",
        "Counter.add",
        "Counter.most_common",
    ]  # dunders are never candidates
    wrap = next(c for c in find_candidates(tiny, layout) if c.feature.qualname == "wrap")
    assert wrap.feature.signature == "def wrap(text, width)"
    assert "breaking between words" in wrap.feature.docstring
    assert (
        wrap.deletion.replacement
        == "    raise NotImplementedError('wrap was removed: implement it')\n"
    )


def test_generator_makes_validated_tasks(generated) -> None:
    store, tasks, counts, output = generated
    assert counts["baseline_tests"] == 6 and counts["tasks"] == len(tasks)
    assert counts["license"] == "MIT" and license_path(store, "tinylib-0.1").is_file()
    # _words breaks every test (too central); Counter.add fails the same tests as Counter;
    # shout's code is still in the working copy (tests/reference.py).
    assert {"initials", "wrap", "Counter.most_common"} <= set(tasks), output
    assert "_words" not in tasks and "shout" not in tasks
    assert counts["rejected"][LEAKED_INSIDE] == 1
    wrap = tasks["wrap"]
    assert wrap.hidden_tests == ("tests/test_text.py::test_wrap",)
    assert wrap.validation["hidden_passed_original"] == 1
    assert wrap.validation["hidden_failed_deleted"] == 1
    assert wrap.validation["visible_passed_deleted"] == 5
    assert "`test_wrap`" in wrap.statement and "brown fox" not in wrap.statement
    most_common = tasks["Counter.most_common"]
    assert most_common.hidden_tests == ("tests/test_text.py::TestCounter::test_most_common",)
    # Duplicates are dropped: one task per set of hidden tests.
    assert len({frozenset(t.hidden_tests) for t in tasks.values()}) == len(tasks)
    assert counts["rejected"]["same hidden tests as an earlier task"] >= 1


def test_agent_tree_hides_the_feature_and_its_tests(generated, tmp_path: Path) -> None:
    store, tasks, _, _ = generated
    task = tasks["Counter.most_common"]
    _assert_graded_as_validated(store, task, tmp_path)
    source = (tmp_path / "agent" / "src" / "tinylib" / "text.py").read_text()
    assert "Counter.most_common was removed" in source and "-pair[1]" not in source
    tests = (tmp_path / "agent" / "tests" / "test_text.py").read_text()
    assert "def test_most_common" not in tests and "def test_add_returns_the_counter" in tests
    assert not (tmp_path / "hidden" / "src" / "tinylib").exists()
    assert "def test_most_common" in (tmp_path / "hidden" / "tests" / "test_text.py").read_text()


def _assert_graded_as_validated(store: Path, task: FeatureTask, tmp_path: Path) -> None:
    """The grader fails the task's agent tree (tmp_path/agent) on its hidden tests (the tests
    tree: tmp_path/hidden) and passes the original, as the generator checked."""
    materialize_agent_tree(store, task, tmp_path / "agent")
    materialize_tests_tree(store, task, tmp_path / "hidden")
    grade = dict(
        tests_tree=tmp_path / "hidden",
        import_root="src",
        packages=["tinylib"],
        node_ids=task.hidden_tests,
        limits=GRADE_LIMITS,
    )
    assert grade_repository(tmp_path / "agent", **grade).passed == 0
    (tmp_path / "original").mkdir()
    with tarfile.open(archive_path(store, task.repo)) as packed:
        packed.extractall(tmp_path / "original", filter="data")
    assert grade_repository(tmp_path / "original", **grade).all_passed


@pytest.mark.skipif(not private_root_available(), reason="no private root: nothing to search")
def test_generator_refuses_candidates_whose_code_the_sandbox_shows(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy of the package where the sandbox can read it (e.g. installed on the host).
    planted = tmp_path / "site-packages" / "tinylib"
    shutil.copytree(tiny / "src" / "tinylib", planted)
    monkeypatch.setattr(feature_generator, "sandbox_roots", lambda: [(str(planted.parent), ())])
    settings = GenerationSettings(max_candidates=3, workers=1)
    lines: list[str] = []
    report = generate_tasks(tiny, "tinylib-0.1", "0" * 64, settings, progress=lines.append)
    assert report.tasks == [] and report.kinds["feature"].rejected == {LEAKED_OUTSIDE: 3}
    assert any(f"a copy at {planted / 'text.py'}" in line for line in lines), lines


def _sandbox_fails_on(tree_prefix: str):
    """grade_repository, except that a tree whose folder name starts with ``tree_prefix`` gets
    the grade of a sandbox that could not run."""

    def grade(tree: Path, **kwargs):
        result = grade_repository(tree, **kwargs)
        if not Path(tree).name.startswith(tree_prefix):
            return result
        failure = "the sandbox could not run the grader (could not start: ENOMEM)"
        return dataclasses.replace(result, passed=0, sandbox_failure=failure)

    return grade


@pytest.mark.parametrize("tree", ["tinylib", "deleted-"])  # the original's grade; the deleted's
def test_a_grade_the_sandbox_could_not_run_stops_the_source(
    tiny: Path, tree: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counted as a rejection it would make the store depend on the machine, and a deleted tree's
    # unrun grade ("no hidden test passes") would accept a task nobody graded.
    monkeypatch.setattr(feature_generator, "grade_repository", _sandbox_fails_on(tree))
    settings = GenerationSettings(max_candidates=3, workers=1)
    with pytest.raises(GenerationError, match=r"tinylib-0.1:.*could not start: ENOMEM\); nothing"):
        generate_tasks(tiny, "tinylib-0.1", "0" * 64, settings, progress=lambda line: None)


@pytest.mark.parametrize("status", ["timeout", "oom", "sandbox_error"])
def test_a_change_that_keeps_the_suite_from_reporting_is_rejected(
    tiny: Path, status: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bug that loops forever is the candidate's doing (a rejection); a sandbox that cannot
    # start is the machine's (the source stops, as on the original's run).
    real_run_suite = feature_generator.run_suite

    def run_suite(tree: Path, *args, **kwargs):
        if tree.name.startswith("deleted-"):
            raise feature_generator.SuiteDidNotReport(status, f"did not report ({status})")
        return real_run_suite(tree, *args, **kwargs)

    monkeypatch.setattr(feature_generator, "run_suite", run_suite)
    settings = GenerationSettings(max_candidates=2, workers=1)
    if status == "sandbox_error":
        with pytest.raises(GenerationError, match=r"did not report \(sandbox_error\)"):
            generate_tasks(tiny, "tinylib-0.1", "0" * 64, settings, progress=lambda line: None)
        return
    report = generate_tasks(tiny, "tinylib-0.1", "0" * 64, settings, progress=lambda line: None)
    verdict = f"the suite does not finish with it ({status})"
    assert report.tasks == [] and report.kinds["feature"].rejected == {verdict: 2}


@pytest.mark.parametrize("tree", ["original", "agent"])
def test_check_counts_a_task_the_sandbox_could_not_grade_as_failed(
    small_store: Path, tree: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    tool = load_tool("make_feature_tasks")
    monkeypatch.setattr(tool, "grade_repository", _sandbox_fails_on(tree))
    tasks = load_feature_tasks(small_store)
    settings = GenerationSettings(workers=1)
    assert tool.check_store(small_store, settings, "weaker") == len(tasks)
    printed = capsys.readouterr().out
    assert printed.count("not checked, the sandbox could not run the grader") == len(tasks)
    assert f"0 of {len(tasks)} tasks validate" in printed


def test_bug_sites_change_one_thing_and_keep_the_formatting(tmp_path: Path) -> None:
    source = tmp_path / "pkg.py"
    source.write_text(
        "def scale(values, low=0):\n"
        '    """Docstring: 1 == 1 and 3 stay."""\n'
        "    if not values:  # nothing to do\n"
        "        return []\n"
        "    top = max(values,\n"
        "              key=abs) * 2\n"
        "    return [min(v, top) for v in values if v >= low and v is not None]\n"
        "\n"
        "\n"
        "def bracketed(a, b):\n"
        "    if (a) <= (b):  # a < b or equal\n"
        "        return (a) and (\n"
        "            b)\n"
        "    return b\n"
    )
    found = find_bug_sites(tmp_path, ["pkg.py"])
    sites = {op: edit for _, name, _, op, edit in found if name == "scale"}
    assert set(sites) == set(OPERATORS)
    last = "    return [min(v, top) for v in values if v >= low and v is not None]\n"
    expected = {
        "flip_comparison": (7, last.replace("v >= low", "v > low")),  # off by one
        "change_constant": (6, "              key=abs) * 3\n"),
        "swap_arguments": (7, last.replace("min(v, top)", "min(top, v)")),
        "flip_boolean": (7, last.replace(" and ", " or ")),
        "drop_branch": (3, "    pass\n"),
    }
    assert {op: (e.start, e.replacement) for op, e in sites.items()} == expected
    assert sites["drop_branch"].end == 4  # the whole if statement
    # Brackets and comments around an operator stay; only the operator changes.
    others = {op: edit for _, name, _, op, edit in found if name == "bracketed"}
    assert others["flip_comparison"].replacement == "    if (a) < (b):  # a < b or equal\n"
    assert others["flip_boolean"].replacement == "        return (a) or (\n            b)\n"
    # Round by round (every function's first site, then every function's second), the second
    # function starting at the second operator: a cap on the candidates spreads over functions
    # and operators.
    first_round = {(name, op) for _, name, _, op, _ in found[:2]}
    # bracketed has no constant and no call to swap: its first site flips a boolean
    assert first_round == {("scale", OPERATORS[0]), ("bracketed", "flip_boolean")}
    assert [op for _, name, _, op, _ in found if name == "scale"] == list(OPERATORS)
    lines = source.read_text().splitlines(keepends=True)
    for *_, edit in found:  # each names the text it replaces, and the result parses
        assert text_sha256("".join(lines[edit.start - 1 : edit.end])) == edit.original_sha256
        ast.parse("".join(lines[: edit.start - 1]) + edit.replacement + "".join(lines[edit.end :]))


def test_generator_makes_validated_bug_tasks(generated, tmp_path: Path) -> None:
    store, _, counts, output = generated
    bugs = [task for task in load_feature_tasks(store) if task.feature.kind == "bug"]
    assert counts["bug"]["tasks"] == len(bugs) >= 2, output
    assert sum(counts["bug"]["rejected"].values()) + len(bugs) == counts["bug"]["candidates"]
    for task in bugs:
        assert task.id.endswith(f":{task.feature.qualname}:{task.feature.mutation}")
        assert task.feature.mutation in OPERATORS
        assert f"A bug has been introduced into `{task.feature.qualname}`" in task.statement
        assert task.deletion.replacement not in task.statement
        assert task.validation["hidden_failed_deleted"] == len(task.hidden_tests) > 0
    task = bugs[0]
    _assert_graded_as_validated(store, task, tmp_path)
    sample = next(s for s in load_feature_task_dataset(store) if s["id"] == task.id)
    assert "original code where the bug is" in sample["solution"]


def test_removing_every_test_of_a_class_keeps_it_valid(tiny: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    keys = [k for k in spans_of_test_functions(copy, ["tests/test_text.py"]) if "TestCounter" in k]
    assert len(keys) == 2
    apply_edits(copy, removal_edits(copy, keys))
    text = (copy / "tests" / "test_text.py").read_text()
    compile(text, "test_text.py", "exec")
    assert "class TestCounter(unittest.TestCase):\n    pass\n" in text


def test_generator_refuses_repositories_it_cannot_use(tmp_path: Path) -> None:
    _write(tmp_path / "notests", {"pkg/__init__.py": "X = 1\n"})
    with pytest.raises(GenerationError, match="no test files"):
        detect_layout(tmp_path / "notests")
    _write(tmp_path / "nopackage", {"tests/test_x.py": "def test_x():\n    pass\n"})
    with pytest.raises(GenerationError, match="no Python package"):
        detect_layout(tmp_path / "nopackage")
    inside = {"pkg/__init__.py": "", "pkg/tests/__init__.py": "", "pkg/tests/test_x.py": ""}
    _write(tmp_path / "inside", inside)
    with pytest.raises(GenerationError, match="tests live inside the package: not supported"):
        detect_layout(tmp_path / "inside")


def test_unknown_task_kinds_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "make_feature_tasks.py"), "--regenerate"]
        + ["--store", str(tmp_path), "--kinds", "feature,typo"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "error: --kinds 'feature,typo'" in done.stderr


def _one_module_repository(root: Path, package: str, tests: str) -> Path:
    """A repository with a licence, ``pkg/__init__.py`` and ``tests/test_x.py``."""
    _write(root, {"LICENSE": TINY["LICENSE"], "pkg/__init__.py": package, "tests/test_x.py": tests})
    return root


def test_a_refused_source_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    # Its suite needs a package the sandbox lacks (funcy 2.0's needs `whatever`): no test passes.
    broken = _one_module_repository(
        tmp_path / "broken-1.0",
        "X = 1\n",
        "import a_missing_dependency\n\n\ndef test_x():\n    pass\n",
    )
    store = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "make_feature_tasks.py")]
        + [str(broken), "--store", str(store)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 2 and "no test passes on the original" in done.stderr, done.stderr
    assert [path for path in store.rglob("*") if path.is_file()] == []


def test_a_source_without_tasks_is_not_kept(tmp_path: Path) -> None:
    # Its suite passes but reaches none of its code: no candidate fails a test.
    untested = _one_module_repository(
        tmp_path / "untested-1.0", "def double(x):\n    return 2 * x\n", "def test_x():\n    pass\n"
    )
    store = tmp_path / "store"
    done = _make_feature_tasks(str(untested), "--store", str(store))
    assert "untested-1.0: no task, so its source is not kept" in done.stdout
    files = sorted(path.name for path in store.rglob("*") if path.is_file())
    assert files == sorted([COUNTS_FILE, TASKS_FILE])
    assert json.loads((store / COUNTS_FILE).read_text()) == {}


# --------------------------------------------------------------------------------------------
# The store format


def _row(store: Path) -> dict:
    return json.loads((store / "tasks.jsonl").read_text().splitlines()[0])


@pytest.fixture
def small_store(generated, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(generated[0], copy)
    return copy


def test_store_round_trip_and_samples(small_store: Path) -> None:
    tasks = load_feature_tasks(small_store)
    samples = load_feature_task_dataset(small_store)
    assert [s["id"] for s in samples] == [t.id for t in tasks]
    wrap = next(s for s in samples if s["id"].endswith(":wrap"))
    assert wrap["prompt"][1]["content"] == next(t for t in tasks if t.id == wrap["id"]).statement
    assert 'candidate = f"{current} {word}".strip()' in wrap["solution"]  # the removed code
    # The class deleted whole is a harder variant of its method's task (the task sampler's).
    counter = next(s for s in samples if s["id"].endswith(":Counter"))
    assert counter["harder_than"] == [next(t.id for t in tasks if t.id.endswith("most_common"))]
    with pytest.raises(FeatureTaskError, match="no tasks for repos"):
        load_feature_task_dataset(small_store, repos=["nosuchrepo"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda row: row.pop("hidden_tests"), "missing field(s) hidden_tests"),
        (lambda row: row.update(extra=1), "unknown field(s) extra"),
        (lambda row: row.update(import_root="lib"), "'import_root' must be"),
        (lambda row: row["feature"].update(kind="macro"), "'feature.kind' must be one of"),
        (lambda row: row["deletion"].update(file="../escape.py"), "must stay inside"),
        (lambda row: row["deletion"].update(start=9, end=3), "start <= end"),
        (lambda row: row.update(repo="../x"), "'repo' must be a plain name"),
    ],
)
def test_malformed_tasks_name_file_line_and_field(small_store: Path, change, message) -> None:
    row = _row(small_store)
    change(row)
    path = small_store / "tasks.jsonl"
    path.write_text(path.read_text() + "\n" + json.dumps(row) + "\n")
    with pytest.raises(FeatureTaskError) as error:
        load_feature_tasks(small_store)
    assert str(error.value).startswith(f"{path}:")
    assert message in str(error.value)


def test_store_damage_is_reported(small_store: Path, tmp_path: Path) -> None:
    path = small_store / "tasks.jsonl"
    first = path.read_text().splitlines()[0]
    path.write_text(first + "\n" + first + "\n")
    with pytest.raises(FeatureTaskError, match=r":2: duplicate id"):
        load_feature_tasks(small_store)
    path.write_text(first + "\n")
    [task] = load_feature_tasks(small_store)
    archive = archive_path(small_store, task.repo)
    archive.write_bytes(archive.read_bytes()[:-10])
    with pytest.raises(FeatureTaskError, match="sha256 does not match"):
        materialize_agent_tree(small_store, task, tmp_path / "tree")
    archive.unlink()
    with pytest.raises(FeatureTaskError, match="missing source"):
        load_feature_tasks(small_store)


# --------------------------------------------------------------------------------------------
# The shipped store


def test_shipped_store_counts_licences_and_size() -> None:
    tasks = load_feature_tasks(SHIPPED)
    counts = json.loads((SHIPPED / COUNTS_FILE).read_text())
    for repo, entry in counts.items():
        deletions = sum(task.repo == repo and task.feature.kind != "bug" for task in tasks)
        bugs = sum(task.repo == repo and task.feature.kind == "bug" for task in tasks)
        assert entry.get("tasks", 0) == deletions, repo
        assert entry.get("bug", {}).get("tasks", 0) == bugs, repo
        assert deletions + bugs > 0, repo
        assert entry["license"] in ("MIT", "BSD", "Apache-2.0", "ISC"), repo
        assert license_path(SHIPPED, repo).read_text().strip(), repo
    for task in tasks:
        assert file_sha256(archive_path(SHIPPED, task.repo)) == task.source_sha256
    # Sources with no task are not kept; both kinds are shipped (docs/feature_tasks.md).
    assert {p.name for p in (SHIPPED / "sources").iterdir()} == {
        f"{repo}{suffix}" for repo in counts for suffix in (".tar.gz", ".LICENSE")
    }
    assert len(counts) >= 12 and len(tasks) >= 250
    # A base model's memorisation is measured for every source with deletions to recall
    # (tools/probe_memorisation.py --write-counts; docs/feature_tasks.md).
    with_deletions = {task.repo for task in tasks if task.feature.kind != "bug"}
    probed = {repo for repo, entry in counts.items() if entry.get("memorisation", {}).get("tasks")}
    assert probed == with_deletions
    assert {task.feature.kind == "bug" for task in tasks} == {True, False}
    size = sum(path.stat().st_size for path in SHIPPED.rglob("*") if path.is_file())
    assert size < 3 * 2**20  # each source once, tasks as edits


def test_every_shipped_task_applies_and_a_sample_materializes(tmp_path: Path) -> None:
    tasks = load_feature_tasks(SHIPPED)
    files: dict[tuple[str, str], list[str]] = {}
    for task in tasks:  # every edit replaces the text it was made for
        for edit in (task.deletion, *task.test_removals):
            key = (task.repo, edit.file)
            if key not in files:
                files[key] = read_source_file(SHIPPED, task, edit.file).splitlines(keepends=True)
            span = "".join(files[key][edit.start - 1 : edit.end])
            assert text_sha256(span) == edit.original_sha256, (task.id, edit.file)
    for index, task in enumerate(sample_tasks(tasks, 1)):
        tree = tmp_path / str(index)
        materialize_agent_tree(SHIPPED, task, tree)
        damaged = (tree / task.deletion.file).read_text()
        assert task.deletion.replacement in damaged, task.id
        hidden_files = sorted({node.split("::", 1)[0] for node in task.hidden_tests})
        remaining = spans_of_test_functions(tree, hidden_files)
        for node in task.hidden_tests:
            assert function_key(node) not in remaining, (task.id, node)


@pytest.mark.slow  # regenerates every candidate of one shipped source (a minute or two on 2 cores)
def test_regenerating_a_shipped_source_reproduces_its_tasks(tmp_path: Path) -> None:
    # wcwidth: both task kinds, a 37-test suite and 28 candidates: regenerated in 37-40 s against
    # idna's 61 s and inflection's 57 s (idle 2-core Xeon, two at a time, 2026-11-29).
    repo = next(
        name
        for name in json.loads((SHIPPED / COUNTS_FILE).read_text())
        if name.startswith("wcwidth")
    )
    store = tmp_path / "store"
    (store / "sources").mkdir(parents=True)
    shutil.copy(archive_path(SHIPPED, repo), archive_path(store, repo))
    # Its counts say which kinds it was made with, and each kind's limits.
    made = {repo: json.loads((SHIPPED / COUNTS_FILE).read_text())[repo]}
    (store / COUNTS_FILE).write_text(json.dumps(made))
    _make_feature_tasks("--regenerate", "--store", str(store))
    shipped = [t.to_json() for t in load_feature_tasks(SHIPPED) if t.repo == repo]
    assert {t.feature.kind == "bug" for t in load_feature_tasks(store)} == {True, False}
    assert [t.to_json() for t in load_feature_tasks(store)] == shipped
    assert archive_path(store, repo).read_bytes() == archive_path(SHIPPED, repo).read_bytes()


@pytest.mark.slow  # grades 2 tasks of each source and searches the sandbox for their code
def test_shipped_tasks_validate_under_the_current_grader() -> None:
    # Every task: `tools/make_feature_tasks.py --check` (minutes; docs/feature_tasks.md).
    done = _make_feature_tasks("--check", "--sample", "2", "--store", str(SHIPPED))
    expected = len(sample_tasks(load_feature_tasks(SHIPPED), 2))
    assert f"{expected} of {expected} tasks validate" in done.stdout
