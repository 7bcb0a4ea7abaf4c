"""What an RL recipe's progress bar shows after a step: the metrics that move.

The on-policy GRPO loss is 0 by construction (its advantages are centred per group and the ratio
is 1), so a bar showing it reads ``loss=0.0000`` on every step. The bar shows instead the rollout
reward and accuracy, and, where the run has them, the KL to the reference and the channel-2/3
losses.
"""

from __future__ import annotations

from collections.abc import Mapping

# metric name -> (short label, format)
PROGRESS_METRICS: dict[str, tuple[str, str]] = {
    "reward/mean": ("reward", ".3f"),
    "accuracy": ("acc", ".3f"),
    "kl": ("kl", ".4f"),
    "sdpo/divergence": ("sdpo", ".4f"),
    "dpo/loss": ("dpo", ".4f"),
}


def progress_postfix(*metrics: Mapping[str, float]) -> dict[str, str]:
    """``tqdm.set_postfix`` arguments from a step's metric dicts (later dicts win)."""
    merged: dict[str, float] = {}
    for values in metrics:
        merged.update(values)
    return {
        label: format(float(merged[name]), spec)
        for name, (label, spec) in PROGRESS_METRICS.items()
        if name in merged
    }
