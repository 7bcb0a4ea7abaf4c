"""Rollout engine: batched sampling of completions from the policy."""

from composer_tune.rollout.generation import (
    GenerationOutput,
    PackedBatch,
    encode_prompts,
    generate,
    pack_sequences,
    sample_next_token,
)

__all__ = [
    "GenerationOutput",
    "PackedBatch",
    "encode_prompts",
    "generate",
    "pack_sequences",
    "sample_next_token",
]
from composer_tune.rollout.rollouts import (  # noqa: E402
    RolloutBatch,
    collect_rollouts,
    sequence_logprobs,
)

__all__ += ["RolloutBatch", "collect_rollouts", "sequence_logprobs"]
