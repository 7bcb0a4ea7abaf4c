"""Reward functions as TRL 1.16 writes them, and the one way every RL recipe scores completions.

TRL's ``GRPOTrainer`` takes plain callables (sync or async)::

    def reward(prompts, completions, completion_ids, **columns) -> list[float | None]

``prompts`` and ``completions`` are strings for a dataset in TRL's standard format and lists of
chat messages for the conversational one (an agent episode's completion holds every assistant
and tool message after the prompt); ``completion_ids`` are the token ids after the prompt;
every other dataset column arrives as a keyword list, and ``environments`` (one instance per
completion) when an environment runs the episodes. ``None`` means "not applicable". Several
functions are summed with ``reward_weights``, NaN/None parts left out (``nansum``); a row that
every function left out is unscored (zero advantage). An environment's ``get_reward()`` is one
more function of weight 1, and the only reward when no function is given.

:class:`RewardFunctions` is that, for a recipe's ``reward:`` section. Its entries may also be the
project's own rewards (``RewardResult``: score, success, feedback), so both kinds mix; a plain
float's success is ``score >= success_threshold``. A function that raises, hangs, returns the
wrong count or a value that is not a finite number leaves its part of those rows unscored and
prints one ``warning:`` line: a run never dies of its reward. :func:`build_reward` turns a config
node into one; :func:`score_completions` is the call the rollouts, episodes and evaluation make.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from composer_tune.rewards.base import Reward, RewardResult
from composer_tune.rewards.composite import combine_results
from composer_tune.user_code import call_with_timeout, resolve_path

# The dataset keys TRL keeps out of the reward functions' keyword columns.
NOT_COLUMNS = ("prompt", "completion", "completion_ids")
# The keyword that carries the episodes' environment instances (TRL's name).
ENVIRONMENTS_KEY = "environments"
# The dataset column whose text SDPO shows its teacher (TRL's SDPOTrainer reads the same one).
FEEDBACK_COLUMN = "privileged_context"


def prompt_text(sample: Mapping[str, Any]) -> str | None:
    """The standard-format prompt string a row was read with (``TaskRow.prompt_text``), or None
    for a conversational row: rows render as chat messages either way, and reward functions see
    the prompt in the format the dataset gave it."""
    return getattr(sample, "prompt_text", None)


@dataclass
class ScoringBatch:
    """The completions to score, with what TRL hands its reward functions.

    Attributes:
        samples: each completion's dataset row.
        texts: each completion's final answer text (what the project's rewards read).
        completion_ids: each completion's token ids after the prompt (tool tokens included).
        prompts: TRL's ``prompts`` (None: each row's prompt as the dataset gave it; an episode
            passes its prompt with the environment's ``reset`` text appended).
        completions: TRL's ``completions`` (None: the text, as one assistant message for a
            conversational row; an episode passes every message after its prompt).
        environments: each row's environment instance (None: no environment; a None entry:
            that row's episode could not run).
    """

    samples: Sequence[Mapping[str, Any]]
    texts: Sequence[str]
    completion_ids: Sequence[Sequence[int]]
    prompts: list[Any] | None = None
    completions: list[Any] | None = None
    environments: list[Any] | None = None

    def __post_init__(self) -> None:
        if self.prompts is None:
            self.prompts = [
                prompt_text(sample) or [dict(message) for message in sample["prompt"]]
                for sample in self.samples
            ]
        if self.completions is None:
            self.completions = [
                text
                if prompt_text(sample) is not None
                else [{"role": "assistant", "content": text}]
                for sample, text in zip(self.samples, self.texts, strict=True)
            ]
        sizes = {len(self.samples), len(self.texts), len(self.completion_ids)}
        sizes |= {len(self.prompts), len(self.completions)}
        if self.environments is not None:
            sizes.add(len(self.environments))
        if len(sizes) != 1:
            raise ValueError(f"ScoringBatch: fields of different lengths {sorted(sizes)}")

    def __len__(self) -> int:
        return len(self.samples)

    def columns(self) -> dict[str, list[Any]]:
        """TRL's keyword columns: every key of the rows but the prompt (a key some rows lack is
        None there, as a Hugging Face dataset gives it), and the environments."""
        keys = dict.fromkeys(key for sample in self.samples for key in sample)
        columns = {
            key: [sample.get(key) for sample in self.samples]
            for key in keys
            if key not in NOT_COLUMNS
        }
        if self.environments is not None:
            columns[ENVIRONMENTS_KEY] = list(self.environments)
        return columns


def _is_function(entry: Any) -> bool:
    """A TRL reward function (a function or method) rather than one of the project's reward
    objects (an instance whose ``__call__(completions, samples)`` returns ``RewardResult``s)."""
    return inspect.isroutine(entry)


def _entry_name(entry: Any) -> str:
    return getattr(entry, "__qualname__", None) or type(entry).__name__


def _resolve_entry(entry: Any, where: str) -> Any:
    """A reward function or reward object from a config entry: a dotted path (a function, or a
    class built without arguments), a ``_component_`` mapping, or the object itself."""
    if isinstance(entry, DictConfig | ListConfig):
        entry = OmegaConf.to_container(entry, resolve=True)
    if isinstance(entry, str):
        target = resolve_path(entry, where)
        return target() if inspect.isclass(target) else target
    if isinstance(entry, Mapping):
        if "_component_" not in entry:
            raise ValueError(f"{where}: a mapping needs '_component_', got {entry!r}")
        from torchtune import config

        return config.instantiate(OmegaConf.create(dict(entry)))
    if not callable(entry):
        raise ValueError(f"{where}: {entry!r} is neither a reward function nor a reward")
    return entry


class RewardFunctions:
    """The reward of an RL recipe: TRL-style reward functions and the project's rewards,
    weighted and summed, plus each episode environment's ``get_reward()`` at weight 1.

    Args:
        reward_funcs: TRL's ``reward_funcs``: dotted paths of functions
            ``f(prompts, completions, completion_ids, **columns) -> list[float | None]`` (sync
            or async) or of reward classes, ``_component_`` mappings of the project's rewards
            (``MathAnswerReward`` ...), or the objects themselves. Empty: the environment's
            ``get_reward()`` is the reward.
        reward_weights: TRL's ``reward_weights``, one per entry (default 1 each).
        success_threshold: a row's total score at or above which it counts as a success, when
            no entry judges success itself (plain floats, ``get_reward()``).
        timeout_s: the longest one function or ``get_reward()`` call may take (None: no limit);
            after it, its part of the batch is unscored.

    Feedback (SDPO's hint) is the project rewards' feedback, then the row's
    ``privileged_context`` column (the column TRL's SDPOTrainer reads), then a failed
    ``get_reward()``'s error.
    """

    def __init__(
        self,
        reward_funcs: Sequence[Any] | Any = (),
        reward_weights: Sequence[float] | None = None,
        success_threshold: float = 1.0,
        timeout_s: float | None = None,
    ) -> None:
        if isinstance(reward_funcs, DictConfig | ListConfig):
            reward_funcs = OmegaConf.to_container(reward_funcs, resolve=True)
        if isinstance(reward_funcs, str | Mapping) or callable(reward_funcs):
            reward_funcs = [reward_funcs]
        self.entries = [
            _resolve_entry(entry, f"reward.reward_funcs[{index}]")
            for index, entry in enumerate(reward_funcs)
        ]
        if reward_weights is None:
            reward_weights = [1.0] * len(self.entries)
        reward_weights = list(reward_weights)
        if len(reward_weights) != len(self.entries):
            raise ValueError(
                f"reward.reward_weights has {len(reward_weights)} weights for "
                f"{len(self.entries)} reward functions"
            )
        for weight in reward_weights:
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise ValueError(f"reward.reward_weights: {weight!r} is not a number")
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, numbers.Real):
            raise ValueError(
                f"reward.success_threshold must be a number, got {success_threshold!r}"
            )
        self.weights = [float(weight) for weight in reward_weights]
        self.success_threshold = float(success_threshold)
        self.timeout_s = timeout_s

    @property
    def names(self) -> list[str]:
        return [_entry_name(entry) for entry in self.entries]

    def check(
        self,
        columns: Sequence[str],
        *,
        environments: bool = False,
        environment_reward: bool = False,
        where: str = "reward",
    ) -> None:
        """Set-up checks, before any rollout: some reward exists (a function, or an environment
        with ``get_reward()``: TRL's rule), and every TRL function takes TRL's arguments, the
        dataset's ``columns`` and, when an environment runs the episodes (``environments``),
        the ``environments`` keyword (TRL passes each as a keyword: ``**kwargs`` takes them)."""
        if not self.entries and not environment_reward:
            raise ValueError(
                f"{where}: no reward: give reward functions, or an agent environment whose "
                "class defines get_reward()"
            )
        keywords = dict.fromkeys(["prompts", "completions", "completion_ids"])
        keywords.update(dict.fromkeys(key for key in columns if key not in NOT_COLUMNS))
        if environments:
            keywords[ENVIRONMENTS_KEY] = None
        for entry in self.entries:
            if not _is_function(entry):
                continue
            try:
                inspect.signature(entry).bind(**keywords)
            except TypeError as err:
                raise ValueError(
                    f"{where}: reward function {_entry_name(entry)} cannot be called with "
                    f"TRL's arguments {sorted(keywords)}: {err} (add **kwargs)"
                ) from None

    def score(self, batch: ScoringBatch) -> list[RewardResult]:
        """Each completion's :class:`RewardResult`: the weighted sum of the parts that scored it
        (NaN when none did), success (every judging reward's verdict, else the score against
        ``success_threshold``; None when unscored) and feedback."""
        parts = [self._entry_results(entry, batch) for entry in self.entries]
        weights = list(self.weights)
        if batch.environments is not None and any(
            callable(getattr(env, "get_reward", None)) for env in batch.environments
        ):
            parts.append(self._environment_results(batch.environments))
            weights.append(1.0)
        if not parts:
            return [RewardResult(math.nan) for _ in range(len(batch))]
        results = []
        for sample, combined in zip(batch.samples, combine_results(parts, weights), strict=True):
            correct = combined.correct
            if correct is None and not math.isnan(combined.score):
                correct = combined.score >= self.success_threshold
            extra = sample.get(FEEDBACK_COLUMN)
            feedback = " ".join(
                part
                for part in (combined.feedback, extra if isinstance(extra, str) else "")
                if part
            )
            results.append(RewardResult(combined.score, correct, feedback))
        return results

    def _entry_results(self, entry: Any, batch: ScoringBatch) -> list[RewardResult]:
        """One entry's results for the batch; all NaN (and one warning line) when it failed."""
        name = _entry_name(entry)
        if _is_function(entry):
            call = functools.partial(
                entry,
                prompts=batch.prompts,
                completions=batch.completions,
                completion_ids=[list(ids) for ids in batch.completion_ids],
                **batch.columns(),
            )
        else:
            call = functools.partial(entry, list(batch.texts), list(batch.samples))
        outcome = call_with_timeout(call, self.timeout_s, name=f"reward-{name}")
        failure, values = outcome.failure, outcome.value
        if failure is None:
            try:  # a list, tuple, array or tensor of values (TRL iterates whatever it gets)
                if isinstance(values, str | bytes | Mapping):
                    raise TypeError
                values = list(values)
            except TypeError:
                failure = f"returned {type(values).__name__}, not a list of rewards"
        if failure is None and len(values) != len(batch):
            failure = f"returned {len(values)} rewards for {len(batch)} completions"
        if failure is not None:
            _warn(f"reward {name} {failure}: its part of {len(batch)} completions is unscored")
            return [RewardResult(math.nan) for _ in range(len(batch))]
        if not _is_function(entry):
            return [_checked_result(result, name, row) for row, result in enumerate(values)]
        return [RewardResult(_checked_value(value, name, row)) for row, value in enumerate(values)]

    def _environment_results(self, environments: Sequence[Any]) -> list[RewardResult]:
        """Each environment's ``get_reward()`` (NaN where its class has none, as TRL's per-class
        reward column is None there; NaN with the error as feedback where it failed)."""
        results = []
        for row, environment in enumerate(environments):
            get_reward = getattr(environment, "get_reward", None)
            if not callable(get_reward):
                results.append(RewardResult(math.nan))
                continue
            name = f"{type(environment).__name__}.get_reward"
            outcome = call_with_timeout(get_reward, self.timeout_s, name=name)
            if outcome.failure is not None:
                _warn(f"{name} {outcome.failure}: completion {row} is unscored by it")
                results.append(
                    RewardResult(math.nan, feedback=f"get_reward failed: {outcome.failure}")
                )
                continue
            results.append(RewardResult(_checked_value(outcome.value, name, row)))
        return results


def _checked_value(value: Any, name: str, row: int) -> float:
    """A reward function's value as a float: None is NaN (not applicable, TRL's meaning); a
    value that is not a finite number is NaN too, with a warning line."""
    if value is None:
        return math.nan
    if isinstance(value, numbers.Real):  # bools too: TRL's tensor reads True as 1.0
        number = float(value)
        if not math.isinf(number):
            return number  # NaN: "not applicable", as TRL reads None
        _warn(f"reward {name} returned {number} for completion {row}: unscored by it")
        return math.nan
    _warn(f"reward {name} returned {value!r} for completion {row}, not a number: unscored by it")
    return math.nan


def _checked_result(result: Any, name: str, row: int) -> RewardResult:
    if not isinstance(result, RewardResult):
        _warn(f"reward {name} returned {result!r} for completion {row}, not a RewardResult")
        return RewardResult(math.nan)
    return RewardResult(_checked_value(result.score, name, row), result.correct, result.feedback)


def _warn(message: str) -> None:
    """One ``warning:`` line on stderr, above a progress bar if one is drawn."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def build_reward(node: Any, *, where: str = "reward") -> RewardFunctions:
    """A recipe's reward from its config node: null (the environment's ``get_reward()``), a
    dotted path or a list of them (TRL reward functions or reward classes), a
    ``RewardFunctions`` node, or a ``_component_`` node of one of the project's rewards."""
    if isinstance(node, DictConfig | ListConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if node is None:
        return RewardFunctions()
    if isinstance(node, str | list):
        return RewardFunctions(node)
    return as_reward_functions(_resolve_entry(node, where))


def as_reward_functions(reward: Reward | RewardFunctions | Callable[..., Any]) -> RewardFunctions:
    """``reward`` as :class:`RewardFunctions` (a project reward or function becomes its one
    entry), so every caller scores through :meth:`RewardFunctions.score`."""
    return reward if isinstance(reward, RewardFunctions) else RewardFunctions([reward])


def score_completions(reward: Any, batch: ScoringBatch) -> list[RewardResult]:
    """``batch`` scored by ``reward`` (a :class:`RewardFunctions`, a project reward or a TRL
    reward function)."""
    return as_reward_functions(reward).score(batch)
