"""One rank of ``tests/test_process_exit.py``: a gloo work issued during a backward pass whose
worker thread waits for the GIL while rank 0's interpreter starts finalizing.

Rank 0 issues an all-reduce from a gradient hook (inside ``backward``, where PyTorch copies a
Python object into the work's thread-local state) and drops its handle; a leaked reference
keeps the group alive, as a live DeviceMesh does in a recipe. Its last exit handler (the first
registered) writes ``joined`` for rank 1 and then holds the GIL for a few seconds, so the
work completes and gloo's worker thread blocks on the GIL to release it; the interpreter
starts finalizing straight after, and a module-level object's ``__del__`` releases the GIL
while it does. Rank 1 joins the all-reduce once ``joined`` appears, and exits if rank 0 ends
without running its exit handlers.

Without ``finish_process`` rank 0 aborts (SIGABRT); with it, it exits 0.
Usage: ``python _gloo_exit_worker.py OUT_DIR plain|finish_process`` with the usual
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` environment.
"""

import atexit
import sys
import time


def _join_then_hold_the_gil() -> None:
    (OUT_DIR / "joined").write_text("")
    # No forced GIL hand-over while this spins: the worker thread keeps waiting for the GIL.
    sys.setswitchinterval(1000.0)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass


class _ReleasesTheGilWhenFinalized:
    # ``sleep`` bound now: module globals are gone by the time finalization deletes this.
    def __del__(self, sleep=time.sleep) -> None:
        sleep(0.5)


if __name__ == "__main__" and sys.argv[0].endswith("_gloo_exit_worker.py"):
    # Registered before torch's own exit handlers, so it runs last, just before finalizing.
    atexit.register(lambda: RANK == 0 and _join_then_hold_the_gil())

import ctypes  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from composer_tune.distributed import finish_process, setup_distributed  # noqa: E402

OUT_DIR = Path(sys.argv[1]) if len(sys.argv) > 1 else Path()
RANK = int(os.environ.get("RANK", "0"))
RELEASES_THE_GIL_WHEN_FINALIZED = _ReleasesTheGilWhenFinalized()


def _rank0() -> None:
    weight = torch.ones(3, requires_grad=True)

    def all_reduce_from_backward(grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(torch.ones(4), async_op=True)  # handle dropped at once
        return grad

    weight.register_hook(all_reduce_from_backward)
    (weight * 2).sum().backward()
    (OUT_DIR / "rank0.pid").write_text(str(os.getpid()))


def _rank1() -> None:
    deadline = time.monotonic() + 120
    pid_file = OUT_DIR / "rank0.pid"
    while not (OUT_DIR / "joined").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 neither reached its exit handlers nor ended")
        if pid_file.exists() and pid_file.read_text() and not _alive(int(pid_file.read_text())):
            os._exit(0)  # rank 0 ended without its exit handlers: nothing left to join
        time.sleep(0.02)
    dist.all_reduce(torch.ones(4))
    os._exit(0)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def main() -> None:
    setup_distributed("cpu")
    # Rank 0 hosts the rendezvous store: it must not end before rank 1 has joined the group.
    dist.barrier()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(dist.group.WORLD))  # never released
    _rank0() if RANK == 0 else _rank1()


if __name__ == "__main__":
    if sys.argv[2] == "finish_process":
        finish_process(main)
    else:
        main()
