"""``finish_process``: a process that ran gloo collectives ends without finalizing the
interpreter, because finalizing can abort it (see the function's docstring); every other
process exits as Python would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from composer_tune.distributed import finish_process

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_gloo_exit_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_two_ranks(mode: str, out_dir: Path) -> list[subprocess.CompletedProcess]:
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO_ROOT),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out_dir), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.slow
def test_finalizing_while_a_gloo_thread_waits_for_the_gil_aborts(tmp_path: Path) -> None:
    """The hazard itself, made deterministic (negative control for the test below). If a
    PyTorch upgrade makes this pass no more, ``finish_process``'s workaround may be obsolete."""
    rank0, rank1 = _run_two_ranks("plain", tmp_path)
    assert rank1.returncode == 0, rank1.stderr
    assert rank0.returncode == -signal.SIGABRT, rank0.stderr
    assert "terminate called without an active exception" in rank0.stderr


@pytest.mark.slow
def test_finish_process_ends_such_a_process_cleanly(tmp_path: Path) -> None:
    rank0, rank1 = _run_two_ranks("finish_process", tmp_path)
    assert rank1.returncode == 0, rank1.stderr
    assert rank0.returncode == 0, rank0.stderr
    assert "terminate called" not in rank0.stderr


def test_without_gloo_it_returns_and_raises_as_python_would() -> None:
    assert finish_process(lambda: 7) == 7
    with pytest.raises(SystemExit) as stopped:
        finish_process(lambda: sys.exit(130))
    assert stopped.value.code == 130
    with pytest.raises(ValueError, match="bad value"):
        finish_process(lambda: (_ for _ in ()).throw(ValueError("bad value")))


@pytest.mark.parametrize(
    ("body", "status", "stderr_has"),
    [
        ("return None", 0, None),
        ("sys.exit(130)", 130, None),
        ("sys.exit('a message')", 1, "a message"),
        ("raise ValueError('bad value')", 1, "ValueError: bad value"),
        ("raise KeyboardInterrupt", 130, "KeyboardInterrupt"),
    ],
)
def test_after_gloo_it_exits_with_pythons_status_and_flushed_output(
    body: str, status: int, stderr_has: str | None
) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import composer_tune.distributed as distributed
        distributed._started_gloo = True  # as setup_distributed records it

        def run():
            print("unflushed output", end="")
            {body}

        distributed.finish_process(run)
        print("not reached")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == status, result.stderr
    assert result.stdout == "unflushed output"
    if stderr_has is not None:
        assert stderr_has in result.stderr
