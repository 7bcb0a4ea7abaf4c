"""Graceful stop: Ctrl-C (SIGINT) or SIGTERM asks a recipe to stop at its next checkpoint
boundary (the end of the current generation batch, or SFT step), save a resumable checkpoint,
say where in one line, and exit with status 130 without a traceback.

Every rank must stop at the same step, and a signal may reach only some of them (torchrun's agent
forwards a terminal's Ctrl-C to its workers, a scheduler may signal one process), so
:meth:`StopRequest.requested` is a collective: a max over ranks of "was I signalled". The
recipes call it once per generation batch (a scalar all-reduce). In a single process a second
signal aborts at once, as a plain Ctrl-C would; under torchrun the agent forwards the terminal's
signal to workers that already received it, so there a repeated signal is not taken as "abort"
(a second Ctrl-C to torchrun itself, or its own timeout, kills the workers).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

# STOPPED_EXIT_CODE is defined with the process-exit helpers it also serves; a recipe imports it
# from here, with the rest of graceful stop.
from composer_tune.distributed import STOPPED_EXIT_CODE, DistInfo, any_rank

__all__ = ["STOPPED_EXIT_CODE", "StopRequest", "print_stopped"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Catches SIGINT and SIGTERM while a recipe trains (main thread only; a no-op elsewhere).

    Use as a context manager around the training loop; :meth:`requested` polls (collectively).
    """

    def __init__(self, dist_info: DistInfo) -> None:
        self.dist_info = dist_info
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        # Under torchrun the agent re-sends the terminal's signal: never abort on a repeat there.
        self._repeat_aborts = dist_info.world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ

    def __enter__(self) -> StopRequest:
        try:
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: leave signals to whoever owns them
            self._restore()
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if self._repeat_aborts:
                self._restore()
                print(f"{name} again: aborting without a checkpoint", file=sys.stderr, flush=True)
                signal.raise_signal(signum)
            return
        self.signal_name = name
        if self.dist_info.is_main or self.dist_info.world_size == 1:
            print(
                f"{name}: stopping at the next checkpoint boundary to save a checkpoint "
                + ("(again to abort)" if self._repeat_aborts else ""),
                file=sys.stderr,
                flush=True,
            )

    @property
    def signalled(self) -> bool:
        """Whether this process was signalled (local; no collective)."""
        return self.signal_name is not None

    def requested(self) -> bool:
        """Whether any rank was signalled (collective: every rank must call it at the same
        point, and every rank gets the same answer)."""
        return any_rank(self.signalled, self.dist_info.device)


def print_stopped(step: int, checkpoint: Any, dist_info: DistInfo) -> None:
    """The one line a stopped run prints (rank 0); the recipe then cleans up and exits with
    :data:`STOPPED_EXIT_CODE`."""
    if dist_info.is_main:
        print(
            f"stopped at step {step}; checkpoint {checkpoint}; resume with "
            "checkpoint.resume_from_checkpoint=latest",
            flush=True,
        )
