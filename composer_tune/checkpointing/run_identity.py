"""A run's identity, so that resuming never mixes two runs.

Every run checkpoint records the resolved config it was written with, minus the keys a resumed
run may change (:data:`RESUMABLE_CHANGES`: how long it runs, where and how often it logs,
checkpoints and evaluates). Resuming from a checkpoint whose identity differs from the current
config (a dapo run resumed by a grpo command, a copied recipe writing the same output_dir) is an
error naming the differing keys, unless ``checkpoint.resume_with_changed_config=true`` says the
change is meant. A key the checkpoint's identity lacks (a setting added to the recipe after it was
written) is no change while it holds the schema's default: that is what the older run ran with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

IDENTITY_FILE = "run_identity.json"
# Top-level keys (and sections) a resumed run may change.
RESUMABLE_CHANGES = (
    "output_dir",
    "max_steps",
    "logging",
    "checkpoint",
    "eval_every_n_steps",
    "eval_batch_size",
)
_MISSING = object()


def run_identity(cfg: DictConfig, *, resolve: bool = True) -> dict[str, Any]:
    """The resolved config as dotted keys, without :data:`RESUMABLE_CHANGES` (``output_dir``
    resolved as a placeholder where other keys interpolate it; ``resolve=False`` keeps
    interpolations and missing values as written)."""
    identity: dict[str, Any] = {}

    def flatten(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            identity[prefix] = node

    # Keys that interpolate output_dir (e.g. a cache under it) stay equal when a run's
    # checkpoints are copied or its folder is moved.
    located = cfg.copy()
    located.output_dir = "<output_dir>"
    flatten("", OmegaConf.to_container(located, resolve=resolve))
    return {
        key: value
        for key, value in sorted(identity.items())
        if key.split(".", 1)[0] not in RESUMABLE_CHANGES
    }


def identity_defaults(schema: type | None) -> dict[str, Any]:
    """The identity of a recipe's config ``schema`` (a dataclass) at its defaults (``{}``
    without one): what a key a checkpoint predates is taken to have been."""
    if schema is None:
        return {}
    defaults = OmegaConf.structured(schema)
    defaults.output_dir = "<output_dir>"
    return run_identity(defaults, resolve=False)


def write_identity(checkpoint_dir: Path, identity: Mapping[str, Any]) -> None:
    """Writes ``identity`` into a (staging) checkpoint folder."""
    (checkpoint_dir / IDENTITY_FILE).write_text(
        json.dumps(dict(identity), indent=1, default=str), encoding="utf-8"
    )


def identity_changes(
    checkpoint: Path, identity: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> list[str] | None:
    """How ``identity`` differs from the one ``checkpoint`` was written with, one
    ``"key: old -> new"`` per differing key (empty: the same run); None when the checkpoint
    records no identity (written before identities were recorded). A key the stored identity
    lacks is no change while its value equals ``defaults``' (:func:`identity_defaults`).

    Raises:
        ValueError: the recorded identity is unreadable.
    """
    path = checkpoint / IDENTITY_FILE
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: unreadable run identity ({error})") from error
    current = json.loads(json.dumps(dict(identity), default=str))  # as it would be stored
    known = json.loads(json.dumps(dict(defaults or {}), default=str))
    return [
        f"{key}: {_show(stored, key)} -> {_show(current, key)}"
        for key in sorted(stored.keys() | current.keys())
        if stored.get(key, _MISSING) != current.get(key, _MISSING)
        and not (key not in stored and key in known and known[key] == current.get(key, _MISSING))
    ]


def describe_changes(changes: list[str], shown: int = 6) -> str:
    """The first ``shown`` changes, joined, and how many more there are."""
    more = f" and {len(changes) - shown} more" if len(changes) > shown else ""
    return ", ".join(changes[:shown]) + more


def check_resume_identity(
    checkpoint: Path,
    identity: Mapping[str, Any],
    *,
    allow_changes: bool,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Refuses to resume ``checkpoint`` with a config whose identity differs from the one it
    was written with (ValueError naming the keys), unless ``allow_changes``. A checkpoint
    written before identities were recorded is accepted, with one line saying it could not be
    checked."""
    changes = identity_changes(checkpoint, identity, defaults)
    main = os.environ.get("RANK", "0") == "0"
    if changes is None:
        if main:
            print(f"{checkpoint} records no run identity: resuming without checking it", flush=True)
        return
    if not changes:
        return
    if allow_changes:
        if main:
            print(
                f"resuming {checkpoint} with a changed config ({describe_changes(changes)})",
                flush=True,
            )
        return
    raise ValueError(
        f"{checkpoint} was written by a different run ({describe_changes(changes)}): resume it "
        "with the settings it was written with, use another output_dir, or set "
        "checkpoint.resume_with_changed_config=true if the change is meant"
    )


def _show(identity: Mapping[str, Any], key: str) -> str:
    return repr(identity[key]) if key in identity else "(unset)"
