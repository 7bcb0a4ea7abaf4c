"""Recipe checkpoints: HF-format weights plus everything needed to resume a run exactly.

Layout of one checkpoint::

    <output_dir>/checkpoints/step_0000120/
        model/               Hugging Face directory (config.json, safetensors, tokenizer files)
        training_state.pt    optimizer, LR scheduler, recipe state (step, data position ...)
        rng_rank{r}.pt       each rank's RNG states

A checkpoint is written into a ``.partial-*`` staging folder, every file and the folder are
fsynced, and the folder is renamed into place (an atomic rename on POSIX) before the parent folder
is fsynced, so a run killed while saving leaves the previous checkpoints intact and no half-written
folder that looks complete. A complete checkpoint is never deleted in place: re-saving a step first
renames the old folder aside (``.replaced-*``), pruning renames it to ``.deleting-*``; a folder
whose name starts with "." is never a checkpoint, and ``remove_stale_staging`` (run at start)
deletes those folders or, where a kill fell between the two renames of a re-save, puts the old
checkpoint back. ``latest_checkpoint`` only ever considers complete folders.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torchtune import training

from composer_tune.checkpointing.hf_checkpoint import (
    CheckpointError,
    _checkpoint_dir,
    _weight_files,
    decoder_args_from_hf_config,
    hf_config_from_decoder_args,
    load_hf_checkpoint,
    read_json,
    save_hf_checkpoint,
)
from composer_tune.checkpointing.run_identity import write_identity
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.distributed import DistInfo, barrier
from composer_tune.models.decoder import DecoderArgs

_STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINING_STATE = "training_state.pt"
MODEL_DIR = "model"
# Scratch folders beside the checkpoints: a save in progress, a re-saved step's old folder kept
# until the new one is in place, and a pruned checkpoint being deleted.
_STAGING, _REPLACED, _DELETING = ".partial-", ".replaced-", ".deleting-"
# Test device (tests/test_crash_safety.py): "<step>:<ready file>" makes the save of that step
# write the ready file and wait, forever, at its most delicate point, so that a test can SIGKILL
# the run there deterministically. Never set in normal runs.
PAUSE_IN_SAVE_ENV = "COMPOSER_TUNE_TEST_PAUSE_IN_SAVE"


def checkpoints_root(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint folder holding its training state and model config."""
    path = Path(path)
    return (path / TRAINING_STATE).is_file() and (path / MODEL_DIR / "config.json").is_file()


def checkpoint_dir(output_dir: str | os.PathLike[str], step: int) -> Path:
    """The folder a run checkpoint of ``step`` is saved in."""
    return checkpoints_root(output_dir) / f"step_{step:07d}"


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The optimizer step a ``step_*`` checkpoint folder was saved at."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a step_* checkpoint folder")
    return int(match.group(1))


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``output_dir``, or None."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _STEP_DIR.match(path.name)) and is_complete_checkpoint(path)
    ]
    return max(complete)[1] if complete else None


def resolve_resume_path(spec: str | None, output_dir: str | os.PathLike[str]) -> Path | None:
    """``None`` -> no resume; ``"latest"`` -> newest complete checkpoint (None if there is none
    yet, so a fresh run and a restarted run share one command, and the run says so: rank 0 prints
    one line); otherwise a checkpoint folder."""
    if spec is None:
        return None
    if spec == "latest":
        latest = latest_checkpoint(output_dir)
        if latest is None and os.environ.get("RANK", "0") == "0":
            print(
                f"resume_from_checkpoint=latest: no complete checkpoint in {output_dir}; "
                "starting from step 0",
                flush=True,
            )
        return latest
    path = Path(spec)
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(
            f"resume_from_checkpoint: {path} is not a complete checkpoint "
            f"(needs {TRAINING_STATE} and {MODEL_DIR}/config.json)"
        )
    return path


def checkpoints_a_fresh_run_replaces(
    section: Any, output_dir: str | os.PathLike[str], *, resuming: bool
) -> list[Path]:
    """The checkpoints a run that does not resume would replace in ``output_dir``.

    A fresh run never silently writes beside another run's checkpoints (``latest`` would then
    mix the two): unless ``section.replace_existing`` says so, finding any is an error telling
    how to resume instead. The caller deletes the returned folders (:func:`remove_checkpoints`)
    only once its set-up has succeeded, so a failed start leaves them as they were.

    Raises:
        ValueError: ``output_dir`` holds checkpoints and ``replace_existing`` is not set.
    """
    root = checkpoints_root(output_dir)
    if resuming or not root.is_dir():
        return []
    existing = sorted(path for path in root.iterdir() if _STEP_DIR.match(path.name))
    if not existing or section.replace_existing:
        return existing
    raise ValueError(
        f"{output_dir} already holds {len(existing)} checkpoint(s) of a run (newest "
        f"{existing[-1].name}): "
        "resume it with checkpoint.resume_from_checkpoint=latest, use another output_dir, or "
        "set checkpoint.replace_existing=true to delete them and start over"
    )


def remove_checkpoints(paths: list[Path]) -> None:
    """Deletes checkpoint folders (from :func:`checkpoints_a_fresh_run_replaces`); prints one
    line."""
    if not paths:
        return
    for path in paths:
        _delete_checkpoint(path)
    print(
        f"checkpoint.replace_existing: deleted the previous run's checkpoints "
        f"({', '.join(path.name for path in paths)}) in {paths[0].parent}",
        flush=True,
    )


def _fsync(path: Path) -> None:
    """Flushes a file's data, or a folder's entries (renames, new files), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file and folder under ``root``, deepest first, then ``root`` itself."""
    for path in sorted(root.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(root)


def _pause_for_test(step: int) -> None:
    """See ``PAUSE_IN_SAVE_ENV``."""
    spec = os.environ.get(PAUSE_IN_SAVE_ENV)
    if not spec:
        return
    pause_step, ready_file = spec.split(":", 1)
    if int(pause_step) != step:
        return
    Path(ready_file).write_text(str(step))
    while True:
        time.sleep(1)


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_model_state_dict(model: nn.Module, dist_info: DistInfo) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (on rank 0; other ranks get an empty dict). Collective."""
    if dist_info.is_distributed:
        return training.gather_cpu_state_dict(model, dist_info.is_main)
    return {key: value.detach().cpu() for key, value in model.state_dict().items()}


def check_checkpoint_section(section: Any) -> None:
    """Rejects a ``checkpoint`` config section's bad counts at set-up, naming the key (a bad
    value would otherwise surface only at the first save)."""
    if section.save_every_n_steps < 0:
        raise ValueError(
            f"config key checkpoint.save_every_n_steps must be >= 0, got "
            f"{section.save_every_n_steps}"
        )
    if section.keep_last is not None and section.keep_last < 1:
        raise ValueError(
            f"config key checkpoint.keep_last must be >= 1 or null (keep all), got "
            f"{section.keep_last}"
        )


def save_run_checkpoint(
    *,
    output_dir: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    model_config: Any,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any,
    recipe_state: Mapping[str, Any],
    dist_info: DistInfo,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_size: int = 4_000_000_000,
    keep_last: int | None = None,
    run_identity: Mapping[str, Any] | None = None,
    save_only_model: bool = False,
) -> Path:
    """Writes ``step_<step>`` atomically. Collective: every rank must call it. ``run_identity``
    (``composer_tune.checkpointing.run_identity``) is recorded for resume checks; ``keep_last``
    (>= 1) then deletes all but the newest that many checkpoints. ``save_only_model`` leaves the
    optimizer state out: the checkpoint can then seed a new run but not resume this one."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    final = checkpoint_dir(output_dir, step)
    root, name = final.parent, final.name
    staging, replaced = root / (_STAGING + name), root / (_REPLACED + name)
    if dist_info.is_main:
        if not root.is_dir():
            root.mkdir(parents=True)
            _fsync(root.parent)  # the new folder's entry survives a crash too
        if staging.exists():  # left by a run killed while saving this same step
            shutil.rmtree(staging)
        staging.mkdir()
    barrier()

    torch.save(rng_state(), staging / f"rng_rank{dist_info.rank}.pt")
    model_sd = full_model_state_dict(model, dist_info)
    optim_sd = None
    if optimizer is not None and not save_only_model:
        optim_sd = (
            training.get_full_optimizer_state_dict(model, optimizer, dist_info.is_main)
            if dist_info.is_distributed
            else optimizer.state_dict()
        )
    barrier()
    if dist_info.is_main:
        hf_config, generation_config = _with_chat_token_ids(model_config, tokenizer_dir)
        save_hf_checkpoint(
            model_sd,
            hf_config,
            staging / MODEL_DIR,
            max_shard_size_bytes=max_shard_size,
            copy_files_from=tokenizer_dir,
            generation_config=generation_config,
        )
        torch.save(
            {
                "step": step,
                "optimizer": optim_sd,
                "model_only": save_only_model,
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "recipe_state": dict(recipe_state),
                "world_size": dist_info.world_size,
            },
            staging / TRAINING_STATE,
        )
        if run_identity is not None:
            write_identity(staging, run_identity)
        _fsync_tree(staging)
        # A re-save of the same step (e.g. a fresh run in an old output_dir): the old folder is
        # only deleted once the new one is in place; remove_stale_staging restores it if a kill
        # falls between the two renames.
        if final.exists():
            os.replace(final, replaced)
        _pause_for_test(step)
        os.replace(staging, final)
        _fsync(root)
        if replaced.exists():
            shutil.rmtree(replaced)
        if keep_last is not None:
            _prune(root, keep_last)
    barrier()
    return final


def _with_chat_token_ids(
    model_config: Any, tokenizer_dir: str | os.PathLike[str] | None
) -> tuple[Any, dict[str, Any] | None]:
    """The HF config and generation config with the chat tokenizer's end-of-turn, pad and BOS
    ids, so that ``transformers``/vLLM stop where the chat template ends a turn. A
    ``config.json`` beside the tokenizer (the initial checkpoint's) supplies the other non-shape
    keys; a run from random init has none."""
    if tokenizer_dir is None:
        return model_config, None
    tokenizer = ChatTokenizer.from_dir(tokenizer_dir)
    source_config = Path(tokenizer_dir) / "config.json"
    extra = read_json(source_config) if source_config.is_file() else {}
    token_ids = {
        "bos_token_id": tokenizer.bos_id
        if tokenizer.bos_id is not None
        else extra.get("bos_token_id"),
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }
    generation = {**token_ids, "eos_token_id": tokenizer.stop_tokens}
    if isinstance(model_config, DecoderArgs):
        config = hf_config_from_decoder_args(
            model_config, torch.float32, extra={**extra, **token_ids}
        )
        return config, generation
    if isinstance(model_config, Mapping):
        return {**dict(model_config), **token_ids}, None
    hf_config = {**model_config.hf_config, **token_ids}
    return dataclasses.replace(model_config, hf_config=hf_config), generation


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(
        (int(m.group(1)), path) for path in root.iterdir() if (m := _STEP_DIR.match(path.name))
    )
    for _, path in steps[:-keep_last]:
        _delete_checkpoint(path)


def _delete_checkpoint(path: Path) -> None:
    # Renamed first: a kill during the deletion must not leave a gutted step_* folder.
    doomed = path.with_name(_DELETING + path.name)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def remove_stale_staging(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Cleans up after a run killed mid-save; returns the scratch folders it deleted.

    Deletes unfinished saves and half-pruned checkpoints, and puts a re-saved step's old folder
    back where the kill came before the new one was in place. Call on rank 0 at start, before
    any rank looks for the latest checkpoint (then a barrier).
    """
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    stale = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(_REPLACED):
            original = path.with_name(path.name.removeprefix(_REPLACED))
            if not original.exists():
                os.replace(path, original)
                continue
        if path.name.startswith((_STAGING, _REPLACED, _DELETING)):
            shutil.rmtree(path)
            stale.append(path)
    _fsync(root)
    return stale


def load_training_state(
    checkpoint: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any,
    dist_info: DistInfo,
) -> dict[str, Any]:
    """Restores optimizer, scheduler and this rank's RNG; returns the recipe state.

    The model weights are loaded separately, from ``checkpoint / "model"``, by the same code path
    as an initial HF checkpoint.
    """
    state = torch.load(checkpoint / TRAINING_STATE, map_location="cpu", weights_only=False)
    if state.get("model_only"):
        raise ValueError(
            f"{checkpoint} was saved with checkpoint.save_only_model=true and holds no optimizer "
            f"state, so the run cannot resume from it exactly; start a new run from its weights "
            f"(checkpoint.initial_checkpoint={checkpoint / MODEL_DIR})"
        )
    if state["world_size"] != dist_info.world_size:
        raise ValueError(
            f"{checkpoint} was written by {state['world_size']} ranks; resuming needs the same "
            f"number (got {dist_info.world_size}) so that data order and RNG streams match"
        )
    if optimizer is not None and state["optimizer"] is not None:
        if dist_info.is_distributed:
            training.load_from_full_optimizer_state_dict(
                model, optimizer, state["optimizer"], dist_info.device
            )
        else:
            optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None and state["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    set_rng_state(
        torch.load(
            checkpoint / f"rng_rank{dist_info.rank}.pt", map_location="cpu", weights_only=False
        )
    )
    return state["recipe_state"]


def _model_dir(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """An HF checkpoint directory as given, or a run checkpoint's ``model/`` inside it."""
    path = Path(checkpoint_dir)
    if (path / MODEL_DIR / "config.json").is_file():
        path = path / MODEL_DIR
    return path


def check_model_files(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Pre-flight of an HF checkpoint directory (or a run checkpoint), reading no weights.

    Checks that ``config.json`` parses and that every weight file exists, so a broken
    checkpoint fails in seconds, naming the path, rather than after the shards before the
    missing one were read. Returns the ``config.json`` dict. Raises CheckpointError.
    """
    directory = _checkpoint_dir(_model_dir(checkpoint_dir))
    config = read_json(directory / "config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{directory / 'config.json'}: no 'model_type'")
    for filename in _weight_files(directory):
        if not (directory / filename).is_file():
            raise CheckpointError(f"missing weight file {directory / filename}")
    return config


def check_architecture(
    model: nn.Module, stored: Mapping[str, Any], checkpoint_dir: str | os.PathLike[str]
) -> None:
    """Raise CheckpointError unless the checkpoint's ``config.json`` (``stored``) describes
    ``model``'s architecture (the context length aside: it is no weight)."""
    source = _model_dir(checkpoint_dir) / "config.json"
    if isinstance(model.config, DecoderArgs):
        args = decoder_args_from_hf_config(stored, source=str(source))
        if dataclasses.replace(args, max_seq_len=model.config.max_seq_len) != model.config:
            raise CheckpointError(
                f"checkpoint {checkpoint_dir} holds a different architecture than config key "
                f"'model': {args} vs {model.config}"
            )
        return
    differences = model.config.architecture_differences(stored)
    if differences:
        raise CheckpointError(
            f"checkpoint {checkpoint_dir} holds a different architecture than config key "
            f"'model' ({source} differs from model.path's config.json in {differences})"
        )


def load_model_weights(
    checkpoint_dir: str | os.PathLike[str], model: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """Weights of an HF checkpoint directory (or a run checkpoint's ``model/``) under the
    parameter names of ``model`` (the native decoder's names when None)."""
    directory = _model_dir(checkpoint_dir)
    if model is not None and not isinstance(model.config, DecoderArgs):
        from composer_tune.models.hf_backend import load_transformers_weights

        return load_transformers_weights(directory)
    _, state_dict = load_hf_checkpoint(directory)
    return state_dict
