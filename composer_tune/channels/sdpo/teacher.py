"""Channel 2 (SDPO self-distillation, replicating Composer 2.5) as a recipe sets it up: the
checks that tie the ``sdpo`` section to the rest of the config, and the EMA teacher's state in
a run checkpoint. A2 (``recipes/sdpo.py``), A4 and DiLoCo all use these, so a config that one
rejects the others reject too, and their checkpoints hold the teacher under one key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import training

from composer_tune.channels.sdpo.channel import SDPOChannelConfig
from composer_tune.checkpointing.run_state import full_model_state_dict
from composer_tune.distributed import DistInfo
from composer_tune.losses.distill import EMATeacher

# The run checkpoint's recipe-state key of the EMA teacher, and the key A2 checkpoints written
# before the channels shared one implementation used (still read on resume).
EMA_STATE_KEY = "sdpo_ema"
LEGACY_A2_EMA_STATE_KEY = "ema_teacher"


def sdpo_config_from(cfg: DictConfig, dist: DistInfo) -> SDPOChannelConfig:
    """Channel 2's settings from a recipe config's ``sdpo`` section (null: off), resolved
    against the whole config (it may interpolate other keys, e.g.
    ``context.max_teacher_tokens: ${model.max_seq_len}``), with the checks that involve the
    rest of the config and the launch."""
    if cfg.sdpo is None:
        return SDPOChannelConfig()
    sdpo_cfg = SDPOChannelConfig.from_mapping(OmegaConf.to_container(cfg.sdpo, resolve=True))
    if not sdpo_cfg.enabled:
        return sdpo_cfg
    if sdpo_cfg.context.enable_thinking != cfg.enable_thinking:
        raise ValueError(
            f"sdpo.context.enable_thinking ({sdpo_cfg.context.enable_thinking}) must equal "
            f"enable_thinking ({cfg.enable_thinking}): the teacher reads the student's "
            "completions after the same generation prompt, apart from the hint"
        )
    teacher_topk = sdpo_cfg.loss.top_k is not None and sdpo_cfg.loss.top_k_support == "teacher"
    if sdpo_cfg.teacher == "ema" and dist.is_distributed and not teacher_topk:
        raise ValueError(
            "sdpo.teacher=ema under torchrun needs sdpo.loss.top_k set and "
            "sdpo.loss.top_k_support=teacher (a sharded teacher's projection only runs in "
            "its own forward)"
        )
    return sdpo_cfg


def check_teacher_length(sdpo_cfg: SDPOChannelConfig, max_seq_len: int) -> None:
    """With channel 2 on, teacher sequences (prompt + hint + completion) must fit the model's
    positions: ``sdpo.context.max_teacher_tokens`` must be set to at most ``max_seq_len``."""
    limit = sdpo_cfg.context.max_teacher_tokens
    if sdpo_cfg.enabled and (limit is None or limit > max_seq_len):
        raise ValueError(
            f"sdpo.context.max_teacher_tokens ({limit}) must be set to at most the model's "
            f"max_seq_len ({max_seq_len}): a hint makes the teacher's sequence longer than "
            "the student's"
        )


def ema_teacher_state(ema_teacher: EMATeacher | None, dist: DistInfo) -> dict[str, Any]:
    """The EMA teacher for a run checkpoint's recipe state (its full weights on rank 0;
    collective under FSDP); ``{}`` without one."""
    if ema_teacher is None:
        return {}
    weights = full_model_state_dict(ema_teacher.module, dist)
    return {EMA_STATE_KEY: {"weights": weights, "num_updates": ema_teacher.num_updates}}


def load_ema_teacher_state(
    ema_teacher: EMATeacher | None,
    state: Mapping[str, Any],
    *,
    source: Any,
    device: torch.device,
    cpu_offload: bool,
) -> None:
    """Restores what :func:`ema_teacher_state` saved into ``state`` (a checkpoint's recipe
    state, read from ``source``), or an older A2 checkpoint's teacher; nothing without an EMA
    teacher."""
    if ema_teacher is None:
        return
    if EMA_STATE_KEY in state:
        weights = state[EMA_STATE_KEY]["weights"]
        num_updates = state[EMA_STATE_KEY]["num_updates"]
    elif LEGACY_A2_EMA_STATE_KEY in state:
        weights = state[LEGACY_A2_EMA_STATE_KEY]["model"]
        num_updates = state[LEGACY_A2_EMA_STATE_KEY]["num_updates"]
    else:
        raise ValueError(
            f"{source} has no EMA teacher (written without sdpo.teacher=ema): resume with the "
            "settings the run started with"
        )
    training.load_from_full_model_state_dict(
        ema_teacher.module, weights, device, strict=True, cpu_offload=cpu_offload
    )
    ema_teacher.rebind()  # torchtune's loader assigned new tensors to the teacher
    ema_teacher.num_updates = int(num_updates)
