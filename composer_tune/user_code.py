"""Calling the user's code (tools, environments, reward functions) the way every part of the
project does: found by dotted path with an error naming the config key, run on a worker thread
with a time limit, awaited when it is async, and its failure reported rather than raised."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def resolve_path(path: str, where: str) -> Any:
    """The object at dotted ``path``, or a ValueError naming the config key ``where``."""
    from torchtune.config._utils import _get_component_from_path

    try:
        return _get_component_from_path(path)
    except Exception as err:  # torchtune raises InstantiationError / ImportError variants
        raise ValueError(f"{where}: cannot import {path!r}: {err}") from err


@dataclass(frozen=True)
class CallOutcome:
    """What :func:`call_with_timeout` got: ``value``, or ``failure``, a one-line description
    of the exception raised (``"KeyError: 'x'"``) or of the timeout (``timed_out``)."""

    value: Any = None
    failure: str | None = None
    timed_out: bool = False


def call_with_timeout(
    function: Callable[[], Any], timeout_s: float | None, *, name: str
) -> CallOutcome:
    """``function()`` on a daemon thread, awaited when it returns a coroutine (TRL accepts async
    tools, reward functions and ``get_reward``), for at most ``timeout_s`` (None: no limit). A
    call still running then is abandoned, not killed: Python cannot kill a thread, so a callable
    that may hang for good should bound itself, as the sandboxed coding tools do."""
    outcome: dict[str, CallOutcome] = {}

    def run() -> None:
        try:
            value = function()
            outcome["done"] = CallOutcome(
                asyncio.run(value) if inspect.iscoroutine(value) else value
            )
        except Exception as err:  # any failure of user code is reported, never raised here
            outcome["done"] = CallOutcome(failure=f"{type(err).__name__}: {err}")

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return CallOutcome(failure=f"timed out after {timeout_s} s", timed_out=True)
    return outcome["done"]
