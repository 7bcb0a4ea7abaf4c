"""Completion log-probs of preference pairs (channel 3, trace-replay DPO, this project's own
addition): the forward the policy and the reference share, and the frozen reference's values,
computed once and cached.

Summed completion log-probs of the frozen initial policy, cached as JSON, one file per
reference-model fingerprint, entries keyed by each pair's ``cache_key`` (pair id + a hash of the
exact token ids scored), so a changed tokenizer, chat rendering or truncation limit misses the
cache instead of reusing a stale value. The pairs themselves (rendering, batching) are data:
``composer_tune.data.preference``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from composer_tune.data.preference import PreferenceExample, collate_preference
from composer_tune.losses.logprobs import IGNORE_INDEX, logprob_head
from composer_tune.rollout.generation import PackedBatch

_CACHE_VERSION = 1


def completion_targets(batch: PackedBatch) -> Tensor:
    """``[b, T]`` targets for the log-prob head: the next token where it is a completion token.

    ``targets[:, t] = tokens[:, t + 1]`` wherever ``completion_mask[:, t + 1]`` (the model
    predicts column ``t + 1`` from position ``t``, see ``PackedBatch``), ``IGNORE_INDEX``
    elsewhere, including the last column, which predicts nothing.
    """
    targets = torch.full_like(batch.tokens, IGNORE_INDEX)
    targets[:, :-1] = torch.where(batch.completion_mask[:, 1:], batch.tokens[:, 1:], IGNORE_INDEX)
    return targets


def completion_logps(
    model: nn.Module, batch: PackedBatch, *, chunk_size: int = 1024
) -> tuple[Tensor, Tensor]:
    """Summed completion log-probs of every row of ``batch`` and the completion lengths.

    One forward of ``model`` (a ``CausalDecoder``, or any decoder accepting ``head_fn``) through
    the chunked log-prob head, so no ``[b, T, vocab]`` logits are materialised. Gradients flow
    when grad is enabled (the policy); wrap in ``torch.no_grad()`` for the reference.

    Returns:
        ``(logps [b] float32, token_counts [b] long)``, on the batch's device.
    """
    targets = completion_targets(batch)
    token_logps = model(batch.tokens, head_fn=logprob_head(targets, chunk_size=chunk_size))
    return token_logps.sum(dim=-1), (targets != IGNORE_INDEX).sum(dim=-1)


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 of the model's state dict (names, dtypes, shapes and values): the reference
    checkpoint's identity for the cache. Reads every weight once (seconds for billions of
    parameters); a sharded (DTensor) model hashes each rank's local shard."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        data = local.detach().cpu().contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}\n".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def reference_cache_path(cache_dir: str | Path, fingerprint: str) -> Path:
    """The cache file of one reference model in ``cache_dir``."""
    return Path(cache_dir) / f"reference_logps_{fingerprint[:24]}.json"


def _read_cache(path: Path, fingerprint: str) -> dict[str, tuple[float, float]]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path}: corrupt reference log-prob cache ({error}); delete it"
        ) from error
    if data.get("version") != _CACHE_VERSION or data.get("model_fingerprint") != fingerprint:
        raise ValueError(
            f"{path}: cache written for another model or format version; delete it or use "
            "another cache_dir"
        )
    return {key: (float(pair[0]), float(pair[1])) for key, pair in data["entries"].items()}


def _write_cache(path: Path, fingerprint: str, entries: Mapping[str, tuple[float, float]]) -> None:
    """Write atomically (temp file + rename): a crash never leaves a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    payload = {
        "version": _CACHE_VERSION,
        "model_fingerprint": fingerprint,
        "entries": {key: list(value) for key, value in sorted(entries.items())},
    }
    try:
        temp.write_text(json.dumps(payload), encoding="utf-8")
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


@torch.no_grad()
def compute_reference_logps(
    model: nn.Module,
    dataset: Sequence[PreferenceExample],
    *,
    pad_id: int,
    batch_size: int = 8,
    chunk_size: int = 1024,
    cache_dir: str | Path | None = None,
    fingerprint: str | None = None,
    device: torch.device | str | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, tuple[float, float]]:
    """Summed completion log-probs of the frozen reference for every pair of ``dataset``.

    Args:
        model: the reference (the initial policy), put in eval mode; no gradients are taken.
        dataset: rendered pairs (a :class:`PreferenceDataset`).
        pad_id: padding token.
        batch_size: pairs per forward (``2 * batch_size`` rows).
        chunk_size: rows per chunk of the log-prob head (``composer_tune.losses.logprobs``).
        cache_dir: if set, values are read from / added to this reference model's cache file
            there (see :func:`reference_cache_path`); only missing pairs are computed, and the
            file is rewritten atomically when anything was added.
        fingerprint: the reference model's identity; default :func:`model_fingerprint`.
        device: where to run the batches; default the model's first parameter's device.
        progress: called with the number of pairs computed after each batch (e.g. a tqdm
            ``update``).

    Returns:
        ``cache_key -> (chosen_logp, rejected_logp)`` for every pair of ``dataset``: the
        ``reference`` argument of :func:`collate_preference`.

    Under FSDP the forward is collective: every rank must call this with the same dataset and
    computes every pair. A sharded model's default fingerprint is per rank (each hashes its
    shard), so pass one ``fingerprint`` to all ranks (e.g. a hash of the checkpoint) to share
    one cache file; concurrent writers are safe (each renames its own temp file into place).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cache_path = None
    cached: dict[str, tuple[float, float]] = {}
    if cache_dir is not None:
        fingerprint = fingerprint or model_fingerprint(model)
        cache_path = reference_cache_path(cache_dir, fingerprint)
        cached = _read_cache(cache_path, fingerprint)
    if device is None:
        device = next(model.parameters()).device
    todo = [example for example in dataset if example.cache_key not in cached]
    computed: dict[str, tuple[float, float]] = {}
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(todo), batch_size):
            examples = todo[start : start + batch_size]
            batch = collate_preference(examples, pad_id=pad_id).to(device)
            logps, _ = completion_logps(model, batch.packed, chunk_size=chunk_size)
            chosen, rejected = batch.split(logps.double().cpu())
            for example, chosen_logp, rejected_logp in zip(examples, chosen, rejected, strict=True):
                computed[example.cache_key] = (float(chosen_logp), float(rejected_logp))
            if progress is not None:
                progress(len(examples))
    finally:
        model.train(was_training)
    if cache_path is not None and computed:
        _write_cache(cache_path, fingerprint, {**cached, **computed})
    table = {**cached, **computed}
    return {example.cache_key: table[example.cache_key] for example in dataset}
