"""Weighted sums of rewards, configurable from YAML with nested ``_component_`` entries."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from composer_tune.rewards.base import Reward, RewardResult


def check_batch(completions: Sequence[str], samples: Sequence[Any], reward_name: str) -> None:
    """Raise if a reward is called with mismatched batches (they would be scored off by one)."""
    if len(completions) != len(samples):
        raise ValueError(
            f"{reward_name}: got {len(completions)} completions for {len(samples)} samples"
        )


def _build_reward(spec: Any, where: str) -> Reward:
    """A reward object as given, or instantiated from a ``{_component_: ..., **kwargs}`` mapping.

    torchtune 0.6.1's ``config.instantiate`` hands nested ``_component_`` nodes to the parent
    as plain dicts, so the composite instantiates its components itself.
    """
    if isinstance(spec, Mapping):
        if "_component_" not in spec:
            raise ValueError(f"CompositeReward: {where} is a mapping without '_component_'")
        from omegaconf import OmegaConf
        from torchtune import config

        spec = config.instantiate(OmegaConf.create(dict(spec)))
    if not callable(spec):
        raise TypeError(f"CompositeReward: {where} is not a reward: {spec!r}")
    return spec


class CompositeReward:
    """The weighted sum of several rewards, e.g. answer correctness plus a small format bonus.

    ``score`` is ``sum(weight * component score)`` over the components that could score the
    completion: a component returning NaN (a crashed verifier) is left out of the sum, and the
    row is unscorable (NaN) only when every component returned NaN. This is TRL 1.16's
    ``nansum`` over reward functions with its all-NaN rows marked unscorable, chosen so that one
    flaky part (say a format bonus) does not throw away the answer's score; the cost is that
    such a row's score lacks that part's term, which the other completions of its group keep.
    ``correct`` is True only if every component
    that defines correctness says so, and None if none does. ``feedback`` joins the components'
    non-empty feedback with spaces, in component order. Each component scores the whole batch in
    one call, so batched verifiers keep their parallelism.

    Args:
        components: entries ``{"reward": reward, "weight": float}``; ``reward`` is a reward
            object or a mapping with ``_component_`` (and its keyword arguments), as YAML gives::

                reward:
                  _component_: composer_tune.rewards.CompositeReward
                  components:
                    - reward: {_component_: composer_tune.rewards.MathAnswerReward}
                      weight: 1.0
                    - reward: {_component_: composer_tune.rewards.FormatReward}
                      weight: 0.1
    """

    def __init__(self, components: Sequence[Mapping[str, Any]]) -> None:
        if not components:
            raise ValueError("CompositeReward: components is empty")
        self.rewards: list[Reward] = []
        self.weights: list[float] = []
        for index, entry in enumerate(components):
            where = f"components[{index}]"
            if not isinstance(entry, Mapping) or set(entry) != {"reward", "weight"}:
                raise ValueError(
                    f"CompositeReward: {where} must have exactly the keys 'reward' and 'weight', "
                    f"got {entry!r}"
                )
            weight = entry["weight"]
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise TypeError(f"CompositeReward: {where}.weight must be a number, got {weight!r}")
            self.rewards.append(_build_reward(entry["reward"], f"{where}.reward"))
            self.weights.append(float(weight))

    def __call__(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        check_batch(completions, samples, type(self).__name__)
        per_component = [reward(completions, samples) for reward in self.rewards]
        for reward, results in zip(self.rewards, per_component, strict=True):
            if len(results) != len(completions):
                raise ValueError(
                    f"CompositeReward: {type(reward).__name__} returned {len(results)} results "
                    f"for {len(completions)} completions"
                )
        return combine_results(per_component, self.weights)


def combine_results(
    per_component: Sequence[Sequence[RewardResult]], weights: Sequence[float]
) -> list[RewardResult]:
    """Each row's weighted sum over the components that scored it (TRL 1.16's ``nansum`` over
    reward functions; NaN only when every component returned NaN), success when every component
    that judges says so (None when none does), and the components' non-empty feedback joined with
    spaces, in component order. ``per_component[k][i]`` is component ``k``'s result for row ``i``."""
    combined = []
    for results in zip(*per_component, strict=True):
        verdicts = [result.correct for result in results if result.correct is not None]
        scored = [
            weight * result.score
            for weight, result in zip(weights, results, strict=True)
            if not math.isnan(result.score)
        ]
        combined.append(
            RewardResult(
                score=sum(scored) if scored else math.nan,
                correct=all(verdicts) if verdicts else None,
                feedback=" ".join(result.feedback for result in results if result.feedback),
            )
        )
    return combined
