"""Lets ``tune run recipes/<name>.py`` run this repository's recipes.

torchtune 0.6.1 turns ``recipes/sft.py`` into the module name ``recipes.sft`` and runs it with
``runpy.run_module`` after *appending* the working directory to ``sys.path``. Its wheel also installs
a top-level ``recipes`` package whose ``__init__`` raises, and that one is found first, so every
custom recipe under a ``recipes/`` folder fails.

The fix is deliberately narrow: a one-line ``.pth`` file installed with composer-tune calls
``install()``, which puts a finder in front of ``sys.meta_path`` that answers for the single
top-level name ``recipes``, and only when the current directory holds a ``recipes/__init__.py``
carrying :data:`MARKER` (this repository's, or a copy of it). Everything else, torchtune's own
built-in recipes included (it runs those by file path), resolves as before. No file of another
package is modified. This module must stay cheap to import: it runs at every interpreter start.

The finder also sees the first import of ``torchao`` (torchtune imports it) and filters the one
known-harmless warning torchao prints then (see ``_quiet_torchao_version_warning``). ``install()``
also makes torchrun's own signal stop (its uncaught ``SignalException``, and only that) one line
instead of a traceback (see ``_one_line_torchrun_signal_stop``).
"""

from __future__ import annotations

import os
import sys

MARKER = "composer-tune recipes"


class LocalRecipesFinder:
    """Resolves ``recipes`` to ``./recipes`` when that folder is a composer-tune recipes package."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> object:
        if fullname == "torchao":
            _quiet_torchao_version_warning()
            return None
        if fullname != "recipes":
            return None
        init = os.path.join(os.getcwd(), "recipes", "__init__.py")
        try:
            with open(init, encoding="utf-8") as handle:
                if MARKER not in handle.read(4096):
                    return None
        except OSError:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(
            "recipes", init, submodule_search_locations=[os.path.dirname(init)]
        )


TORCHAO_VERSION_WARNING = "Skipping import of cpp extensions due to incompatible torch version"


def _quiet_torchao_version_warning() -> None:
    """Drops the one warning torchao logs on import when the pinned torch is newer than the
    versions it lists: its C++ kernels (quantisation, low-bit optimisers) are not used by
    composer-tune. Called just before torchao is first imported, so interpreter start pays
    nothing; the filter matches that message on the ``torchao`` logger only."""
    import logging

    logging.getLogger("torchao").addFilter(
        lambda record: not record.getMessage().startswith(TORCHAO_VERSION_WARNING)
    )


def _is_torchrun_signal_stop(exc_type: type[BaseException]) -> bool:
    return exc_type.__name__ == "SignalException" and exc_type.__module__.startswith(
        "torch.distributed.elastic"
    )


def _one_line_torchrun_signal_stop(previous: object) -> object:
    """An excepthook that prints torchrun's own signal stop as one line, not a traceback.

    On Ctrl-C the torchrun agent (the ``tune run --nproc_per_node ...`` process) passes the
    signal to its workers, which save a checkpoint and say where (composer_tune/stop.py), then
    re-raises ``SignalException`` to its top level. Every other exception goes to ``previous``.
    """

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        if _is_torchrun_signal_stop(exc_type):
            print(f"torchrun: {exc}; its workers were told to stop", file=sys.stderr, flush=True)
            return
        previous(exc_type, exc, tb)  # type: ignore[operator]

    hook.composer_tune = True  # type: ignore[attr-defined]
    return hook


def install() -> None:
    """Adds the finder and the excepthook once (``.pth`` files can be processed twice, e.g. via
    a lib64 link)."""
    if not any(isinstance(finder, LocalRecipesFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, LocalRecipesFinder())
    if not getattr(sys.excepthook, "composer_tune", False):
        sys.excepthook = _one_line_torchrun_signal_stop(sys.excepthook)
