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
class RolloutWorkerSection:
    """``rollout.worker``: the rollout worker process beside the trainer
    (:mod:`composer_tune.rollout.async_rollouts`), used when ``max_staleness >= 1`` or a
    ``server.url`` is set.

    Attributes:
        threads: the worker's torch threads (null: the trainer's count).
        device: where the worker's copy of the policy runs ("cpu", "cuda:1"; null: the
            trainer's device).
        max_restarts: dead workers replaced in one run before it stops with an error.
        start_timeout_s: seconds a worker may take to start (import, build, first weights).
    """

    threads: int | None = None
    device: str | None = None
    max_restarts: int = 3
    start_timeout_s: float = 600.0


@dataclass
class RolloutServerSection:
    """``rollout.server``: generation on a vLLM server elsewhere, through its OpenAI-compatible
    API, with the trainer's weights pushed over torch.distributed (``tools/serve_rollouts.py``
    starts such a server).

    Attributes:
        url: the server's base URL (``http://host:port``; null: no server).
        weight_sync: "gloo", "nccl" or "auto" (nccl when the worker's device is a GPU).
        push_every_n_steps: optimiser steps between weight pushes (``max_staleness`` must be
            at least this minus 1, so that every batch can be sampled in bounds).
        group_host: the address the server reaches the worker's weight group at (null: the
            address this machine uses to reach the server).
        timeout_s: seconds one generation request or weight push may take.
    """

    url: str | None = None
    weight_sync: str = "auto"
    push_every_n_steps: int = 1
    group_host: str | None = None
    timeout_s: float = 600.0


@dataclass
class RolloutSection:
    """``rollout``: which engine samples the completions of the RL recipes, and where.

    Attributes:
        engine: "native", "vllm" or "auto" (vLLM if it is installed and starts for this
            model and these settings, else native; the run prints which).
        vllm: the vLLM engine's settings (read with ``engine: vllm`` or ``auto``).
        max_staleness: 0 samples each batch with the current weights in the trainer's process
            (the synchronous step); k >= 1 generates later batches in a rollout worker while
            the current one trains, with weights at most k optimiser steps old.
        worker: the rollout worker's settings.
        server: a remote vLLM server that generates instead of ``engine``.
    """

    engine: str = "native"
    vllm: VLLMSection = field(default_factory=VLLMSection)
    max_staleness: int = 0
    worker: RolloutWorkerSection = field(default_factory=RolloutWorkerSection)
    server: RolloutServerSection = field(default_factory=RolloutServerSection)


def vllm_available() -> bool:
    """Whether ``vllm`` imports (the ``vllm-cpu`` or ``vllm`` extra is installed)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True
