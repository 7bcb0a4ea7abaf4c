"""Channel 1's glue (GRPO-family RL on verifiable rewards, replicating Composer 2.5): what every
RL recipe adds around ``composer_tune.losses.policy`` so that A1-A4 and DiLoCo share it.

* :func:`sample_rollouts`: ``group_size`` scored completions per prompt, with the log-probs the
  step reads;
* :func:`group_advantages`: group-relative advantages, after the KL penalty in
  ``kl_mode=reward``, with ``scale_rewards=batch`` taking the std over every rank;
* :func:`step_normalization`: the facts the policy loss normalises an optimiser step by
  (collective), so no recipe branches on the objective.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig
from torch import nn

from composer_tune.agents import AgentRuntime, collect_episodes
from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.losses import (
    PolicyLossConfig,
    StepNormalization,
    apply_kl_to_rewards,
    apply_truncation_mask,
    compute_advantages,
)
from composer_tune.rollout.rollouts import RolloutBatch, collect_rollouts

if TYPE_CHECKING:
    from composer_tune.rollout.vllm_engine import VLLMEngine


def kl_in_reward(loss_cfg: PolicyLossConfig) -> bool:
    """Whether the KL penalty is folded into the reward (it then needs the sampling policy's
    log-probs) rather than added to the loss."""
    return loss_cfg.beta > 0 and loss_cfg.kl_mode == "reward"


def sample_rollouts(
    model: nn.Module,
    samples: list[dict[str, Any]],
    cfg: DictConfig,
    *,
    tokenizer: Any,
    reward: Any,
    generator: torch.Generator,
    reference: nn.Module | None,
    compute_old_logp: bool,
    sync_ranks: bool,
    engine: VLLMEngine | None = None,
    policy_version: int | None = None,
    agent: AgentRuntime | None = None,
) -> RolloutBatch:
    """``cfg.group_size`` completions per prompt of ``samples``, scored. ``cfg`` is the recipe
    config (its sampling keys: group_size, max_new_tokens, temperature, top_k, top_p,
    enable_thinking, logprob_chunk_size, micro_batch_size, shared_prefix_forward);
    ``reference`` (None: none) adds reference log-probs for a KL term; ``compute_old_logp`` the
    sampling policy's.

    With a vLLM ``engine`` (``build_rollout_engine``), ``model``'s weights are pushed into it
    first unless it already holds ``policy_version`` (the optimiser step they come from; None:
    always push), and the engine sleeps afterwards where its settings say so (GPU sleep mode).

    With an ``agent`` (``composer_tune.agents.build_agent``) each row is a multi-turn
    tool-calling episode instead (its limits replace ``max_new_tokens``), packed so that the
    completion mask covers only the model's own tokens."""
    if engine is not None:
        engine.sync_weights(model, policy_version)
    settings = {
        "group_size": cfg.group_size,
        "temperature": cfg.temperature,
        "top_k": cfg.top_k,
        "top_p": cfg.top_p,
        "generator": generator,
        "reference": reference,
        "enable_thinking": cfg.enable_thinking,
        "logprob_chunk_size": cfg.logprob_chunk_size,
        "forward_batch_size": cfg.micro_batch_size,
        "sync_ranks": sync_ranks,
        "compute_old_logp": compute_old_logp,
        "engine": engine,
        "shared_prefix": cfg.shared_prefix_forward,
    }
    if agent is not None:
        rollout = collect_episodes(agent, model, tokenizer, samples, reward, **settings)
    else:
        rollout = collect_rollouts(
            model, tokenizer, samples, reward, max_new_tokens=cfg.max_new_tokens, **settings
        )
    if engine is not None:
        engine.sleep()
    return rollout


def group_advantages(
    rollout: RolloutBatch, loss_cfg: PolicyLossConfig, group_size: int, dist: DistInfo
) -> torch.Tensor:
    """Group-relative advantages of this rank's rows, after the KL penalty in
    ``kl_mode=reward``; ``scale_rewards=batch`` takes the std over every rank's rewards
    (collective then)."""
    rewards = rollout.rewards
    if kl_in_reward(loss_cfg):
        rewards = apply_kl_to_rewards(
            rewards,
            rollout.old_logp,
            rollout.ref_logp,
            rollout.completion_mask,
            loss_cfg.beta,
            loss_cfg.kl_estimator,
        )
    if loss_cfg.scale_rewards != "batch" or not dist.is_distributed:
        return compute_advantages(rewards, group_size, loss_cfg.scale_rewards)
    gathered = torch.zeros(
        (dist.world_size, rewards.numel()), dtype=rewards.dtype, device=rewards.device
    )
    gathered[dist.rank] = rewards
    all_reduce_sum(gathered)
    advantages = compute_advantages(gathered.reshape(-1), group_size, "batch")
    return advantages.view(dist.world_size, -1)[dist.rank]


def step_normalization(
    rows: RolloutBatch, loss_cfg: PolicyLossConfig, dist: DistInfo, micro_batch_size: int
) -> StepNormalization:
    """The normalisation facts of one optimiser step on ``rows`` (this rank's share; the
    active-token count is summed over ranks, a collective)."""
    active = rows.completion_mask
    if loss_cfg.mask_truncated_completions:
        active = apply_truncation_mask(active, rows.truncated)
    global_tokens = all_reduce_sum(active.sum().double().reshape(1))
    return StepNormalization(
        active_tokens=float(global_tokens),
        world_size=dist.world_size,
        num_micro_batches=math.ceil(len(rows) / micro_batch_size),
    )
