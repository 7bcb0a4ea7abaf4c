"""Hostile programs against the sandbox: each must end in a clear failed result, leave nothing
behind, and leave this test process alive and responsive.

Where a protection depends on the platform (namespaces and a private uid need root), the test
reads ``result.isolation`` and asserts the behaviour docs/sandbox.md documents for that case.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from composer_tune.rewards import sandbox
from composer_tune.rewards.sandbox import Mount, SandboxLimits, run_command, run_many, run_python

LIMITS = SandboxLimits(
    wall_time_s=2.0,
    cpu_time_s=2.0,
    memory_bytes=256 * 2**20,
    max_processes=8,
    max_output_bytes=4096,
)


def _isolation() -> frozenset[str]:
    return run_python("pass", limits=LIMITS).isolation


def _host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def _assert_responsive() -> None:
    start = time.monotonic()
    result = run_python("print(6 * 7)", limits=LIMITS)
    assert result.status == "ok" and result.stdout == "42\n"
    assert time.monotonic() - start < 5


def test_ok_run_exit_codes_stdin_and_status() -> None:
    ok = run_python("print(input()[::-1])", limits=LIMITS, stdin="abc\n")
    assert (ok.status, ok.exit_code, ok.stdout) == ("ok", 0, "cba\n")
    failed = run_python("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)", limits=LIMITS)
    assert (failed.status, failed.exit_code) == ("error", 3)
    assert failed.stderr == "boom\n"
    raised = run_python("raise KeyError('k')", limits=LIMITS)
    assert raised.status == "error" and "KeyError: 'k'" in raised.stderr
    crashed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", limits=LIMITS)
    assert (crashed.status, crashed.detail) == ("killed", "killed by signal SIGSEGV")


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", secret)
    code = (
        "import json, os, sys\n"
        "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(),\n"
        "                  'isolated': sys.flags.isolated, 'no_site': sys.flags.no_site}))\n"
    )
    result = run_python(code, limits=LIMITS)
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout
    seen = json.loads(result.stdout)
    assert set(seen["env"]) <= {"PATH", "LANG", "LC_ALL", "PYTHONHASHSEED", "HOME", "TMPDIR"}
    assert seen["env"]["HOME"] == seen["env"]["TMPDIR"] == seen["cwd"]
    assert seen["isolated"] == 1 and seen["no_site"] == 1
    # Not via the parent's /proc entry either (private pid namespace or a different uid).
    leak = run_python(
        "import os\ntry:\n    print(open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError as exc:\n    print('denied', exc)",
        limits=LIMITS,
    )
    assert secret not in leak.stdout


def test_infinite_loop_is_killed_at_wall_clock_timeout() -> None:
    limits = SandboxLimits(wall_time_s=1.0, cpu_time_s=30.0)
    result = run_python("import time\nwhile True:\n    time.sleep(0.01)", limits=limits)
    assert result.status == "timeout" and result.exit_code is None
    assert result.detail == "timed out after 1s"
    assert 1.0 <= result.wall_time_s < 5.0
    _assert_responsive()


def test_cpu_burner_hits_rlimit_cpu() -> None:
    # Generous wall clock so that RLIMIT_CPU, not the parent's timer, ends it on a loaded box.
    limits = SandboxLimits(wall_time_s=20.0, cpu_time_s=1.0)
    result = run_python("while True:\n    pass", limits=limits)
    assert result.status == "cpu_limit", (result.status, result.detail)
    assert result.wall_time_s < 20.0


def test_nproc_bounds_forking() -> None:
    isolation = _isolation()
    code = (
        "import os, time\n"
        "count = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        count += 1\n"
        "except OSError as exc:\n"
        "    print('refused', count, exc.errno, flush=True)\n"
    )
    result = run_python(code, limits=LIMITS)
    if "private_uid" in isolation:
        # RLIMIT_NPROC counts the private uid's tasks: the program itself plus its children.
        assert result.stdout.startswith("refused")
        assert int(result.stdout.split()[1]) < LIMITS.max_processes
    else:
        # Documented: as a shared uid NPROC counts all the user's processes and may not bind.
        assert result.status in {"ok", "timeout"}
    _assert_responsive()


def test_fork_bomb_is_contained_and_cleaned_up() -> None:
    marker = f"forkbomb-{os.getpid()}-{time.monotonic_ns()}"
    code = f"import os\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(code, limits=LIMITS)
    assert result.status in {"timeout", "cpu_limit"}
    assert not _host_processes_with(marker)
    _assert_responsive()


def test_memory_bomb_fails_with_oom() -> None:
    # Small RLIMIT_AS and a generous clock: filling pages is slow on a loaded machine.
    limits = SandboxLimits(wall_time_s=15.0, cpu_time_s=15.0, memory_bytes=96 * 2**20)
    growing = "blocks = []\nwhile True:\n    blocks.append(bytearray(8 * 2**20))"
    for code in (growing, "huge = bytearray(10**11)"):
        result = run_python(code, limits=limits)
        assert result.status == "oom", (result.status, result.stderr[-300:])
        assert "MemoryError" in result.stderr and result.detail == "memory limit of 96 MiB exceeded"
    _assert_responsive()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_capped(stream: str) -> None:
    code = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 10000)"
    result = run_python(code, limits=LIMITS)
    assert result.status == "output_limit"
    captured = getattr(result, stream)
    assert len(captured.encode()) == LIMITS.max_output_bytes
    assert set(captured) == {"x"}


def test_file_size_limit() -> None:
    code = "open('big.bin', 'wb').write(b'0' * (64 * 2**20))"
    result = run_python(code, limits=LIMITS)
    assert result.status == "error" and "File too large" in result.stderr


def test_writing_outside_the_temp_dir(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    tmp_path.chmod(0o777)  # even a world-writable directory must not be reachable
    code = (
        "import os\n"
        f"try:\n    open({str(target)!r}, 'w').write('pwned')\n    print('wrote')\n"
        "except OSError as exc:\n    print('blocked', type(exc).__name__)\n"
        "open('inside.txt', 'w').write('fine')\nprint(os.getcwd())\n"
    )
    result = run_python(code, limits=LIMITS)
    assert result.status == "ok", result.stderr
    blocked, workdir = result.stdout.splitlines()
    if "private_tmp" in result.isolation:
        assert blocked.startswith("blocked") and not target.exists()
    else:
        # Documented: without root the program runs as the caller and can write where it can.
        assert blocked == "wrote" and target.read_text() == "pwned"
    assert not os.path.exists(workdir)  # the temp dir (and inside.txt) are gone


def test_network_to_a_local_listener() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
            "    print('connected')\n"
            "except OSError as exc:\n    print('blocked', exc.errno)\n"
        )
        result = run_python(code, limits=LIMITS)
        try:
            connection, _ = server.accept()
            connection.close()
            accepted = True
        except TimeoutError:
            accepted = False
    if "network" in result.isolation:
        assert result.stdout.startswith("blocked") and not accepted
    else:
        # Documented: no network namespace available means the network is NOT blocked.
        assert result.stdout == "connected\n" and accepted


def test_program_cannot_kill_the_parent() -> None:
    isolation = _isolation()
    attacks = [
        f"os.kill({os.getpid()}, signal.SIGKILL)",
        "os.kill(os.getppid(), signal.SIGKILL)",
        f"os.killpg(os.getpgid({os.getpid()}), signal.SIGKILL)",
    ]
    if {"private_uid", "pid_namespace"} & isolation:
        # Only safe to try where kill(-1) cannot reach this test's own user's processes.
        attacks.append("os.kill(-1, signal.SIGKILL)")
    code = "import os, signal\n" + "".join(
        f"try:\n    {attack}\nexcept OSError as exc:\n    print('failed', exc.errno)\n"
        for attack in attacks
    )
    result = run_python(code, limits=LIMITS)
    assert result.status in {"ok", "error", "killed"}
    if isolation:
        assert result.stdout.count("failed") >= 3, result.stdout
    _assert_responsive()


def test_background_processes_do_not_outlive_the_run() -> None:
    marker = f"orphan-{os.getpid()}-{time.monotonic_ns()}"
    sleeper = f"import time\\ntime.sleep(60)  # {marker}"
    code = (
        "import os, subprocess, sys, time\n"
        # escapes the process group with its own session
        f"subprocess.Popen([sys.executable, '-c', '{sleeper}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"  # classic double-fork daemon
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', '{sleeper}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\nprint('spawned')\n"
    )
    result = run_python(code, limits=LIMITS)
    assert result.status == "ok" and result.stdout == "spawned\n", result.stderr
    leftovers = _host_processes_with(marker)
    for pid in leftovers:  # do not leave them behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    if "pid_namespace" in result.isolation:
        assert not leftovers
    else:
        # Documented: without a pid namespace only the process group is killed; setsid escapes.
        assert leftovers


def test_run_many_respects_worker_limit_order_and_cleanup() -> None:
    code = "import os, time\nstart = time.time()\ntime.sleep(0.6)\nprint({i}, start, time.time(), os.getcwd())"
    open_fds = len(os.listdir("/proc/self/fd"))
    results = run_many([code.format(i=i) for i in range(6)], limits=LIMITS, max_workers=2)
    assert len(os.listdir("/proc/self/fd")) == open_fds  # no leaked pipes
    assert [r.status for r in results] == ["ok"] * 6
    rows = [r.stdout.split() for r in results]
    assert [int(row[0]) for row in rows] == list(range(6))
    intervals = [(float(row[1]), float(row[2])) for row in rows]
    most_concurrent = max(sum(s <= t < e for s, e in intervals) for t, _ in intervals)
    assert most_concurrent == 2
    workdirs = {row[3] for row in rows}
    assert len(workdirs) == 6 and not any(os.path.exists(d) for d in workdirs)


def test_invalid_limits_name_the_field() -> None:
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        run_many(["pass"], limits=LIMITS, max_workers=0)


# --------------------------------------------------------------------------------------------
# The private root, mounts, commands, passed descriptors and stopping a run


needs_private_root = pytest.mark.skipif(
    "private_root" not in run_python("pass", limits=LIMITS).isolation,
    reason="no mount namespaces here (not root): docs/sandbox.md says what is not enforced",
)


@pytest.fixture
def planted_on_the_host() -> list[str]:
    """A file planted in the base interpreter's site-packages, in /usr/lib and in a folder of
    /usr/lib (as third-party software installed there would be); removed afterwards."""
    import site
    import sysconfig

    marker = f"composer_tune_planted_{os.getpid()}_{time.monotonic_ns()}"
    folders = [sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"], "/usr/lib"]
    folders += site.getsitepackages([sys.base_prefix])
    planted = []
    try:
        for folder in dict.fromkeys(folders):
            path = Path(folder, f"{marker}.py")
            try:
                path.write_text(
                    "def camelize(string):\n    return 'planted' + 'copy'  # plantedcopy\n"
                )
            except OSError:
                continue
            planted.append(str(path))
        if not planted:
            pytest.skip("cannot write into the host's site-packages or /usr/lib here")
        yield planted
    finally:
        for path in planted:
            Path(path).unlink(missing_ok=True)


@needs_private_root
def test_allow_listed_root_hides_the_host(planted_on_the_host: list[str]) -> None:
    code = (
        "import json, os, subprocess, sys\n"
        "planted = json.loads(sys.stdin.read())\n"
        "grep = subprocess.run(['/bin/grep', '-rl', 'planted' 'copy', '/', '--exclude-dir=proc'],"
        " capture_output=True, text=True)\n"
        "print(json.dumps({'top': sorted(os.listdir('/')), 'usr': sorted(os.listdir('/usr')),"
        " 'usr_lib': sorted(os.listdir('/usr/lib')), 'sites': [os.listdir(p) for p in"
        " (os.path.join(sys.base_prefix, 'lib', f'python3.{sys.version_info[1]}', n) for n in"
        " ('site-packages', 'ensurepip', 'test')) if os.path.isdir(p)],"
        " 'planted': [os.path.exists(p) for p in planted], 'grep': grep.stdout,"
        f" 'readme': os.path.exists({str(Path(__file__).resolve().parents[1] / 'README.md')!r}),"
        f" 'venv': os.path.exists({sys.prefix!r}), 'home': os.path.exists('/home'),"
        " 'etc': os.path.exists('/etc'), 'modules': [m for m in ('json', 'ssl', 'sqlite3',"
        " 'decimal', 'ctypes', 'zlib', 'lzma') if __import__(m)]}))\n"
    )
    # grep reads the whole root (about 130 MB): a clock for a loaded machine.
    limits = SandboxLimits(wall_time_s=120.0, cpu_time_s=120.0, max_processes=8)
    result = run_python(code, limits=limits, stdin=json.dumps(planted_on_the_host))
    assert result.status == "ok", result.stderr
    seen = json.loads(result.stdout)
    assert seen["planted"] == [False] * len(planted_on_the_host) and seen["grep"] == ""
    assert seen["readme"] is seen["venv"] is seen["home"] is seen["etc"] is False
    assert seen["sites"] and all(entries == [] for entries in seen["sites"])
    links = {"bin", "sbin", "lib", "lib32", "lib64", "libx32"}
    # /root only where the interpreter lives below it (pyenv), and then only the interpreter.
    assert set(seen["top"]) <= links | {"dev", "proc", "root", "tmp", "usr", "var"}
    # /usr holds the commands and the libraries they load, nothing else of the host's.
    assert set(seen["usr"]) <= {"bin", "lib", "lib64", "sbin"}, seen["usr"]
    assert "google-cloud-sdk" not in seen["usr_lib"] and "python3" not in seen["usr_lib"]
    assert seen["modules"] == ["json", "ssl", "sqlite3", "decimal", "ctypes", "zlib", "lzma"]


@needs_private_root
def test_process_one_shows_no_launch_specification(tmp_path: Path) -> None:
    code = (
        "import json\n"
        "print(json.dumps({'cmdline': open('/proc/1/cmdline', 'rb').read().decode(),"
        " 'environ': _try(lambda: open('/proc/1/environ').read()),"
        " 'root': _try(lambda: __import__('os').listdir('/proc/1/root'))}))\n"
    )
    helper = "def _try(f):\n    try:\n        return f()\n    except OSError as e:\n        return type(e).__name__\n"
    mounts = [Mount(str(tmp_path), "/secret_mount_target")]
    result = run_python(helper + code, limits=LIMITS, mounts=mounts)
    assert result.status == "ok", result.stderr
    seen = json.loads(result.stdout)
    assert "secret_mount_target" not in seen["cmdline"] and str(tmp_path) not in seen["cmdline"]
    assert "{" not in seen["cmdline"] and "main.py" not in seen["cmdline"]
    assert seen["environ"] == seen["root"] == "PermissionError"


def test_no_allow_list_means_no_private_root(monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_tune.rewards import sandbox

    def unavailable() -> sandbox.RootPlan:
        raise sandbox.PrivateRootUnavailable("no ldd on this host (test)")

    monkeypatch.setattr(sandbox, "private_root_plan", unavailable)
    result = run_python("import os\nprint(os.path.isdir('/work'))", limits=LIMITS)
    assert result.status == "ok", result.stderr
    assert "private_root" not in result.isolation
    assert sandbox._private_root_problem.__wrapped__() == "no ldd on this host (test)"


def test_weaker_isolation_is_refused_unless_accepted_by_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from composer_tune.rewards import sandbox

    monkeypatch.setattr(sandbox, "_private_root_problem", lambda: "no mount namespaces (test)")
    with pytest.raises(sandbox.PrivateRootUnavailable, match="weaker_isolation=host_filesystem"):
        sandbox.isolation_in_effect(None, "Env")
    with pytest.raises(ValueError, match="weaker_isolation must be one of"):
        sandbox.isolation_in_effect("none", "Env")
    with caplog.at_level("WARNING"):
        assert sandbox.isolation_in_effect("host_filesystem", "Env") == "host_filesystem"
    assert "weaker_isolation=host_filesystem" in caplog.text and "(test)" in caplog.text
    monkeypatch.setattr(sandbox, "_private_root_problem", lambda: None)
    assert sandbox.isolation_in_effect("host_filesystem", "Env") == "private_root"


@needs_private_root
def test_mounts_are_read_only_or_handed_over_and_back(tmp_path: Path) -> None:
    shared, scratch = tmp_path / "shared", tmp_path / "scratch"
    shared.mkdir()
    scratch.mkdir()
    (shared / "data.txt").write_text("hello")
    code = (
        "print(open('/data/data.txt').read())\n"
        "try:\n    open('/data/new.txt', 'w')\nexcept OSError as exc:\n    print('ro', exc.errno)\n"
        "open('/scratch/made.txt', 'w').write('made')\n"
    )
    mounts = [Mount(str(shared), "/data"), Mount(str(scratch), "/scratch", writable=True)]
    result = run_python(code, limits=LIMITS, mounts=mounts)
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines()[:2] == ["hello", "ro 30"]  # EROFS
    assert (scratch / "made.txt").read_text() == "made"
    assert (scratch / "made.txt").stat().st_uid == os.geteuid()  # handed back after the run
    with pytest.raises(ValueError, match="absolute path"):
        Mount(str(shared), "relative")


@needs_private_root
def test_run_command_finds_python_and_runs_in_cwd(tmp_path: Path) -> None:
    result = run_command(
        ["/bin/sh", "-c", "pwd; python3 -c 'import sys; print(sys.flags.isolated)'"],
        limits=LIMITS,
        mounts=[Mount(str(tmp_path), "/work_here", writable=True)],
        cwd="/work_here",
        env={"EXTRA": "1"},
    )
    assert result.status == "ok", result.stderr
    assert result.stdout.split() == ["/work_here", "0"]
    with pytest.raises(ValueError, match="absolute path"):
        run_command(["sh", "-c", "true"], limits=LIMITS)


def test_passed_descriptors_and_stop_fd() -> None:
    to_program, from_caller = os.pipe()
    stop_read, stop_write = os.pipe()
    code = f"import os\nos.write(1, os.read({to_program}, 100))\nimport time\ntime.sleep(60)\n"
    os.write(from_caller, b"through the pipe")
    os.close(from_caller)
    started = time.monotonic()
    timer = threading.Timer(1.5, os.close, args=(stop_write,))
    timer.start()
    try:
        result = run_python(
            code, limits=SandboxLimits(wall_time_s=30.0), pass_fds=[to_program], stop_fd=stop_read
        )
    finally:
        timer.join()
        os.close(stop_read)
    assert (result.status, result.detail) == ("stopped", "stopped by the caller")
    assert result.stdout == "through the pipe"
    assert time.monotonic() - started < 20
    with pytest.raises(OSError):
        os.fstat(to_program)  # the run owned it and closed it


class _FakeLibc:
    """unshare(2) failing with the given errnos, in turn, then succeeding."""

    def __init__(self, *failures: int) -> None:
        self.failures = list(failures)
        self.calls: list[int] = []

    def unshare(self, flags: int) -> int:
        self.calls.append(flags)
        if self.failures:
            ctypes.set_errno(self.failures.pop(0))
            return -1
        return 0


def test_namespaces_fail_closed_where_the_host_builds_the_private_root(monkeypatch) -> None:
    """A host whose probe built the private root never runs a program without it: a transient
    failure (ENOMEM) is retried, a lasting or other one is the run's error; only a host
    without it falls back to the network namespace alone."""
    monkeypatch.setattr(sandbox.time, "sleep", lambda seconds: None)
    libc = _FakeLibc(errno.ENOMEM, errno.ENOMEM)
    assert sandbox._enter_namespaces(libc, required=True) == (True, ["network", "pid_namespace"])
    assert len(libc.calls) == 3

    libc = _FakeLibc(*[errno.ENOMEM] * 10)
    with pytest.raises(OSError, match="not run without it"):
        sandbox._enter_namespaces(libc, required=True)
    assert len(libc.calls) == sandbox._UNSHARE_ATTEMPTS

    libc = _FakeLibc(errno.EPERM)
    with pytest.raises(OSError, match="Operation not permitted"):
        sandbox._enter_namespaces(libc, required=True)
    assert len(libc.calls) == 1

    libc = _FakeLibc(errno.EPERM)  # a host without namespaces: the network one is tried
    assert sandbox._enter_namespaces(libc, required=False) == (False, ["network"])
    assert libc.calls[1] == sandbox._CLONE_NEWNET


def test_runs_launch_the_launcher_this_process_imported() -> None:
    """A running trainer keeps launching the sandbox code it imported, whatever happens to the
    checkout meanwhile: the launcher is a copy made once per process, outside the package."""
    result = run_python("print('launched')", limits=SandboxLimits(wall_time_s=30.0))
    assert result.status == "ok" and result.stdout.strip() == "launched"
    copy = Path(sandbox._launcher_path())
    assert copy.parent != Path(sandbox.__file__).parent
    assert copy.read_text() == Path(sandbox.__file__).read_text() == sandbox._LAUNCHER_SOURCE
