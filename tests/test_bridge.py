"""The bridge between a grader and a solution process (composer_tune/rewards/bridge.py), in one
process over real pipes with the solution side on a thread: what crosses by value and as what
type, what a proxy refuses, how errors, callbacks, context managers and mutations cross, and
that every malformed or missing answer breaks the bridge instead of passing a test."""

from __future__ import annotations

import datetime
import decimal
import fractions
import json
import math
import os
import pathlib
import struct
import threading
import time
from collections import Counter, OrderedDict, deque
from types import SimpleNamespace

import pytest

from composer_tune.rewards.bridge import (
    BridgeError,
    Channel,
    Endpoint,
    Proxy,
    RemoteBaseException,
)

SOLUTION = """
import collections, contextlib, enum
class ParseError(ValueError):
    def __init__(self, message, line):
        super().__init__(message)
        self.line = line
class Anything:
    def __eq__(self, other): return True
    def __lt__(self, other): return True
    def __contains__(self, item): return True
    def __iter__(self): return iter([1, 2])
    __hash__ = object.__hash__
class Color(enum.IntEnum):
    RED = 1
Point = collections.namedtuple("Point", "x y")
def echo(value): return value
def parse(text):
    if text == "bad": raise ParseError("bad input", 3)
    if text == "exit": raise SystemExit(0)
    return int(text)
def anything(): return Anything()
def count(n): return (i * i for i in range(n))
def call(function, *args): return function(*args)
def swallow(function):
    try: function()
    except BaseException: return "swallowed"
def peek(function, name): return getattr(function, name)
def append(items): items.append(len(items)); return None
@contextlib.contextmanager
def suppressing():
    try: yield
    except BaseException: pass
def raising(): raise KeyError("k")
"""


@pytest.fixture
def bridge():
    """(grader endpoint, the solution's names decoded by it, the solution's channel)."""
    to_solution_read, to_solution_write = os.pipe()
    to_grader_read, to_grader_write = os.pipe()
    solution = Endpoint(Channel(to_solution_read, to_grader_write), serves_all=True)
    grader = Endpoint(Channel(to_grader_read, to_solution_write), serves_all=False)
    namespace: dict = {"__name__": "solution"}
    exec(SOLUTION, namespace)
    names = solution.encode({k: v for k, v in namespace.items() if not k.startswith("__")})
    thread = threading.Thread(target=solution.serve_forever, daemon=True)
    thread.start()
    yield grader, grader.decode(names), solution.channel
    os.close(to_solution_write)
    thread.join(timeout=10)
    for fd in (to_solution_read, to_grader_read, to_grader_write):
        os.close(fd)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**200),
        1.5,
        -0.0,
        math.inf,
        "é",
        b"\x00\xff",
        bytearray(b"ab"),
        [1, [2, (3, frozenset({4}))]],
        {(1, 2): {"a": {3}}},
        range(2, 9, 3),
        1 + 2j,
        pathlib.PurePosixPath("/a/b"),
        datetime.date(2020, 2, 29),
        datetime.datetime(2020, 1, 1, 12, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=5))),
        datetime.time(1, 2, 3),
        datetime.timedelta(days=-1, seconds=5),
        decimal.Decimal("1.10"),
        fractions.Fraction(3, 7),
        {"b": 1, "a": 2}.keys(),
        {"b": 1, "a": 2}.items(),
        deque([1, "x"]),
        SimpleNamespace(x=1, y=[2]),
    ],
)
def test_plain_values_cross_with_their_exact_type(bridge, value) -> None:
    grader, names, _ = bridge
    back = names["echo"](value)
    assert back == value and type(back) is type(value)
    if isinstance(value, type({}.keys())):
        assert list(back) == list(value)  # order kept, set semantics too


def test_nan_and_builtin_subclasses(bridge) -> None:
    grader, names, _ = bridge
    assert math.isnan(names["echo"](math.nan))
    ordered = names["echo"](OrderedDict(a=1))
    assert ordered == {"a": 1} and isinstance(ordered, dict)
    red = names["Color"].RED
    assert red == 1 and red.name == "RED" and red is names["Color"].RED
    point = names["Point"](1, 2)
    assert point == (1, 2) and point.x == 1 and names["echo"](point) is point
    assert names["echo"](Counter("aab")) == {"a": 2, "b": 1}


def test_proxies_equal_only_themselves(bridge) -> None:
    grader, names, _ = bridge
    anything = names["anything"]()
    assert isinstance(anything, Proxy)
    assert anything != 5 and not (anything == "x") and anything == anything
    assert anything != names["anything"]()
    with pytest.raises(TypeError):
        anything < 3  # noqa: B015
    assert 1 in anything and 7 not in anything  # iteration, not the solution's __contains__
    assert hash(anything) == object.__hash__(anything)


def test_exceptions_cross_as_builtins_or_mirrored_classes(bridge) -> None:
    grader, names, _ = bridge
    with pytest.raises(ValueError, match="bad input") as caught:
        names["parse"]("bad")
    assert isinstance(caught.value, names["ParseError"]) and caught.value.line == 3
    assert "in the solution's process" in caught.value.__notes__[0]
    with pytest.raises(KeyError):
        names["raising"]()
    try:
        names["parse"]("exit")
    except Exception:  # what a test's own handler would do
        pytest.fail("SystemExit from the solution must not be an Exception here")
    except RemoteBaseException as exc:
        assert "SystemExit" in str(exc)
    assert names["parse"]("41") + 1 == 42


def test_generators_iterate_in_chunks(bridge) -> None:
    grader, names, _ = bridge
    assert list(names["count"](200)) == [i * i for i in range(200)]
    assert sum(names["count"](4)) == 14


def test_callbacks_and_what_the_grader_will_not_share(bridge) -> None:
    grader, names, _ = bridge
    secret = 7
    assert names["call"](lambda v: v * secret, 6) == 42
    for name in ("__closure__", "__globals__", "__code__", "_private"):
        with pytest.raises(AttributeError):
            names["peek"](lambda: secret, name)

    # A test's failure inside a callback fails the test, whatever the solution does with it.
    def check() -> None:
        raise AssertionError("expected 3")

    with pytest.raises(AssertionError):
        names["swallow"](check)


def test_context_managers_cannot_swallow_the_tests_failures(bridge) -> None:
    grader, names, _ = bridge
    with pytest.raises(AssertionError):
        with names["suppressing"]():
            raise AssertionError("the test's own check")
    with names["suppressing"]():
        names["raising"]()  # the solution may suppress its own error


def test_in_place_changes_come_back(bridge) -> None:
    grader, names, _ = bridge
    items = [5]
    assert names["append"](items) is None and items == [5, 1]


def _frame(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack("!I", len(data)) + data


@pytest.mark.parametrize(
    "answer",
    [
        {"re": 999, "value": 1},  # an answer to a request that was not asked
        {"re": 1, "value": {"t": "builtin", "v": "eval"}},  # a callable builtin
        {"re": 1, "value": {"t": "nonsense"}},
        {"re": 1, "value": {"t": "dict", "v": [[{"t": "list", "v": []}, 1]]}},  # unhashable key
        {"re": 1, "value": {"t": "origin", "v": {"t": "ref", "v": 3}, "r": 2}},
    ],
)
def test_malformed_answers_break_the_bridge(answer) -> None:
    to_grader_read, to_grader_write = os.pipe()
    sink_read, sink_write = os.pipe()
    grader = Endpoint(Channel(to_grader_read, sink_write), serves_all=False)
    os.write(to_grader_write, _frame(answer))
    with pytest.raises(BridgeError):
        grader.request({"op": "getattr", "target": 1, "name": "x"})
    for fd in (to_grader_read, to_grader_write, sink_read, sink_write):
        os.close(fd)


def test_a_dead_or_silent_solution_breaks_the_bridge_for_good() -> None:
    to_grader_read, to_grader_write = os.pipe()
    sink_read, sink_write = os.pipe()
    grader = Endpoint(Channel(to_grader_read, sink_write), serves_all=False)
    grader.deadline = time.monotonic() + 0.5
    with pytest.raises(BridgeError, match="did not answer"):
        grader.request({"op": "getattr", "target": 1, "name": "x"})
    os.close(to_grader_write)  # the solution's end: gone
    with pytest.raises(BridgeError):
        grader.request({"op": "getattr", "target": 1, "name": "x"})
    assert grader.broken
    for fd in (to_grader_read, sink_read, sink_write):
        os.close(fd)
    # An oversized frame header is refused before reading the body.
    read, write = os.pipe()
    os.write(write, struct.pack("!I", 2**31))
    with pytest.raises(BridgeError, match="exceeds"):
        Channel(read, write).receive(None)
    os.close(read)
    os.close(write)
