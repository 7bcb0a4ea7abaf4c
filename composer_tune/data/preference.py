"""Preference pairs for DPO: loading, chat rendering, truncation, held-out split, batching and
reference log-probs (cached on disk).

Channel 3 of composer-tune, trace-replay DPO, is this project's OWN research addition, not part
of Cursor's published Composer recipe. Its pairs are mined by ``tools/build_pairs.py``
(``composer_tune.data.pairs``): JSONL rows ``{prompt_messages, tools_json, chosen, rejected,
scores, provenance, teachers}`` with OpenAI-format messages, tool-call arguments as JSON strings
and the tool definitions as a JSON string.

Rendering (Qwen3 chat template, ``ChatTokenizer.tokenize_messages``):

* prompt = ``prompt_messages`` with ``tools`` and the generation prompt
  (``<|im_start|>assistant\\n``);
* a completion = the tokens that rendering ``prompt_messages + [assistant message]`` adds after
  the prompt, through ``<|im_end|>`` (text, ``<tool_call>`` blocks and, in thinking mode, the
  empty ``<think>`` block Qwen3 puts on a final turn). The prompt must be an exact token prefix
  of the full rendering, which makes the completion ids exactly what the model would generate;
  a pair where it is not raises :class:`PreferenceDataError`. Qwen3's template gives a final
  assistant turn the empty ``<think>`` block only when a user message precedes it; agent
  contexts cut short by ingestion often have none, so such completions start without it (as
  the template renders them; chosen and rejected of one pair are always rendered alike).

Truncation (``max_seq_len``): a row of a batch is prompt + one completion, so a pair needs
``len(prompt) + max(len(chosen), len(rejected)) <= max_seq_len``. Completions are never cut (a
cut completion is a different action); a pair whose longer completion alone leaves no room for
one prompt token is dropped and counted (``stats["dropped_completion_too_long"]``). Otherwise a
long prompt keeps its END (the latest context and the generation prompt, which the next action
depends on most) and loses its start (system prompt, tool list, early turns); counted in
``stats["prompt_truncated"]``.

Held-out split: each pair has a ``pair_id``, a hash of the trace step it came from (see
:func:`pair_id`), and belongs to the held-out split when that hash, read as a number in [0, 1),
is below ``heldout_fraction``: deterministic, independent of file order and of which other pairs
exist. ``split_by="session"`` hashes only the session instead, so that consecutive steps of one
session (which share most of their context) never straddle the split.

Batches (:func:`collate_preference`): chosen rows then rejected rows in one right-padded
``PackedBatch`` (one forward over ``2B`` rows), targets aligned as in
``composer_tune.rollout.generation`` (target ``t`` predicted from position ``t - 1``).

The reference log-probs that batches carry are computed (model forwards) in
``composer_tune.channels.dpo_reference``; each pair's ``cache_key`` (pair id + a hash of the exact
token ids scored) keys them.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset

from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.rollout.generation import PackedBatch, pack_sequences

Split = Literal["train", "heldout", "all"]
SplitBy = Literal["pair", "session"]
PAIR_FIELDS = ("prompt_messages", "tools_json", "chosen", "rejected", "provenance")
# Provenance fields that identify the trace step itself: not the absolute path it was ingested
# from (machine-dependent) nor the mining decision (mode, chosen_from), so re-mining the same
# steps with other rules keeps every step on its side of the split.
_STEP_IDENTITY = ("source_format", "session_id", "step_index", "record_ids", "is_sidechain")


class PreferenceDataError(ValueError):
    """A preference pair is unusable; the message names the source (file:line) and the field."""


# ----------------------------------------------------------------------------------- loading


def load_pair_rows(source: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every pair of ``source``, validated; ``where`` is ``file:line``.

    ``source`` is a pairs JSONL file, a local directory of them (``*.jsonl``, sorted), or the
    name of a ``datasets`` dataset (its ``train`` split; ``where`` is then ``name[row]``).
    """
    path = Path(source)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"no *.jsonl pairs files in directory {path}")
    elif path.suffix in (".jsonl", ".json") or path.is_absolute():
        raise FileNotFoundError(f"pairs file not found: {path}")
    else:
        return _load_hub_rows(str(source))
    rows = []
    for file in files:
        with file.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{line_number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise PreferenceDataError(f"{where}: invalid JSON: {error}") from error
                validate_pair(row, where)
                rows.append((where, row))
    return rows


def _load_hub_rows(name: str) -> list[tuple[str, dict[str, Any]]]:
    import datasets  # heavy import, only needed for named datasets

    dataset = datasets.load_dataset(name, split="train")
    rows = []
    for index, row in enumerate(dataset):
        where = f"{name}[{index}]"
        validate_pair(row, where)
        rows.append((where, row))
    return rows


def validate_pair(row: Any, where: str) -> None:
    """Raise :class:`PreferenceDataError` naming ``where`` and the field if ``row`` is unusable."""
    if not isinstance(row, Mapping):
        raise PreferenceDataError(
            f"{where}: a pair must be a JSON object, got {type(row).__name__}"
        )
    missing = [key for key in PAIR_FIELDS if key not in row]
    if missing:
        raise PreferenceDataError(f"{where}: missing field(s) {missing}")
    messages = row["prompt_messages"]
    if not isinstance(messages, list) or not messages:
        raise PreferenceDataError(f"{where}: 'prompt_messages' must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PreferenceDataError(
                f"{where}: 'prompt_messages[{index}]' must be an object with a string 'role'"
            )
    _parse_tools(row["tools_json"], where)
    for key in ("chosen", "rejected"):
        message = row[key]
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            raise PreferenceDataError(f"{where}: '{key}' must be an assistant message object")
        for index, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise PreferenceDataError(
                    f"{where}: '{key}.tool_calls[{index}]' needs a 'function' with a 'name'"
                )
            if not isinstance(function.get("arguments"), str):
                raise PreferenceDataError(
                    f"{where}: '{key}.tool_calls[{index}].function.arguments' must be a JSON "
                    "string, as the chat API sends it"
                )
    if row["chosen"] == row["rejected"]:
        raise PreferenceDataError(f"{where}: 'chosen' and 'rejected' are the same message")
    if not isinstance(row["provenance"], Mapping):
        raise PreferenceDataError(f"{where}: 'provenance' must be an object")


def _parse_tools(tools_json: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tools_json, str):
        raise PreferenceDataError(f"{where}: 'tools_json' must be a JSON string")
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as error:
        raise PreferenceDataError(f"{where}: 'tools_json' is not valid JSON: {error}") from error
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise PreferenceDataError(f"{where}: 'tools_json' must encode a list of tool objects")
    return tools


# ------------------------------------------------------------------------------ identity/split


def _hash_hex(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _step_identity(provenance: Mapping[str, Any], *, session_only: bool) -> dict[str, Any]:
    keys = ("source_format", "session_id") if session_only else _STEP_IDENTITY
    identity = {key: provenance.get(key) for key in keys}
    # The file name (not its absolute path) identifies sessions of formats without session ids.
    identity["file_name"] = Path(str(provenance.get("file", ""))).name
    return identity


def pair_id(provenance: Mapping[str, Any]) -> str:
    """Stable id of the trace step a pair comes from (16 hex digits of a SHA-256).

    Hashes the step's identity (format, session, step index, source record ids, sidechain flag,
    file name), not the ingest path nor the mining decision.
    """
    return _hash_hex(_step_identity(provenance, session_only=False))[:16]


def heldout_bucket(provenance: Mapping[str, Any], split_by: SplitBy = "pair") -> float:
    """Position in [0, 1) of a pair for the held-out split (a pair is held out below the
    held-out fraction)."""
    if split_by not in ("pair", "session"):
        raise ValueError(f"split_by must be 'pair' or 'session', got {split_by!r}")
    digest = _hash_hex(_step_identity(provenance, session_only=split_by == "session"))
    return int(digest[:13], 16) / 16**13


# ---------------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class PreferenceExample:
    """One rendered pair.

    Attributes:
        pair_id: see :func:`pair_id`.
        where: source of the row (``file:line``), for error messages.
        prompt_ids: prompt tokens, ending with the generation prompt (possibly truncated at
            its start).
        chosen_ids: completion tokens of the chosen answer, ending with ``<|im_end|>``.
        rejected_ids: same for the rejected answer.
        prompt_tokens_dropped: prompt tokens removed by truncation.
    """

    pair_id: str
    where: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_tokens_dropped: int = 0

    @property
    def cache_key(self) -> str:
        """Pair id + hash of the exact token ids scored: the reference-log-prob cache key."""
        tokens = [self.prompt_ids, self.chosen_ids, self.rejected_ids]
        return f"{self.pair_id}:{_hash_hex(tokens)[:16]}"


def render_pair(
    row: Mapping[str, Any],
    tokenizer: ChatTokenizer,
    *,
    where: str = "<pair>",
    enable_thinking: bool = True,
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of one validated pair, untruncated.

    Raises:
        PreferenceDataError: if the prompt is not a token prefix of prompt + answer, the
            answer's tokens after the prompt are not one assistant turn ending in ``<|im_end|>``,
            the template drops an answer's tool calls, or both answers render alike.
    """
    if tokenizer.max_seq_len is not None:
        raise ValueError(
            "render_pair: the tokenizer truncates (max_seq_len="
            f"{tokenizer.max_seq_len}), which would cut renderings mid-pair; load it without "
            "max_seq_len and pass max_seq_len to PreferenceDataset instead"
        )
    tools = _parse_tools(row["tools_json"], where) or None
    messages = list(row["prompt_messages"])
    prompt_ids, _ = tokenizer.tokenize_messages(
        messages, tools=tools, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    completions = []
    for key in ("chosen", "rejected"):
        full_ids, loss_mask = tokenizer.tokenize_messages(
            [*messages, row[key]], tools=tools, enable_thinking=enable_thinking
        )
        start = len(prompt_ids)
        if full_ids[:start] != prompt_ids:
            raise PreferenceDataError(
                f"{where}: '{key}': the prompt does not tokenise as a prefix of prompt + answer, "
                "so the answer's tokens cannot be separated exactly (with enable_thinking=False "
                "this happens when no user message precedes the answer: Qwen3's template then "
                "renders it without the generation prompt's empty <think> block)"
            )
        suffix_mask = loss_mask[start:]
        length = suffix_mask.index(False) if False in suffix_mask else len(suffix_mask)
        completion = full_ids[start : start + length]
        if not completion or completion[-1] != tokenizer.eos_id or any(suffix_mask[length:]):
            raise PreferenceDataError(
                f"{where}: '{key}': the tokens after the prompt are not one assistant turn "
                "ending in <|im_end|>"
            )
        rendered = tokenizer.decode(completion, skip_special_tokens=False)
        for call in row[key].get("tool_calls") or []:
            if call["function"]["name"] not in rendered:
                raise PreferenceDataError(
                    f"{where}: '{key}': the checkpoint's chat template drops tool calls (the "
                    f"call to {call['function']['name']!r} is not in its rendering); pairs with "
                    "tool calls need a template that renders them (Qwen3's does, SmolLM2's not)"
                )
        completions.append(completion)
    if completions[0] == completions[1]:
        raise PreferenceDataError(
            f"{where}: 'chosen' and 'rejected' render to the same tokens, so the pair prefers "
            "nothing (the chat template drops what tells them apart)"
        )
    return prompt_ids, completions[0], completions[1]


class PreferenceDataset(Dataset):
    """Rendered preference pairs of one split, as :class:`PreferenceExample`.

    Args:
        source: pairs JSONL file, directory of them, or ``datasets`` name (see
            :func:`load_pair_rows`).
        tokenizer: a ``ChatTokenizer`` loaded without ``max_seq_len``.
        max_seq_len: longest prompt + completion row (see the module docstring for the
            truncation policy); None keeps everything.
        split: ``train`` (pairs not held out), ``heldout`` or ``all``.
        heldout_fraction: share of pairs (in expectation) held out, in [0, 1).
        split_by: hash each ``pair``'s step, or only its ``session``.
        enable_thinking: Qwen3 thinking mode of the rendering (see ``render_chat``).

    Attributes:
        stats: counts ``rows`` (in the source), ``pairs`` (in this split),
            ``prompt_truncated`` and ``dropped_completion_too_long`` (in this split).
    """

    def __init__(
        self,
        source: str | Path,
        tokenizer: ChatTokenizer,
        *,
        max_seq_len: int | None = None,
        split: Split = "train",
        heldout_fraction: float = 0.0,
        split_by: SplitBy = "pair",
        enable_thinking: bool = True,
    ) -> None:
        if split not in ("train", "heldout", "all"):
            raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2 or None, got {max_seq_len}")
        rows = load_pair_rows(source)
        self.stats: Counter = Counter(rows=len(rows))
        seen: dict[str, str] = {}
        self.examples: list[PreferenceExample] = []
        for where, row in rows:
            key = pair_id(row["provenance"])
            if key in seen:
                raise PreferenceDataError(
                    f"{where}: same trace step (pair_id {key}) as {seen[key]}: one pair per step"
                )
            seen[key] = where
            held_out = heldout_bucket(row["provenance"], split_by) < heldout_fraction
            if split != "all" and held_out != (split == "heldout"):
                continue
            example = self._render(row, key, where, tokenizer, max_seq_len, enable_thinking)
            if example is not None:
                self.examples.append(example)
        self.stats["pairs"] = len(self.examples)

    def _render(
        self,
        row: Mapping[str, Any],
        key: str,
        where: str,
        tokenizer: ChatTokenizer,
        max_seq_len: int | None,
        enable_thinking: bool,
    ) -> PreferenceExample | None:
        prompt, chosen, rejected = render_pair(
            row, tokenizer, where=where, enable_thinking=enable_thinking
        )
        dropped = 0
        if max_seq_len is not None:
            room = max_seq_len - max(len(chosen), len(rejected))
            if room < 1:
                self.stats["dropped_completion_too_long"] += 1
                return None
            if len(prompt) > room:
                dropped = len(prompt) - room
                prompt = prompt[dropped:]
                self.stats["prompt_truncated"] += 1
        return PreferenceExample(key, where, prompt, chosen, rejected, dropped)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PreferenceExample:
        return self.examples[index]

    def __iter__(self) -> Iterator[PreferenceExample]:
        return iter(self.examples)


# ------------------------------------------------------------------------------------ batching


@dataclass
class PreferenceBatch:
    """``B`` pairs as ``2B`` right-padded rows: chosen rows ``[0, B)``, rejected ``[B, 2B)``.

    Attributes:
        packed: the rows (``completion_mask`` marks targets as in ``PackedBatch``).
        pair_ids: ``B`` pair ids, in row order.
        reference_chosen_logps: ``[B]`` cached reference log-probs, or None when the batch was
            collated without a reference table (compute them on the fly then).
        reference_rejected_logps: ``[B]``, likewise.
    """

    packed: PackedBatch
    pair_ids: list[str]
    reference_chosen_logps: Tensor | None = None
    reference_rejected_logps: Tensor | None = None

    @property
    def num_pairs(self) -> int:
        """``B``."""
        return len(self.pair_ids)

    def split(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """Per-row ``values`` (``[2B, ...]``) as ``(chosen [B, ...], rejected [B, ...])``."""
        if values.shape[0] != 2 * self.num_pairs:
            raise ValueError(
                f"PreferenceBatch.split: expected {2 * self.num_pairs} rows, got {values.shape[0]}"
            )
        return values[: self.num_pairs], values[self.num_pairs :]

    def to(self, device: torch.device | str) -> PreferenceBatch:
        """A copy with every tensor on ``device``."""
        packed = PackedBatch(
            **{name: value.to(device) for name, value in vars(self.packed).items()}
        )
        return PreferenceBatch(
            packed,
            list(self.pair_ids),
            _to_device(self.reference_chosen_logps, device),
            _to_device(self.reference_rejected_logps, device),
        )


def _to_device(tensor: Tensor | None, device: torch.device | str) -> Tensor | None:
    return tensor.to(device) if tensor is not None else None


ReferenceTable = Mapping[str, tuple[float, float]]


def collate_preference(
    examples: Sequence[PreferenceExample],
    *,
    pad_id: int,
    reference: ReferenceTable | None = None,
) -> PreferenceBatch:
    """Collate pairs for one policy forward (use with ``functools.partial`` as a DataLoader
    ``collate_fn``).

    Args:
        examples: the pairs.
        pad_id: padding token (``tokenizer.pad_id``).
        reference: ``cache_key -> (chosen_logp, rejected_logp)`` from
            :func:`composer_tune.channels.dpo_reference.compute_reference_logps`; when given, the batch carries the reference
            log-probs, and a pair missing from it raises ``KeyError`` naming the pair.
    """
    if not examples:
        raise ValueError("collate_preference: no examples")
    prompts = [example.prompt_ids for example in examples]
    packed = pack_sequences(
        prompts + prompts,
        [example.chosen_ids for example in examples]
        + [example.rejected_ids for example in examples],
        pad_id,
    )
    batch = PreferenceBatch(packed, [example.pair_id for example in examples])
    if reference is not None:
        missing = [example.where for example in examples if example.cache_key not in reference]
        if missing:
            raise KeyError(f"no reference log-probs for the pairs at {missing}")
        values = torch.tensor(
            [reference[example.cache_key] for example in examples], dtype=torch.float32
        )
        batch.reference_chosen_logps, batch.reference_rejected_logps = values[:, 0], values[:, 1]
    return batch
