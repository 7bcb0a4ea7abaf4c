"""Run untrusted, model-generated Python in a throw-away, resource-limited child process.

The trainer scores completions by executing them, so this module must contain whatever the code
does (loop forever, fork-bomb, allocate 100 GB, print gigabytes, read secrets, kill its parent)
and still return a result. See ``docs/sandbox.md`` for what is enforced and what is not.

Process layout of one execution (``run_python``)::

    trainer (this module)
      └─ launcher  python -I -S sandbox.py CONFIG   own session (start_new_session), host namespaces
           └─ init    fork of the launcher: pid 1 of fresh pid/net/mount namespaces when possible
                └─ program  python -I -S main.py  rlimits, private uid, cwd = HOME = TMPDIR = temp dir

The launcher is a fresh single-threaded interpreter, so the namespace / mount / setuid work
happens there rather than in a ``preexec_fn`` (unsafe in a threaded parent such as ``run_many``).
When the init process exits the kernel kills everything left in its pid namespace, so background
processes cannot outlive the run even if they escaped the process group with ``setsid``.
Where mount namespaces work, the program is chrooted into a private root built from an
allow-list (:func:`private_root_plan`): the interpreter and its standard library, a shell and
the commands the repository tools need, the shared libraries those load, and the caller's
mounts. Nothing else of the host is there to read: no site-packages, no other software under
``/usr``, no home directories or caches, no task store. The launcher reads its configuration
from a pipe, so process 1 of the run shows no launch specification on its command line.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import errno
import functools
import glob
import hashlib
import itertools
import json
import logging
import os
import re
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal[
    "ok",
    "error",
    "timeout",
    "cpu_limit",
    "oom",
    "output_limit",
    "killed",
    "stopped",
    "sandbox_error",
]

# Unshare flags and mount flags from <sched.h> / <sys/mount.h> (Python 3.11 has no os.unshare).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_PR_SET_PDEATHSIG = 1

# The private root's allow-list (see private_root_plan). Top-level links such as /lib -> usr/lib
# are recreated as links; the commands are those a shell session in a repository uses (the
# search tool's grep among them), each where the host has it.
_TOP_LEVEL_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_COMMAND_DIRS = ("/usr/bin", "/bin")
_COMMANDS = (
    "bash", "sh", "grep", "egrep", "fgrep", "sed", "awk", "ls", "cat", "head", "tail", "wc",
    "sort", "uniq", "cut", "tr", "find", "xargs", "diff", "cmp", "patch", "cp", "mv", "rm",
    "mkdir", "rmdir", "touch", "ln", "chmod", "echo", "printf", "env", "pwd", "dirname",
    "basename", "readlink", "realpath", "stat", "tee", "mktemp", "sleep", "true", "false",
    "test", "[", "expr", "seq", "du", "nl", "od", "paste", "comm", "tar", "gzip", "timeout",
    "which", "id", "date", "uname", "mkfifo", "md5sum", "sha256sum",
)  # fmt: skip
# Parts of the standard library's folder left out: installed packages (third-party code), the
# bundled pip and setuptools wheels, CPython's own test suite, the IDE and the build files.
_STDLIB_HIDDEN = (
    "site-packages", "dist-packages", "ensurepip", "test", "idlelib", "turtledemo", "config-*",
)  # fmt: skip
# Extension modules whose libraries stay out (Tcl/Tk and X11 for tkinter).
_EXTENSIONS_LEFT_OUT = ("_tkinter",)
# Loaded with dlopen, so ldd does not list it: glibc needs it to cancel and unwind threads.
_DLOPENED = ("libgcc_s.so.1",)
_LOCALES = ("/usr/lib/locale/C.utf8", "/usr/lib/locale/C.UTF-8")
_DEVICES = ("null", "zero", "full", "random", "urandom")

# Private uids for sandboxed programs: far above any real account, one per concurrent run so
# that RLIMIT_NPROC counts only this run's processes and runs cannot touch each other's files.
_UID_BASE = 1 << 30
_run_counter = itertools.count()
_counter_lock = threading.Lock()

logger = logging.getLogger(__name__)

_BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
_BASE_PREFIX = os.path.realpath(sys.base_prefix)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one execution.

    wall_time_s: wall-clock budget enforced by the parent (kills the whole run).
    cpu_time_s: RLIMIT_CPU of the program (whole seconds, rounded up; SIGXCPU when exceeded).
    memory_bytes: RLIMIT_AS (address space) of each process of the program.
    file_size_bytes: RLIMIT_FSIZE, the largest file the program may write.
    max_processes: RLIMIT_NPROC; binds per run only when the program gets a private uid.
    max_open_files: RLIMIT_NOFILE.
    max_output_bytes: cap on each of stdout and stderr; the run is killed when one exceeds it.
    disk_bytes: size of the private tmpfs mounted on the temp dir and on /tmp, /var/tmp and
        /dev/shm (only where mount namespaces work; see docs/sandbox.md).
    """

    wall_time_s: float = 5.0
    cpu_time_s: float = 5.0
    memory_bytes: int = 512 * 2**20
    file_size_bytes: int = 16 * 2**20
    max_processes: int = 32
    max_open_files: int = 64
    max_output_bytes: int = 64 * 2**10
    disk_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_bytes",
            "file_size_bytes",
            "max_processes",
            "max_open_files",
            "max_output_bytes",
            "disk_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one execution.

    status: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock), "cpu_limit"
        (RLIMIT_CPU), "oom" (MemoryError under RLIMIT_AS), "output_limit", "killed" (died from
        another signal), "stopped" (the caller's ``stop_fd`` became readable), "sandbox_error"
        (the sandbox itself failed to start the program).
    exit_code: the program's exit status, None when it died from a signal or was killed.
    stdout, stderr: decoded output, each truncated to ``max_output_bytes``.
    wall_time_s: seconds from start until the run was over.
    detail: one human-readable line about the status ("timed out after 2.0s").
    isolation: which protections were active: "network", "pid_namespace", "private_proc",
        "private_uid", "private_tmp", "private_root" (see docs/sandbox.md).
    """

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_time_s: float
    detail: str = ""
    isolation: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Mount:
    """A host file or directory the program sees at ``target``, read-only unless ``writable``.

    Mounts exist only inside the private root (``"private_root"`` in ``SandboxResult.isolation``,
    see :func:`private_root_available`); without one the program sees the host's file system
    as it is and ``target`` does not exist. A writable mount's files are handed to the run's
    private uid for the run and back to the caller afterwards.
    """

    source: str
    target: str
    writable: bool = False

    def __post_init__(self) -> None:
        if not os.path.isabs(self.target) or ".." in self.target.split("/"):
            raise ValueError(f"Mount.target must be an absolute path, got {self.target!r}")
        if not os.path.exists(self.source):
            raise ValueError(f"Mount.source does not exist: {self.source!r}")


@dataclass(frozen=True)
class _Options:
    mounts: tuple[Mount, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    pass_fds: tuple[int, ...] = ()
    stop_fd: int | None = None


def run_python(
    code: str,
    *,
    limits: SandboxLimits,
    stdin: str = "",
    mounts: Sequence[Mount] = (),
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    stop_fd: int | None = None,
) -> SandboxResult:
    """Execute ``code`` as ``__main__`` of a fresh ``python -I -S`` under ``limits``.

    ``mounts``: extra host paths inside the private root. ``env``: variables added to the
    scrubbed environment (``-I`` ignores ``PYTHON*`` ones in this interpreter). ``pass_fds``:
    descriptors the program inherits under the same numbers; they belong to the run from now
    on and are closed here once it has started. ``stop_fd``: the run is killed (status
    "stopped") as soon as this descriptor is readable or at end of file; it stays the caller's.

    Never raises for anything the program does; the temporary directory and every process of
    the run are gone when this returns.
    """
    options = _Options(tuple(mounts), tuple((env or {}).items()), None, tuple(pass_fds), stop_fd)
    return _run(None, code, limits, stdin, options)


def run_command(
    argv: Sequence[str],
    *,
    limits: SandboxLimits,
    stdin: str = "",
    mounts: Sequence[Mount] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    stop_fd: int | None = None,
) -> SandboxResult:
    """Execute ``argv`` (``argv[0]`` an absolute path, e.g. ``/bin/sh``) like :func:`run_python`.

    ``python`` and ``python3`` on the program's ``PATH`` are the trainer's base interpreter
    (site-packages hidden in the private root). ``cwd`` (default: the private home directory)
    is a path the program sees, e.g. a mount's target.
    """
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError(f"run_command: argv[0] must be an absolute path, got {list(argv)[:1]}")
    options = _Options(tuple(mounts), tuple((env or {}).items()), cwd, tuple(pass_fds), stop_fd)
    return _run(list(argv), None, limits, stdin, options)


def private_root_available() -> bool:
    """Whether programs here run in the private root, so that mounts take effect (probed once)."""
    return _private_root_problem() is None


_probing = False

# The launcher's source as this process imported it: a run started before the checkout changed
# keeps launching the code its parent speaks to (a merge under a training run once made every
# grade of that run a sandbox_error).
_LAUNCHER_SOURCE = open(__file__, encoding="utf-8").read()


@functools.cache
def _launcher_path() -> str:
    """This process's copy of the launcher (removed at exit)."""
    folder = tempfile.mkdtemp(prefix="composer-sandbox-launcher-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = os.path.join(folder, "sandbox_launcher.py")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(_LAUNCHER_SOURCE)
    return path


@functools.cache
def _private_root_problem() -> str | None:
    """Why programs here do not run in the private root (None when they do); probed once."""
    try:
        private_root_plan()
    except PrivateRootUnavailable as err:
        return str(err)
    global _probing
    _probing = True  # the probe's own run may fall back: it is what finds out
    try:
        probe = run_python("pass", limits=SandboxLimits(wall_time_s=30.0))
    finally:
        _probing = False
    if "private_root" in probe.isolation:
        return None
    if probe.status != "ok":
        return f"the probe run failed ({probe.status}: {probe.detail})"
    return "no mount namespaces here (not root, or no CAP_SYS_ADMIN)"


# Isolation a caller may accept by name where the private root cannot be built.
WEAKER_ISOLATION = ("host_filesystem",)


def isolation_in_effect(weaker_isolation: str | None, who: str) -> str:
    """ "private_root" where this host builds it; otherwise ``weaker_isolation`` when the caller
    accepted it by name (a warning says so), else PrivateRootUnavailable naming the way out."""
    if weaker_isolation is not None and weaker_isolation not in WEAKER_ISOLATION:
        raise ValueError(
            f"{who}: weaker_isolation must be one of {list(WEAKER_ISOLATION)} or null, "
            f"got {weaker_isolation!r}"
        )
    problem = _private_root_problem()
    if problem is None:
        return "private_root"
    if weaker_isolation is None:
        raise PrivateRootUnavailable(
            f"{who}: the sandbox cannot build its private root here ({problem}), so programs "
            "would see the host's files, copies of the task's original code among them; accept "
            "that by name with weaker_isolation=host_filesystem (docs/sandbox.md)"
        )
    logger.warning(
        "%s: running with weaker_isolation=%s: the private root is unavailable (%s), "
        "programs see the host's files, copies of a task's deleted code and the task store "
        "among them, and the leak check cannot clear them (docs/sandbox.md)",
        who,
        weaker_isolation,
        problem,
    )
    return weaker_isolation


@dataclass(frozen=True)
class RootPlan:
    """What the private root holds besides the run's own folders and the caller's mounts.

    links: ``(path, link text)`` of the host's top-level links (``/lib -> usr/lib``).
    directories: host folders shown read-only at the same path (the standard library).
    hidden: folders inside ``directories`` covered by an empty mount (site-packages...).
    files: ``(path, host file)`` shown read-only: the interpreter, the commands and the shared
        libraries they load, each at its host path (links resolved).
    """

    links: tuple[tuple[str, str], ...]
    directories: tuple[str, ...]
    hidden: tuple[str, ...]
    files: tuple[tuple[str, str], ...]

    def readable(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(host path, hidden folders below it)`` of everything the plan lets a run read."""
        shown = [
            (d, tuple(h for h in self.hidden if h.startswith(d + "/"))) for d in self.directories
        ]
        return shown + [(source, ()) for _, source in self.files]


class PrivateRootUnavailable(RuntimeError):
    """The host cannot build the allow-listed private root; the message says why."""


@functools.cache
def private_root_plan() -> RootPlan:
    """The allow-list of the private root, computed once per process from this host.

    Raises PrivateRootUnavailable when the host lacks what it needs (``ldd``, a shell).
    """
    ldd = next((p for p in ("/usr/bin/ldd", "/bin/ldd") if os.path.isfile(p)), None)
    if ldd is None:
        raise PrivateRootUnavailable("no ldd on this host to list the libraries programs load")
    files: dict[str, str] = {}

    def add(path: str) -> None:
        # At its canonical place (the folders' links resolved, so that it never lands behind
        # one of the root's own links), backed by the file the name finally points to.
        canonical = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        files.setdefault(canonical, os.path.realpath(path))

    for name in _COMMANDS:
        found = next((f"{d}/{name}" for d in _COMMAND_DIRS if os.path.isfile(f"{d}/{name}")), None)
        if found is not None:
            add(found)
    if not any(os.path.basename(path) == "bash" for path in files):
        raise PrivateRootUnavailable("no /bin/bash on this host")
    add(_BASE_PYTHON)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    extensions = os.path.realpath(sysconfig.get_config_var("DESTSHARED") or stdlib)
    loaded = [source for source in files.values()] + [
        path
        for path in sorted(glob.glob(os.path.join(extensions, "*.so")))
        if not os.path.basename(path).startswith(_EXTENSIONS_LEFT_OUT)
    ]
    libraries = _libraries(ldd, loaded)
    for library in libraries:
        add(library)
    for directory in {os.path.dirname(os.path.realpath(path)) for path in libraries}:
        for name in _DLOPENED:
            if os.path.isfile(os.path.join(directory, name)):
                add(os.path.join(directory, name))
    directories = [stdlib] + ([extensions] if not extensions.startswith(stdlib + "/") else [])
    directories += [os.path.realpath(p) for p in _LOCALES if os.path.isdir(p)][:1]
    hidden = sorted(
        path
        for pattern in _STDLIB_HIDDEN
        for path in glob.glob(os.path.join(stdlib, pattern))
        if os.path.isdir(path) and not os.path.islink(path)
    )
    links = tuple((path, os.readlink(path)) for path in _TOP_LEVEL_LINKS if os.path.islink(path))
    return RootPlan(links, tuple(directories), tuple(hidden), tuple(sorted(files.items())))


def _libraries(ldd: str, programs: Sequence[str]) -> list[str]:
    """The shared libraries ``programs`` load, as ``ldd`` lists them. ldd runs the loader once
    per program (seconds on a loaded machine), so its answer is kept in the cache folder
    under the programs' paths, sizes and times, and used while every library still exists."""
    from composer_tune import default_cache_dir

    digest = hashlib.sha256(ldd.encode())
    for path in programs:
        info = os.stat(path)
        digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    cache = default_cache_dir() / "sandbox" / f"libraries-{digest.hexdigest()[:32]}.json"
    try:
        libraries = json.loads(cache.read_text())
        if libraries and all(os.path.isfile(path) for path in libraries):
            return libraries
    except (OSError, ValueError):
        pass
    listed = subprocess.run([ldd, *programs], capture_output=True, text=True, check=False)
    found = set()
    for line in listed.stdout.splitlines():
        match = re.match(r"\s*(?:\S+ => )?(/\S+) \(0x", line)
        if match:
            found.add(match.group(1))
    if not found:
        raise PrivateRootUnavailable(f"ldd listed no libraries: {listed.stderr[-300:]}")
    libraries = sorted(found)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(libraries))
        os.replace(partial, cache)
    except OSError:
        pass  # a read-only cache folder costs the next process the ldd run, nothing else
    return libraries


def _run(
    argv: list[str] | None, code: str | None, limits: SandboxLimits, stdin: str, options: _Options
) -> SandboxResult:
    root = tempfile.mkdtemp(prefix="composer-sandbox-")
    unclosed = list(options.pass_fds)  # closed exactly once: at the start, or here
    try:
        return _run_in(root, argv, code, limits, stdin, options, unclosed)
    finally:
        _close_all(unclosed)
        _remove_tree(root)


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def run_many(
    codes: Sequence[str],
    *,
    limits: SandboxLimits,
    max_workers: int = 4,
    stdins: Sequence[str] | None = None,
) -> list[SandboxResult]:
    """Run ``codes`` with at most ``max_workers`` executions at a time; results in input order."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if stdins is not None and len(stdins) != len(codes):
        raise ValueError(f"got {len(stdins)} stdins for {len(codes)} programs")
    inputs = stdins if stdins is not None else [""] * len(codes)
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox") as pool:
        futures = [
            pool.submit(run_python, code, limits=limits, stdin=text)
            for code, text in zip(codes, inputs, strict=True)
        ]
        return [future.result() for future in futures]


# --------------------------------------------------------------------------------------------
# Parent side


def _next_uid() -> int:
    with _counter_lock:
        slot = next(_run_counter) % 4096
    return _UID_BASE + (os.getpid() % 65536) * 4096 + slot


def _run_in(
    root: str,
    argv: list[str] | None,
    code: str | None,
    limits: SandboxLimits,
    stdin: str,
    options: _Options,
    unclosed: list[int],
) -> SandboxResult:
    as_root = os.geteuid() == 0
    uid = _next_uid() if as_root else None
    workdir = os.path.join(root, "work")
    os.mkdir(workdir, 0o700)
    # Read-only by the program: its source and the python/python3 commands of its PATH.
    program_dir, bin_dir = os.path.join(root, "program"), os.path.join(root, "bin")
    os.mkdir(program_dir, 0o755)
    os.mkdir(bin_dir, 0o755)
    for name in ("python", "python3"):
        os.symlink(_BASE_PYTHON, os.path.join(bin_dir, name))
    program = os.path.join(program_dir, "main.py")
    with open(program, "w", encoding="utf-8") as handle:
        handle.write(code or "")
    os.chmod(program, 0o644)
    if argv is None:
        argv = [_BASE_PYTHON, "-I", "-S", program]
    # Stdin reaches the program as an open descriptor; the file itself is the trainer's only.
    stdin_path = os.path.join(root, "stdin")
    with open(stdin_path, "w", encoding="utf-8") as handle:
        handle.write(stdin)
    os.chmod(stdin_path, 0o600)
    if uid is not None:
        # The program runs as ``uid``: it may enter root and read its files, write only workdir.
        os.chmod(root, 0o711)
        os.chown(workdir, uid, uid)
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # The program itself runs with -I (ignores PYTHON* vars); this seeds Pythons it spawns.
        "PYTHONHASHSEED": "0",
        "HOME": workdir,
        "TMPDIR": workdir,
        **dict(options.env),
    }
    try:
        plan: RootPlan | None = private_root_plan()
    except PrivateRootUnavailable:
        plan = None
    config = {
        "python": _BASE_PYTHON,
        "prefix": _BASE_PREFIX,
        "root_plan": None if plan is None else dataclasses.asdict(plan),
        "argv": argv,
        "root": root,
        "shared_dirs": [program_dir, bin_dir],
        "workdir": workdir,
        "cwd": options.cwd or workdir,
        "mounts": [[m.source, m.target, m.writable] for m in options.mounts],
        "env": env,
        "uid": uid,
        "rlimits": _rlimits(limits),
        "disk_bytes": limits.disk_bytes,
        "pass_fds": list(options.pass_fds),
        # Where the probe builds the private root, a run that cannot enter it fails.
        "require_namespaces": plan is not None and not _probing and _private_root_problem() is None,
    }
    writable = [m.source for m in options.mounts if m.writable]
    if uid is not None:
        for source in writable:
            _chown_tree(source, uid, uid)
    status_read, status_write = os.pipe()
    config["status_fd"] = status_write
    # The configuration travels through a pipe: on the command line it would be readable in
    # /proc/1/cmdline from inside the run (host paths, mounts, the program's argv).
    config_read, config_write = os.pipe()
    start = time.monotonic()
    try:
        with open(stdin_path, "rb") as stdin_file:
            os.unlink(stdin_path)
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", _launcher_path(), str(config_read)],
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                pass_fds=(status_write, config_read, *options.pass_fds),
                start_new_session=True,
            )
    except OSError as exc:
        _close_all([status_read, status_write, config_read, config_write])
        return SandboxResult("sandbox_error", None, "", "", 0.0, f"could not start: {exc}")
    finally:
        _close_all(unclosed)
    _close_all([status_write, config_read])
    try:
        with open(config_write, "wb") as pipe:  # the launcher reads it whole, then starts
            pipe.write(json.dumps(config).encode())
    except BrokenPipeError:
        pass  # the launcher died before reading: its missing report says so
    try:
        with process:  # closes the pipes on exit
            try:
                outcome, out, err = _supervise(process, limits, start, options.stop_fd)
            finally:
                _kill_group(process)
    finally:
        if uid is not None:
            for source in writable:
                _chown_tree(source, os.geteuid(), os.getegid())
    wall = time.monotonic() - start
    report = _read_report(status_read)
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    isolation = frozenset(report.get("isolation", ()))
    if outcome == "timeout":
        detail = f"timed out after {limits.wall_time_s:g}s"
        return SandboxResult("timeout", None, stdout, stderr, wall, detail, isolation)
    if outcome == "output_limit":
        detail = f"output exceeded {limits.max_output_bytes} bytes"
        return SandboxResult("output_limit", None, stdout, stderr, wall, detail, isolation)
    if outcome == "stopped":
        return SandboxResult(
            "stopped", None, stdout, stderr, wall, "stopped by the caller", isolation
        )
    status, exit_code, detail = _classify(report, stderr, limits)
    return SandboxResult(status, exit_code, stdout, stderr, wall, detail, isolation)


def _chown_tree(path: str, uid: int, gid: int) -> None:
    """Hand ``path`` and everything below it to ``uid`` (links themselves, never their targets)."""
    os.chown(path, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
            except OSError:
                pass


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    cpu = max(1, int(-(-limits.cpu_time_s // 1)))
    return {
        # Soft limit sends SIGXCPU; the hard limit one second later is a SIGKILL backstop.
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (limits.memory_bytes, limits.memory_bytes),
        "RLIMIT_FSIZE": (limits.file_size_bytes, limits.file_size_bytes),
        "RLIMIT_NPROC": (limits.max_processes, limits.max_processes),
        "RLIMIT_NOFILE": (limits.max_open_files, limits.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }


def _supervise(
    process: subprocess.Popen[bytes], limits: SandboxLimits, start: float, stop_fd: int | None
) -> tuple[str, bytes, bytes]:
    """Collect output until the launcher exits, the deadline passes, the output cap is hit or
    ``stop_fd`` becomes readable.

    Output is read incrementally and never buffered beyond the cap.
    """
    assert process.stdout is not None and process.stderr is not None
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    deadline = start + limits.wall_time_s
    selector = selectors.DefaultSelector()
    for fd in buffers:
        selector.register(fd, selectors.EVENT_READ)
    exit_fd = os.pidfd_open(process.pid) if hasattr(os, "pidfd_open") else None
    if exit_fd is not None:
        selector.register(exit_fd, selectors.EVENT_READ)
    if stop_fd is not None:
        selector.register(stop_fd, selectors.EVENT_READ)
    outcome = ""
    try:
        while not outcome:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = "timeout"
                break
            # Without a pidfd, poll for the launcher's exit every 50 ms.
            events = selector.select(remaining if exit_fd is not None else min(remaining, 0.05))
            for key, _ in events:
                if key.fd == exit_fd:
                    outcome = outcome or "exited"
                elif key.fd == stop_fd:
                    outcome = outcome or "stopped"
                elif _read_capped(key.fd, buffers[key.fd], limits.max_output_bytes, selector):
                    outcome = "output_limit"
            if exit_fd is None and process.poll() is not None:
                outcome = outcome or "exited"
        if outcome == "exited":
            # Everything in the run is dead now (or killed below); drain what is left briefly.
            _kill_group(process)
            for fd in (exit_fd, stop_fd):
                if fd is not None:
                    selector.unregister(fd)
            drain_deadline = time.monotonic() + 0.5
            while selector.get_map() and time.monotonic() < drain_deadline:
                for key, _ in selector.select(0.05):
                    if _read_capped(key.fd, buffers[key.fd], limits.max_output_bytes, selector):
                        outcome = "output_limit"
    finally:
        selector.close()
        if exit_fd is not None:
            os.close(exit_fd)
    return (
        outcome,
        bytes(buffers[process.stdout.fileno()]),
        bytes(buffers[process.stderr.fileno()]),
    )


def _read_capped(fd: int, buffer: bytearray, cap: int, selector: selectors.BaseSelector) -> bool:
    """Append one read from ``fd`` to ``buffer``; True when the cap was exceeded."""
    chunk = os.read(fd, 65536)
    if not chunk:
        selector.unregister(fd)
        return False
    room = cap - len(buffer)
    buffer += chunk[: max(room, 0)]
    return len(chunk) > room


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher's process group (its init dies with it, taking its namespace)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _read_report(fd: int) -> dict:
    """The init process's JSON report lines merged; no "exit_code" key when it was killed."""
    os.set_blocking(fd, False)
    data = bytearray()
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    report: dict = {}
    try:
        for line in data.decode().splitlines():
            report.update(json.loads(line))
    except ValueError:
        return {"error": f"unreadable sandbox report: {bytes(data[:200])!r}"}
    return report


def _classify(report: dict, stderr: str, limits: SandboxLimits) -> tuple[Status, int | None, str]:
    if "error" in report:
        return "sandbox_error", None, report["error"]
    if "exit_code" not in report:
        return "sandbox_error", None, "sandbox launcher died: " + stderr[-300:]
    exit_code, signum = report.get("exit_code"), report.get("signal")
    if signum == signal.SIGXCPU:
        return "cpu_limit", None, f"CPU time limit of {limits.cpu_time_s:g}s exceeded"
    if signum is not None:
        name = signal.Signals(signum).name if signum in signal.valid_signals() else signum
        return "killed", None, f"killed by signal {name}"
    if exit_code == 0:
        return "ok", 0, ""
    if "MemoryError" in stderr:
        return "oom", exit_code, f"memory limit of {limits.memory_bytes // 2**20} MiB exceeded"
    return "error", exit_code, f"exited with status {exit_code}"


def _remove_tree(path: str) -> None:
    """Delete a run's directory even if the program made parts of it unreadable."""
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Launcher side: runs as ``python -I -S sandbox.py CONFIG`` (stdlib only, single-threaded).


def _libc_call(libc: ctypes.CDLL, name: str, *args: object) -> None:
    if getattr(libc, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")


def _blocked_ancestor(path: str) -> str | None:
    """The topmost ancestor directory of ``path`` that other users cannot traverse, if any."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:depth])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _mount(
    libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: str
) -> None:
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    _libc_call(libc, "mount", encode(source), target.encode(), encode(fstype), flags, encode(data))


def _inside_jail(jail: str, target: str) -> str:
    """``target``'s path in ``jail``; OSError when a link inside the jail lies on the way (it
    could lead out of the jail before the chroot)."""
    path = jail
    for part in target.strip("/").split("/"):
        path = f"{path}/{part}"
        if os.path.islink(path):
            raise OSError(f"mount target {target!r} passes through a link of the private root")
    return path


def _bind(libc: ctypes.CDLL, jail: str, source: str, target: str, writable: bool) -> None:
    """Bind ``source`` at ``target`` inside ``jail`` (read-only unless ``writable``)."""
    inside = _inside_jail(jail, target)
    if os.path.isdir(source):
        os.makedirs(inside, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
        open(inside, "a").close()
    _mount(libc, source, inside, None, _MS_BIND | _MS_REC, None)
    flags = _MS_REMOUNT | _MS_BIND | (0 if writable else _MS_RDONLY)
    if not source.startswith("/dev/"):  # device nodes need their dev flag; nothing else does
        flags |= _MS_NOSUID | _MS_NODEV
    _mount(libc, None, inside, None, flags, None)


def _build_private_root(libc: ctypes.CDLL, config: dict, uid: int) -> str:
    """Assemble the program's root directory from the allow-list (``RootPlan``) and return its
    host path.

    Everything is read-only except the private home (a tmpfs of ``disk_bytes`` owned by
    ``uid``), /tmp, /var/tmp, /dev/shm (empty tmpfs mounts) and the caller's writable mounts.
    """
    plan = config["root_plan"]
    jail = os.path.join(config["root"], "jail")
    os.mkdir(jail, 0o755)
    _mount(libc, "tmpfs", jail, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=0755")
    for path, text in plan["links"]:
        os.symlink(text, jail + path)
    for path in plan["directories"]:
        _bind(libc, jail, path, path, writable=False)
    for path in plan["hidden"]:
        _mount(libc, "tmpfs", jail + path, "tmpfs", _MS_NOSUID | _MS_RDONLY, "size=4k")
    for path, source in plan["files"]:
        _bind(libc, jail, source, path, writable=False)
    os.makedirs(jail + "/dev", 0o755)
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind(libc, jail, f"/dev/{name}", f"/dev/{name}", writable=True)
    links = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1"}
    for name, target in {**links, "stderr": "/proc/self/fd/2"}.items():
        os.symlink(target, f"{jail}/dev/{name}")
    os.makedirs(jail + "/proc", 0o555)
    _mount(libc, "proc", jail + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    scratch = f"size={config['disk_bytes']},mode=1777"
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        os.makedirs(_inside_jail(jail, path), 0o755, exist_ok=True)
        _mount(libc, "tmpfs", jail + path, "tmpfs", _MS_NOSUID | _MS_NODEV, scratch)
    for path in config["shared_dirs"]:
        _bind(libc, jail, path, path, writable=False)
    os.makedirs(_inside_jail(jail, config["workdir"]), 0o700, exist_ok=True)
    home = f"size={config['disk_bytes']},mode=0700,uid={uid},gid={uid}"
    _mount(libc, "tmpfs", jail + config["workdir"], "tmpfs", _MS_NOSUID | _MS_NODEV, home)
    for source, target, writable in config["mounts"]:
        _bind(libc, jail, source, target, writable)
    return jail


# Errors of unshare(2) that a retry can outlast (a kernel short of memory for the namespaces).
_TRANSIENT_ERRNOS = (errno.ENOMEM, errno.EAGAIN, errno.ENOSPC)
_UNSHARE_ATTEMPTS = 5


def _enter_namespaces(libc: Any, required: bool) -> tuple[bool, list[str]]:
    """Unshares mount, pid and network namespaces; returns whether it did and the isolation
    gained. Where the host was probed to build the private root (``required``) a failure is
    retried while transient and then raised: a program never runs on the host's files because
    the kernel was short of memory once. Elsewhere the network namespace alone is tried."""
    for attempt in range(_UNSHARE_ATTEMPTS):
        try:
            _libc_call(libc, "unshare", _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET)
            return True, ["network", "pid_namespace"]
        except OSError as err:
            if not required:
                break
            if err.errno not in _TRANSIENT_ERRNOS or attempt == _UNSHARE_ATTEMPTS - 1:
                raise OSError(
                    err.errno,
                    f"sandbox: {err.strerror}; this host builds the private root, so the "
                    "program is not run without it",
                ) from None
            time.sleep(0.05 * 2**attempt)
    try:  # e.g. no CAP_SYS_ADMIN for pid/mount namespaces but network still possible
        _libc_call(libc, "unshare", _CLONE_NEWNET)
        return False, ["network"]
    except OSError:
        return False, []


def _launcher_main(config: dict) -> None:
    """Set up isolation, start the program and report how it ended on the status fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    status_fd = config["status_fd"]
    try:
        namespaces, isolation = _enter_namespaces(libc, config["require_namespaces"])
    except OSError as err:  # fail closed: the program does not run
        os.write(status_fd, (json.dumps({"error": str(err), "isolation": []}) + "\n").encode())
        os._exit(0)
    init = os.fork()
    if init:
        _close_all(list(config["pass_fds"]))  # only the program keeps the caller's descriptors
        _, wait_status = os.waitpid(init, 0)
        os._exit(os.waitstatus_to_exitcode(wait_status) & 0xFF)
    # init: pid 1 of the new namespace. Die with the launcher (the parent kills the launcher).
    report: dict = {}
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        uid = config["uid"]
        jail = None
        if namespaces:
            _libc_call(libc, "mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)
            if uid is not None and config["root_plan"] is not None:
                jail = _build_private_root(libc, config, uid)
                isolation += ["private_proc", "private_tmp", "private_root"]
            else:
                try:
                    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
                    _libc_call(libc, "mount", b"proc", b"/proc", b"proc", flags, None)
                    isolation.append("private_proc")
                except OSError:
                    pass
        if jail is None and uid is not None and _blocked_ancestor(config["prefix"]) is not None:
            uid = None  # outside the private root the private uid could not reach the interpreter
        if uid is not None:
            isolation.append("private_uid")
        # First report line: known even if the run is killed before the final line.
        os.write(status_fd, (json.dumps({"isolation": isolation}) + "\n").encode())
        # Close-on-exec pipe: the program's process writes to it only if it fails before exec.
        failure_read, failure_write = os.pipe()
        program = os.fork()
        if program == 0:
            os.close(failure_read)
            _exec_program(config, uid, jail, status_fd, failure_write)
        os.close(failure_write)
        _close_all(list(config["pass_fds"]))
        report = {"isolation": isolation, "exit_code": None, "signal": None}
        while True:  # as pid 1, also reap orphans re-parented to us
            pid, wait_status = os.wait()
            if pid == program:
                break
        failure = os.read(failure_read, 4096).decode(errors="replace")
        if failure:
            report = {"error": failure, "isolation": isolation}
        elif os.WIFSIGNALED(wait_status):
            report["signal"] = os.WTERMSIG(wait_status)
        else:
            report["exit_code"] = os.WEXITSTATUS(wait_status)
    except Exception as exc:  # any setup failure must reach the parent as a report
        report = {"error": f"sandbox setup failed: {exc!r}", "isolation": isolation}
    os.write(status_fd, (json.dumps(report) + "\n").encode())
    os._exit(0)


def _exec_program(
    config: dict, uid: int | None, jail: str | None, status_fd: int, failure_fd: int
) -> None:
    """In the program's process: enter the private root, apply limits, drop privileges, exec."""
    try:
        os.close(status_fd)
        if jail is not None:
            os.chroot(jail)
        for name, (soft, hard) in config["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        os.chdir(config["cwd"])
        argv = config["argv"]
        os.execve(argv[0], argv, config["env"])
    except BaseException as exc:  # report, and never fall through into init's code
        try:
            os.write(failure_fd, f"could not start the program: {exc!r}".encode())
        finally:
            os._exit(127)


if __name__ == "__main__":
    with open(int(sys.argv[1]), "rb") as _config_pipe:
        _launcher_main(json.loads(_config_pipe.read()))
