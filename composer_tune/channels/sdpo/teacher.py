"""Channel 2 (SDPO self-distillation, replicating Composer 2.5) as a recipe sets it up: the
checks that tie the ``sdpo`` section to the rest of the config, the EMA teacher
(:class:`EMATeacher`) and its state in a run checkpoint. A2 (``recipes/sdpo.py``), A4 and DiLoCo
all use these, so a config that one rejects the others reject too, and their checkpoints hold
the teacher under one key in one format.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torchtune import training

from composer_tune.channels.sdpo.channel import SDPOChannelConfig
from composer_tune.checkpointing.run_state import full_model_state_dict
from composer_tune.distributed import DistInfo
from composer_tune.run.loop import build_model

# The run checkpoint's recipe-state key of the EMA teacher, and the key A2 checkpoints written
# before the channels shared one implementation used (still read on resume).
EMA_STATE_KEY = "sdpo_ema"
LEGACY_A2_EMA_STATE_KEY = "ema_teacher"


def sdpo_config_from(cfg: DictConfig, dist: DistInfo) -> SDPOChannelConfig:
    """Channel 2's settings from a recipe config's ``sdpo`` section (null: off), resolved
    against the whole config (it may interpolate other keys, e.g.
    ``context.max_teacher_tokens: ${model.max_seq_len}``), with the checks that involve the
    rest of the config and the launch."""
    if cfg.get("sdpo") is None:
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


def setup_sdpo_teacher(
    cfg: DictConfig, dist: DistInfo, sdpo_cfg: SDPOChannelConfig, policy: nn.Module, checkpoint: Any
) -> EMATeacher | None:
    """Channel 2's teacher as a recipe sets it up: checks that hinted teacher sequences fit
    the policy (:func:`check_teacher_length`), and returns the EMA teacher of ``policy`` with
    ``sdpo.teacher: ema`` (None otherwise: the policy itself teaches), a decoder built like the
    policy from ``checkpoint`` but in float32, so that small updates are not rounded away. It
    starts as a copy of the policy; a resumed run then restores its average
    (:func:`load_ema_teacher_state`)."""
    check_teacher_length(sdpo_cfg, policy.max_seq_len)
    if not sdpo_cfg.uses_ema_teacher:
        return None
    module = build_model(cfg, dist, checkpoint, dtype=torch.float32)
    return EMATeacher(policy, sdpo_cfg.ema_rate, teacher=module)


def ema_teacher_state(ema_teacher: EMATeacher | None, dist: DistInfo) -> dict[str, Any]:
    """The EMA teacher for a run checkpoint's recipe state (collective under FSDP2); ``{}``
    without one."""
    return {EMA_STATE_KEY: ema_teacher.state_dict(dist)} if ema_teacher is not None else {}


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
    saved = state.get(EMA_STATE_KEY, state.get(LEGACY_A2_EMA_STATE_KEY))
    if saved is None:
        raise ValueError(
            f"{source} has no EMA teacher (written without sdpo.teacher=ema): resume with the "
            "settings the run started with"
        )
    ema_teacher.load_state_dict(saved, device=device, cpu_offload=cpu_offload)


class EMATeacher:
    """An exponential moving average of the student's parameters, used as the SDPO teacher.

    ``update()`` (after each optimiser step) sets ``teacher = (1 - rate) * teacher + rate *
    student`` for every parameter and copies buffers; SDPO's default rate is 0.05. The teacher
    runs under ``torch.no_grad()`` and never receives gradients.

    Args:
        model: the student.
        rate: EMA rate in (0, 1]; 1 makes the teacher a copy of the latest student.
        teacher: a module of the same architecture to hold the average (its weights are
            overwritten with the student's). None = ``copy.deepcopy(model)``, for plain modules.

    Precision: with a small rate, an update below half an ulp of a bf16 parameter is lost, so
    hold the average in float32 (pass a float32 ``teacher``; the student may be bf16).

    FSDP2: build the teacher like the student (same builder, ``shard_decoder`` on the same
    mesh) and pass it as ``teacher``. Parameters are then DTensors with the same placements as
    the student's, and the element-wise update runs on each rank's local shards with no
    communication (the tests check it on two gloo ranks). ``state_dict()`` then holds DTensor shards:
    save the teacher through ``run_state.full_model_state_dict`` like the student. Its output
    projection only runs inside its own forward, so hand its view to the loss as
    :func:`teacher_topk` from its ``head_fn``.
    """

    def __init__(self, model: nn.Module, rate: float, teacher: nn.Module | None = None) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"EMATeacher: rate must be in (0, 1], got {rate}")
        self.rate = rate
        self.student = model
        self.module = teacher if teacher is not None else copy.deepcopy(model)
        self._pairs = self._matched(model, self.module)
        self.module.requires_grad_(False)
        self.module.eval()
        self.num_updates = 0
        self._copy_all()

    @staticmethod
    def _matched(model: nn.Module, teacher: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """(teacher tensor, student tensor) pairs by name: parameters, then buffers."""
        pairs: list[tuple[Tensor, Tensor]] = []
        for kind in ("named_parameters", "named_buffers"):
            student = dict(getattr(model, kind)())
            ours = dict(getattr(teacher, kind)())
            if student.keys() != ours.keys():
                missing = sorted(student.keys() - ours.keys())
                extra = sorted(ours.keys() - student.keys())
                raise ValueError(
                    f"EMATeacher: teacher {kind[6:]} differ from the student's "
                    f"(missing {missing[:5]}, unexpected {extra[:5]})"
                )
            for name, value in student.items():
                if ours[name].shape != value.shape:
                    raise ValueError(
                        f"EMATeacher: {name} has shape {tuple(ours[name].shape)} in the teacher, "
                        f"{tuple(value.shape)} in the student"
                    )
                pairs.append((ours[name], value))
        return pairs

    def rebind(self) -> None:
        """Pair the teacher's tensors with the student's again, after a loader replaced them.

        torchtune's ``load_from_full_model_state_dict`` (FSDP2 shards included) assigns new
        tensors to a module instead of copying into the old ones; without this call every later
        :meth:`update` would move the discarded tensors and the teacher would stay frozen.
        """
        self._pairs = self._matched(self.student, self.module)

    @torch.no_grad()
    def _copy_all(self) -> None:
        for ours, student in self._pairs:
            ours.copy_(student)

    @torch.no_grad()
    def update(self) -> None:
        """Move the teacher ``rate`` of the way toward the student's current weights."""
        parameter_ids = {id(parameter) for parameter in self.module.parameters()}
        for ours, student in self._pairs:
            if id(ours) in parameter_ids and ours.is_floating_point():
                ours.lerp_(student.to(ours.dtype), self.rate)
            else:
                ours.copy_(student)
        self.num_updates += 1

    def state_dict(self, dist: DistInfo) -> dict[str, Any]:
        """The teacher's full weights (on rank 0; collective under FSDP2) and its update count:
        the run checkpoint's format."""
        return {
            "weights": full_model_state_dict(self.module, dist),
            "num_updates": self.num_updates,
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, device: torch.device, cpu_offload: bool = False
    ) -> None:
        """Restores what :meth:`state_dict` saved; an older checkpoint's ``model`` key (the
        format A2 wrote before the channels shared this class) still loads. The rate comes
        from the config, not the checkpoint."""
        weights = state.get("weights", state.get("model"))
        if weights is None or "num_updates" not in state:
            raise KeyError(
                f"EMATeacher state has no weights or num_updates (keys: {sorted(state)})"
            )
        training.load_from_full_model_state_dict(
            self.module, weights, device, strict=True, cpu_offload=cpu_offload
        )
        self.rebind()  # torchtune's loader assigned new tensors to the teacher
        self.num_updates = int(state["num_updates"])
