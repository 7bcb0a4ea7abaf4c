"""The rollout engine's config sections and error, shared by the engine builder
(:mod:`composer_tune.rollout.engines`) and the vLLM engine
(:mod:`composer_tune.rollout.vllm_engine`); it imports neither, so neither imports the other
back."""

from __future__ import annotations

from dataclasses import dataclass, field

# "auto": vLLM where it is installed and starts for the model, else native.
ENGINES = ("native", "vllm", "auto")


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
        engine: "native", "vllm" or "auto" (vLLM if it is installed and starts for this
            model and these settings, else native; the run prints which).
        vllm: the vLLM engine's settings (read with ``engine: vllm`` or ``auto``).
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
