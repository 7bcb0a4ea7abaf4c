"""Configuration of the DiLoCo outer loop (one YAML section, one dataclass).

DiLoCo (Douillard et al., 2023, arXiv:2311.08105) trains N model replicas independently for ``H``
inner optimizer steps, then averages their pseudo-gradients (theta_global - theta_local) across
replicas and applies them to the shared global weights with an outer optimizer (Nesterov SGD,
lr 0.7, momentum 0.9 in the paper). Streaming DiLoCo (arXiv:2501.18512) splits the model into
``num_fragments`` fragments and synchronises one fragment every ``H / num_fragments`` inner steps,
optionally overlapping the all-reduce with ``fragment_sync_delay`` further inner steps and mixing
local and global weights with ``fragment_update_alpha``. Both run on torchft's
``torchft.local_sgd.DiLoCo`` with a torchft ``Manager`` that makes replica membership fault
tolerant.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

REPLICA_ID_ENV = "REPLICA_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# Set by the launcher: how many times this replica was restarted after a failure.
RESTART_ENV = "REPLICA_RESTART"


class DiLoCoConfigError(ValueError):
    """A DiLoCo config value that cannot work; the message names the key."""


@dataclass
class DiLoCoConfig:
    # H: inner optimizer steps per outer round (every fragment is synchronised once per round).
    sync_every: int = 16
    # Streaming DiLoCo: contiguous fragments of the model's layers; 1 is classic DiLoCo.
    num_fragments: int = 1
    # Inner steps a fragment's all-reduce may overlap with before the replica waits for it
    # (tau in the Streaming DiLoCo paper); must be < sync_every / num_fragments.
    fragment_sync_delay: int = 0
    # After a fragment sync: weights = global + alpha * (local - global); 0 keeps the global ones.
    fragment_update_alpha: float = 0.0
    # Outer optimizer: SGD over each fragment's global weights, applied to the averaged
    # pseudo-gradient (defaults: the DiLoCo paper's Nesterov momentum).
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    # FP8 all-reduce of the pseudo-gradients (torchft's Triton kernels: CUDA + NCCL only).
    should_quantize: bool = False
    # A sync commits only with at least this many replicas in the quorum.
    min_replicas: int = 1
    # This replica's index; null: the REPLICA_ID environment variable (set by the launcher).
    replica_id: int | None = None
    # "http://host:port" of the torchft lighthouse; null: TORCHFT_LIGHTHOUSE.
    lighthouse_addr: str | None = None
    # Host name other replicas use to reach this replica's manager and checkpoint server.
    hostname: str = "127.0.0.1"
    # TCPStore of this replica group when it is a single process (under torchrun the store is
    # MASTER_ADDR:MASTER_PORT). Other replicas connect to it while reconfiguring, so on a cluster
    # set store_host to an address they can reach. Port 0: the OS picks a free one.
    store_host: str = "127.0.0.1"
    store_port: int = 0
    # Port of this replica's torchft manager server; 0: the OS picks a free one.
    manager_port: int = 0
    # "auto": gloo for CPU models, nccl for CUDA models.
    backend: str = "auto"
    # Where the global weights live between syncs; null: CPU (saves accelerator memory).
    backup_device: str | None = None
    # Collectives, commit votes and checkpoint transfers to healing peers.
    timeout_s: float = 300.0
    # Waiting for the other replicas at a sync: must exceed the longest inner round plus the
    # start-up skew between replicas (torchft recommends ~1 h for DiLoCo on real models).
    quorum_timeout_s: float = 3600.0
    connect_timeout_s: float = 120.0
    # Raise after this many consecutive failed syncs; null retries forever.
    max_retries: int | None = None

    @classmethod
    def coerce(cls, value: DiLoCoConfig | Mapping[str, Any]) -> DiLoCoConfig:
        """A ``DiLoCoConfig`` from itself or from a mapping (a YAML section / DictConfig)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise DiLoCoConfigError(
                f"diloco config must be a mapping or DiLoCoConfig, got {type(value).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise DiLoCoConfigError(
                f"unknown diloco config key(s) {unknown}; known keys: {sorted(known)}"
            )
        return cls(**dict(value))

    @property
    def fragment_sync_every(self) -> int:
        """Inner steps between two fragment syncs (one manager step each)."""
        return self.sync_every // self.num_fragments

    def validate(self, device: torch.device) -> None:
        """Raises ``DiLoCoConfigError`` naming the first key that cannot work on ``device``."""
        if self.sync_every < 1:
            raise DiLoCoConfigError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.num_fragments < 1:
            raise DiLoCoConfigError(f"num_fragments must be >= 1, got {self.num_fragments}")
        if self.sync_every % self.num_fragments:
            raise DiLoCoConfigError(
                f"sync_every ({self.sync_every}) must be a multiple of num_fragments "
                f"({self.num_fragments}): each fragment syncs every sync_every / num_fragments "
                "inner steps"
            )
        if not 0 <= self.fragment_sync_delay < self.fragment_sync_every:
            raise DiLoCoConfigError(
                f"fragment_sync_delay must be in [0, sync_every / num_fragments = "
                f"{self.fragment_sync_every}), got {self.fragment_sync_delay}"
            )
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise DiLoCoConfigError(
                f"fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}"
            )
        if self.outer_lr <= 0:
            raise DiLoCoConfigError(f"outer_lr must be > 0, got {self.outer_lr}")
        if self.outer_momentum < 0:
            raise DiLoCoConfigError(f"outer_momentum must be >= 0, got {self.outer_momentum}")
        if self.outer_nesterov and self.outer_momentum == 0:
            raise DiLoCoConfigError("outer_nesterov needs outer_momentum > 0")
        if self.min_replicas < 1:
            raise DiLoCoConfigError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise DiLoCoConfigError(
                f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}"
            )
        if self.resolved_backend(device) == "nccl" and device.type != "cuda":
            raise DiLoCoConfigError(f"backend 'nccl' needs a CUDA model, this one is on {device}")
        for key in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            if getattr(self, key) <= 0:
                raise DiLoCoConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.should_quantize:
            self._check_quantization(device)

    def _check_quantization(self, device: torch.device) -> None:
        # torchft 0.2.0 quietly sends unquantized tensors when Triton is missing, and its FP8
        # all-reduce (alltoall + allgather of Triton-packed buffers) runs on CUDA with NCCL only.
        if device.type != "cuda":
            raise DiLoCoConfigError(
                f"should_quantize: torchft's FP8 all-reduce runs on CUDA only; this model is on "
                f"{device}. Set should_quantize: false for CPU runs"
            )
        if importlib.util.find_spec("triton") is None:
            raise DiLoCoConfigError(
                "should_quantize: torchft's FP8 all-reduce needs the triton package, which is "
                "not installed (torchft would silently send full-precision tensors)"
            )
        if self.resolved_backend(device) != "nccl":
            raise DiLoCoConfigError("should_quantize needs backend 'nccl' (or 'auto' on CUDA)")

    def resolved_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"

    def resolved_replica_id(self) -> int:
        """``replica_id``, else the REPLICA_ID environment variable."""
        if self.replica_id is not None:
            value: Any = self.replica_id
        elif REPLICA_ID_ENV in os.environ:
            value = os.environ[REPLICA_ID_ENV]
        else:
            raise DiLoCoConfigError(
                f"replica_id is not set and the {REPLICA_ID_ENV} environment variable is missing"
            )
        try:
            replica_id = int(value)
        except ValueError:
            raise DiLoCoConfigError(f"replica_id must be an integer, got {value!r}") from None
        if replica_id < 0:
            raise DiLoCoConfigError(f"replica_id must be >= 0, got {replica_id}")
        return replica_id

    def resolved_lighthouse_addr(self) -> str:
        """``lighthouse_addr``, else the TORCHFT_LIGHTHOUSE environment variable."""
        addr = self.lighthouse_addr or os.environ.get(LIGHTHOUSE_ENV)
        if not addr:
            raise DiLoCoConfigError(
                f"lighthouse_addr is not set and the {LIGHTHOUSE_ENV} environment variable is "
                "missing (start one with tools/launch_diloco.py or `torchft_lighthouse`)"
            )
        return addr


def restarted_by_launcher() -> bool:
    """Whether this replica process is a launcher restart of a failed one (it continues the
    run: it heals from a live peer rather than starting over)."""
    return int(os.environ.get(RESTART_ENV, "0")) > 0
