"""The leak check: is a task's deleted code anywhere its sandbox can read?

A feature-deletion task is only a task while the deleted code cannot be copied back: Composer
2.5's reward was hacked by recovering deleted code from leftovers, and a host with a vendored
SDK, a pip cache or a system Python holds copies of popular packages. This module searches
everything a task's sandbox shows (the private root's allow-list, the pytest runtime and the
working copy itself) for each task's deleted code:

* **Fingerprint** (:func:`fingerprint`): the original definition (``def``/``class`` line to its
  end; for a module, its body) as normalised tokens, cut into windows of ``WINDOW`` tokens;
  only windows that reach into the deleted lines and that the damaged file does not also hold
  are kept (the signature and docstring stay in the agent's copy on purpose). Normalising
  drops comments, commas and line continuations and makes every quote the same, so that
  re-indenting, re-wrapping, re-quoting or re-commenting a copy does not hide it. For
  bytecode, the compiled feature's code objects (name, instructions, names, constants).
* **Search** (:func:`find_leaks`): every regular file under the roots; text files by their
  windows, ``.pyc`` files of this interpreter by their code objects, and compressed archives
  (zip, wheel, egg, tar, gzip, bzip2, xz; nested up to three deep) member by member. A file holds a
  copy when it has at least ``MATCH_FRACTION`` of a fingerprint's windows (or of its code
  objects).
* **Where** (:func:`sandbox_roots`): what a sandboxed command can read, i.e. the private
  root's allow-list (``composer_tune.rewards.sandbox.private_root_plan``) and the pytest
  runtime, plus the task's working copy. Under ``weaker_isolation: host_filesystem`` the
  whole host is readable, the task store included, so no search can clear a task: the
  check outside the working copy is skipped there, as the accepted isolation's warning says.

The generator refuses a candidate whose code is reachable, ``make_feature_tasks.py --check``
reports every stored task's, and the repository environment refuses to start an episode on
one (its ``reset`` raises with the path, so the episode is not scored).
"""

from __future__ import annotations

import ast
import bz2
import gzip
import hashlib
import importlib.util
import io
import json
import keyword
import lzma
import marshal
import os
import re
import sys
import tarfile
import threading
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

from composer_tune import default_cache_dir
from composer_tune.data.feature_tasks import (
    TASKS_FILE,
    Feature,
    FeatureTask,
    LineEdit,
    load_feature_tasks,
    read_source_file,
)
from composer_tune.rewards.sandbox import private_root_plan
from composer_tune.rewards.split import pytest_runtime

WINDOW = 8
MATCH_FRACTION = 0.6
IDENTIFIER_FRACTION = 0.8
MAX_FILE_BYTES = 16 * 2**20
MAX_MEMBER_BYTES = 16 * 2**20
MAX_ARCHIVE_DEPTH = 3
_SNIFF_BYTES = 8192

_COMMENT = re.compile(r"#[^\n]*")
_IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9][A-Za-z0-9_.]*|[^\sA-Za-z0-9_,\\]")

# A root: (host path, folders below it the sandbox does not show).
Root = tuple[str, tuple[str, ...]]


class TaskLeakError(ValueError):
    """A task's deleted code is readable in its sandbox; the message names where."""


def normalized_tokens(text: str) -> list[str]:
    """``text`` as tokens that formatting does not change (see the module docstring)."""
    return _TOKEN.findall(_COMMENT.sub("", text.replace("'", '"')))


def _windows(tokens: Sequence[str]) -> set[tuple[str, ...]]:
    size = min(WINDOW, len(tokens))
    return set(zip(*(tokens[i:] for i in range(size)), strict=False)) if size else set()


@dataclass(frozen=True)
class Fingerprint:
    """What identifies one task's deleted code: its token windows, the identifiers in them
    (names, attributes, words of strings; no keywords) and its code objects' keys."""

    task_id: str
    windows: frozenset[tuple[str, ...]]
    identifiers: frozenset[str]
    code_keys: frozenset[tuple]


class _SourceFile:
    """One original feature file, parsed, compiled and tokenised once for all its tasks."""

    def __init__(self, name: str, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self.module = ast.parse(text)
        try:
            self.code: list[CodeType] = list(
                _code_objects(compile(text, name, "exec", dont_inherit=True))
            )
        except (SyntaxError, ValueError):
            self.code = []
        # Tokens never span lines, so the file's tokens are its lines' tokens in order.
        self.line_starts = [0]
        self.tokens: list[str] = []
        for line in self.lines:
            self.tokens += normalized_tokens(line)
            self.line_starts.append(len(self.tokens))
        self.positions: dict[tuple[str, ...], list[int]] = {}
        for position in range(len(self.tokens) - WINDOW + 1):
            window = tuple(self.tokens[position : position + WINDOW])
            self.positions.setdefault(window, []).append(position)

    def span(self, feature: Feature, deletion: LineEdit) -> tuple[int, int]:
        """First and last line of the feature's definition, decorators left out (for a
        module: the deleted lines)."""
        if feature.kind == "module":
            return deletion.start, deletion.end
        body: list[ast.stmt] = self.module.body
        node: ast.stmt | None = None
        for name in feature.qualname.split("."):
            node = next((n for n in body if _defines(n, name)), None)
            if node is None:
                return deletion.start, deletion.end
            body = node.body  # type: ignore[attr-defined]
        assert node is not None and node.end_lineno is not None
        return node.lineno, node.end_lineno

    def decorated_start(self, first: int) -> int:
        """The first line of the decorators above line ``first`` (a code object's first line)."""
        while first > 1 and self.lines[first - 2].lstrip().startswith("@"):
            first -= 1
        return first


def _defines(node: ast.stmt, name: str) -> bool:
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return isinstance(node, definitions) and node.name == name


def _code_objects(code: CodeType) -> Iterator[CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            yield from _code_objects(constant)


def _code_key(code: CodeType) -> tuple:
    constants = tuple(repr(c) for c in code.co_consts if not isinstance(c, CodeType))
    return (code.co_name, code.co_code, code.co_names, constants)


def fingerprint(
    task_id: str, feature: Feature, deletion: LineEdit, original_file: str | _SourceFile
) -> Fingerprint:
    """The fingerprint of the code ``deletion`` removes (``feature``), from its file's original
    text."""
    source = (
        original_file
        if isinstance(original_file, _SourceFile)
        else _SourceFile(deletion.file, original_file)
    )
    first, last = source.span(feature, deletion)
    start, end = source.line_starts[deletion.start - 1], source.line_starts[deletion.end]
    low, high = source.line_starts[first - 1], source.line_starts[last]
    if high - low < WINDOW:  # a definition shorter than a window: windows reach beyond it
        low, high = 0, len(source.tokens)
    tokens = source.tokens
    replacement = normalized_tokens(deletion.replacement)
    # The damaged file's windows across the edit; the rest are the original's outside it.
    seam = tokens[max(0, start - WINDOW + 1) : start] + replacement + tokens[end : end + WINDOW - 1]
    across = _windows(seam) if len(seam) >= WINDOW else set()

    def in_damaged_file(window: tuple[str, ...]) -> bool:
        if window in across:
            return True
        return any(p + WINDOW <= start or p >= end for p in source.positions.get(window, ()))

    windows = {
        tuple(tokens[p : p + WINDOW])
        for p in range(max(low, start - WINDOW + 1), min(end, high - WINDOW + 1))
    }
    windows = {w for w in windows if not in_damaged_file(w)}
    # Bytecode: the feature's code objects (a module's: all of them).
    decorated = source.decorated_start(first)
    code_keys = {
        _code_key(code)
        for code in source.code
        if feature.kind == "module"
        or (code.co_name != "<module>" and decorated <= code.co_firstlineno <= last)
    }
    identifiers = {
        token
        for window in windows
        for token in window
        if token.isidentifier() and not keyword.iskeyword(token)
    }
    return Fingerprint(task_id, frozenset(windows), frozenset(identifiers), frozenset(code_keys))


def store_fingerprints(store: str | Path, tasks: Sequence[FeatureTask]) -> list[Fingerprint]:
    """Every task's fingerprint (each original file read from its archive once)."""
    by_file = {(task.repo, task.deletion.file): task for task in tasks}
    texts = {key: read_source_file(store, task, key[1]) for key, task in by_file.items()}
    return _fingerprints(
        [(task.id, task.feature, task.deletion) for task in tasks],
        lambda task_id, file: texts[(task_id.split(":", 1)[0], file)],
    )


def candidate_fingerprints(
    root: Path, candidates: Sequence[tuple[str, Feature, LineEdit]]
) -> list[Fingerprint]:
    """Fingerprints of ``(task id, feature, deletion)`` candidates of the repository at
    ``root`` (the generator's, before they are tasks)."""
    return _fingerprints(candidates, lambda _, file: (root / file).read_text(encoding="utf-8"))


def _fingerprints(
    items: Sequence[tuple[str, Feature, LineEdit]], read: Callable[[str, str], str]
) -> list[Fingerprint]:
    """Fingerprints of ``items``, each feature file parsed and tokenised once."""
    files: dict[tuple[str, str], _SourceFile] = {}
    prints = []
    for task_id, feature, deletion in items:
        key = (task_id.split(":", 1)[0], deletion.file)
        if key not in files:
            files[key] = _SourceFile(deletion.file, read(task_id, deletion.file))
        prints.append(fingerprint(task_id, feature, deletion, files[key]))
    return prints


# --------------------------------------------------------------------------------------------
# Searching


class _Index:
    """The fingerprints by identifier, window and code key.

    A file holds a copy of a fingerprint's code when it has at least ``IDENTIFIER_FRACTION`` of
    its identifiers and ``MATCH_FRACTION`` of its windows (text) or code keys (bytecode). The
    identifiers, read from the raw bytes, decide cheaply which fingerprints a file could match.
    """

    def __init__(self, prints: Sequence[Fingerprint]) -> None:
        self.prints = list(prints)
        self.by_identifier: dict[bytes, list[int]] = {}
        for number, print_ in enumerate(self.prints):
            for name in print_.identifiers:
                self.by_identifier.setdefault(name.encode(), []).append(number)

    def candidates(self, data: bytes) -> list[int]:
        counts: dict[int, int] = {}
        for name in set(_IDENTIFIER.findall(data)) & self.by_identifier.keys():
            for number in self.by_identifier[name]:
                counts[number] = counts.get(number, 0) + 1
        return [
            number
            for number, count in counts.items()
            if count >= IDENTIFIER_FRACTION * len(self.prints[number].identifiers)
        ]

    def match_text(self, data: bytes) -> list[int]:
        numbers = self.candidates(data)
        if not numbers:
            return []
        windows = _windows(normalized_tokens(data.decode("utf-8", errors="replace")))
        return [n for n in numbers if _enough(self.prints[n].windows, windows)]

    def match_code(self, data: bytes) -> list[int]:
        numbers = [n for n in self.candidates(data) if self.prints[n].code_keys]
        if not numbers:
            return []
        try:
            code = marshal.loads(data[16:])
        except (ValueError, EOFError, TypeError):
            return []
        if not isinstance(code, CodeType):
            return []
        keys = {_code_key(c) for c in _code_objects(code)}
        return [n for n in numbers if _enough(self.prints[n].code_keys, keys)]


def _enough(wanted: frozenset, present: set) -> bool:
    return bool(wanted) and len(wanted & present) >= MATCH_FRACTION * len(wanted)


def _is_text(data: bytes) -> bool:
    return b"\0" not in data[:_SNIFF_BYTES]


def _worth_reading(head: bytes) -> bool:
    """Whether a file starting with ``head`` can hold code: text, bytecode or an archive."""
    magic = (importlib.util.MAGIC_NUMBER, b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"PK\x03\x04")
    return _is_text(head) or head.startswith(magic) or head[257:262] == b"ustar"


def _decompressed(data: bytes) -> bytes | None:
    """The contents of a gzip, bzip2 or xz stream (at most MAX_MEMBER_BYTES), else None."""
    stream: io.BufferedIOBase
    if data[:2] == b"\x1f\x8b":
        stream = gzip.GzipFile(fileobj=io.BytesIO(data))
    elif data[:3] == b"BZh":
        stream = bz2.BZ2File(io.BytesIO(data))
    elif data[:6] == b"\xfd7zXZ\x00":
        stream = lzma.LZMAFile(io.BytesIO(data))
    else:
        return None
    try:
        with stream:
            return stream.read(MAX_MEMBER_BYTES)
    except (OSError, EOFError, lzma.LZMAError):
        return None


def _members(data: bytes) -> Iterator[tuple[str, bytes]] | None:
    """(name, contents) of a zip or tar archive's regular members, else None."""
    if data[:4] == b"PK\x03\x04":
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile:
            return None

        def from_zip() -> Iterator[tuple[str, bytes]]:
            for info in archive.infolist():
                if not info.is_dir() and info.file_size <= MAX_MEMBER_BYTES:
                    try:
                        yield info.filename, archive.read(info)
                    except (zipfile.BadZipFile, OSError, NotImplementedError, RuntimeError):
                        continue

        return from_zip()
    if len(data) > 262 and data[257:262] == b"ustar":

        def from_tar() -> Iterator[tuple[str, bytes]]:
            try:
                with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                    for member in archive:
                        if member.isfile() and member.size <= MAX_MEMBER_BYTES:
                            handle = archive.extractfile(member)
                            if handle is not None:
                                yield member.name, handle.read()
            except tarfile.TarError:
                return

        return from_tar()
    return None


def _scan_bytes(index: _Index, name: str, data: bytes, depth: int) -> Iterator[tuple[int, str]]:
    """(fingerprint number, where) of every copy in one file's contents."""
    if data[:4] == importlib.util.MAGIC_NUMBER:
        for number in index.match_code(data):
            yield number, name
        return
    if depth < MAX_ARCHIVE_DEPTH:
        unpacked = _decompressed(data)
        if unpacked is not None:
            yield from _scan_bytes(index, name, unpacked, depth + 1)
            return
        members = _members(data)
        if members is not None:
            for member, contents in members:
                yield from _scan_bytes(index, f"{name}!{member}", contents, depth + 1)
            return
    if _is_text(data):
        for number in index.match_text(data):
            yield number, name


def _files(roots: Iterable[Root]) -> Iterator[str]:
    for path, hidden in roots:
        if os.path.isfile(path):
            yield path
            continue
        for directory, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if os.path.join(directory, d) not in hidden)
            for name in sorted(filenames):
                yield os.path.join(directory, name)


def find_leaks(prints: Sequence[Fingerprint], roots: Iterable[Root]) -> dict[str, list[str]]:
    """Task id -> the paths under ``roots`` that hold a copy of its deleted code (``archive!member``
    inside archives); tasks without a copy are absent."""
    index = _Index(prints)
    found: dict[str, list[str]] = {}
    for path in _files(roots):
        try:
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            with open(path, "rb") as handle:
                head = handle.read(_SNIFF_BYTES)
                if not _worth_reading(head):
                    continue
                data = head + handle.read()
        except OSError:
            continue
        for number, where in _scan_bytes(index, path, data, 0):
            paths = found.setdefault(prints[number].task_id, [])
            if where not in paths:
                paths.append(where)
    return found


# --------------------------------------------------------------------------------------------
# What a sandbox can read


def sandbox_roots() -> list[Root]:
    """What a command of the repository environment can read besides its working copy: the
    private root's allow-list and the pytest runtime. PrivateRootUnavailable where the host
    cannot build the root: there the sandbox shows the whole host (the task store too), which
    no search covers."""
    return [*private_root_plan().readable(), (str(pytest_runtime()), ())]


_cache_lock = threading.Lock()
_store_leaks: dict[str, dict[str, list[str]]] = {}
# Bump when the fingerprint or the matching changes: cached searches are then made again.
_SEARCH_VERSION = f"1:{WINDOW}:{MATCH_FRACTION}:{IDENTIFIER_FRACTION}:{sys.version_info[:2]}"


def leaks_in_sandbox(store: str | Path, cache_dir: Path | None = None) -> dict[str, list[str]]:
    """Task id -> paths of the sandbox's roots holding that task's deleted code, for every task
    of ``store``. Searched once per process, and once per machine while neither the store's
    tasks nor any file of a root changes (``<cache_dir>/leak_check``, default
    ``$COMPOSER_TUNE_CACHE`` or ``~/.cache/composer_tune``)."""
    key = str(Path(store).resolve())
    with _cache_lock:
        if key not in _store_leaks:
            _store_leaks[key] = _search_cached(Path(store), sandbox_roots(), cache_dir)
        return _store_leaks[key]


def _search_cached(
    store: Path, roots: Sequence[Root], cache_dir: Path | None
) -> dict[str, list[str]]:
    """``find_leaks`` of the store's tasks over ``roots``, cached on disk under the digest of
    the tasks and of every file's root, relative path, size and time (paths relative to their
    root, so that a root copied elsewhere with its times, such as the pytest runtime, hits)."""
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(f"{_SEARCH_VERSION}\n".encode())
    digest.update((store / TASKS_FILE).read_bytes())
    for number, (root, _) in enumerate(roots):
        for path in _files([roots[number]]):
            try:
                info = os.lstat(path)
            except OSError:
                continue
            relative = os.path.relpath(path, root)
            digest.update(f"{number}\0{relative}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    cache = cache_dir / "leak_check" / f"{digest.hexdigest()}.json"
    try:
        located = json.loads(cache.read_text())
    except (OSError, ValueError):
        prints = store_fingerprints(store, load_feature_tasks(store))
        located = {}
        for number, root in enumerate(roots):
            for task_id, paths in find_leaks(prints, [root]).items():
                located.setdefault(task_id, []).extend(
                    [number, os.path.relpath(path, root[0])] for path in paths
                )
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(located))
        os.replace(partial, cache)
    return {
        task_id: [os.path.normpath(os.path.join(roots[n][0], path)) for n, path in places]
        for task_id, places in located.items()
    }


def refuse_reachable(store: str | Path, task: FeatureTask, tree: Path) -> None:
    """Raise TaskLeakError naming where ``task``'s deleted code is readable to its episode:
    the sandbox's roots or its working copy ``tree`` (the repository environment's start)."""
    found = list(leaks_in_sandbox(store).get(task.id, []))
    found += find_leaks(store_fingerprints(store, [task]), [(str(tree), ())]).get(task.id, [])
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise TaskLeakError(
            f"task {task.id}: its deleted code is readable in the sandbox at {shown} "
            "(the agent could copy it back); remove the copy or the task (docs/feature_tasks.md)"
        )
