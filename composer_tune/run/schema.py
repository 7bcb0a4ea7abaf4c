"""The config schema the RL recipes share (A1-A4 and DiLoCo's inner loop).

:class:`RLRecipeConfig` extends :class:`~composer_tune.config.TrainingConfig` with what every
recipe that samples rollouts reads: prompts, reward, sampling, the step layout, channel 1's
``loss`` section, evaluation and the rollout engine. A recipe adds only its own sections
(``sdpo``: :class:`SDPOChannelConfig`, ``dpo``: :class:`DPOChannelConfig`, DiLoCo's outer loop),
typed the same in every recipe that has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from composer_tune.channels.replay_dpo import DPOChannelConfig
from composer_tune.channels.sdpo.channel import SDPOChannelConfig
from composer_tune.checkpointing.warm_start import WarmStartSection
from composer_tune.config import TrainingConfig
from composer_tune.rollout.engines import RolloutSection
from composer_tune.run.dynamic_sampling import DynamicSamplingSection
from composer_tune.run.task_sampler import TaskSamplerSection

__all__ = ["DPOChannelConfig", "RLRecipeConfig", "SDPOChannelConfig"]


@dataclass
class RLRecipeConfig(TrainingConfig):
    # Training prompts: a ``prompt`` (chat messages, or TRL's standard string) and any columns
    # the reward and environment read (composer_tune.data.TaskDataset reads files / the HF cache).
    dataset: Any = MISSING
    # The reward (composer_tune.rewards.functions.build_reward): TRL reward functions by dotted
    # path (a list, or a RewardFunctions node with reward_weights and success_threshold), the
    # project's rewards (_component_), or null: the agent environment's get_reward() alone.
    reward: Any = None
    eval_dataset: Any = None  # held-out prompts; null skips evaluation
    eval_reward: Any = None  # null: the training reward (and environment) decide success
    # The supervised run to start from; trained first if it has no checkpoint. Mutually
    # exclusive with checkpoint.initial_checkpoint.
    warm_start: WarmStartSection | None = None
    # Prompts per generation batch over all ranks (each rank takes an equal share).
    num_prompts_per_generation: int = 16
    group_size: int = 8  # completions per prompt (G)
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # Optimiser steps the generation batch is split into, and passes over it (TRL's names).
    steps_per_generation: int = 1
    num_iterations: int = 1
    micro_batch_size: int = 32  # completions per forward/backward on each rank
    # Log-prob forwards (training, old and reference) run each group's prompt once and its
    # completions attend to it (composer_tune/rollout/shared_prefix.py): the same log-probs and
    # gradients as packed rows up to float rounding, fewer FLOPs; false: one row per completion.
    shared_prefix_forward: bool = True
    # With two or more channels on, log each channel's gradient norm before clipping and its
    # share of the step (grad_norm/<channel>, grad_share/<channel>); channels 1 and 2 then take
    # a student forward and backward each instead of sharing one (channels/gradients.py).
    log_channel_gradients: bool = False
    # Channel 1: ``weight`` (default 1; 0 turns the policy loss off) and a PolicyLossConfig
    # mapping (objective, epsilon_low/high, beta, kl_estimator, kl_mode, scale_rewards,
    # mask_truncated_completions, ...). max_completion_length defaults to max_new_tokens.
    loss: Any = None
    # Debug knob for negative controls: -1 flips every advantage (the run must then get worse).
    advantage_sign: float = 1.0
    # FSDP2 CPU offload of parameters, gradients and optimizer state (policy and reference).
    fsdp_cpu_offload: bool = False
    # The engine that samples rollouts (rollout.engine: native | vllm; rollout.vllm.*).
    rollout: RolloutSection = field(default_factory=RolloutSection)
    # Agent episodes instead of single-turn completions (composer_tune/agents): an
    # environment, tools and the episode limits; null samples one assistant turn per row.
    agent: Any = None
    # Tasks chosen by their recent pass rate under the policy (target rate, retirement,
    # promotion to harder variants; composer_tune/run/task_sampler.py); null: uniform epochs.
    task_sampler: TaskSamplerSection | None = None
    # DAPO's dynamic sampling: drop the groups whose scored rewards are all equal and draw more
    # prompts, up to max_generation_batches, until the batch holds train_groups groups
    # (composer_tune/run/dynamic_sampling.py); off by default.
    dynamic_sampling: DynamicSamplingSection = field(default_factory=DynamicSamplingSection)
