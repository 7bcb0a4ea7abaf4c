"""Channel 3 glue for the training recipes: trace-replay DPO on preference pairs.

Trace-replay DPO is composer-tune's OWN research addition, not part of Cursor's published
Composer recipe (which has channel 1, GRPO-family RL on verifiable rewards, and channel 2, SDPO
self-distillation): agent traces are replayed by teacher models and their (dis)agreement with
the trace becomes preference pairs (``tools/build_pairs.py``). The loss and the pair data live in
``composer_tune.losses.dpo`` and ``composer_tune.data.preference``; this module holds what a
recipe adds around them so that ``recipes/replay_dpo.py`` (A3), ``recipes/composer_full.py``
(A4) and ``recipes/diloco.py`` share one implementation:

* :class:`DPOChannelConfig`: the ``dpo:`` config section (weight, pairs, variant, reference mode);
* :func:`load_pair_splits`: the train and held-out pair splits, rendered once;
* :func:`reference_table`: summed reference log-probs of every pair from the frozen initial
  policy, computed once (and cached on disk) before training;
* :class:`PairStream`: endless per-rank training batches beside the rollouts, resumable;
* :func:`evaluate_pairs`: DPO loss, reward margin and accuracy on the held-out pairs;
* :class:`PairChannel`: all of the above as a recipe holds it (splits, reference table, the
  stream dealt over ranks and replicas, resume state, evaluation);
* :func:`pair_loss_backward`: the channel's weighted forward and backward in a training step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DistributedSampler

from composer_tune.channels.dpo_reference import (
    completion_logps,
    compute_reference_logps,
    model_fingerprint,
)
from composer_tune.data.preference import (
    PreferenceBatch,
    PreferenceDataset,
    PreferenceExample,
    ReferenceTable,
    collate_preference,
)
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.losses.dpo import DPO_LOSS_TYPES, DPOLossConfig, DPOOutput, dpo_loss
from composer_tune.models.hf_backend import router_loss


@dataclass(frozen=True)
class DPOChannelConfig:
    """The ``dpo:`` section of a recipe config.

    Attributes:
        weight: multiplier of the DPO loss in the training objective; 0 turns the channel off
            (no pairs are loaded, no reference log-probs computed, no forward taken).
        pairs: pairs JSONL file, directory of them, or ``datasets`` name
            (``composer_tune.data.preference.load_pair_rows``); required when ``weight > 0``.
        pairs_per_step: preference pairs per optimiser step over all ranks (each rank takes
            an equal share and runs one policy forward over its ``2 * share`` rows).
        loss_type: ``sigmoid``, ``ipo`` or ``hinge`` (``composer_tune.losses.dpo``).
        beta: inverse temperature of the implicit reward.
        label_smoothing: cDPO label-flip probability (``sigmoid`` only).
        reference: ``precomputed``: reference log-probs of every pair are computed once from
            the initial policy before training (and cached in ``cache_dir``), so no reference
            model stays in memory; ``live``: a frozen copy of the initial policy scores each
            batch (one extra no-grad forward per step).
        max_seq_len: longest prompt + completion row; longer prompts lose their start, pairs
            whose completion alone does not fit are dropped (``PreferenceDataset``).
        heldout_fraction: share of pairs held out for evaluation (by a hash of the trace step).
        split_by: ``pair`` or ``session`` (keep one session's steps on one side of the split).
        enable_thinking: Qwen3 thinking mode of the chat rendering.
        reference_batch_size: pairs per forward when precomputing reference log-probs.
        eval_batch_size: pairs per forward of the held-out evaluation.
        cache_dir: where precomputed reference log-probs are cached, one file per reference
            model; null: no disk cache.
    """

    weight: float = 0.0
    pairs: str | None = None
    pairs_per_step: int = 8
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference: str = "precomputed"
    max_seq_len: int | None = None
    heldout_fraction: float = 0.1
    split_by: str = "pair"
    enable_thinking: bool = True
    reference_batch_size: int = 8
    eval_batch_size: int = 8
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if self.reference not in ("precomputed", "live"):
            raise ValueError(f"reference must be 'precomputed' or 'live', got {self.reference!r}")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}")
        if self.pairs_per_step < 1 or self.reference_batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError(
                "pairs_per_step, reference_batch_size and eval_batch_size must be >= 1"
            )
        if self.enabled and not self.pairs:
            raise ValueError(f"weight is {self.weight} but no pairs source is set (dpo.pairs)")
        _ = self.loss_config  # validates beta and label_smoothing now, not at the first step

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any] | None, source: str = "dpo"
    ) -> DPOChannelConfig:
        """Build from a dict-like section (e.g. an OmegaConf node); None is the channel off.

        ``source`` names the section in errors (``dpo: unknown key(s) ['wieght']``).
        """
        mapping = dict(mapping or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {unknown}; expected a subset of {sorted(known)}"
            )
        try:
            return cls(**mapping)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from err

    @property
    def enabled(self) -> bool:
        """Whether the channel contributes to the objective (and costs anything at all)."""
        return self.weight > 0

    @property
    def loss_config(self) -> DPOLossConfig:
        return DPOLossConfig(
            loss_type=self.loss_type, beta=self.beta, label_smoothing=self.label_smoothing
        )


def load_pair_splits(
    cfg: DPOChannelConfig, tokenizer: ChatTokenizer
) -> tuple[PreferenceDataset, PreferenceDataset]:
    """The ``(train, heldout)`` pair splits of ``cfg.pairs``, rendered with the chat template.

    Raises:
        ValueError: if the training split is empty (naming the counts that emptied it).
    """
    splits = []
    for split in ("train", "heldout"):
        splits.append(
            PreferenceDataset(
                cfg.pairs,
                tokenizer,
                max_seq_len=cfg.max_seq_len,
                split=split,
                heldout_fraction=cfg.heldout_fraction,
                split_by=cfg.split_by,
                enable_thinking=cfg.enable_thinking,
            )
        )
    if not len(splits[0]):
        raise ValueError(
            f"dpo.pairs {cfg.pairs}: no training pairs left ({dict(splits[0].stats)}); "
            "raise dpo.max_seq_len or lower dpo.heldout_fraction"
        )
    return splits[0], splits[1]


def shared_fingerprint(model: nn.Module, dist_info: DistInfo) -> str:
    """One identity for a (possibly FSDP-sharded) model on every rank: the hash of all ranks'
    shard fingerprints, so that all ranks read and write the same reference cache file."""
    local = bytes.fromhex(model_fingerprint(model))
    table = torch.zeros((dist_info.world_size, len(local)), dtype=torch.int64)
    table[dist_info.rank] = torch.tensor(list(local), dtype=torch.int64)
    table = all_reduce_sum(table.to(dist_info.device)).cpu()
    return hashlib.sha256(bytes(table.flatten().tolist())).hexdigest()


def reference_table(
    reference: nn.Module,
    datasets: Sequence[Sequence[PreferenceExample]],
    cfg: DPOChannelConfig,
    *,
    pad_id: int,
    dist_info: DistInfo,
    chunk_size: int,
) -> dict[str, tuple[float, float]]:
    """Reference log-probs of every pair of ``datasets`` (``cache_key -> (chosen, rejected)``).

    ``reference`` must be the initial policy (a recipe passes its policy before the first
    step). Collective under FSDP: every rank scores every pair.
    """
    fingerprint = shared_fingerprint(reference, dist_info) if cfg.cache_dir else None
    table: dict[str, tuple[float, float]] = {}
    for dataset in datasets:
        table.update(
            compute_reference_logps(
                reference,
                dataset,
                pad_id=pad_id,
                batch_size=cfg.reference_batch_size,
                chunk_size=chunk_size,
                cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None,
                fingerprint=fingerprint,
                device=dist_info.device,
            )
        )
    return table


class PairStream:
    """Endless batches of training pairs for one rank, epoch after epoch, resumable.

    Each epoch shuffles the pairs (seeded by ``seed`` and the epoch, identical on every rank)
    and deals each rank a disjoint share (``DistributedSampler``, incomplete tail dropped), cut
    into batches of ``pairs_per_rank``. ``state_dict()`` is the position: resuming from it
    yields exactly the batches an uninterrupted run would have.
    """

    def __init__(
        self,
        dataset: Sequence[PreferenceExample],
        *,
        pairs_per_step: int,
        dist_info: DistInfo,
        seed: int,
        pad_id: int,
        reference: ReferenceTable | None = None,
    ) -> None:
        if pairs_per_step % dist_info.world_size:
            raise ValueError(
                f"dpo.pairs_per_step ({pairs_per_step}) must be a multiple of the number of "
                f"ranks ({dist_info.world_size})"
            )
        self.pairs_per_rank = pairs_per_step // dist_info.world_size
        if len(dataset) // dist_info.world_size < self.pairs_per_rank:
            raise ValueError(
                f"dpo.pairs_per_step={pairs_per_step} needs at least {pairs_per_step} training "
                f"pairs, the pairs file has {len(dataset)} in the train split"
            )
        self.dataset = dataset
        self.pad_id = pad_id
        self.reference = reference
        self.sampler = DistributedSampler(
            dataset,  # type: ignore[arg-type]  # any sized sequence
            num_replicas=dist_info.world_size,
            rank=dist_info.rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.epoch = 0
        self.batches_in_epoch = 0  # batches of the current epoch already yielded

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])

    def __iter__(self) -> Iterator[PreferenceBatch]:
        return self

    def __next__(self) -> PreferenceBatch:
        self.sampler.set_epoch(self.epoch)
        indices = list(self.sampler)
        if (self.batches_in_epoch + 1) * self.pairs_per_rank > len(indices):
            self.epoch += 1
            self.batches_in_epoch = 0
            self.sampler.set_epoch(self.epoch)
            indices = list(self.sampler)
        start = self.batches_in_epoch * self.pairs_per_rank
        self.batches_in_epoch += 1
        examples = [self.dataset[index] for index in indices[start : start + self.pairs_per_rank]]
        return collate_preference(examples, pad_id=self.pad_id, reference=self.reference)


@torch.no_grad()
def evaluate_pairs(
    model: nn.Module,
    dataset: Sequence[PreferenceExample],
    cfg: DPOChannelConfig,
    *,
    pad_id: int,
    device: torch.device,
    chunk_size: int,
    reference: ReferenceTable | None = None,
    reference_model: nn.Module | None = None,
) -> dict[str, float]:
    """Mean DPO loss, implicit-reward margin and preference accuracy over every pair of
    ``dataset`` (held-out pairs), with reference log-probs from ``reference`` or a forward of
    ``reference_model``. Every rank scores every pair (collective under FSDP), so the result is
    the same on all ranks; an empty dataset gives ``{}``."""
    totals = {"loss": 0.0, "margin": 0.0, "accuracy": 0.0}
    for start in range(0, len(dataset), cfg.eval_batch_size):
        examples = [
            dataset[index] for index in range(start, min(start + cfg.eval_batch_size, len(dataset)))
        ]
        batch = collate_preference(examples, pad_id=pad_id, reference=reference).to(device)
        output = preference_loss(
            model,
            batch,
            cfg.loss_config,
            reference_model=reference_model,
            chunk_size=chunk_size,
        )
        totals["loss"] += float(output.losses.sum())
        totals["margin"] += float(output.margins.sum())
        totals["accuracy"] += float(output.accuracies.sum())
    if not len(dataset):
        return {}
    return {f"eval/dpo_{name}": value / len(dataset) for name, value in totals.items()}


# ----------------------------------------------------------------------------- in a recipe


class PairChannel:
    """Channel 3's data in a recipe (trace-replay DPO, this project's own addition).

    Loads the train and held-out pair splits, the reference table (``dpo.reference:
    precomputed``: from the resumed run's state, else scored now by ``model``, which before the
    first step is the initial policy), and a :class:`PairStream`.
    Pairs are dealt like prompts: over ``num_replicas`` replicas of ``dist.world_size`` ranks
    each, every rank of every replica gets its own disjoint share, ``dpo.pairs_per_step`` per
    replica and step. ``state`` is a resumed run's recipe state (``{}`` for a fresh run);
    :meth:`state_dict` is what to put into the next one.
    """

    def __init__(
        self,
        cfg: DPOChannelConfig,
        *,
        model: nn.Module,
        tokenizer: Any,
        dist: DistInfo,
        seed: int,
        logprob_chunk_size: int,
        state: Mapping[str, Any],
        resumed: bool,
        num_replicas: int = 1,
        replica_id: int = 0,
    ) -> None:
        self.cfg = cfg
        self.dist = dist
        self.pad_id = tokenizer.pad_id
        self.logprob_chunk_size = logprob_chunk_size
        self.train, self.heldout = load_pair_splits(cfg, tokenizer)
        self.reference: dict[str, tuple[float, float]] | None = None
        if cfg.reference == "precomputed" and "dpo_reference" in state:
            self.reference = state["dpo_reference"]
        elif cfg.reference == "precomputed":
            if resumed:  # the policy is no longer the initial one
                raise ValueError(
                    "dpo.reference=precomputed, but the resumed checkpoint has no reference "
                    "table (written with channel 3 off or dpo.reference=live): resume with "
                    "the settings the run started with"
                )
            self.reference = reference_table(
                model,
                [self.train, self.heldout],
                cfg,
                pad_id=self.pad_id,
                dist_info=dist,
                chunk_size=logprob_chunk_size,
            )
        shards = num_replicas * dist.world_size
        if num_replicas > 1 and len(self.train) < cfg.pairs_per_step * num_replicas:
            raise ValueError(
                f"dpo.pairs_per_step={cfg.pairs_per_step} per replica over {num_replicas} "
                f"replicas needs at least {cfg.pairs_per_step * num_replicas} training pairs, "
                f"the pairs source has {len(self.train)} in the train split"
            )
        # One shard per rank of every replica; PairStream splits pairs_per_step over its shards.
        self.stream = PairStream(
            self.train,
            pairs_per_step=cfg.pairs_per_step * num_replicas,
            dist_info=DistInfo(
                world_size=shards, rank=replica_id * dist.world_size + dist.rank, device=dist.device
            ),
            seed=seed,
            pad_id=self.pad_id,
            reference=self.reference,
        )
        if "pair_stream" in state:
            self.stream.load_state_dict(state["pair_stream"])
        if dist.is_main:
            print(
                f"dpo: {len(self.train)} training pairs {dict(self.train.stats)}, "
                f"{len(self.heldout)} held out, reference {cfg.reference}",
                flush=True,
            )

    def next_batch(self) -> PreferenceBatch:
        """This rank's training pairs for the next optimiser step, on its device."""
        return next(self.stream).to(self.dist.device)

    def state_dict(self) -> dict[str, Any]:
        """The resume state: the stream position (every rank advances in lockstep, so rank 0's
        is everyone's) and the reference table."""
        return {"pair_stream": self.stream.state_dict(), "dpo_reference": self.reference}

    def evaluate_and_report(
        self,
        model: nn.Module,
        reference: nn.Module | None,
        log: Callable[[Mapping[str, float]], None],
        *,
        where: str,
    ) -> dict[str, float]:
        """:meth:`evaluate`, logged with ``log`` and printed on rank 0 as ``[where] ...``."""
        metrics = self.evaluate(model, reference)
        if metrics:
            log(metrics)
            if self.dist.is_main:
                print(
                    f"[{where}] held-out pairs: DPO loss {metrics['eval/dpo_loss']:.4f}, margin "
                    f"{metrics['eval/dpo_margin']:.4f}, accuracy "
                    f"{metrics['eval/dpo_accuracy']:.3f} over {len(self.heldout)} pairs",
                    flush=True,
                )
        return metrics

    def print_summary(
        self, before: Mapping[str, float], after: Mapping[str, float], qualifier: str = ""
    ) -> None:
        """The run's closing line on held-out pairs (rank 0; nothing without them), against
        the step-0 values (kept in checkpoints, so a resumed run prints the same line)."""
        if not before or not after or not self.dist.is_main:
            return
        print(
            f"held-out pairs{qualifier}: DPO accuracy before {before['eval/dpo_accuracy']:.3f} "
            f"-> after {after['eval/dpo_accuracy']:.3f}, margin before "
            f"{before['eval/dpo_margin']:.4f} -> after {after['eval/dpo_margin']:.4f} "
            f"({len(self.heldout)} pairs)",
            flush=True,
        )

    def evaluate(self, model: nn.Module, reference: nn.Module | None = None) -> dict[str, float]:
        """DPO loss, margin and accuracy of ``model`` on the held-out pairs (``eval/dpo_*``;
        ``{}`` without held-out pairs); ``reference`` scores them with ``dpo.reference: live``.
        """
        return evaluate_pairs(
            model,
            self.heldout,
            self.cfg,
            pad_id=self.pad_id,
            device=self.dist.device,
            chunk_size=self.logprob_chunk_size,
            reference=self.reference,
            reference_model=reference if self.cfg.reference == "live" else None,
        )


def pair_loss_backward(
    model: nn.Module,
    batch: PreferenceBatch,
    cfg: DPOChannelConfig,
    *,
    reference_model: nn.Module | None,
    chunk_size: int,
) -> tuple[float, dict[str, float]]:
    """Channel 3's forward and backward over this rank's pair batch, weighted by
    ``cfg.weight``. Its loss is a mean over the rank's pairs; FSDP's gradient average makes it
    the global mean. ``reference_model`` scores the pairs with ``dpo.reference: live`` (None
    otherwise). Returns the weighted loss and the ``dpo/*`` metrics."""
    output = preference_loss(
        model,
        batch,
        cfg.loss_config,
        reference_model=reference_model if cfg.reference == "live" else None,
        chunk_size=chunk_size,
    )
    aux, router_metrics = router_loss(model)
    weighted = cfg.weight * output.loss
    (weighted if aux is None else weighted + aux).backward()
    metrics = {f"dpo/{name}": value for name, value in output.metrics().items()}
    metrics.update({f"dpo/{name}": value for name, value in router_metrics.items()})
    return cfg.weight * float(output.loss.detach()), metrics


def preference_loss(
    policy: nn.Module,
    batch: PreferenceBatch,
    config: DPOLossConfig,
    *,
    reference_model: nn.Module | None = None,
    chunk_size: int = 1024,
) -> DPOOutput:
    """The DPO loss of one collated preference batch: a recipe's whole training-step forward.

    One policy forward over the batch's ``2B`` rows (chosen then rejected). Reference log-probs
    come from the batch (collated with a table from
    ``composer_tune.channels.dpo_reference.compute_reference_logps``) or, when ``reference_model`` is
    given, from a no-grad forward of it on the same rows (the on-the-fly mode).
    """
    logps, counts = completion_logps(policy, batch.packed, chunk_size=chunk_size)
    if reference_model is not None:
        with torch.no_grad():
            reference_logps, _ = completion_logps(
                reference_model, batch.packed, chunk_size=chunk_size
            )
        reference_chosen, reference_rejected = batch.split(reference_logps)
    elif batch.reference_chosen_logps is not None and batch.reference_rejected_logps is not None:
        reference_chosen = batch.reference_chosen_logps
        reference_rejected = batch.reference_rejected_logps
    else:
        raise ValueError(
            "preference_loss: the batch carries no reference log-probs (collate it with "
            "reference=compute_reference_logps(...)) and no reference_model was given"
        )
    policy_chosen, policy_rejected = batch.split(logps)
    chosen_counts, rejected_counts = batch.split(counts)
    return dpo_loss(
        policy_chosen,
        policy_rejected,
        reference_chosen,
        reference_rejected,
        config,
        chosen_token_counts=chosen_counts,
        rejected_token_counts=rejected_counts,
    )


def pair_channel(
    cfg: DictConfig,
    dpo_cfg: DPOChannelConfig,
    *,
    model: nn.Module,
    tokenizer: Any,
    dist: DistInfo,
    state: Mapping[str, Any],
    resumed: bool,
    num_replicas: int = 1,
    replica_id: int = 0,
) -> PairChannel | None:
    """A recipe's :class:`PairChannel` (its seed and log-prob chunk from ``cfg``), or None
    with channel 3 off."""
    if not dpo_cfg.enabled:
        return None
    return PairChannel(
        dpo_cfg,
        model=model,
        tokenizer=tokenizer,
        dist=dist,
        seed=cfg.seed,
        logprob_chunk_size=cfg.logprob_chunk_size,
        state=state,
        resumed=resumed,
        num_replicas=num_replicas,
        replica_id=replica_id,
    )
