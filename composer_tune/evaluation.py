"""Held-out evaluation by generation: every recipe measures progress the same way.

Prompts are split across ranks; each rank decodes its share with the KV cache and the verifiable
reward scores the completions; counts are summed over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer_tune.config import EvalSampling
from composer_tune.distributed import DistInfo, all_reduce_sum
from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.functions import ScoringBatch
from composer_tune.rollout import encode_prompts
from composer_tune.rollout.rollouts import episode_metrics
from composer_tune.rollout.window import generate_in_window, score_in_window

if TYPE_CHECKING:
    from composer_tune.agents import AgentRuntime, EpisodeRecord


@dataclass
class EvalResult:
    accuracy: float  # success (RewardResult.correct); an unscored completion is a failure
    reward_mean: float  # over the scored completions (NaN: none was)
    num_samples: int
    mean_completion_tokens: float
    # A few (prompt, completion, gold when the row has one, reward) from rank 0, for logs.
    examples: list[dict[str, Any]] = field(default_factory=list)
    # Agent episodes only: turns, tool_calls, tool_errors, truncated, ... (logged under prefix)
    episode_metrics: dict[str, float] = field(default_factory=dict)
    # A sampled evaluation (mean success over samples_per_problem completions per problem;
    # num_samples counts every completion) instead of greedy pass@1.
    sampled: bool = False
    samples_per_problem: int = 1
    # Completions that ran to ``max_new_tokens`` without a stop token (single turn; an episode's
    # truncation is in episode_metrics).
    truncated_rate: float = 0.0
    # With ``group_by``: accuracy within each value of that dataset column (``eval/accuracy/<v>``).
    group_accuracy: dict[str, float] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        """``eval/`` for greedy decoding, ``eval_sampled/`` for the mean over samples."""
        return "eval_sampled/" if self.sampled else "eval/"

    def metrics(self) -> dict[str, float]:
        """The metrics every recipe logs for a held-out evaluation (tools/ladder.py and the tests
        read these names): ``eval/...`` greedy, ``eval_sampled/...`` sampled."""
        metrics = {
            "accuracy": self.accuracy,
            "reward_mean": self.reward_mean,
            "completion_tokens": self.mean_completion_tokens,
            **self.episode_metrics,
            **{f"accuracy/{group}": value for group, value in self.group_accuracy.items()},
        }
        if not self.episode_metrics:
            metrics["truncated"] = self.truncated_rate
        return {self.prefix + key: value for key, value in metrics.items()}

    def summary(self) -> str:
        """The recipes' console line for it, after their ``[step N]`` prefix."""
        if self.sampled:
            problems = self.num_samples // self.samples_per_problem
            return (
                f"held-out accuracy (sampled, mean of {self.samples_per_problem} per problem) "
                f"{self.accuracy:.3f} over {problems} problems{self._groups()}"
            )
        return (
            f"held-out accuracy {self.accuracy:.3f} over {self.num_samples} problems"
            f"{self._groups()}; e.g. {self.examples[:2]}"
        )

    def _groups(self) -> str:
        return "".join(f", {group} {value:.3f}" for group, value in self.group_accuracy.items())


def _example(sample: Mapping[str, Any], text: str, result: RewardResult) -> dict[str, Any]:
    """An evaluated completion for logs: the question, the completion, the gold answer when the
    row has one (a task scored by its environment or its reward functions needs none), and the
    reward."""
    example = {"prompt": sample["prompt"][-1]["content"], "completion": text}
    if "answer" in sample:
        example["gold"] = sample["answer"]
    return {**example, "reward": result.score}


@torch.no_grad()
def evaluate_heldout(
    model: nn.Module,
    tokenizer: Any,
    dataset: Sequence[Mapping[str, Any]],
    reward: Any,
    *,
    dist_info: DistInfo,
    batch_size: int,
    max_new_tokens: int,
    enable_thinking: bool = False,
    num_examples: int = 3,
    agent: AgentRuntime | None = None,
    sampling: EvalSampling | None = None,
    group_by: str | None = None,
) -> EvalResult:
    """Greedy pass@1 of ``model`` on ``dataset``: accuracy (``RewardResult.correct``) and mean
    reward, scored by ``reward`` as training scores (a ``RewardFunctions``, a project reward or
    a TRL reward function: no gold answer is needed). Completions stop at the model's window
    (``generate_in_window``). Collective under torchrun: every rank must call it.

    With ``sampling``, each problem is instead sampled ``samples_per_problem`` times at its
    temperature from a generator seeded by its seed (the same draws for every checkpoint
    evaluated), and accuracy is the mean success over all samples (avg@k): what a policy
    trained on sampled rollouts is optimised for, where greedy decoding hides how often the
    policy takes each path.

    With an ``agent``, each problem is a greedy episode (the agent's limits replace
    ``max_new_tokens``): accuracy is episode success, completion tokens count the model's own,
    and the episode metrics are added (``eval/turns``, ``eval/tool_calls``, ...,
    ``eval/tool_use_rate``: the share of episodes with at least one tool call)."""
    repeats = sampling.samples_per_problem if sampling else 1
    own = range(dist_info.rank, len(dataset), dist_info.world_size)
    indices = [index for index in own for _ in range(repeats)]
    greedy, temperature, generator = sampling is None, 1.0, None
    if sampling is not None:
        temperature = sampling.temperature
        generator = torch.Generator(device=dist_info.device)
        generator.manual_seed(sampling.seed + dist_info.rank)
    # Equal batch counts on every rank: FSDP forwards are collectives.
    per_rank = -(-len(dataset) // dist_info.world_size) * repeats
    num_batches = -(-per_rank // batch_size)
    # Every rank reads the whole dataset, so every rank lists the same groups in the same order.
    groups = sorted({str(dataset[i][group_by]) for i in range(len(dataset))}) if group_by else []
    # Per group: correct, samples.
    group_totals = torch.zeros(2 * len(groups), dtype=torch.float64)
    # correct, reward (of the scored), samples, completion tokens, scored samples, truncated
    totals = torch.zeros(6, dtype=torch.float64)
    examples: list[dict[str, Any]] = []
    records: list[EpisodeRecord] = []
    for batch_index in range(num_batches):
        batch_ids = indices[batch_index * batch_size : (batch_index + 1) * batch_size]
        # A rank out of samples decodes a copy of sample 0 and ignores it.
        samples = [dataset[i] for i in batch_ids] or [dataset[0]]
        if agent is not None:
            episodes, results = agent.run(
                model,
                tokenizer,
                samples,
                reward,
                greedy=greedy,
                temperature=temperature,
                generator=generator,
                sync_ranks=dist_info.is_distributed,
                enable_thinking=enable_thinking,
            )
            texts = [episode.final_text for episode in episodes]
            model_tokens = sum(sum(episode.model_mask) for episode in episodes)
        else:
            windowed = generate_in_window(
                model,
                encode_prompts(tokenizer, samples, enable_thinking=enable_thinking),
                max_new_tokens=max_new_tokens,
                pad_id=tokenizer.pad_id,
                greedy=greedy,
                temperature=temperature,
                generator=generator,
                stop_tokens=tokenizer.stop_tokens,
                sync_ranks=dist_info.is_distributed,
            )
            output = windowed.output
            texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in output.completions]
            results = score_in_window(
                reward, ScoringBatch(samples, texts, output.completions), windowed.over_window
            )
            model_tokens = float(output.completion_lengths.sum())
            totals[5] += float(output.truncated[: len(batch_ids)].sum())
        if not batch_ids:
            continue
        if agent is not None:
            records += [episode.record for episode in episodes]
        totals[0] += sum(bool(r.correct) for r in results)
        scores = [r.score for r in results if not math.isnan(r.score)]
        totals[1] += sum(scores)
        totals[2] += len(results)
        totals[3] += model_tokens
        totals[4] += len(scores)
        if group_by:
            for sample, result in zip(samples, results, strict=True):
                group = groups.index(str(sample[group_by]))
                group_totals[2 * group] += bool(result.correct)
                group_totals[2 * group + 1] += 1
        for sample, text, result in zip(samples, texts, results, strict=True):
            if len(examples) < num_examples:
                examples.append(_example(sample, text, result))
    all_reduce_sum(totals)
    if groups:
        all_reduce_sum(group_totals)
    count = max(int(totals[2]), 1)
    episode_stats: dict[str, float] = {}
    if agent is not None:
        episode_stats = episode_metrics(records, "", totals.device)
        used = torch.tensor([float(sum(bool(r.tool_calls) for r in records))], dtype=torch.float64)
        episode_stats["tool_use_rate"] = float(all_reduce_sum(used)) / count
    return EvalResult(
        accuracy=float(totals[0]) / count,
        reward_mean=float(totals[1]) / int(totals[4]) if totals[4] else math.nan,
        num_samples=int(totals[2]),
        mean_completion_tokens=float(totals[3]) / count,
        examples=examples,
        episode_metrics=episode_stats,
        sampled=sampling is not None,
        samples_per_problem=repeats,
        truncated_rate=float(totals[5]) / count,
        group_accuracy={
            group: float(group_totals[2 * i] / max(group_totals[2 * i + 1], 1))
            for i, group in enumerate(groups)
        },
    )
