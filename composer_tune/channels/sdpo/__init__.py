"""SDPO self-distillation (channel 2 of the Composer recipe): the hinted teacher's contexts
(:mod:`~composer_tune.channels.sdpo.contexts`), the channel's loss on a micro-batch
(:mod:`~composer_tune.channels.sdpo.channel`), and the teacher as a recipe sets it up: config
checks, the EMA teacher and its checkpoint state (:mod:`~composer_tune.channels.sdpo.teacher`).
The divergence itself is math on tensors in :mod:`composer_tune.losses.distill`.
"""

from composer_tune.channels.sdpo.channel import (
    SDPOChannelConfig,
    build_sdpo_teacher_batch,
    distilled_token_count,
    logprobs_with_sdpo,
    loss_normalizer_count,
    reduce_sdpo_metrics,
    sdpo_channel_loss,
    select_teacher_rows,
)
from composer_tune.channels.sdpo.contexts import (
    HINT_SOURCES,
    TeacherBatch,
    TeacherContextConfig,
    build_hints,
    build_teacher_batch,
    insert_hint,
    prediction_positions,
    strip_reasoning,
    succeeded,
)

__all__ = [
    "HINT_SOURCES",
    "SDPOChannelConfig",
    "TeacherBatch",
    "TeacherContextConfig",
    "build_hints",
    "build_sdpo_teacher_batch",
    "build_teacher_batch",
    "distilled_token_count",
    "loss_normalizer_count",
    "insert_hint",
    "logprobs_with_sdpo",
    "prediction_positions",
    "reduce_sdpo_metrics",
    "sdpo_channel_loss",
    "select_teacher_rows",
    "strip_reasoning",
    "succeeded",
]
