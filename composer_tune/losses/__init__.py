"""Losses: the GRPO-family policy objectives and KL estimators (channel 1), the SDPO
distillation divergence (channel 2), DPO variants (channel 3, this project's own addition), and
chunked token log-probs that never materialise ``[batch, seq, vocab]`` float32 logits. Math on
tensors: the model forwards that feed them live with their channels (``composer_tune.channels``)."""

from composer_tune.losses.distill import (
    DistillConfig,
    DistillOutput,
    TeacherTopK,
    distill_loss,
    teacher_topk,
)
from composer_tune.losses.dpo import DPOLossConfig, DPOOutput, dpo_loss
from composer_tune.losses.kl import KLEstimator, apply_kl_to_rewards, kl_penalty
from composer_tune.losses.logprobs import (
    logprob_head,
    naive_token_logprobs,
    token_logprobs,
)
from composer_tune.losses.policy import (
    Objective,
    PolicyLossConfig,
    RewardScale,
    StepNormalization,
    apply_truncation_mask,
    compute_advantages,
    needs_reference_model,
    policy_loss,
)

__all__ = [
    "DPOLossConfig",
    "DPOOutput",
    "DistillConfig",
    "DistillOutput",
    "KLEstimator",
    "Objective",
    "PolicyLossConfig",
    "RewardScale",
    "StepNormalization",
    "TeacherTopK",
    "apply_kl_to_rewards",
    "apply_truncation_mask",
    "compute_advantages",
    "distill_loss",
    "dpo_loss",
    "kl_penalty",
    "logprob_head",
    "naive_token_logprobs",
    "needs_reference_model",
    "policy_loss",
    "teacher_topk",
    "token_logprobs",
]
