"""Any task's prompts, the way TRL reads them: :class:`TaskDataset`.

The rows come from a Hugging Face dataset name (from the local cache: the hub is never
contacted), local JSONL / JSON / Parquet / CSV files or a folder of them, or a folder that
``datasets.Dataset.save_to_disk`` wrote, all loaded by the ``datasets`` library. A row is in one
of TRL 1.16's two formats: standard (``prompt`` is a string) or conversational (``prompt`` is a
list of chat messages). ``column_map`` renames source columns first (``{question: prompt}``).

Every other column is passed through untouched, as TRL passes it: to the reward functions as a
keyword list, to an environment's ``reset(**row)``, to SDPO's hints (``solution``,
``privileged_context``) and to evaluation. No gold ``answer`` is needed anywhere.

Each row renders as chat messages (a standard prompt becomes the user message; ``system_prompt``
is put first when the row has no system message); the reward functions still see a standard
row's prompt and completions as strings (``TaskRow.prompt_text``).

A held-out set is a split name (``split: test``), another file (``source: heldout.jsonl``), or
a deterministic hash split of one source: rows whose prompt hashes below ``heldout_fraction``
are held out (``heldout: true`` takes them, ``false`` the rest), so a prompt is never on both
sides and the split does not depend on row order, ``num_samples`` or the shuffle seed.

A source that cannot be read, holds no rows, lacks a ``prompt`` column, or has a row whose
prompt is missing or of the wrong type is a one-line ``ValueError`` naming the source and row.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

# File suffixes and the ``datasets`` builder that reads them.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# What ``save_to_disk`` writes into its folder (a Dataset; a DatasetDict).
SAVED_MARKERS = ("state.json", "dataset_dict.json")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class TaskRow(dict):
    """A dataset row (its columns, ``prompt`` as chat messages), plus ``prompt_text``: the
    prompt string of a standard-format row (None: conversational). It is an attribute, not a
    column, so it never reaches ``reset(**row)`` or the reward functions' keywords."""

    __slots__ = ("prompt_text",)

    def __init__(self, columns: Mapping[str, Any], prompt_text: str | None = None) -> None:
        super().__init__(columns)
        self.prompt_text = prompt_text


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or log lines from ``datasets`` while it loads (its own errors are
    turned into one line here), the hub left alone, and its settings restored after."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def _files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in FILE_BUILDERS)


def _load_source(source: str, subset: str | None) -> Any:
    """The ``datasets.Dataset`` (or ``DatasetDict``) at ``source``."""
    import datasets

    path = Path(source)
    if path.is_dir():
        if any((path / marker).is_file() for marker in SAVED_MARKERS):
            return datasets.load_from_disk(str(path))
        files = _files_in(path)
        if not files:
            raise ValueError(
                f"dataset {source}: the folder holds no {'/'.join(FILE_BUILDERS)} file and is "
                "not a save_to_disk folder"
            )
        builders = {FILE_BUILDERS[f.suffix] for f in files}
        if len(builders) > 1:
            raise ValueError(f"dataset {source}: the folder mixes file types {sorted(builders)}")
        return datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files])
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(
                f"dataset {source}: unsupported file type {path.suffix!r} "
                f"(one of {', '.join(FILE_BUILDERS)})"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"dataset {source}: the file is empty")
        return datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
    if path.suffix in FILE_BUILDERS or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise FileNotFoundError(f"dataset {source}: no such file or folder")
    try:
        return datasets.load_dataset(source, subset)
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        raise ValueError(
            f"dataset {source}: not a local file or folder, and not in the Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}; this machine does not download): "
            f"{str(err).splitlines()[0]}"
        ) from None


def _pick_split(data: Any, source: str, split: str | None) -> Any:
    """One split of a ``DatasetDict`` (``split``, else its only one, else ``train``)."""
    import datasets

    if not isinstance(data, datasets.DatasetDict):
        return data
    names = sorted(data)
    if split is None:
        split = names[0] if len(names) == 1 else "train"
    if split not in data:
        raise ValueError(f"dataset {source}: no split {split!r} (it has {names})")
    return data[split]


def _first_line(err: BaseException) -> str:
    """The first line of the innermost message, where ``datasets`` wraps the reader's error."""
    while err.__cause__ is not None and not str(err).strip():
        err = err.__cause__
    cause = err.__cause__ or err
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__


def _prompt_error(prompt: Any) -> str | None:
    """Why ``prompt`` is neither TRL's standard nor conversational prompt (None: it is one)."""
    if prompt is None:
        return "has no prompt"
    if isinstance(prompt, str):
        return "has an empty prompt" if not prompt.strip() else None
    if not isinstance(prompt, list) or not prompt:
        return (
            f"has a prompt of type {type(prompt).__name__}: expected a string (TRL's standard "
            "format) or a non-empty list of chat messages (conversational)"
        )
    for index, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"has prompt[{index}] of type {type(message).__name__}, not a chat message"
        if message.get("role") not in MESSAGE_ROLES:
            return (
                f"has prompt[{index}] with role {message.get('role')!r}, not one of {MESSAGE_ROLES}"
            )
        content = message.get("content")
        if not isinstance(content, str) and not (
            message["role"] == "assistant" and message.get("tool_calls")
        ):
            return f"has prompt[{index}] whose content is {type(content).__name__}, not a string"
    return None


def _prompt_hash(prompt: Any) -> float:
    """A prompt's place in [0, 1), from its text alone (the hash split's key)."""
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


class TaskDataset(Dataset):
    """A task's prompts from files, a ``save_to_disk`` folder or the Hugging Face cache.

    Args:
        source: a JSONL / JSON / Parquet / CSV file, a folder of such files, a
            ``save_to_disk`` folder, or a Hugging Face dataset name (read from the local cache).
        split: the split of a dataset with several (default: its only one, else ``train``).
        subset: a Hugging Face dataset's configuration (``load_dataset``'s ``name``).
        column_map: source column -> name, applied first (``{question: prompt}``).
        system_prompt: a system message put first in every row without one.
        num_samples: keep the first this many rows (after the held-out split and the shuffle);
            None: all.
        shuffle_seed: shuffle the rows with this seed before ``num_samples``; None: source
            order.
        heldout_fraction: hash-split the rows: this share is held out (0: no split).
        heldout: with ``heldout_fraction``, take the held-out rows instead of the others.
    """

    def __init__(
        self,
        source: str,
        split: str | None = None,
        subset: str | None = None,
        column_map: Mapping[str, str] | None = None,
        system_prompt: str | None = None,
        num_samples: int | None = None,
        shuffle_seed: int | None = None,
        heldout_fraction: float = 0.0,
        heldout: bool = False,
    ) -> None:
        if not isinstance(source, str) or not source:
            raise ValueError(f"TaskDataset: source must be a path or dataset name, got {source!r}")
        column_map = dict(column_map or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in column_map.items()):
            raise ValueError(f"dataset {source}: column_map must map names to names: {column_map}")
        if num_samples is not None and (isinstance(num_samples, bool) or num_samples < 1):
            raise ValueError(f"dataset {source}: num_samples must be >= 1, got {num_samples}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(
                f"dataset {source}: heldout_fraction must be in [0, 1), got {heldout_fraction}"
            )
        if heldout and not heldout_fraction:
            raise ValueError(f"dataset {source}: heldout=true needs a heldout_fraction above 0")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"dataset {source}: system_prompt must be a string")
        self.source, self.system_prompt = source, system_prompt
        where = source if split is None else f"{source} [{split}]"
        with _quiet_datasets():
            try:
                data = _pick_split(_load_source(source, subset), source, split)
            except (ValueError, FileNotFoundError):
                raise
            except StopIteration:
                raise ValueError(f"dataset {where}: holds no rows") from None
            except Exception as err:  # datasets' reader errors: one line naming the source
                raise ValueError(f"dataset {where}: cannot be read: {_first_line(err)}") from None
        missing = sorted(set(column_map) - set(data.column_names))
        if missing:
            raise ValueError(
                f"dataset {where}: column_map names columns it lacks {missing} "
                f"(columns: {data.column_names})"
            )
        if column_map:
            clashes = sorted(set(column_map.values()) & (set(data.column_names) - set(column_map)))
            if clashes:
                raise ValueError(
                    f"dataset {where}: column_map would overwrite existing columns {clashes}"
                )
            data = data.rename_columns(column_map)
        if "prompt" not in data.column_names:
            raise ValueError(
                f"dataset {where}: no 'prompt' column (columns: {data.column_names}); "
                "rename one with column_map, e.g. column_map: {question: prompt}"
            )
        if len(data) == 0:
            raise ValueError(f"dataset {where}: holds no rows")
        prompts = data["prompt"]
        rows = range(len(data))
        if heldout_fraction:
            rows = [i for i in rows if (_prompt_hash(prompts[i]) < heldout_fraction) == heldout]
            if not rows:
                part = "held-out" if heldout else "training"
                raise ValueError(
                    f"dataset {where}: the {part} part of heldout_fraction={heldout_fraction} "
                    "holds no rows"
                )
        if shuffle_seed is not None:
            import random

            rows = list(rows)
            random.Random(shuffle_seed).shuffle(rows)
        if num_samples is not None:
            if num_samples > len(rows):
                raise ValueError(
                    f"dataset {where}: num_samples={num_samples} but it has {len(rows)} rows"
                )
            rows = rows[:num_samples]
        for row in rows:
            problem = _prompt_error(prompts[row])
            if problem is not None:
                raise ValueError(f"dataset {where}: row {row} {problem}")
        self.rows = list(rows)
        self.data = data

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> TaskRow:
        row = dict(self.data[self.rows[index]])
        prompt = row["prompt"]
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            messages = [{"role": "user", "content": text}]
        else:
            # Arrow gives every message every key any message has (None where it lacked it);
            # templates test keys with `is defined`, so the absent ones are dropped again.
            messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        row["prompt"] = messages
        return TaskRow(row, prompt_text=text)
