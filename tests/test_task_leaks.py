"""Recovering a task's deleted code from outside its working copy.

A scripted hostile agent uses only the repository environment's own tools: it greps every
file the sandbox shows for the deleted feature's definition (outside its working copy) and
copies each hit over the task's file. The sandbox's allow-listed root holds no copy of any
shipped source, so it finds nothing and earns 0. The leak check finds planted copies outside
the tree, in a site-packages folder and in compressed archives.
"""

from __future__ import annotations

import ast
import io
import lzma
import py_compile
import re
import shlex
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from composer_tune.agents.repository import RepositoryEnvironment
from composer_tune.data.feature_tasks import (
    FeatureTask,
    load_feature_task_dataset,
    load_feature_tasks,
    materialize_agent_tree,
    read_source_file,
    task_from_sample,
)
from composer_tune.data.task_leaks import (
    TaskLeakError,
    find_leaks,
    leaks_in_sandbox,
    store_fingerprints,
)
from composer_tune.rewards.repository import PYTEST_TARGET
from composer_tune.rewards.sandbox import private_root_available
from composer_tune.rewards.split import pytest_runtime

REPO_ROOT = Path(__file__).resolve().parent.parent
STORE = REPO_ROOT / "tests" / "assets" / "feature_tasks"

needs_private_root = pytest.mark.skipif(
    not private_root_available(), reason="no mount namespaces here: docs/sandbox.md"
)


def _stdout(observation: str) -> str:
    return observation.split("stdout:\n", 1)[1].rsplit("\nstderr:\n", 1)[0]


@needs_private_root
@pytest.mark.parametrize(
    "task_id",
    [
        "inflection-0.5.1:inflection/__init__.py:camelize",
        "cachetools-8.0.2:src/cachetools/__init__.py:TTLCache.ttl",
    ],
)
def test_hostile_agent_searching_the_sandbox_finds_no_copy(task_id: str) -> None:
    sample = next(s for s in load_feature_task_dataset(STORE) if s["id"] == task_id)
    task, _ = task_from_sample(sample)
    environment = RepositoryEnvironment(command_time_s=120, grade_time_s=120)
    environment.reset(**sample)
    name = task.feature.qualname.rsplit(".", 1)[-1]
    pattern = shlex.quote(rf"(def|class) {re.escape(name)}\b")
    found = environment.run_command(
        f"grep -rlE {pattern} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=repo; true"
    )
    assert found.startswith("status: ok"), found  # the search finished within its budget
    hits = [line for line in _stdout(found).splitlines() if line.strip()]
    for hit in hits:
        environment.run_command(f"cp {shlex.quote(hit)} {shlex.quote(task.deletion.file)}")
    reward = environment.get_reward()
    assert (hits, reward) == ([], 0.0)


# --------------------------------------------------------------------------------------------
# The leak check


@pytest.fixture(scope="module")
def camelize() -> tuple[FeatureTask, str]:
    task = next(t for t in load_feature_tasks(STORE) if t.id.endswith(":camelize"))
    return task, read_source_file(STORE, task, task.deletion.file)


def _reformatted(text: str) -> str:
    """``text`` as another formatter and editor would leave it: re-wrapped, re-quoted and
    re-parenthesised (``ast.unparse``), indented by two spaces, a comment on every def."""
    lines = []
    for line in ast.unparse(ast.parse(text)).splitlines():
        stripped = line.lstrip(" ")
        lines.append(" " * ((len(line) - len(stripped)) // 2) + stripped)
        lines[-1] += "  # formatted" if stripped.startswith("def ") else ""
    return "\n".join(lines) + "\n"


def test_fingerprint_sees_through_formatting_not_the_damaged_file(
    camelize: tuple[FeatureTask, str], tmp_path: Path
) -> None:
    task, original = camelize
    (print_,) = store_fingerprints(STORE, [task])
    assert print_.windows and print_.code_keys and "camelize" in print_.identifiers
    copy = tmp_path / "copy" / "vendored.py"
    copy.parent.mkdir()
    copy.write_text(_reformatted(original))
    compile(copy.read_text(), str(copy), "exec")  # still Python
    materialize_agent_tree(STORE, task, tmp_path / "agent")
    signature_only = tmp_path / "signature" / "stub.py"
    signature_only.parent.mkdir()
    first = original.splitlines(keepends=True)[: task.deletion.start - 1]
    signature_only.write_text("".join(first[-12:]) + "    pass\n")
    roots = [(str(tmp_path / name), ()) for name in ("copy", "agent", "signature")]
    # The reformatted copy is found; the agent's own tree and a copy of what it still shows
    # (signature and docstring) are not.
    assert find_leaks([print_], roots) == {task.id: [str(copy)]}


def test_planted_copies_outside_in_site_packages_and_in_archives_are_found(
    camelize: tuple[FeatureTask, str], tmp_path: Path
) -> None:
    task, original = camelize
    prints = store_fingerprints(STORE, load_feature_tasks(STORE))
    outside = tmp_path / "somewhere" / "else" / "inflection_copy.py"
    # A site-packages folder the sandbox shows (a mounted runtime), and one its root covers.
    installed = tmp_path / "runtime" / "site-packages" / "inflection" / "__init__.py"
    stdlib = tmp_path / "lib" / "python3.11"
    covered = stdlib / "site-packages" / "inflection" / "__init__.py"
    for path, text in (
        (outside, _reformatted(original)),
        (installed, original),
        (covered, original),
    ):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    archives = tmp_path / "archives"
    archives.mkdir()
    with zipfile.ZipFile(archives / "inflection-0.5.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr("inflection/__init__.py", original)
    with tarfile.open(archives / "inflection-0.5.1.tar.gz", "w:gz") as sdist:
        data = original.encode()
        info = tarfile.TarInfo("inflection-0.5.1/inflection/__init__.py")
        info.size = len(data)
        sdist.addfile(info, io.BytesIO(data))
    # Bytecode only, inside a zip inside an xz stream: the compiled original.
    py_compile.compile(str(installed), cfile=str(tmp_path / "inflection.pyc"), doraise=True)
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as cache:
        cache.write(tmp_path / "inflection.pyc", "__pycache__/inflection.cpython-311.pyc")
    (archives / "cache.zip.xz").write_bytes(lzma.compress(inner.getvalue()))
    (tmp_path / "inflection.pyc").unlink()
    roots = [
        (str(tmp_path / "somewhere"), ()),
        (str(tmp_path / "runtime"), ()),
        (str(stdlib), (str(stdlib / "site-packages"),)),
        (str(archives), ()),
    ]
    found = find_leaks(prints, roots)
    expected = {
        str(outside),
        str(installed),
        f"{archives / 'inflection-0.5.1-py3-none-any.whl'}!inflection/__init__.py",
        f"{archives / 'inflection-0.5.1.tar.gz'}!inflection-0.5.1/inflection/__init__.py",
        f"{archives / 'cache.zip.xz'}!__pycache__/inflection.cpython-311.pyc",
    }
    assert set(found[task.id]) == expected  # the covered site-packages is not readable
    # Every inflection task is found in the full copies; no task of another source is.
    inflection = {t.id for t in load_feature_tasks(STORE) if t.repo.startswith("inflection")}
    assert set(found) == inflection


@needs_private_root
def test_environment_refuses_a_task_whose_code_the_sandbox_shows(
    camelize: tuple[FeatureTask, str], tmp_path: Path
) -> None:
    task, original = camelize
    sample = next(s for s in load_feature_task_dataset(STORE) if s["id"] == task.id)
    leaks_in_sandbox(STORE)  # the shipped store, searched before the plant
    store = tmp_path / "store"
    shutil.copytree(STORE, store)
    planted = pytest_runtime() / "planted_inflection.py"
    planted.write_text(original)
    try:
        environment = RepositoryEnvironment()
        with pytest.raises(TaskLeakError, match=f"readable in the sandbox at {planted}"):
            environment.reset(**{**sample, "store": str(store)})
        # Not a false alarm: an agent reads the planted copy through its tools.
        seen = environment.run_command(f"grep -c 'def camelize' {PYTEST_TARGET}/{planted.name}")
        assert _stdout(seen) == "1\n", seen
    finally:
        planted.unlink()
