"""Verifiable rewards: the interface, math answer correctness, code execution, format bonus,
weighted sums, and TRL-style reward functions (``RewardFunctions``, how every RL recipe
scores)."""

from composer_tune.rewards.answer import answers_match, extract_answer, final_response
from composer_tune.rewards.base import Reward, RewardResult
from composer_tune.rewards.coding import CodeExecutionReward
from composer_tune.rewards.composite import CompositeReward
from composer_tune.rewards.format import FormatReward
from composer_tune.rewards.functions import RewardFunctions
from composer_tune.rewards.math import MathAnswerReward

__all__ = [
    "CodeExecutionReward",
    "CompositeReward",
    "FormatReward",
    "MathAnswerReward",
    "Reward",
    "RewardFunctions",
    "RewardResult",
    "answers_match",
    "extract_answer",
    "final_response",
]
