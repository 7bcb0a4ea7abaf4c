"""Plain-data calls between a grader process and the process that runs untrusted code.

The grader holds the tests; the solution process holds the candidate code. They share no
memory, disk or environment, only two pipes. When a test calls the candidate's code, the call
crosses as a message; what comes back is decoded by the grader into exact builtin types
(``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``,
``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``range``, paths, named tuples), so every
comparison a test makes runs in the grader on values whose ``__eq__`` the candidate never wrote.
Anything else the candidate returns (its objects, classes, functions, modules) arrives as a
*proxy*: the grader may call it, read its attributes, iterate it, index it, print it or do
arithmetic with it, all answered by the solution process as plain data again, but a proxy is
never equal to anything but itself, cannot be ordered, and ``x in proxy`` iterates instead of
asking the candidate. So a test that compares the candidate's results against the test's own
values is decided by the grader alone; a test that only compares two of the candidate's
objects with each other cannot be decided fairly and fails.

Errors the candidate raises come back as the builtin exception of the same name, or as an
instance of a proxy class mirroring the candidate's exception class (its builtin base kept,
so ``pytest.raises(ValueError)`` and ``pytest.raises(pkg.ParseError)`` work).
:class:`BridgeError` (a ``BaseException``: ``except Exception`` in a test cannot swallow it)
marks anything the grader cannot trust: the solution died, broke the protocol, sent an
undecodable value or ran past its time budget.

The grader's own objects that a test hands to the candidate (callbacks, file objects, mocks)
travel the other way as proxies, and the grader serves only calls, public attributes and the
container protocol on them: never underscore names, so no ``__globals__`` or ``__closure__``.

This file is stdlib-only because the sandbox runs it as program text (see :func:`program`).
"""

from __future__ import annotations

import base64
import builtins
import collections
import datetime
import decimal
import fractions
import json
import operator
import os
import pathlib
import select
import signal
import struct
import sys
import time
import traceback
import types

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_ITEMS = 1_000_000  # elements of one encoded value
MAX_DEPTH = 100  # nesting of one encoded value
_SMALL_INT = 2**63  # larger ints travel as hex text (no decimal digit limit)
_ITER_CHUNK = 64  # items fetched per round trip when the grader iterates a proxy
_TRACEBACK_CHARS = 4000

# The grader never decodes a builtin it could be tricked into calling with the candidate's
# data (eval, exec, open, getattr ...): only classes cross by name.
_BUILTIN_CLASSES = {
    name: value
    for name, value in vars(builtins).items()
    if isinstance(value, type) and not name.startswith("_")
}
# Exceptions that stay what they are across the bridge (BaseException-only ones such as
# SystemExit become RemoteBaseException: a test cannot catch them with ``except Exception``).
_PORTABLE_EXCEPTIONS = {
    name: value
    for name, value in _BUILTIN_CLASSES.items()
    if issubclass(value, Exception) and value not in (StopIteration, StopAsyncIteration)
}

_BINARY_OPS = {
    name: getattr(operator, name)
    for name in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "lshift",
        "rshift",
        "and_",
        "or_",
        "xor",
        "matmul",
    )
}
_UNARY_OPS = {
    "len": len,
    "bool": bool,
    "str": str,
    "repr": repr,
    "iter": iter,
    "next": next,
    "index": operator.index,
    "int": int,
    "float": float,
    "abs": abs,
    "neg": operator.neg,
    "pos": operator.pos,
    "invert": operator.invert,
}
# What the grader serves on its own objects when the candidate holds them.
_GRADER_SERVED_OPS = {"len", "bool", "str", "repr", "iter", "next", "getitem"}


class BridgeError(BaseException):
    """The other process died, broke the protocol, or did not answer in time."""


class CallTimeout(BridgeError):
    """A call into the solution ran past its time budget."""


class RemoteBaseException(BaseException):
    """An exception of the other side that is not an ``Exception`` (``SystemExit`` ...)."""


class RemoteError(Exception):
    """An ``Exception`` of the other side whose class has no counterpart here."""


class _Unencodable(Exception):
    """Internal: a value that cannot travel by value (too deep, cyclic, too large)."""


# --------------------------------------------------------------------------------------------
# Framing


class Channel:
    """Length-prefixed JSON messages over a read and a write descriptor."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise _Unencodable(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        view = memoryview(_HEADER.pack(len(data)) + data)
        try:
            while view:
                view = view[os.write(self.write_fd, view) :]
        except OSError as exc:
            raise BridgeError(f"the other process is gone ({exc.strerror})") from None

    def receive(self, deadline: float | None) -> dict:
        (size,) = _HEADER.unpack(self._read_exactly(_HEADER.size, deadline))
        if size > MAX_MESSAGE_BYTES:
            raise BridgeError(f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
        payload = self._read_exactly(size, deadline)
        try:
            message = json.loads(payload)
        except (ValueError, RecursionError) as exc:
            raise BridgeError(f"malformed message: {exc!s:.200}") from None
        if not isinstance(message, dict):
            raise BridgeError("malformed message: not an object")
        return message

    def _read_exactly(self, size: int, deadline: float | None) -> bytes:
        data = bytearray()
        while len(data) < size:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self.read_fd], [], [], remaining)[0]:
                    raise CallTimeout("the solution did not answer in time")
            try:
                chunk = os.read(self.read_fd, min(size - len(data), 1 << 20))
            except InterruptedError:
                continue
            except OSError as exc:
                raise BridgeError(f"the other process is gone ({exc.strerror})") from None
            if not chunk:
                raise BridgeError("the solution's process ended (exit() or os._exit?)")
            data += chunk
        return bytes(data)


# --------------------------------------------------------------------------------------------
# Proxies of the other side's objects


class Proxy:
    """An object of the other process. Equal only to itself; see the module docstring."""

    def __getattr__(self, name: str):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        if name.startswith("_bridge"):
            raise AttributeError(name)
        endpoint, ident = _ref(self)
        return endpoint.request({"op": "getattr", "target": ident, "name": name})

    def __setattr__(self, name: str, value) -> None:
        endpoint, ident = _ref(self)
        endpoint.request(
            {"op": "setattr", "target": ident, "name": name, "value": endpoint.encode(value)}
        )

    def __delattr__(self, name: str) -> None:
        endpoint, ident = _ref(self)
        endpoint.request({"op": "delattr", "target": ident, "name": name})

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        endpoint, ident = _ref(self)
        return endpoint.call({"op": "call", "target": ident}, args, kwargs)

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    __hash__ = object.__hash__

    def __iter__(self):
        endpoint, ident = _ref(self)
        iterator = endpoint.request({"op": "unary", "name": "iter", "target": ident})
        return (
            _ChunkedIterator(endpoint, _ref(iterator)[1])
            if isinstance(iterator, Proxy)
            else iter(iterator)
        )

    def __next__(self):
        return self._bridge_unary("next")

    def __len__(self) -> int:
        return self._bridge_unary("len")

    def __bool__(self) -> bool:
        return self._bridge_unary("bool")

    def __str__(self) -> str:
        return self._bridge_unary("str")

    def __repr__(self) -> str:
        try:
            return self._bridge_unary("repr")
        except BaseException:  # repr must not fail (pytest's reports call it)
            return f"<proxy {type(self).__qualname__}>"

    def __format__(self, spec: str) -> str:
        endpoint, ident = _ref(self)
        return endpoint.request({"op": "format", "target": ident, "spec": spec})

    def __index__(self) -> int:
        return self._bridge_unary("index")

    def __int__(self) -> int:
        return self._bridge_unary("int")

    def __float__(self) -> float:
        return self._bridge_unary("float")

    def __abs__(self):
        return self._bridge_unary("abs")

    def __neg__(self):
        return self._bridge_unary("neg")

    def __pos__(self):
        return self._bridge_unary("pos")

    def __invert__(self):
        return self._bridge_unary("invert")

    def __getitem__(self, key):
        return self._bridge_item("getitem", key)

    def __setitem__(self, key, value) -> None:
        self._bridge_item("setitem", key, value)

    def __delitem__(self, key) -> None:
        self._bridge_item("delitem", key)

    def __enter__(self):
        endpoint, ident = _ref(self)
        return endpoint.request({"op": "enter", "target": ident})

    def __exit__(self, kind, value, trace):
        endpoint, ident = _ref(self)
        # The grader's exception never crosses: only whether there was one, and its builtin type.
        portable = _portable_name(kind) if value is not None else None
        message = {"op": "exit", "target": ident, "failed": value is not None, "kind": portable}
        suppress = bool(endpoint.request(message))
        # The candidate may swallow its own errors, never a failure the test raised.
        return suppress and getattr(value, "_bridge_origin", None) is endpoint

    def _bridge_unary(self, name: str):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        endpoint, ident = _ref(self)
        return endpoint.request({"op": "unary", "name": name, "target": ident})

    def _bridge_item(self, op: str, key, *value):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        endpoint, ident = _ref(self)
        message = {"op": op, "target": ident, "key": endpoint.encode(key)}
        if value:
            message["value"] = endpoint.encode(value[0])
        return endpoint.request(message)

    def _bridge_binary(self, name: str, other, reflected: bool):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        endpoint, ident = _ref(self)
        message = {"op": "binary", "name": name, "target": ident, "other": endpoint.encode(other)}
        message["reflected"] = reflected
        return endpoint.request(message)


def _binary(name: str, reflected: bool):
    def method(self, other):
        return self._bridge_binary(name, other, reflected)

    return method


for _name in _BINARY_OPS:
    _dunder = _name.rstrip("_")
    setattr(Proxy, f"__{_dunder}__", _binary(_name, False))
    setattr(Proxy, f"__r{_dunder}__", _binary(_name, True))


def _ref(proxy) -> tuple[Endpoint, int]:
    return object.__getattribute__(proxy, "_bridge_ref")


class ProxyClass(type):
    """The metaclass of proxies of the other side's classes: calling one constructs remotely,
    unknown class attributes are read remotely, and ``isinstance`` follows the mirrored bases."""

    def __call__(cls, *args, **kwargs):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        endpoint, ident = cls._bridge_class_ref
        return endpoint.call({"op": "call", "target": ident}, args, kwargs)

    def __getattr__(cls, name: str):
        if name.startswith("_bridge") or name.startswith("__"):
            raise AttributeError(name)
        endpoint, ident = cls._bridge_class_ref
        return endpoint.request({"op": "getattr", "target": ident, "name": name})

    def __setattr__(cls, name: str, value) -> None:
        if name.startswith("_bridge"):
            type.__setattr__(cls, name, value)
            return
        endpoint, ident = cls._bridge_class_ref
        endpoint.request(
            {"op": "setattr", "target": ident, "name": name, "value": endpoint.encode(value)}
        )

    def __iter__(cls):
        endpoint, ident = cls._bridge_class_ref
        iterator = endpoint.request({"op": "unary", "name": "iter", "target": ident})
        return _ChunkedIterator(endpoint, _ref(iterator)[1])

    def __len__(cls) -> int:
        endpoint, ident = cls._bridge_class_ref
        return endpoint.request({"op": "unary", "name": "len", "target": ident})

    def __getitem__(cls, key):
        endpoint, ident = cls._bridge_class_ref
        return endpoint.request({"op": "getitem", "target": ident, "key": endpoint.encode(key)})

    def __repr__(cls) -> str:
        return f"<proxy class {cls.__module__}.{cls.__qualname__}>"


class ProxyModule(types.ModuleType):
    """A module of the other process: attributes are read (and set) remotely."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name not in ("__all__", "__version__", "__file__"):
            raise AttributeError(name)
        endpoint = self.__dict__["_bridge_endpoint"]
        try:
            return endpoint.request({"op": "modattr", "module": self.__name__, "name": name})
        except AttributeError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None

    def __setattr__(self, name: str, value) -> None:
        endpoint = self.__dict__["_bridge_endpoint"]
        # Dunders, and the import system binding an imported submodule to its parent, stay here.
        submodule = (
            isinstance(value, ProxyModule) and value.__dict__["_bridge_endpoint"] is endpoint
        )
        if name.startswith("__") or name.startswith("_bridge") or submodule:
            super().__setattr__(name, value)
            return
        endpoint.request(
            {
                "op": "setmodattr",
                "module": self.__name__,
                "name": name,
                "value": endpoint.encode(value),
            }
        )

    def __delattr__(self, name: str) -> None:
        endpoint = self.__dict__["_bridge_endpoint"]
        endpoint.request({"op": "delmodattr", "module": self.__name__, "name": name})


class _Origin:
    """Mixin of decoded builtin-subclass values: the value behaves as its builtin (its
    ``__eq__`` is the builtin's, run here), attributes it lacks are read remotely."""

    def __getattr__(self, name: str):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        if name.startswith("_bridge") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        endpoint, ident = object.__getattribute__(self, "_bridge_ref")
        return endpoint.request({"op": "getattr", "target": ident, "name": name})


_ORIGIN_BASES = (str, int, float, list, dict, set, frozenset, tuple)
_IMMUTABLE_BASES = (str, int, float, frozenset, tuple)
_ORIGIN_CLASSES: dict[type, type] = {}


class _ChunkedIterator:
    """Iterates a proxy iterator a chunk of items per round trip."""

    def __init__(self, endpoint: Endpoint, ident: int) -> None:
        self._endpoint, self._ident = endpoint, ident
        self._items: collections.deque = collections.deque()
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if not self._items and not self._done:
            chunk = self._endpoint.request({"op": "iterchunk", "target": self._ident})
            if not isinstance(chunk, list) or len(chunk) != 2 or not isinstance(chunk[1], bool):
                raise BridgeError("malformed iteration chunk")
            items, self._done = chunk
            if not isinstance(items, list):
                raise BridgeError("malformed iteration chunk")
            self._items.extend(items)
        if self._items:
            return self._items.popleft()
        raise StopIteration


class _ProxyMethod:
    """``proxy.name`` where the remote attribute is a bound method: one round trip per call."""

    def __init__(self, endpoint: Endpoint, ident: int, name: str) -> None:
        self._endpoint, self._ident, self._name = endpoint, ident, name

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        message = {"op": "callmethod", "target": self._ident, "name": self._name}
        return self._endpoint.call(message, args, kwargs)

    def __repr__(self) -> str:
        return f"<proxy method {self._name}>"


# --------------------------------------------------------------------------------------------
# The endpoint: encoding, requests, serving


class Endpoint:
    """One side of the bridge.

    Args:
        channel: the pipes to the other process.
        serves_all: True in the solution's process (it answers every request on its objects and
            runs each under the request's time budget); False in the grader, which answers only
            calls, public attributes and the container protocol on objects it handed over,
            decodes builtins by name only when they are classes, and re-raises in the test a
            test failure raised inside a callback the candidate called.

    Attributes (grader side):
        deadline: absolute ``time.monotonic()`` cap of everything (the grader's budget).
        call_deadline: the current test's cap; each request tells the solution how much of the
            nearer cap is left, and the grader waits ``GRACE_S`` longer for its answer before
            it declares the bridge broken.
        broken: why the bridge can no longer be trusted (then every request raises).
    """

    GRACE_S = 1.0

    def __init__(self, channel: Channel, *, serves_all: bool) -> None:
        self.channel = channel
        self.serves_all = serves_all
        self.deadline: float | None = None
        self.call_deadline: float | None = None
        self.broken: str | None = None
        # A test's failure raised inside a callback the candidate called: re-raised in the test.
        self.pending_failure: BaseException | None = None
        self._exports: dict[int, object] = {}
        self._export_ids: dict[int, int] = {}
        self._imports: dict[int, object] = {}
        self._classes: dict[int, type] = {}
        self._sent_classes: set[int] = set()
        self._next_request = 0
        self.modules: dict[str, ProxyModule] = {}

    # ---------------------------------------------------------------- exports and imports

    def export(self, value) -> int:
        key = id(value)
        ident = self._export_ids.get(key)
        if ident is None or self._exports.get(ident) is not value:
            ident = len(self._exports) + 1
            self._exports[ident] = value
            self._export_ids[key] = ident
        return ident

    def _exported(self, ident) -> object:
        if type(ident) is not int or ident not in self._exports:
            raise BridgeError(f"unknown object id {ident!r}")
        return self._exports[ident]

    # ---------------------------------------------------------------- encoding

    def encode(self, value) -> object:
        """``value`` as JSON-able data: by value when it is plain, else as a reference."""
        budget = [MAX_ITEMS]
        try:
            return self._encode(value, 0, set(), budget)
        except _Unencodable:
            return self._encode_ref(value)

    def _encode(self, value, depth: int, active: set, budget: list) -> object:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unencodable("too many items")
        kind = type(value)
        if value is None or kind is bool or kind is str or kind is float:
            return value
        if kind is int:
            return value if -_SMALL_INT < value < _SMALL_INT else {"t": "int", "v": hex(value)}
        if isinstance(value, _Origin) and not self.serves_all:
            endpoint, ident = object.__getattribute__(value, "_bridge_ref")
            if endpoint is self and isinstance(value, _IMMUTABLE_BASES):
                return {"t": "yours", "v": ident}  # the solution gets its own object back
        if depth > MAX_DEPTH:
            raise _Unencodable("too deep")
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            if id(value) in active:
                raise _Unencodable("cyclic")
            active.add(id(value))
            try:
                return self._with_origin(
                    value, self._encode_container(value, depth, active, budget)
                )
            finally:
                active.discard(id(value))
        if kind is bytes or kind is bytearray:
            return {"t": kind.__name__, "v": base64.b64encode(value).decode()}
        # Subclasses of builtins (StrEnum, IntEnum ...) by their value, and their own object
        # for attribute access (see _Origin).
        if isinstance(value, str):
            return self._with_origin(value, str.__str__(value))
        if isinstance(value, int) and not isinstance(value, bool):
            return self._with_origin(
                value, self._encode(int.__index__(value), depth, active, budget)
            )
        if isinstance(value, float):
            return self._with_origin(value, float.__float__(value))
        if kind is complex:
            return {"t": "complex", "v": [value.real, value.imag]}
        if kind is range:
            return {"t": "range", "v": [value.start, value.stop, value.step]}
        if kind in _TEMPORAL:
            return self._encode_temporal(value, depth, active, budget)
        if kind is decimal.Decimal:
            return {"t": "decimal", "v": str(value)}
        if kind in _CONTAINER_LIKE:  # by value, rebuilt as the same type on the other side
            if id(value) in active:
                raise _Unencodable("cyclic")
            active.add(id(value))
            try:
                items = value.__dict__.items() if kind is types.SimpleNamespace else value
                inner = [self._encode(item, depth + 1, active, budget) for item in items]
            finally:
                active.discard(id(value))
            return {"t": _CONTAINER_LIKE[kind], "v": inner}
        if kind is fractions.Fraction:
            return {
                "t": "fraction",
                "v": [
                    self._encode(value.numerator, depth, active, budget),
                    self._encode(value.denominator, depth, active, budget),
                ],
            }
        if isinstance(value, pathlib.PurePath):
            return {"t": "path", "v": str(value)}
        if isinstance(value, type) and _BUILTIN_CLASSES.get(value.__name__) is value:
            return {"t": "builtin", "v": value.__name__}
        if not self.serves_all and isinstance(value, types.BuiltinFunctionType):
            if getattr(builtins, value.__name__, None) is value:
                return {"t": "builtin", "v": value.__name__}  # the grader's len, sorted ...
        if isinstance(value, ProxyModule) and value.__dict__["_bridge_endpoint"] is self:
            return {"t": "module", "v": value.__name__}  # the solution's own module
        if isinstance(value, types.ModuleType) and self.serves_all:
            return {"t": "module", "v": value.__name__}
        return self._encode_ref(value)

    def _with_origin(self, value, encoded: object) -> object:
        """A builtin subclass's value, plus (solution side) a reference to the object itself."""
        if not self.serves_all or type(value) in (
            list,
            tuple,
            dict,
            set,
            frozenset,
            str,
            int,
            float,
        ):
            return encoded
        return {"t": "origin", "v": encoded, "r": self.export(value)}

    def _encode_temporal(self, value, depth: int, active: set, budget: list) -> object:
        """Dates, times and durations by their fields; a time zone by its fixed UTC offset."""
        if type(value) is datetime.timedelta:
            return {"t": "timedelta", "v": [value.days, value.seconds, value.microseconds]}
        if type(value) is datetime.date:
            return {"t": "date", "v": [value.year, value.month, value.day]}
        offset = value.utcoffset() if type(value) is datetime.datetime else None
        if type(value) is datetime.time and value.tzinfo is not None:
            offset = value.tzinfo.utcoffset(None)
        fields = [value.hour, value.minute, value.second, value.microsecond, value.fold]
        if type(value) is datetime.datetime:
            fields = [value.year, value.month, value.day, *fields]
        zone = None if offset is None else self._encode(offset, depth + 1, active, budget)
        return {"t": type(value).__name__, "v": fields, "z": zone}

    def _encode_container(self, value, depth: int, active: set, budget: list) -> object:
        def items(iterable):
            return [self._encode(item, depth + 1, active, budget) for item in iterable]

        if isinstance(value, dict):
            pairs = [
                [
                    self._encode(k, depth + 1, active, budget),
                    self._encode(v, depth + 1, active, budget),
                ]
                for k, v in dict.items(value)
            ]
            return {"t": "dict", "v": pairs}
        if isinstance(value, list):
            return {"t": "list", "v": items(list.copy(value))}
        if isinstance(value, tuple):
            fields = getattr(type(value), "_fields", None)
            plain = tuple.__getitem__(value, slice(None))
            if type(value) is not tuple and isinstance(fields, tuple) and len(fields) == len(plain):
                if all(type(f) is str and f.isidentifier() for f in fields):
                    name = type(value).__name__
                    return {"t": "ntuple", "n": str(name), "f": list(fields), "v": items(plain)}
            return {"t": "tuple", "v": items(plain)}
        if isinstance(value, frozenset):
            return {"t": "frozenset", "v": items(frozenset.copy(value))}
        return {"t": "set", "v": items(set.copy(value))}

    def _encode_ref(self, value) -> object:
        if isinstance(value, Proxy):
            endpoint, ident = _ref(value)
            if endpoint is self:
                return {"t": "yours", "v": ident}
        if isinstance(value, ProxyClass) and value._bridge_class_ref[0] is self:
            return {"t": "yours", "v": value._bridge_class_ref[1]}
        if isinstance(value, type):
            return {"t": "class", "v": self._describe_class(value)}
        if self.serves_all and _is_bound_method(value):  # no new object per method lookup
            return {"t": "method", "v": self.export(value.__self__), "n": value.__name__}
        message = {"t": "ref", "v": self.export(value)}
        if self.serves_all:  # the grader mirrors the candidate's classes for isinstance
            message["c"] = self._describe_class(type(value))
        return message

    def _describe_class(self, cls: type) -> object:
        if _BUILTIN_CLASSES.get(cls.__name__) is cls:
            return {"builtin": cls.__name__}
        ident = self.export(cls)
        if ident in self._sent_classes:
            return {"id": ident}
        self._sent_classes.add(ident)
        bases = [
            self._describe_class(base)
            for base in cls.__bases__
            if _BUILTIN_CLASSES.get(base.__name__) is not base
        ]
        portable = _portable_name(cls)
        return {
            "id": ident,
            "name": str(getattr(cls, "__name__", "?")),
            "qualname": str(getattr(cls, "__qualname__", "?")),
            "module": str(getattr(cls, "__module__", "?")),
            "bases": bases,
            "exception": portable,
            "base_exception": issubclass(cls, BaseException),
        }

    # ---------------------------------------------------------------- decoding

    def decode(self, data, depth: int = 0) -> object:
        """The value ``data`` encodes; BridgeError for anything malformed."""
        if depth > MAX_DEPTH + 2:
            raise BridgeError("value nested too deeply")
        if data is None or type(data) in (bool, int, float, str):
            return data
        if type(data) is not dict or type(data.get("t")) is not str:
            raise BridgeError(f"malformed value of type {type(data).__name__}")
        tag, value = data["t"], data.get("v")
        try:
            return self._decode_tagged(tag, value, data, depth)
        except BridgeError:
            raise
        except Exception as exc:  # any inconsistency (unhashable key, bad base64 ...)
            raise BridgeError(f"malformed {tag!r} value: {exc!s:.200}") from None

    def _decode_tagged(self, tag: str, value, data: dict, depth: int) -> object:
        def items():
            if type(value) is not list:
                raise BridgeError(f"malformed {tag!r} value")
            return [self.decode(item, depth + 1) for item in value]

        if tag == "list":
            return items()
        if tag == "tuple":
            return tuple(items())
        if tag == "set":
            return set(items())
        if tag == "frozenset":
            return frozenset(items())
        if tag == "dict":
            if type(value) is not list or not all(type(p) is list and len(p) == 2 for p in value):
                raise BridgeError("malformed dict")
            return {self.decode(k, depth + 1): self.decode(v, depth + 1) for k, v in value}
        if tag == "ntuple":
            return _namedtuple(data.get("n"), tuple(data.get("f") or ()))(*items())
        if tag == "origin" and not self.serves_all and type(data.get("r")) is int:
            return self._decode_origin(value, data["r"], depth)
        if tag == "int" and type(value) is str:
            return int(value, 16)
        if tag in ("bytes", "bytearray") and type(value) is str:
            raw = base64.b64decode(value.encode(), validate=True)
            return raw if tag == "bytes" else bytearray(raw)
        if tag == "complex" and type(value) is list and len(value) == 2:
            return complex(*(float(part) for part in value))
        if tag == "range" and type(value) is list and all(type(v) is int for v in value):
            return range(*value)
        if tag in ("date", "datetime", "time") and type(value) is list:
            if not all(type(part) is int for part in value):
                raise BridgeError(f"malformed {tag}")
            zone = data.get("z")
            tzinfo = None
            if zone is not None:
                offset = self.decode(zone, depth + 1)
                if type(offset) is not datetime.timedelta:
                    raise BridgeError(f"malformed {tag} time zone")
                tzinfo = datetime.timezone(offset)
            if tag == "date":
                return datetime.date(*value)
            *fields, fold = value
            cls = datetime.datetime if tag == "datetime" else datetime.time
            return cls(*fields, tzinfo=tzinfo, fold=fold)
        if tag == "timedelta" and type(value) is list and all(type(v) is int for v in value):
            return datetime.timedelta(*value)
        if tag == "decimal" and type(value) is str:
            return decimal.Decimal(value)
        if tag in _CONTAINER_TAGS:
            return _CONTAINER_TAGS[tag](items())
        if tag == "fraction" and type(value) is list and len(value) == 2:
            numerator, denominator = (self.decode(v, depth + 1) for v in value)
            if type(numerator) is not int or type(denominator) is not int:
                raise BridgeError("malformed fraction")
            return fractions.Fraction(numerator, denominator)
        if tag == "path" and type(value) is str:
            return pathlib.PurePosixPath(value) if not self.serves_all else pathlib.Path(value)
        if tag == "builtin" and type(value) is str:
            if self.serves_all and hasattr(builtins, value):
                return getattr(builtins, value)
            if value in _BUILTIN_CLASSES:
                return _BUILTIN_CLASSES[value]
            raise BridgeError(f"builtin {value!r} may not cross the bridge")
        if tag == "yours":
            return self._exported(value)
        if tag == "module" and type(value) is str:
            if not self.serves_all:
                return self.module(value)
            if value in sys.modules:
                return sys.modules[value]
            raise BridgeError(f"module {value!r} is not imported here")
        if tag == "ref" and type(value) is int:
            return self._proxy(value, data.get("c"))
        if tag == "method" and type(value) is int and type(data.get("n")) is str:
            return _ProxyMethod(self, value, data["n"])
        if tag == "class":
            return self._proxy_class(value)
        raise BridgeError(f"unknown value tag {tag!r}")

    def _decode_origin(self, value, ident: int, depth: int) -> object:
        """A value of a builtin subclass: the value (compared as the builtin it is) whose other
        attributes are read from the solution's object (e.g. an IntEnum's ``name``)."""
        if ident in self._imports:
            return self._imports[ident]
        plain = self.decode(value, depth + 1)
        base = type(plain)
        if base not in _ORIGIN_CLASSES:
            if not (base in _ORIGIN_BASES or issubclass(base, tuple)):
                raise BridgeError(f"an origin value of type {base.__name__}")
            _ORIGIN_CLASSES[base] = type(f"Remote{base.__name__}", (_Origin, base), {})
        cls = _ORIGIN_CLASSES[base]
        result = cls(*plain) if hasattr(base, "_fields") else cls(plain)
        object.__setattr__(result, "_bridge_ref", (self, ident))
        if isinstance(result, _IMMUTABLE_BASES):
            self._imports[ident] = result
        return result

    def _proxy(self, ident: int, class_description) -> object:
        if ident not in self._imports:
            cls = self._proxy_class(class_description) if class_description else Proxy
            if not issubclass(cls, Proxy):
                raise BridgeError("a reference's class is not a proxy class")
            proxy = object.__new__(cls) if not issubclass(cls, BaseException) else cls.__new__(cls)
            object.__setattr__(proxy, "_bridge_ref", (self, ident))
            self._imports[ident] = proxy
        return self._imports[ident]

    def _proxy_class(self, description) -> type:
        if type(description) is not dict:
            raise BridgeError("malformed class description")
        if "builtin" in description:
            name = description["builtin"]
            if name not in _BUILTIN_CLASSES:
                raise BridgeError(f"unknown builtin class {name!r}")
            return _BUILTIN_CLASSES[name]
        ident = description.get("id")
        if type(ident) is not int:
            raise BridgeError("malformed class description")
        if ident in self._classes:
            return self._classes[ident]
        if "name" not in description:
            raise BridgeError(f"class {ident} described by id before its description")
        bases = [self._proxy_class(base) for base in description.get("bases") or []]
        bases = [base for base in bases if isinstance(base, ProxyClass)] or [Proxy]
        portable = _PORTABLE_EXCEPTIONS.get(description.get("exception") or "")
        if portable is None and description.get("base_exception"):
            portable = RemoteBaseException
        if portable is not None and not any(issubclass(b, portable) for b in bases):
            bases.append(portable)
        namespace = {
            "__module__": str(description.get("module")),
            "__qualname__": str(description.get("qualname")),
        }
        if portable is not None:  # exceptions print their remote message, not a proxy's str()
            namespace.update(__str__=_exception_str, __repr__=_exception_repr)
        name = str(description.get("name"))
        try:
            cls = ProxyClass(name, tuple(bases), namespace)
        except TypeError:  # incompatible mirrored bases: keep only the exception base
            fallback = (Proxy, portable) if portable is not None else (Proxy,)
            cls = ProxyClass(name, fallback, namespace)
        cls._bridge_class_ref = (self, ident)
        self._classes[ident] = cls
        return cls

    # ---------------------------------------------------------------- modules

    def module(self, name: str) -> ProxyModule:
        """The proxy of the solution's module ``name`` (imported there on first use)."""
        if name not in self.modules:
            info = self.request({"op": "import", "name": name})
            if not isinstance(info, dict) or type(info.get("package")) is not bool:
                raise BridgeError(f"malformed import answer for {name!r}")
            module = ProxyModule(name)
            module.__dict__["_bridge_endpoint"] = self
            if info["package"]:
                module.__dict__["__path__"] = []
            names = info.get("all")
            if isinstance(names, list) and all(type(n) is str for n in names):
                module.__dict__["__all__"] = names
            self.modules[name] = module
        return self.modules[name]

    # ---------------------------------------------------------------- requests

    def call(self, message: dict, args, kwargs) -> object:
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        message["args"] = [self.encode(arg) for arg in args]
        message["kwargs"] = [[str(k), self.encode(v)] for k, v in kwargs.items()]
        answer = self._exchange(message)
        mutated = answer.get("mutated") or []
        if type(mutated) is not list:
            raise BridgeError("malformed answer")
        for change in mutated:
            if type(change) is not list or len(change) != 2:
                raise BridgeError("malformed answer")
            position, new_state = change
            if type(position) is int and 0 <= position < len(args):
                target = args[position]
            elif type(position) is str and position in kwargs:
                target = kwargs[position]
            else:
                raise BridgeError("an answer changed an argument that does not exist")
            _sync_in_place(target, self.decode(new_state))
        return self._result(answer)

    def request(self, message: dict) -> object:
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        return self._result(self._exchange(message))

    def _exchange(self, message: dict) -> dict:
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        if self.broken:
            raise BridgeError(self.broken)
        self._next_request += 1
        ident = message["id"] = self._next_request
        limit = self.limit()
        if limit is not None:
            message["budget"] = max(limit - time.monotonic(), 0.001)
        try:
            self.channel.send(message)
            while True:
                incoming = self.channel.receive(limit + self.GRACE_S if limit else None)
                if "re" in incoming:
                    if incoming["re"] != ident:
                        raise BridgeError("answer to a request that was not asked")
                    if self.pending_failure is not None:
                        failure, self.pending_failure = self.pending_failure, None
                        raise failure
                    return incoming
                self.serve(incoming)
        except CallTimeout as exc:
            self.broken = str(exc)
            raise
        except BridgeError as exc:
            self.broken = str(exc)
            raise
        except _Unencodable as exc:
            raise TypeError(f"cannot send the value: {exc}") from None

    def limit(self) -> float | None:
        """The nearer of ``deadline`` and ``call_deadline`` (None: no limit)."""
        limits = [limit for limit in (self.deadline, self.call_deadline) if limit is not None]
        return min(limits) if limits else None

    def _result(self, answer: dict) -> object:
        __tracebackhide__ = True  # pytest reports show the test, not the bridge
        if "error" in answer:
            raise self._decode_error(answer["error"])
        return self.decode(answer.get("value"))

    def _decode_error(self, error) -> BaseException:
        if type(error) is not dict:
            return BridgeError("malformed error answer")
        if error.get("timeout"):
            return CallTimeout("the call ran past its time budget")
        message = str(error.get("message", ""))[:_TRACEBACK_CHARS]
        name = str(error.get("name", "Exception"))
        try:
            args = tuple(self.decode(error.get("args") or {"t": "tuple", "v": []}))
        except BridgeError:
            args = (message,)
        description = error.get("class")
        if error.get("stop") and name == "StopIteration":
            return StopIteration(*args)
        if name in _PORTABLE_EXCEPTIONS and description == {"builtin": name}:
            try:
                exc = _PORTABLE_EXCEPTIONS[name](*args)
            except Exception:
                exc = _PORTABLE_EXCEPTIONS[name](message)
        elif type(description) is dict and "builtin" not in description:
            try:
                cls = self._proxy_class(description)
                if not issubclass(cls, BaseException) or type(error.get("ref")) is not int:
                    raise TypeError("not an exception")
                exc = cls.__new__(cls)
                _ARGS.__set__(exc, args)
                object.__setattr__(exc, "_bridge_ref", (self, error["ref"]))
                object.__setattr__(exc, "_bridge_message", message)
            except (BridgeError, TypeError, ValueError):
                exc = RemoteError(f"{name}: {message}")
        elif name in _BUILTIN_CLASSES and not issubclass(_BUILTIN_CLASSES[name], Exception):
            exc = RemoteBaseException(f"{name}: {message}")
        else:
            exc = RemoteError(f"{name}: {message}")
        object.__setattr__(exc, "_bridge_origin", self)
        trace = error.get("traceback")
        if isinstance(trace, str) and trace:
            notes = ["in the solution's process:\n" + trace[-_TRACEBACK_CHARS:]]
            object.__setattr__(exc, "__notes__", notes)
        return exc

    # ---------------------------------------------------------------- serving

    def serve(self, message: dict) -> None:
        """Answer one request of the other side (never raises for what the request does)."""
        ident = message.get("id")
        if type(ident) is not int or type(message.get("op")) is not str:
            raise BridgeError("malformed request")
        mutated: list = []
        try:
            value = self._perform(message, mutated)
            answer = {"re": ident, "value": self.encode(value)}
            if mutated:
                answer["mutated"] = mutated
        except BridgeError:
            raise
        except BaseException as exc:  # the request's own failure, reported to the requester
            if not self.serves_all and self.pending_failure is None:
                if isinstance(exc, AssertionError) or not isinstance(exc, Exception):
                    self.pending_failure = exc
            answer = {"re": ident, "error": self._encode_error(exc, message["op"])}
        try:
            self.channel.send(answer)
        except _Unencodable as exc:
            error = self._encode_error(TypeError(f"cannot send the value: {exc}"), "")
            self.channel.send({"re": ident, "error": error})

    def _perform(self, message: dict, mutated: list) -> object:
        op = message["op"]
        if op == "import" and self.serves_all:
            name = message.get("name")
            if type(name) is not str:
                raise TypeError("bad module name")
            import importlib

            module = importlib.import_module(name)
            names = getattr(module, "__all__", None)
            if names is None:
                names = [n for n in vars(module) if not n.startswith("_")]
            return {"package": hasattr(module, "__path__"), "all": [str(n) for n in names]}
        if op in _MODULE_OPS and self.serves_all:
            module = sys.modules.get(message.get("module"))
            if module is None:
                raise ImportError(f"module {message.get('module')!r} is not imported")
            return self._attribute(_MODULE_OPS[op], module, message)
        target = self._exported(message.get("target"))
        if op in ("getattr", "setattr", "delattr"):
            return self._attribute(op, target, message)
        if op == "call":
            return self._invoke(target, message, mutated)
        if op == "callmethod":
            name = self._name(message)
            return self._invoke(getattr(target, name), message, mutated)
        if op == "unary":
            name = message.get("name")
            if name not in _UNARY_OPS or (not self.serves_all and name not in _GRADER_SERVED_OPS):
                raise TypeError(f"unsupported operation {name!r}")
            return self._with_budget(message, _UNARY_OPS[name], target)
        if op == "iterchunk":
            return self._with_budget(message, _chunk, target)
        if op in ("getitem", "setitem", "delitem"):
            if not self.serves_all and op != "getitem":
                raise TypeError(f"unsupported operation {op!r}")
            key = self.decode(message.get("key"))
            if op == "getitem":
                return self._with_budget(message, operator.getitem, target, key)
            if op == "setitem":
                value = self.decode(message.get("value"))
                return self._with_budget(message, operator.setitem, target, key, value)
            return self._with_budget(message, operator.delitem, target, key)
        if not self.serves_all:
            raise TypeError(f"unsupported operation {op!r}")
        if op == "binary":
            function = _BINARY_OPS.get(message.get("name"))
            if function is None:
                raise TypeError("unsupported operator")
            other = self.decode(message.get("other"))
            operands = (other, target) if message.get("reflected") else (target, other)
            return self._with_budget(message, function, *operands)
        if op == "format":
            return self._with_budget(message, format, target, str(message.get("spec", "")))
        if op == "enter":
            return self._with_budget(message, lambda: target.__enter__())
        if op == "exit":
            kind = _PORTABLE_EXCEPTIONS.get(message.get("kind") or "", Exception)
            value = kind("raised in the grader") if message.get("failed") else None
            kind = type(value) if value is not None else None
            return self._with_budget(message, lambda: target.__exit__(kind, value, None))
        raise TypeError(f"unknown operation {op!r}")

    def _attribute(self, op: str, target, message: dict) -> object:
        name = self._name(message)
        if op == "getattr":
            return getattr(target, name)
        if not self.serves_all:
            raise TypeError(f"the grader's objects are read-only ({op})")
        if op == "setattr":
            return setattr(target, name, self.decode(message.get("value")))
        return delattr(target, name)

    def _name(self, message: dict) -> str:
        name = message.get("name")
        if type(name) is not str or not name.isidentifier():
            raise AttributeError(f"bad attribute name {name!r}")
        if not self.serves_all and name.startswith("_"):
            raise AttributeError(f"the grader does not share {name!r}")
        return name

    def _invoke(self, function, message: dict, mutated: list) -> object:
        if not callable(function):
            raise TypeError(f"{type(function).__name__!r} object is not callable")
        args = [self.decode(arg) for arg in message.get("args") or []]
        pairs = message.get("kwargs") or []
        if not all(type(p) is list and len(p) == 2 and type(p[0]) is str for p in pairs):
            raise BridgeError("malformed keyword arguments")
        kwargs = {key: self.decode(value) for key, value in pairs}
        before = [(i, message["args"][i]) for i, a in enumerate(args) if _mutable(a)]
        before += [(k, v) for k, v in pairs if _mutable(kwargs[k])]
        result = self._with_budget(message, function, *args, **kwargs)
        for position, original in before:
            current = self.encode(args[position] if type(position) is int else kwargs[position])
            if current != original:
                mutated.append([position, current])
        return result

    def _with_budget(self, message: dict, function, *args, **kwargs) -> object:
        """Run ``function`` under the request's time budget (solution side only)."""
        budget = message.get("budget")
        if not self.serves_all or type(budget) not in (int, float) or budget <= 0:
            return function(*args, **kwargs)
        if signal.getitimer(signal.ITIMER_REAL)[0] > 0:  # a nested request: the outer one rules
            return function(*args, **kwargs)
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, budget)
        try:
            return function(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _encode_error(self, exc: BaseException, op: str) -> dict:
        if isinstance(exc, _BudgetExceeded):
            return {"timeout": True}
        cls = type(exc)
        if not self.serves_all:  # the grader says only which builtin failed, never its message
            name = _portable_name(cls) or "Exception"
            return {"name": name, "class": {"builtin": name}, "message": ""}
        described = self._describe_class(cls)
        try:
            args = self.encode(tuple(exc.args))
        except Exception:
            args = None
        error = {
            "name": cls.__name__,
            "class": described,
            "message": _safe_str(exc),
            "args": args,
            "ref": self.export(exc),
            "stop": isinstance(exc, StopIteration) and op in ("unary", "iterchunk"),
        }
        if self.serves_all:
            error["traceback"] = _traceback_text(exc)
        return error

    def serve_forever(self) -> None:
        """Answer requests until the other side closes the channel (solution side)."""
        while True:
            try:
                message = self.channel.receive(None)
            except BridgeError:
                return
            self.serve(message)


class _BudgetExceeded(BaseException):
    """Raised by SIGALRM in the solution when a request's time budget is spent."""


def _on_alarm(signum, frame):
    raise _BudgetExceeded()


_TEMPORAL = (datetime.date, datetime.datetime, datetime.time, datetime.timedelta)
# Standard containers that compare by value, by their tag; decoding rebuilds the exact type
# (dict views on a fresh dict, so that keys and items still compare as sets).
_CONTAINER_LIKE = {
    type({}.keys()): "dict_keys",
    type({}.values()): "dict_values",
    type({}.items()): "dict_items",
    collections.deque: "deque",
    types.SimpleNamespace: "namespace",
}
_CONTAINER_TAGS = {
    "dict_keys": lambda items: dict.fromkeys(items).keys(),
    "dict_values": lambda items: dict(enumerate(items)).values(),
    "dict_items": lambda items: dict(_pairs(items)).items(),
    "deque": collections.deque,
    "namespace": lambda items: types.SimpleNamespace(
        **{key: value for key, value in _pairs(items) if type(key) is str}
    ),
}


def _pairs(items: list) -> list:
    if not all(type(item) is tuple and len(item) == 2 for item in items):
        raise BridgeError("malformed pairs")
    return items


_MODULE_OPS = {"modattr": "getattr", "setmodattr": "setattr", "delmodattr": "delattr"}
_ARGS = BaseException.__dict__["args"]


def _portable_name(cls) -> str | None:
    """The name of the first builtin Exception class in ``cls``'s MRO."""
    for base in getattr(cls, "__mro__", ()):
        if _PORTABLE_EXCEPTIONS.get(base.__name__) is base:
            return base.__name__
    return None


def _chunk(iterator) -> list:
    items = []
    for _ in range(_ITER_CHUNK):
        try:
            items.append(next(iterator))
        except StopIteration:
            return [items, True]
    return [items, False]


def _is_bound_method(value) -> bool:
    return isinstance(value, types.MethodType) and not isinstance(value.__self__, type)


def _mutable(value) -> bool:
    return type(value) in (list, dict, set, bytearray)


def _sync_in_place(target, new_state) -> None:
    """Mirror the callee's in-place change of an argument (lists, dicts, sets, bytearrays)."""
    if not _mutable(target) or type(target) is not type(new_state):
        raise BridgeError("an argument came back as another type")
    if type(target) in (list, bytearray):
        target[:] = new_state
    else:
        target.clear()
        target.update(new_state)


def _traceback_text(exc: BaseException) -> str:
    """The exception's traceback without the bridge's and the harness's own frames."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if frame.filename not in ("bridge.py", "harness.py")
    ]
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
    text += "".join(traceback.format_exception_only(type(exc), exc))
    return text[-_TRACEBACK_CHARS:]


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)[:_TRACEBACK_CHARS]
    except BaseException:
        return f"<{type(exc).__name__}>"


def _exception_str(self) -> str:
    return object.__getattribute__(self, "_bridge_message")


def _exception_repr(self) -> str:
    return f"{type(self).__name__}({_exception_str(self)!r})"


_NAMEDTUPLES: dict = {}


def _namedtuple(name, fields: tuple) -> type:
    if type(name) is not str or not name.isidentifier():
        raise BridgeError("malformed named tuple")
    key = (name, fields)
    if key not in _NAMEDTUPLES:
        _NAMEDTUPLES[key] = collections.namedtuple(name, fields)
    return _NAMEDTUPLES[key]
