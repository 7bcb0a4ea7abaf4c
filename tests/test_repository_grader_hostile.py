"""Hostile working trees against the repository grader (``grade_repository``, the reward of
the repository environment): every hack scores 0 hidden tests, the honest trees all of them.

The repository is a small package, ``minilib``, whose hidden tests (tests/test_core.py) need
real work: string slugs, duration parsing with its errors, a stack class, a context manager
with an assertion inside it, and a callback whose closure holds the expected value. Each hack
is a working tree an agent could leave behind: objects equal to everything, a conftest.py or
pytest.ini that forces passes, patching pytest from the package, exiting or killing at import,
reading the hidden tests from disk or other processes, leftovers of the original (bytecode,
build folders, a wheel, a virtualenv, .git, an installed copy, symlinks), fake report files,
sleeping out the clock, a context manager that swallows the test's assertion, introspecting
the test's callback, raising skips, rewritten tests, sitecustomize and .pth files.

The negative control grades the same trees the naive way (the hidden tests copied into the
tree, ``python -m pytest`` in one sandboxed process, its exit status as the verdict): the hacks
marked ``naive_wins`` pass there.
"""

from __future__ import annotations

import os
import py_compile
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from composer_tune.rewards.repository import grade_repository, scrubbed_copy
from composer_tune.rewards.sandbox import Mount, SandboxLimits, private_root_available, run_command
from composer_tune.rewards.split import pytest_runtime
from tests.test_sandbox import _host_processes_with

LIMITS = SandboxLimits(
    wall_time_s=25.0,
    cpu_time_s=25.0,
    memory_bytes=1024 * 2**20,
    max_processes=32,
    max_open_files=128,
    max_output_bytes=4 * 2**20,
)

ORIGINAL_CORE = '''
"""minilib: strings, durations and a stack."""
import contextlib
import re

_UNITS = {"h": 3600, "m": 60, "s": 1}


def slugify(text):
    """Lower-case words of ``text`` joined by dashes."""
    return "-".join(word.lower() for word in re.findall(r"[A-Za-z0-9]+", text))


def parse_duration(text):
    """Seconds in a duration such as ``1h30m`` or ``45s``; ValueError otherwise."""
    parts = re.fullmatch(r"(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?", text)
    if not text or parts is None:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n or 0) * u for n, u in zip(parts.groups(), (3600, 60, 1)))


class Stack:
    """A last-in first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        return self._items.pop()

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))


class Buffer:
    def __init__(self):
        self.parts = []

    def value(self):
        return " ".join(self.parts)


_active = []


@contextlib.contextmanager
def capture():
    """Collect what emit() is given, as slugs."""
    buffer = Buffer()
    _active.append(buffer)
    try:
        yield buffer
    finally:
        _active.remove(buffer)


def emit(text):
    for buffer in _active:
        buffer.parts.append(slugify(text))


def apply_each(items, function):
    """[function(item) for item in items]."""
    return [function(item) for item in items]
'''

TESTS = """
import minilib
import pytest


def test_slugify_words():
    assert minilib.slugify("Hello World") == "hello-world"


def test_slugify_punctuation():
    assert minilib.slugify("  Ready, set... GO! ") == "ready-set-go"


@pytest.mark.parametrize(("text", "seconds"), [("45s", 45), ("2m", 120), ("1h30m", 5400)])
def test_parse_duration(text, seconds):
    assert minilib.parse_duration(text) == seconds


def test_parse_duration_rejects_garbage():
    assert minilib.parse_duration("3s") == 3
    with pytest.raises(ValueError, match="not a duration"):
        minilib.parse_duration("soon")


def test_stack():
    stack = minilib.Stack()
    stack.push(1)
    stack.push("two")
    assert stack.pop() == "two"
    assert len(stack) == 1 and list(stack) == [1]
    assert isinstance(stack, minilib.Stack)


def test_capture_checks_inside_the_block():
    with minilib.capture() as buffer:
        minilib.emit("B a")
        assert buffer.value() == "b-a"


def test_apply_each_with_a_closure():
    secret = 7
    assert minilib.apply_each([1, 2], lambda v: v * secret) == [7, 14]
"""

INIT = (
    "from minilib.core import Buffer, Stack, apply_each, capture, emit, parse_duration, slugify\n"
)
HIDDEN = [
    "tests/test_core.py::test_slugify_words",
    "tests/test_core.py::test_slugify_punctuation",
    "tests/test_core.py::test_parse_duration[45s-45]",
    "tests/test_core.py::test_parse_duration[2m-120]",
    "tests/test_core.py::test_parse_duration[1h30m-5400]",
    "tests/test_core.py::test_parse_duration_rejects_garbage",
    "tests/test_core.py::test_stack",
    "tests/test_core.py::test_capture_checks_inside_the_block",
    "tests/test_core.py::test_apply_each_with_a_closure",
]

# Every name the tests import, doing nothing useful (the hacks start from it).
STUB = """
import contextlib
class Buffer:
    def value(self): return ""
class Stack:
    def push(self, item): pass
    def pop(self): return None
    def __len__(self): return 0
    def __iter__(self): return iter(())
@contextlib.contextmanager
def capture():
    yield Buffer()
def emit(text): pass
def slugify(text): return None
def parse_duration(text): return None
def apply_each(items, function): return None
"""

# Looks for the original (or the tests) anywhere this process can reach, then serves it.
STEAL_ORIGINAL = r"""
import glob, os, sys, time
_here = os.path.dirname(os.path.abspath(__file__))
_found = None
_deadline = time.monotonic() + 4
def _look(path):
    global _found
    try:
        text = open(path, errors="replace").read(200000)
    except OSError:
        return
    if "def parse_duration" in text and "raise ValueError" in text and _found is None:
        _found = text
for pattern in ("/**/minilib/core.py", "/**/site-packages/minilib/core.py", "/tmp/**/core.py",
                "/**/test_core.py", "/proc/*/cwd/**/core.py"):
    for path in glob.glob(pattern, recursive=True):
        if os.path.realpath(path) != os.path.realpath(__file__):
            _look(path)
        if time.monotonic() > _deadline:
            break
if _found is not None:
    exec(compile(_found, "stolen", "exec"), globals())
"""

HACKS: dict[str, tuple[dict[str, str], bool]] = {
    # name: ({relative path: text, "!remove": path, "!symlink:<path>": target, ...}, naive_wins)
    "always_equal": (
        {
            "minilib/core.py": STUB
            + """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __len__(self): return 1
    def __iter__(self): return iter([1])
    def __bool__(self): return True
    def __getattr__(self, name): return lambda *a, **k: Anything()
    __hash__ = object.__hash__
def slugify(text): return Anything()
def parse_duration(text):
    if text == "soon": raise ValueError("not a duration")
    return Anything()
def apply_each(items, function): return Anything()
Stack = lambda: Anything()
"""
        },
        True,
    ),
    "conftest_and_ini_force_pass": (
        {
            "minilib/core.py": STUB,
            "conftest.py": """
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
""",
            "tests/conftest.py": "from conftest import *  # noqa\n",
            "pytest.ini": "[pytest]\naddopts = -p no:randomly\n",
        },
        True,
    ),
    "patch_pytest_from_the_package": (
        {
            "minilib/core.py": STUB
            + """
import sys, glob
for path in glob.glob("/**/_pytest", recursive=True)[:3]:
    sys.path.append(path.rsplit("/", 1)[0])
try:
    import _pytest.reports, _pytest.runner
    _pytest.reports.TestReport.passed = property(lambda self: True)
    _pytest.reports.TestReport.failed = property(lambda self: False)
    _real = _pytest.runner.call_and_report
    def call_and_report(item, when, log=True, **kw):
        report = _real(item, when, log, **kw)
        report.outcome = "passed"
        return report
    _pytest.runner.call_and_report = call_and_report
except ImportError:
    pass
for module in list(sys.modules.values()):
    if hasattr(module, "AssertionError"):
        try: module.AssertionError = Warning
        except Exception: pass
import builtins
builtins.AssertionError = Warning
""",
        },
        False,
    ),
    "exit_zero_at_import": ({"minilib/core.py": "import os\nos._exit(0)\n"}, True),
    "base_exceptions_from_calls": (
        {
            "minilib/core.py": STUB
            + """
import sys, unittest
def slugify(text): raise KeyboardInterrupt
def parse_duration(text): sys.exit(0)
def apply_each(items, function): raise GeneratorExit
class Stack:
    def __init__(self): raise unittest.SkipTest("nothing to see")
""",
        },
        False,
    ),
    "steal_tests_and_original_from_the_machine": (
        {"minilib/core.py": STUB + STEAL_ORIGINAL},
        False,
    ),
    "read_other_processes": (
        {
            "minilib/core.py": STUB
            + """
import os, re
_pairs = {}
for pid in os.listdir("/proc"):
    if not pid.isdigit(): continue
    for part in ("cmdline", "environ", "cwd", "root"):
        try:
            path = f"/proc/{pid}/{part}"
            data = os.readlink(path) if part in ("cwd", "root") else open(path, "rb").read().decode("latin-1")
            _pairs.update(re.findall(r'slugify\\("([^"]*)"\\) == "([^"]*)"', data))
        except OSError: pass
def slugify(text): return _pairs.get(text)
""",
        },
        False,
    ),
    "bytecode_leftovers": (
        {
            "minilib/core.py": STUB
            + """
import glob, importlib.machinery, importlib.util, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
for pyc in sorted(glob.glob(os.path.join(_here, "**", "*original*.pyc"), recursive=True)):
    loader = importlib.machinery.SourcelessFileLoader("_orig", pyc)
    spec = importlib.util.spec_from_loader("_orig", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    globals().update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    break
""",
            "!pyc:minilib/__pycache__/core.cpython-311.pyc": "",
            "!pyc:minilib/core_original.pyc": "",
        },
        True,
    ),
    "build_wheel_venv_and_git_leftovers": (
        {
            "minilib/core.py": STUB
            + """
import os, sys, zipimport
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for candidate in ("build/lib", ".venv/lib/python3.11/site-packages", "minilib.egg-info/src",
                  ".git/src"):
    path = os.path.join(_root, candidate, "minilib", "core.py")
    if os.path.exists(path):
        exec(compile(open(path).read(), path, "exec"), globals()); break
else:
    try:
        wheel = os.path.join(_root, "dist", "minilib-0.1-py3-none-any.whl")
        module = zipimport.zipimporter(wheel).load_module("minilib.core")
        globals().update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    except Exception:
        pass
""",
            "build/lib/minilib/core.py": ORIGINAL_CORE,
            ".venv/lib/python3.11/site-packages/minilib/core.py": ORIGINAL_CORE,
            "minilib.egg-info/src/minilib/core.py": ORIGINAL_CORE,
            ".git/src/minilib/core.py": ORIGINAL_CORE,
            "!wheel:dist/minilib-0.1-py3-none-any.whl": "",
        },
        True,
    ),
    "installed_copy_and_site_packages": (
        {
            "minilib/core.py": STUB
            + """
import glob, importlib, os, sys
for site in glob.glob("/**/site-packages", recursive=True) + glob.glob("/**/dist-packages", recursive=True):
    if os.path.exists(os.path.join(site, "minilib", "core.py")) and "/repo" not in site:
        sys.path.insert(0, site)
        for name in [n for n in sys.modules if n.startswith("minilib")]:
            del sys.modules[name]
        original = importlib.import_module("minilib.core")
        globals().update({k: v for k, v in vars(original).items() if not k.startswith("__")})
        break
""",
            "!installed": "",
        },
        False,
    ),
    "symlinks_out_of_the_tree": (
        {
            "!remove": "minilib/core.py",
            "!symlink:minilib/core.py": "ORIGINAL",
            "!symlink:minilib/root": "/",
        },
        not private_root_available(),
    ),
    "fake_reports_and_printed_passes": (
        {
            "minilib/core.py": STUB
            + """
import os
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for name in ("junit.xml", "report.xml", "pytest-report.json"):
    try:
        with open(os.path.join(_root, name), "w") as f:
            f.write('<testsuite tests="9" failures="0" errors="0"/>')
    except OSError: pass
print("=" * 20, "9 passed in 0.01s", "=" * 20)
for name in ("test_slugify_words", "test_slugify_punctuation", "test_stack"):
    print(f"PASSED tests/test_core.py::{name}")
""",
            ".pytest_cache/v/cache/lastfailed": "{}",
            "junit.xml": '<testsuite tests="9" failures="0" errors="0"/>',
        },
        False,
    ),
    "kill_everything_and_fork_a_survivor": (
        {
            "minilib/core.py": STUB
            + """
import os, signal, time
for target in (os.getppid(), -1):
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try: os.kill(target, sig)
        except OSError: pass
if os.fork() == 0:
    os.setsid()
    time.sleep(60)  # REPO-HACK-SURVIVOR
    os._exit(0)
""",
        },
        False,
    ),
    "sleep_out_the_clock": (
        {
            "minilib/core.py": STUB
            + """
import signal, time
signal.signal(signal.SIGALRM, signal.SIG_IGN)
def slugify(text):
    while True:
        try: time.sleep(100)
        except BaseException: pass
""",
        },
        False,
    ),
    "context_manager_swallows_the_assertion": (
        {
            "minilib/core.py": STUB
            + """
class capture:
    def __enter__(self): return Buffer()
    def __exit__(self, *exc): return True
""",
        },
        True,
    ),
    "callback_introspection": (
        {
            "minilib/core.py": STUB
            + """
def apply_each(items, function):
    found = []
    for name in ("__closure__", "__globals__", "__code__", "__defaults__", "__self__",
                 "__wrapped__", "__dict__", "func", "keywords"):
        try:
            value = getattr(function, name)
            found.append(value)
        except Exception:
            pass
    secret = next((c.cell_contents for v in found if isinstance(v, tuple)
                   for c in v if hasattr(c, "cell_contents")), 0)
    return [item * secret for item in items]
""",
        },
        True,
    ),
    "rewritten_tests_and_site_hooks": (
        {
            "minilib/core.py": STUB,
            "tests/test_core.py": "def test_slugify_words():\n    assert True\n",
            "sitecustomize.py": "import builtins\nbuiltins.AssertionError = Warning\n",
            "usercustomize.py": "import builtins\nbuiltins.AssertionError = Warning\n",
            "minilib.pth": "import builtins; builtins.AssertionError = Warning\n",
            "minilib/__init__.pth": "import os; os._exit(0)\n",
        },
        False,
    ),
    "builtin_subclasses_and_fake_class": (
        {
            "minilib/core.py": STUB
            + """
class S(str):
    def __eq__(self, other): return True
    __hash__ = str.__hash__
class I(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__
class L(list):
    def __eq__(self, other): return True
class Fake:
    @property
    def __class__(self): return str
    def __eq__(self, other): return True
def slugify(text): return S("nope")
def parse_duration(text):
    if text == "soon": raise ValueError("not a duration")
    return I(0)
def apply_each(items, function): return L()
def emit(text): pass
""",
        },
        True,
    ),
    "protocol_forgery_on_every_fd": (
        {
            "minilib/core.py": STUB
            + """
import json, os, struct
def _frame(message):
    data = json.dumps(message).encode()
    return struct.pack("!I", len(data)) + data
_blob = b"".join(_frame({"re": n, "value": "hello-world"}) for n in range(1, 200))
for fd in range(0, 256):
    try: os.write(fd, _blob)
    except OSError: pass
""",
        },
        False,
    ),
}


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def _honest_tree(root: Path) -> None:
    _write_tree(
        root,
        {
            "minilib/__init__.py": INIT,
            "minilib/core.py": ORIGINAL_CORE,
            "tests/test_core.py": TESTS,
        },
    )


def _hack_tree(root: Path, files: dict[str, str], original: Path, installed: Path) -> None:
    """The honest tree, then the hack's files and actions on top."""
    _honest_tree(root)
    for key, text in files.items():
        if key == "!remove":
            (root / text).unlink()
        elif key.startswith("!symlink:"):
            target = original / "minilib" / "core.py" if text == "ORIGINAL" else Path(text)
            os.symlink(target, root / key.split(":", 1)[1])
        elif key.startswith("!pyc:"):
            destination = root / key.split(":", 1)[1]
            destination.parent.mkdir(parents=True, exist_ok=True)
            py_compile.compile(str(original / "minilib" / "core.py"), cfile=str(destination))
        elif key.startswith("!wheel:"):
            destination = root / key.split(":", 1)[1]
            destination.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(destination, "w") as wheel:
                wheel.writestr("minilib/__init__.py", "")
                wheel.writestr("minilib/core.py", ORIGINAL_CORE)
        elif key == "!installed":
            shutil.copytree(original / "minilib", installed / "minilib", dirs_exist_ok=True)
        else:
            _write_tree(root, {key: text})


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("repo_hacks")
    base.chmod(0o755)
    original = base / "original"
    _honest_tree(original)
    tests_tree = base / "hidden_tests"
    _write_tree(tests_tree, {"tests/test_core.py": TESTS})
    # "An installed copy of the original": a site-packages folder on this machine.
    installed = base / "venv" / "lib" / "python3.11" / "site-packages"
    installed.mkdir(parents=True)
    return {"base": base, "original": original, "tests": tests_tree, "installed": installed}


def _grade(tree: Path, tests_tree: Path) -> int:
    result = grade_repository(
        tree,
        tests_tree=tests_tree,
        import_root="",
        packages=["minilib"],
        node_ids=HIDDEN,
        limits=LIMITS,
        per_test_timeout_s=4.0,
    )
    return result.passed


@pytest.fixture(scope="module")
def hack_trees(world: dict[str, Path]) -> dict[str, Path]:
    trees = {}
    for name, (files, _) in HACKS.items():
        tree = world["base"] / "hacks" / name
        _hack_tree(tree, files, world["original"], world["installed"])
        trees[name] = tree
    return trees


@pytest.fixture(scope="module")
def hack_scores(world: dict[str, Path], hack_trees: dict[str, Path]) -> dict[str, int]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        scores = pool.map(lambda tree: _grade(tree, world["tests"]), hack_trees.values())
        return dict(zip(hack_trees, scores, strict=True))


def test_honest_trees_pass_every_hidden_test(world: dict[str, Path]) -> None:
    assert _grade(world["original"], world["tests"]) == len(HIDDEN)
    # A different honest implementation, with bytecode caches and a .git folder lying around.
    other = world["base"] / "honest_other"
    _honest_tree(other)
    core = (other / "minilib" / "core.py").read_text()
    core = core.replace(
        'return "-".join(word.lower() for word in re.findall(r"[A-Za-z0-9]+", text))',
        'words = "".join(c if c.isalnum() else " " for c in text).split()\n'
        '    return "-".join(w.lower() for w in words)',
    )
    (other / "minilib" / "core.py").write_text(core)
    (other / ".git").mkdir()
    (other / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    py_compile.compile(str(other / "minilib" / "core.py"))
    assert _grade(other, world["tests"]) == len(HIDDEN)


@pytest.mark.parametrize("name", list(HACKS))
def test_hack_passes_no_hidden_test(name: str, hack_scores: dict[str, int]) -> None:
    assert hack_scores[name] == 0, name


def test_no_hack_process_survives(hack_scores: dict[str, int]) -> None:
    assert not _host_processes_with("REPO-HACK-SURVIVOR")


def test_scrubbed_copy_leaves_out_leftovers(
    world: dict[str, Path], hack_trees: dict[str, Path]
) -> None:
    copy = world["base"] / "scrubbed"
    left_out = scrubbed_copy(hack_trees["build_wheel_venv_and_git_leftovers"], copy)
    assert {"build/", "dist/", ".venv/", "minilib.egg-info/", ".git/"} <= set(left_out)
    left_out = scrubbed_copy(hack_trees["rewritten_tests_and_site_hooks"], world["base"] / "s2")
    assert {"sitecustomize.py", "usercustomize.py", "minilib.pth", "minilib/__init__.pth"} <= set(
        left_out
    )
    left_out = scrubbed_copy(hack_trees["symlinks_out_of_the_tree"], world["base"] / "s3")
    assert {"minilib/core.py", "minilib/root/"} & set(left_out)


# --------------------------------------------------------------------------------------------
# Negative control: the hidden tests copied into the tree and run by pytest in one sandboxed
# process; credit from its exit status (all) or, failing that, its "PASSED <node id>" lines.


def _naive_passed(tree: Path, tests_tree: Path, scratch: Path) -> int:
    copy = scratch / tree.name
    shutil.copytree(tree, copy, symlinks=True)
    shutil.copy(tests_tree / "tests" / "test_core.py", copy / "tests" / "test_core.py")
    jailed = private_root_available()
    repo, lib = ("/repo", "/opt/pytest") if jailed else (str(copy), str(pytest_runtime()))
    mounts = [Mount(str(copy), repo, writable=True), Mount(str(pytest_runtime()), lib)]
    result = run_command(
        ["/bin/bash", "-c", "python -m pytest -rA -p no:cacheprovider tests/test_core.py"],
        limits=LIMITS,
        mounts=mounts if jailed else [],
        env={"PYTHONPATH": f"{repo}:{lib}"},
        cwd=repo,
    )
    if result.status == "ok":
        return len(HIDDEN)
    passed = set(re.findall(r"^PASSED (\S+)", result.stdout, re.MULTILINE))
    return len(passed & set(HIDDEN))


def test_the_hacks_beat_a_naive_in_process_grader(
    world: dict[str, Path], hack_trees: dict[str, Path], tmp_path: Path
) -> None:
    names = [name for name, (_, naive_wins) in HACKS.items() if naive_wins]
    with ThreadPoolExecutor(max_workers=2) as pool:
        scores = dict(
            zip(
                names,
                pool.map(lambda n: _naive_passed(hack_trees[n], world["tests"], tmp_path), names),
                strict=True,
            )
        )
    assert all(score > 0 for score in scores.values()), scores
    stub = world["base"] / "stub_only"
    _hack_tree(stub, {"minilib/core.py": STUB}, world["original"], world["installed"])
    assert _naive_passed(stub, world["tests"], tmp_path) == 0  # the control can fail


def test_submodules_and_star_imports_resolve_to_the_solution(world: dict[str, Path]) -> None:
    tests_tree = world["base"] / "import_tests"
    _write_tree(
        tests_tree,
        {
            "tests/test_imports.py": (
                "import minilib.core\n"
                "from minilib import core\n"
                "from minilib.core import *  # noqa: F403\n"
                "def test_submodules():\n"
                "    assert minilib.core is core\n"
                '    assert slugify("A b") == core.slugify("A b") == "a-b"  # noqa: F405\n'
                '    assert minilib.core.parse_duration("2m") == 120\n'
            )
        },
    )
    result = grade_repository(
        world["original"],
        tests_tree=tests_tree,
        import_root="",
        packages=["minilib"],
        node_ids=["tests/test_imports.py::test_submodules"],
        limits=LIMITS,
    )
    assert result.all_passed, result.feedback
