"""Start a torchft lighthouse and N DiLoCo replica processes on one machine (CPU / gloo).

The command-line front end is ``tools/launch_diloco.py``; tests use these functions to drive
replicas one by one (kill one, restart it later).

Each replica runs the same command with its own environment:

- ``REPLICA_ID``: 0 .. N-1, read by ``DiLoCoConfig.resolved_replica_id``;
- ``NUM_REPLICAS``: N;
- ``TORCHFT_LIGHTHOUSE``: the lighthouse address, read by ``DiLoCoConfig``;
- ``REPLICA_RESTART``: how many times this replica was restarted (0 for the first run);
- ``PET_MASTER_ADDR`` / ``PET_MASTER_PORT``: a free loopback port per replica, so a replica
  command that is itself ``torchrun ...`` (an FSDP replica group) gets its own rendezvous store
  instead of every group colliding on torchrun's default 29500;
- ``PYTHONUNBUFFERED=1`` so log lines arrive as they are written.

Every output line is echoed as ``[replica i] <line>``.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from torchft.coordination import LighthouseServer

from composer_tune.diloco.config import LIGHTHOUSE_ENV, REPLICA_ID_ENV, RESTART_ENV
from composer_tune.stop import STOPPED_EXIT_CODE

LOOPBACK = "127.0.0.1"
NUM_REPLICAS_ENV = "NUM_REPLICAS"
# Seconds a replica gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE_S = 15.0


def start_lighthouse(
    *,
    min_replicas: int,
    host: str = LOOPBACK,
    port: int = 0,
    join_timeout_ms: int = 60_000,
    heartbeat_timeout_ms: int = 5_000,
) -> tuple[LighthouseServer, str]:
    """An in-process lighthouse bound to ``host:port`` and the address replicas should use.

    torchft's own ``address()`` names the machine by ``gethostname()``, which need not resolve;
    the returned address uses ``host`` instead.
    """
    server = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    bound_port = server.address().rsplit(":", 1)[1]
    return server, f"http://{host}:{bound_port}"


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free a moment ago (for commands that cannot take port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def replica_env(
    replica_id: int,
    num_replicas: int,
    lighthouse_addr: str,
    *,
    restart: int = 0,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one replica process (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            REPLICA_ID_ENV: str(replica_id),
            NUM_REPLICAS_ENV: str(num_replicas),
            LIGHTHOUSE_ENV: lighthouse_addr,
            RESTART_ENV: str(restart),
            "PET_MASTER_ADDR": LOOPBACK,
            "PET_MASTER_PORT": str(free_port()),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@dataclass
class Replica:
    """One running replica process and the thread echoing its output."""

    replica_id: int
    restart: int
    process: subprocess.Popen
    pump: threading.Thread = field(repr=False)

    def terminate(self, grace_s: float = TERMINATE_GRACE_S) -> int:
        """SIGTERM to the replica's process group (its children too), SIGKILL after
        ``grace_s``; returns the exit code."""
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait()
        # A grandchild (e.g. under a torchrun replica) could keep the log pipe open.
        self.pump.join(timeout=grace_s)
        return self.process.returncode


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session: the group id is the pid
    except ProcessLookupError:
        pass


def spawn_replica(
    command: Sequence[str],
    replica_id: int,
    env: Mapping[str, str],
    *,
    restart: int = 0,
    out: TextIO | None = None,
    lock: threading.Lock | None = None,
    cwd: str | None = None,
) -> Replica:
    """Starts ``command`` in its own session (so a terminal's Ctrl-C reaches only the launcher,
    which then stops the replicas in order) and echoes its output with a prefix to ``out``."""
    process = subprocess.Popen(
        list(command),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    prefix = f"[replica {replica_id}] ".encode()
    sink = out if out is not None else sys.stdout
    write_lock = lock if lock is not None else threading.Lock()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            text = (prefix + line).decode(errors="replace")
            with write_lock:
                sink.write(text if text.endswith("\n") else text + "\n")
                sink.flush()
        process.stdout.close()

    thread = threading.Thread(target=pump, name=f"replica-{replica_id}-log", daemon=True)
    thread.start()
    return Replica(replica_id=replica_id, restart=restart, process=process, pump=thread)


def _exit_status(returncode: int) -> int:
    """A shell-style status: 128 + signal number for a replica killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def launch(
    command: Sequence[str],
    *,
    replicas: int,
    min_replicas: int | None = None,
    lighthouse_addr: str | None = None,
    max_restarts: int = 0,
    join_timeout_ms: int = 60_000,
    heartbeat_timeout_ms: int = 5_000,
    out: TextIO | None = None,
) -> int:
    """Runs ``replicas`` copies of ``command`` until all exit; returns the launcher's exit status.

    Starts an in-process lighthouse (``min_replicas``, default ``replicas``) unless
    ``lighthouse_addr`` names a running one. A replica that exits non-zero is restarted up to
    ``max_restarts`` times in total (it rejoins and heals from a live peer); beyond that the
    other replicas are stopped and its status is returned.

    Ctrl-C / SIGTERM: every replica gets SIGTERM, which the recipe takes as "stop after the next
    sync, all replicas at the same one, and save a checkpoint"; the launcher (and its lighthouse,
    which that sync needs) waits for them and returns 130 / 143. A second signal kills them, and
    so does a replica that dies instead of stopping (its peers could never sync again).
    """
    if not command:
        raise ValueError("no replica command given (put it after `--`)")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    sink = out if out is not None else sys.stdout
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            sink.write(f"[launcher] {message}\n")
            sink.flush()

    server = None
    if lighthouse_addr is None:
        server, lighthouse_addr = start_lighthouse(
            min_replicas=min_replicas if min_replicas is not None else replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        say(f"lighthouse at {lighthouse_addr}")

    # Replica exits (replica, returncode) and signals (None, signum), in arrival order.
    # SimpleQueue.put is reentrant, so the signal handler may put while the loop waits.
    events: queue.SimpleQueue[tuple[Replica | None, int]] = queue.SimpleQueue()
    running: dict[int, Replica] = {}
    restarts_used = 0
    stop_signals: list[int] = []

    def start(replica_id: int, restart: int) -> None:
        env = replica_env(replica_id, replicas, lighthouse_addr, restart=restart)
        replica = spawn_replica(command, replica_id, env, restart=restart, out=sink, lock=lock)
        running[replica_id] = replica
        threading.Thread(
            target=lambda: events.put((replica, replica.process.wait())), daemon=True
        ).start()

    previous = {
        sig: signal.signal(sig, lambda signum, _frame: events.put((None, signum)))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    status = 0
    try:
        for replica_id in range(replicas):
            start(replica_id, restart=0)
        while running:
            replica, code = events.get()
            if replica is None:  # a signal
                stop_signals.append(code)
                name = signal.Signals(code).name
                if len(stop_signals) == 1:
                    say(
                        f"got {name}; the replicas stop after their next sync and save a "
                        "checkpoint (again to kill them)"
                    )
                    for running_replica in running.values():
                        _signal_group(running_replica.process, signal.SIGTERM)
                    status = 128 + code
                    continue
                say(f"got {name} again; killing the replicas")
                for running_replica in running.values():
                    _signal_group(running_replica.process, signal.SIGKILL)
                break
            replica.pump.join(timeout=TERMINATE_GRACE_S)
            del running[replica.replica_id]
            if stop_signals:
                say(f"replica {replica.replica_id} exited with status {_exit_status(code)}")
                if code not in (0, STOPPED_EXIT_CODE) and running:
                    # Killed before it could stop (e.g. still importing): no sync can commit.
                    say("the other replicas cannot sync without it: stopping them unsaved")
                    break
                continue
            if code == 0:
                say(f"replica {replica.replica_id} finished")
                continue
            if restarts_used < max_restarts:
                restarts_used += 1
                say(
                    f"replica {replica.replica_id} exited with status "
                    f"{_exit_status(code)}; restart {restarts_used}/{max_restarts}"
                )
                start(replica.replica_id, restart=replica.restart + 1)
                continue
            status = _exit_status(code)
            say(f"replica {replica.replica_id} failed with status {status}; stopping the others")
            break
    finally:
        for replica in list(running.values()):
            replica.terminate()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server is not None:
            server.shutdown()
    return status
