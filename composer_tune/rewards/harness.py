"""The programs of a split test run, one per sandboxed process (stdlib only; see bridge.py).

* :func:`snippet_solution` / :func:`snippet_grader`: a coding problem's solution source and its
  test snippets (``CodeExecutionReward``).
* :func:`package_solution` / :func:`pytest_grader`: a repository's package and pytest tests
  (the feature-deletion tasks' hidden tests).
* :func:`pytest_suite`: an ordinary in-process pytest run that reports per-test outcomes, for
  trusted code only (the task generator's runs of the original and of the deleted snapshot).

A grader reads its configuration (the tests) from stdin, which the sandbox hands over as an
open descriptor of a file only the trainer can read, and prints one JSON report line that
starts with the nonce from its configuration. No code of the candidate runs in a grader's
process, so its report is its own.

:func:`program` turns an entry point into program text: the sandboxed interpreter runs with
``-I -S`` and cannot import composer_tune, so this module and bridge.py travel as source.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
import traceback

from composer_tune.rewards.bridge import BridgeError, CallTimeout, Channel, Endpoint

_ERROR_CHARS = 600
_GRACE_S = 0.5  # past a test's budget before the grader interrupts its own code


def program(entry: str, **arguments: object) -> str:
    """Program text that loads bridge.py and this module and calls ``entry(**arguments)``."""
    from pathlib import Path

    here = Path(__file__).parent
    sources = {
        f"composer_tune.rewards.{name}": (here / f"{name}.py").read_text(encoding="utf-8")
        for name in ("bridge", "harness")
    }
    return "\n".join(
        [
            "import sys, types",
            f"_SOURCES = {sources!r}",
            "for _package in ('composer_tune', 'composer_tune.rewards'):",
            "    sys.modules[_package] = types.ModuleType(_package)",
            "    sys.modules[_package].__path__ = []",
            "for _name, _source in _SOURCES.items():",
            "    _module = sys.modules[_name] = types.ModuleType(_name)",
            "    exec(compile(_source, _name.rsplit('.', 1)[1] + '.py', 'exec'), _module.__dict__)",
            "del _SOURCES, _name, _source, _module, _package",
            f"sys.modules['composer_tune.rewards.harness'].{entry}(**{arguments!r})",
        ]
    )


def _exception_line(exc: BaseException, limit: int = 400) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-limit:]


def _report(nonce: str, report: dict) -> None:
    sys.stdout.flush()
    sys.stdout.write("\n" + nonce + json.dumps(report) + "\n")
    sys.stdout.flush()


class _TestTimeout(BaseException):
    """The grader's own alarm: a test's code ran past its budget."""


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _wait_ready(endpoint: Endpoint) -> tuple[str | None, dict]:
    """The solution's first message, and None once it loaded or else why it did not
    ("timeout" when the budget ran out first)."""
    try:
        ready = endpoint.channel.receive(endpoint.deadline)
    except CallTimeout:
        return "timeout", {}
    except BridgeError:
        return "the program ended before the tests finished (exit() or os._exit?)", {}
    if ready.get("ready") is True:
        return None, ready
    return "solution failed to load: " + str(ready.get("error", "?"))[-_ERROR_CHARS:], ready


# --------------------------------------------------------------------------------------------
# Coding problems: a solution's source against test snippets


def snippet_solution(code: str, read_fd: int, write_fd: int) -> None:
    """Run ``code`` as a module and answer the grader's requests on its names."""
    channel = Channel(read_fd, write_fd)
    endpoint = Endpoint(channel, serves_all=True)
    namespace = {"__name__": "__solution__"}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException as exc:
        channel.send({"ready": False, "error": _exception_line(exc)})
        return
    names = {name: value for name, value in namespace.items() if not name.startswith("__")}
    channel.send({"ready": True, "names": endpoint.encode(names)})
    endpoint.serve_forever()


def snippet_grader(read_fd: int, write_fd: int) -> None:
    """Run the test snippets of the stdin configuration against the solution's names.

    Configuration: ``tests`` (snippets), ``per_test_timeout_s`` (None: one budget for all),
    ``time_budget_s`` (everything), ``nonce``. Report: ``results`` (per test ``passed`` and
    ``error``), ``timed_out``, ``load_error``.
    """
    config = json.loads(sys.stdin.read())
    tests, per_test = config["tests"], config["per_test_timeout_s"]
    endpoint = Endpoint(Channel(read_fd, write_fd), serves_all=False)
    endpoint.deadline = time.monotonic() + config["time_budget_s"]
    report: dict = {"results": [], "timed_out": False, "load_error": None}
    problem, ready = _wait_ready(endpoint)
    if problem == "timeout":
        report["timed_out"] = True
    elif problem is not None:
        report["load_error"] = problem
    else:
        try:
            names = endpoint.decode(ready.get("names"))
        except BridgeError:
            names = None
        namespace = {"__name__": "__tests__"}
        # The candidate's names, except any that would shadow a builtin the tests rely on.
        namespace.update(
            (name, value)
            for name, value in (names.items() if type(names) is dict else ())
            if type(name) is str and name.isidentifier() and not hasattr(builtins, name)
        )
        if per_test:
            signal.signal(signal.SIGALRM, _on_alarm)
        for snippet in tests:
            outcome = _run_snippet(snippet, namespace, endpoint, per_test)
            if outcome is None:
                report["timed_out"] = True
                break
            report["results"].append(outcome)
    _report(config["nonce"], report)


def _run_snippet(snippet: str, namespace: dict, endpoint: Endpoint, per_test: float | None):
    """One test's outcome; None when the whole budget is spent."""
    broken_before = endpoint.broken
    if per_test:
        endpoint.call_deadline = time.monotonic() + per_test
        signal.setitimer(signal.ITIMER_REAL, per_test + Endpoint.GRACE_S + _GRACE_S)
    try:
        exec(compile(snippet, "<test>", "exec"), namespace)
        outcome = {"passed": True}
    except AssertionError:
        outcome = {"passed": False, "error": _compare_hint(snippet, namespace) or "AssertionError"}
    except CallTimeout as exc:
        if not per_test:
            return None
        outcome = {"passed": False, "error": f"test timed out after {per_test:g}s"}
        if endpoint.broken:
            outcome["error"] += f" ({exc})"
    except _TestTimeout:
        outcome = {"passed": False, "error": f"test timed out after {per_test:g}s"}
    except BaseException as exc:
        outcome = {"passed": False, "error": _exception_line(exc)}
    finally:
        if per_test:
            signal.setitimer(signal.ITIMER_REAL, 0)
        endpoint.call_deadline = None
    if endpoint.broken and endpoint.broken != broken_before:
        outcome = {"passed": False, "error": endpoint.broken}
    elif endpoint.broken:
        outcome = {"passed": False, "error": f"not run: {endpoint.broken}"}
    if endpoint.deadline is not None and time.monotonic() > endpoint.deadline:
        return None
    return outcome


def _compare_hint(snippet: str, namespace: dict) -> str:
    """For a failing ``assert a == b``: "expected b, got a", both evaluated again here."""
    import ast

    try:
        test = ast.parse(snippet).body[-1].test
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Eq, ast.Is))
        ):
            return ""
        got = eval(compile(ast.Expression(test.left), "<test>", "eval"), namespace)
        want = eval(compile(ast.Expression(test.comparators[0]), "<test>", "eval"), namespace)
        return f"expected {want!r:.150}, got {got!r:.150}"
    except BaseException:
        return ""


# --------------------------------------------------------------------------------------------
# Repositories: a package against pytest tests


def package_solution(import_root: str, read_fd: int, write_fd: int) -> None:
    """Make ``import_root`` importable and answer the grader's requests on its modules."""
    sys.dont_write_bytecode = True
    sys.path.insert(0, import_root)
    channel = Channel(read_fd, write_fd)
    channel.send({"ready": True})
    Endpoint(channel, serves_all=True).serve_forever()


class _ProxyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the package under test resolve to the solution process's modules."""

    def __init__(self, endpoint: Endpoint, packages: set[str]) -> None:
        self.endpoint = endpoint
        self.packages = packages

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in self.packages:
            return None
        try:
            module = self.endpoint.module(fullname)
        except ModuleNotFoundError:
            return None
        except Exception as exc:
            raise ImportError(f"cannot import {fullname}: {_exception_line(exc)}") from None
        is_package = "__path__" in module.__dict__
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec):
        return self.endpoint.modules[spec.name]

    def exec_module(self, module) -> None:
        pass


def pytest_grader(read_fd: int, write_fd: int) -> None:
    """Run the stdin configuration's pytest node ids with the package under test proxied.

    Configuration: ``lib`` (where pytest is), ``rootdir`` (the tests' tree), ``node_ids``,
    ``packages`` (top-level import names served by the solution), ``per_test_timeout_s``,
    ``time_budget_s``, ``nonce``. Report: ``outcomes`` (node id -> "passed" / "failed" /
    "skipped"), ``failure`` (the first failing test's report text), ``load_error``.
    """
    config = json.loads(sys.stdin.read())
    sys.dont_write_bytecode = True
    sys.path.insert(0, config["lib"])
    endpoint = Endpoint(Channel(read_fd, write_fd), serves_all=False)
    endpoint.deadline = time.monotonic() + config["time_budget_s"]
    report: dict = {"outcomes": {}, "failure": "", "load_error": None}
    problem, _ = _wait_ready(endpoint)
    if problem is not None:
        report["load_error"] = "timed out" if problem == "timeout" else problem
        _report(config["nonce"], report)
        return
    sys.meta_path.insert(0, _ProxyFinder(endpoint, set(config["packages"])))
    outcomes = _run_pytest(config, endpoint, report)
    report["outcomes"] = outcomes
    _report(config["nonce"], report)


def _run_pytest(config: dict, endpoint: Endpoint | None, summary: dict) -> dict:
    """pytest.main on the configured node ids; per node id its outcome (see pytest_grader)."""
    import pytest

    per_test = config.get("per_test_timeout_s")
    outcomes: dict[str, str] = {}

    class Outcomes:
        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            broken_before = endpoint.broken if endpoint else None
            if per_test:
                if endpoint is not None:
                    endpoint.call_deadline = time.monotonic() + per_test
                signal.signal(signal.SIGALRM, _on_alarm)
                signal.setitimer(signal.ITIMER_REAL, per_test + Endpoint.GRACE_S + _GRACE_S)
            try:
                return (yield)
            finally:
                if per_test:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if endpoint is not None:
                    endpoint.call_deadline = None
                    if endpoint.broken and endpoint.broken != broken_before:
                        self._fail(item.nodeid, f"the bridge broke: {endpoint.broken}")
                    if endpoint.deadline and time.monotonic() > endpoint.deadline:
                        item.session.shouldstop = "the grader's time budget is spent"

        @pytest.hookimpl
        def pytest_runtest_logreport(self, report):
            node = report.nodeid
            if report.failed:
                self._fail(node, report.longreprtext)
            elif report.skipped and outcomes.get(node) != "failed":
                outcomes[node] = "skipped"
            elif report.when == "call" and report.passed and node not in outcomes:
                outcomes[node] = "passed"

        @pytest.hookimpl
        def pytest_collectreport(self, report):
            if report.failed:
                self._fail(report.nodeid, report.longreprtext)

        def _fail(self, node: str, text: str) -> None:
            outcomes[node] = "failed"
            if not summary["failure"]:
                summary["failure"] = f"{node}\n{text}"[-4000:]

    home = os.environ.get("HOME", ".")
    ini = os.path.join(home, "grader-pytest.ini")
    with open(ini, "w") as handle:
        handle.write("[pytest]\n")
    args = [
        *config["node_ids"],
        "-c",
        ini,
        "--rootdir",
        config["rootdir"],
        "--confcutdir",
        config["rootdir"],
        "-p",
        "no:cacheprovider",
        "-p",
        "no:terminal",
        "--basetemp",
        os.path.join(home, "pytest-tmp"),
        "-W",
        "ignore::DeprecationWarning",
    ]
    if config.get("max_failures"):
        args.append(f"--maxfail={int(config['max_failures'])}")
    os.chdir(config["rootdir"])
    try:
        pytest.main(args, plugins=[Outcomes()])
    except BaseException as exc:  # pytest itself failed: every test counts as failed
        summary["failure"] = summary["failure"] or _exception_line(exc)
    return outcomes


def pytest_suite(
    import_root: str,
    rootdir: str,
    lib: str,
    node_ids: list,
    nonce: str,
    max_failures: int | None = None,
) -> None:
    """Run ``node_ids`` under ``rootdir`` in this process (trusted code only) and report the
    outcome of every collected test, as :func:`pytest_grader` does (stopping after
    ``max_failures`` failures, when given)."""
    sys.dont_write_bytecode = True
    sys.path.insert(0, lib)
    sys.path.insert(0, import_root)
    report: dict = {"outcomes": {}, "failure": "", "load_error": None}
    config = {"node_ids": node_ids, "rootdir": rootdir, "max_failures": max_failures}
    report["outcomes"] = _run_pytest(config, None, report)
    _report(nonce, report)
