"""SDPO self-distillation (channel 2 of the Composer recipe): teacher contexts with hints.

The loss lives in :mod:`composer_tune.losses.distill`; this package builds what the teacher
reads.
"""

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
    "TeacherBatch",
    "TeacherContextConfig",
    "build_hints",
    "build_teacher_batch",
    "insert_hint",
    "prediction_positions",
    "strip_reasoning",
    "succeeded",
]
from composer_tune.channels.sdpo.channel import (  # noqa: E402  (appended: the per-micro-batch channel)
    SDPOChannelConfig,
    build_sdpo_teacher_batch,
    distilled_token_count,
    logprobs_with_sdpo,
    reduce_sdpo_metrics,
    sdpo_channel_loss,
    select_teacher_rows,
)

__all__ += [
    "SDPOChannelConfig",
    "build_sdpo_teacher_batch",
    "distilled_token_count",
    "logprobs_with_sdpo",
    "reduce_sdpo_metrics",
    "sdpo_channel_loss",
    "select_teacher_rows",
]
