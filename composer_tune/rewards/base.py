"""The reward interface every verifiable reward implements.

A reward scores a batch of completions against the dataset samples they answer. Batching lets
expensive verifiers (sandboxed test execution, remote graders) run in parallel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    """One completion's score.

    score: the scalar the policy optimises; NaN when the completion cannot be scored (a
        verifier that crashed or timed out): it then gets zero advantage, and its group's
        statistics are taken over the scored completions only.
    correct: task success, for accuracy metrics (None when the reward has no notion of it,
        e.g. a format bonus).
    feedback: the verifier's message in plain text ("expected 42, got 41", failing test output).
        The SDPO channel can insert it into the teacher's context as a hint.
    """

    score: float
    correct: bool | None = None
    feedback: str = ""


class Reward(Protocol):
    """Scores completions: ``reward(completions, samples)[i]`` scores ``completions[i]``."""

    def __call__(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]: ...
