"""Warm start for the RL recipes: reuse (or first train) the SFT checkpoint they begin from.

Every RL arm starts from a supervised checkpoint. A recipe config names the run that makes it::

    warm_start:
      recipe: recipes/sft.py
      config: cpu_smoke
      output_dir: outputs/sft_cpu_smoke
      overrides: []

:func:`resolve_warm_start` returns the ``model/`` folder of the newest complete checkpoint in
``output_dir`` once that folder holds the *finished* run the section describes; if there is no
checkpoint yet it first runs ``tune run <recipe> --config <config> output_dir=<output_dir>
<overrides...>`` in a subprocess. The folder's checkpoint must record the same run identity as
that command's config (so a warm start trained with other settings, another config or by another
recipe is never taken silently: that is an error naming the differing keys), and must be at the
run's ``max_steps`` (a run stopped earlier is resumed to the end first).
Under torchrun only rank 0 trains (single process); the other ranks wait at a barrier. Rank 0
holds an exclusive file lock (``<output_dir>.lock``) while it checks and trains, so several runs
started together (DiLoCo replicas on one machine, a ladder) train the warm start once: the
first trains it, the others wait and then find it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_tune.checkpointing.run_identity import (
    describe_changes,
    identity_changes,
    identity_defaults,
    run_identity,
)
from composer_tune.checkpointing.run_state import MODEL_DIR, checkpoint_step, latest_checkpoint
from composer_tune.config import load_recipe_config, recipe_schema
from composer_tune.distributed import DistInfo, barrier
from composer_tune.stop import STOPPED_EXIT_CODE

# Set by torchrun; a child that inherited them would try to join this run's process group.
_TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


@dataclass
class WarmStartSection:
    """The supervised run an RL recipe starts from (a config section; see the module docstring).

    Attributes:
        recipe: recipe file run by ``tune run`` when no checkpoint exists yet.
        config: config name or path for that recipe.
        output_dir: where that run writes its checkpoints (and where they are looked up).
        overrides: extra ``key=value`` overrides for that run (e.g. ``max_steps=200``).
    """

    recipe: str = "recipes/sft.py"
    config: str = "cpu_smoke"
    output_dir: str = "outputs/sft_cpu_smoke"
    overrides: list[str] = field(default_factory=list)


def warm_start_command(section: WarmStartSection) -> list[str]:
    """The ``tune run`` command line that trains the warm-start checkpoint."""
    tune = Path(sys.executable).parent / "tune"
    return [
        str(tune),
        "run",
        section.recipe,
        "--config",
        section.config,
        f"output_dir={section.output_dir}",
        *section.overrides,
    ]


def resolve_warm_start(section: WarmStartSection, dist_info: DistInfo) -> Path:
    """The warm-start model folder, training it first if no complete checkpoint exists.

    Collective under torchrun: every rank must call it.

    Returns:
        ``<output_dir>/checkpoints/step_*/model`` of the newest complete checkpoint.

    Raises:
        ValueError: if ``output_dir`` holds a run other than the one the section describes (the
            differing keys named), or one that does not reach its ``max_steps``.
        RuntimeError: if the warm-start run fails or leaves no complete checkpoint.
    """
    if dist_info.is_main:
        with _file_lock(Path(f"{section.output_dir}.lock")):
            _finish_warm_start_run(section)
    barrier()
    checkpoint = latest_checkpoint(section.output_dir)
    if checkpoint is None:
        raise RuntimeError(
            f"warm start: {section.output_dir} holds no complete checkpoint after training; "
            f"check warm_start.recipe/config ({section.recipe}, {section.config})"
        )
    if dist_info.is_main:
        print(f"warm start: initial weights from {checkpoint / MODEL_DIR}", flush=True)
    return checkpoint / MODEL_DIR


def _finish_warm_start_run(section: WarmStartSection) -> None:
    """Leaves ``section.output_dir`` holding the finished run the section describes: trains it
    if absent, resumes it if stopped early; refuses a folder holding another run."""
    expected = load_recipe_config(
        section.recipe, section.config, [f"output_dir={section.output_dir}", *section.overrides]
    )
    checkpoint = latest_checkpoint(section.output_dir)
    if checkpoint is None:
        _train(section, resume=False)
    else:
        changes = identity_changes(
            checkpoint,
            run_identity(expected),
            identity_defaults(recipe_schema(section.recipe)),
        )
        if changes:
            raise ValueError(
                f"warm start: {section.output_dir} holds a run with other settings than "
                f"warm_start describes ({section.recipe} --config {section.config}"
                f"{''.join(' ' + o for o in section.overrides)}): {describe_changes(changes)}; "
                "set warm_start.config/overrides to that run's, or warm_start.output_dir to a "
                "new folder to train the described one"
            )
        if changes is None:
            print(f"warm start: {checkpoint} records no run identity; not checked", flush=True)
        if checkpoint_step(checkpoint) < expected.max_steps:
            print(
                f"warm start: the run in {section.output_dir} stopped at step "
                f"{checkpoint_step(checkpoint)} of {expected.max_steps}; finishing it",
                flush=True,
            )
            _train(section, resume=True)
    checkpoint = latest_checkpoint(section.output_dir)
    if checkpoint is not None and checkpoint_step(checkpoint) < expected.max_steps:
        raise ValueError(
            f"warm start: {section.output_dir} ends at step {checkpoint_step(checkpoint)}, not "
            f"at its max_steps={expected.max_steps}"
        )


def initial_checkpoint(
    warm_start: Mapping[str, Any] | None, checkpoint: str | None, dist_info: DistInfo
) -> str | None:
    """The weights a recipe starts from: the ``warm_start`` run's model folder (trained first
    if missing; collective) or ``checkpoint.initial_checkpoint``; None means random init.

    Raises:
        ValueError: if both are set.
    """
    if warm_start is None:
        return checkpoint
    if checkpoint is not None:
        raise ValueError(
            "set either warm_start or checkpoint.initial_checkpoint, not both (got "
            f"initial_checkpoint={checkpoint}); to start from that checkpoint, add warm_start=null"
        )
    return str(resolve_warm_start(WarmStartSection(**warm_start), dist_info))


def _train(section: WarmStartSection, *, resume: bool) -> None:
    command = warm_start_command(section)
    if resume:
        command.append("checkpoint.resume_from_checkpoint=latest")
    else:
        print(
            f"warm start: no complete checkpoint in {section.output_dir}; training it with: "
            f"{' '.join(command)}",
            flush=True,
        )
    env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_ENV}
    child = subprocess.Popen(command, env=env)
    try:
        returncode = child.wait()
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reached the warm-start run too (one process group): it stops at
        # its next step with a checkpoint the next start resumes. Wait for it, do not kill it
        # (subprocess.run would); a second Ctrl-C aborts both.
        child.wait()
        raise
    if returncode == STOPPED_EXIT_CODE:
        # It was signalled and stopped with a checkpoint; this process too, where its own
        # SIGINT handler did not run (a shell's background job starts with SIGINT ignored).
        raise KeyboardInterrupt
    if returncode != 0:
        raise RuntimeError(f"warm start: `{' '.join(command)}` exited with status {returncode}")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing), held for the duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
