"""The ladder's arms: the rungs ``tools/ladder.py`` runs (and the peers its tables can hold),
and the names of the metrics it reads from their logs."""

from __future__ import annotations

from dataclasses import dataclass

ACCURACY, REWARD, GENERATED = "eval/accuracy", "reward/mean", "tokens/generated"
# log_channel_gradients: each channel's gradient norm before clipping, its share of the step,
# and the step's norm before clipping.
CHANNEL_NORM, CHANNEL_SHARE, STEP_NORM = "grad_norm/", "grad_share/", "grad_norm"
# ... and each channel's logit gradient on the end-of-reply token (> 0: shortens replies).
EOS_PUSH, EOS_SHARE = "eos_push/", "eos_share/"
# Sampled training completions: mean length and the share cut off at max_new_tokens.
LENGTH, TRUNCATED = "completion_length/mean", "truncation_rate"


@dataclass(frozen=True)
class Arm:
    """One rung of the ladder: a recipe run from the shared warm start."""

    key: str  # as --arms and --override ARM:... name it
    title: str
    recipe: str  # path from the repository root
    replicas: int = 1  # > 1: DiLoCo replicas under tools/launch_diloco.py
    # The arm's own key=value settings, after every --override (an ablation arm stays one).
    overrides: tuple[str, ...] = ()
    # An ablation arm: the A4 channel it leaves out (its contribution is A4 minus this arm).
    without: str | None = None


ARMS = {
    arm.key: arm
    for arm in (
        Arm("a1", "A1 GRPO", "recipes/grpo.py"),
        Arm("a2", "A2 SDPO", "recipes/sdpo.py"),
        Arm("a3", "A3 trace-replay DPO", "recipes/replay_dpo.py"),
        Arm("a4", "A4 composer_full", "recipes/composer_full.py"),
        # "A4 minus one channel": composer_full with that channel's weight at 0 (the same
        # recipe and settings as A4 otherwise). A4 minus SDPO is A1+3, minus DPO is A1+2.
        Arm(
            "a4_no_policy",
            "A4 minus GRPO (channels 2+3)",
            "recipes/composer_full.py",
            overrides=("loss.weight=0",),
            without="GRPO (channel 1)",
        ),
        Arm(
            "a4_no_sdpo",
            "A4 minus SDPO (A1+3)",
            "recipes/composer_full.py",
            overrides=("sdpo.weight=0",),
            without="SDPO (channel 2)",
        ),
        Arm(
            "a4_no_dpo",
            "A4 minus trace-replay DPO (A1+2)",
            "recipes/composer_full.py",
            overrides=("dpo.weight=0",),
            without="trace-replay DPO (channel 3)",
        ),
        Arm(
            "diloco",
            "DiLoCo (A4 loop, 2 replicas)",
            "recipes/diloco.py",
            replicas=2,
        ),
    )
}
# Peers the ladder does not run: a tool of their own runs one and writes a ladder results.json
# (one arm) that --combine joins with the ladder's, so a peer has a title and a place in the
# table and plots, but no `tune run` (and is no choice of --arms).
PEER_ARMS = {
    arm.key: arm
    for arm in (Arm("trl_sdpo", "TRL 1.16 SDPOTrainer (peer)", "tools/trl_sdpo_peer.py"),)
}
TITLED_ARMS = {**ARMS, **PEER_ARMS}  # every arm a results table can hold, in table order
DEFAULT_ARMS = ["a1", "a2", "a3", "a4", "diloco"]
ABLATION_ARMS = [key for key, arm in ARMS.items() if arm.without is not None]
