"""What every part of the GPU check shares: its settings, a part's result table, the goals and
the devices' peak figures, and the helpers that free and synchronise a device."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.metadata
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
PARTS = ("parity", "memory", "speed", "sampling", "peer", "muon", "async")
GIB = 2**30
MIB = 2**20
# Past this a part risks the GPU machine's 10-minute limit per command.
PART_SECONDS_WARN = 9 * 60
MEMORY_GOAL = 0.10  # |estimate / measured peak - 1|
MFU_GOAL = 0.45
PEER_GOAL = 1.0  # TRL median step / composer-tune median step
ASYNC_GOAL = 1.0  # seconds per step at rollout.max_staleness 0 / at 1 (one device)
SAMPLING_GOAL = 1.0  # native engine tokens/s / transformers' static-cache generate tokens/s
PEER_PHASES = ("generation", "train log-prob forward", "other")
# Dense bf16 peak per GPU, matched against the device name in this order (PCIe/NVL first).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
# Memory bandwidth per GPU in TB/s (the weight-read bound of sampling), matched as above.
PEAK_BANDWIDTH_TBS = (
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),
    ("H200", 4.8),
    ("A100", 2.0),
)
# Versions listed in the report header (importlib.metadata: nothing is imported for this).
PACKAGES = (
    "transformers",
    "torchtune",
    "torchao",
    "torchft",
    "trl",
    "datasets",
    "pyarrow",
    "omegaconf",
    "accelerate",
    "numpy",
)
# Imported once per run for the header: whether composer_tune works on this torch, DiLoCo
# (torchft) included, which no part needs.
IMPORT_CHECKS = ("composer_tune.models", "composer_tune.diloco", "recipes.grpo")
STATUS_ORDER = ("ERROR", "FAIL", "PASS", "INFO", "SKIPPED")


class MissingDependency(Exception):
    """A part needs a package (or an API) this machine lacks: the part is skipped, by name."""


def require(*modules: str) -> None:
    """Import ``modules`` or raise :class:`MissingDependency` naming the first that fails."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise MissingDependency(f"{name} is not importable here ({err})") from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every part reads from the command line."""

    device: torch.device
    tiny: bool
    smollm2_dir: Path | None
    peak_tflops: float | None
    peak_bandwidth_tbs: float | None = None

    @property
    def judged(self) -> bool:
        """Whether the memory, speed and peer goals apply (CUDA, full sizes)."""
        return self.device.type == "cuda" and not self.tiny

    def verdict(self, ok: bool) -> str:
        return ("PASS" if ok else "FAIL") if self.judged else "INFO"

    def device_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(self.device).total_memory / GIB


@dataclasses.dataclass
class PartResult:
    """A part's table: ``columns`` are ``(row key, header, format spec)``; each row carries a
    ``status`` (PASS, FAIL, INFO, SKIPPED or ERROR) and, where it has one, a ``note``."""

    columns: list[tuple[str, str, str]]
    rows: list[dict[str, Any]]
    notes: list[str] = dataclasses.field(default_factory=list)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_row(row: dict[str, Any], err: Exception) -> dict[str, Any]:
    """``row`` marked ERROR with the exception's one-line reason (out of memory included)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return {**row, "status": "ERROR", "note": f"{type(err).__name__}: {message}"[:300]}
