"""The calculator tool task, sized for SmolLM2-135M: products of a 3-digit and a 2-digit number
and two-step expressions, which the model gets wrong in its head and right through the tool.

* :func:`calculate`: the tool, a plain function (TRL's ``tools=[calculate]``), evaluating
  arithmetic by walking its syntax tree (no ``eval``);
* :class:`CalculatorProblems`: the prompts, ``answer`` = the exact result (the reward is
  ``MathAnswerReward`` on the final answer);
* :class:`CalculatorDemonstrations`: supervised tool-use episodes for the A0 warm start,
  generated from a seed at load time.

Splits are disjoint by a stable hash of the expression; the held-out split has no duplicates.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
from typing import Any, Literal

from torch.utils.data import Dataset

Kind = Literal["mul", "two_step"]
Split = Literal["train", "heldout"]

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_MAGNITUDE = 10**18  # keeps a hostile expression from building huge integers
_HELDOUT_PERCENT = 20
_DEFAULT_INSTRUCTION = "Use the calculate tool, then reply with just the number."


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % and parentheses.

    Args:
        expression: The arithmetic expression, for example "347 * 68".
    """
    tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if abs(value) > _MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")


def split_of(expression: str) -> Split:
    """The split a problem belongs to, from its text alone (so seeds and sizes never leak
    held-out problems into training)."""
    digest = hashlib.sha256(expression.encode()).digest()
    return "heldout" if digest[0] * 100 // 256 < _HELDOUT_PERCENT else "train"


class CalculatorProblems(Dataset):
    """Seeded calculator problems: ``"What is 347 * 68? Use the calculate tool, then reply
    with just the number."`` -> ``answer`` ``"23596"``.

    Args:
        split: "train" or "heldout" (disjoint; held-out problems are all distinct).
        num_samples: dataset length.
        seed: which problems are drawn.
        kinds: "mul" (3-digit x 2-digit) and/or "two_step" (``a * b + c`` or ``a * b - c``
            with a 2-digit ``a``, ``b`` and a 3-digit ``c``).
        instruction: appended to the question after a space.
    """

    def __init__(
        self,
        split: Split,
        num_samples: int,
        seed: int = 0,
        kinds: tuple[Kind, ...] | list[Kind] = ("mul", "two_step"),
        instruction: str = _DEFAULT_INSTRUCTION,
    ) -> None:
        if split not in ("train", "heldout"):
            raise ValueError(
                f"CalculatorProblems: split must be 'train' or 'heldout', got {split!r}"
            )
        kinds = tuple(kinds)
        if not kinds or any(kind not in ("mul", "two_step") for kind in kinds):
            raise ValueError(
                f"CalculatorProblems: kinds must be a non-empty subset of ('mul', 'two_step'), got {kinds!r}"
            )
        if num_samples < 1:
            raise ValueError(f"CalculatorProblems: num_samples must be >= 1, got {num_samples}")
        self.split, self.seed, self.kinds, self.instruction = split, seed, kinds, instruction
        self.num_samples = num_samples
        # Held-out problems are drawn once, in order, skipping repeats.
        self._heldout: list[str] | None = None
        if split == "heldout":
            rng, seen = random.Random(f"calculator:{seed}:heldout"), dict[str, None]()
            for _ in range(num_samples * 1000):
                expression = self._draw(rng)
                if split_of(expression) == "heldout":
                    seen.setdefault(expression)
                    if len(seen) == num_samples:
                        break
            if len(seen) < num_samples:
                raise ValueError(f"CalculatorProblems: only {len(seen)} distinct held-out problems")
            self._heldout = list(seen)

    def __len__(self) -> int:
        return self.num_samples

    def _draw(self, rng: random.Random) -> str:
        if rng.choice(self.kinds) == "mul":
            return f"{rng.randint(100, 999)} * {rng.randint(11, 99)}"
        sign = rng.choice("+-")
        return f"{rng.randint(11, 99)} * {rng.randint(11, 99)} {sign} {rng.randint(100, 999)}"

    def expression(self, index: int) -> str:
        if not 0 <= index < self.num_samples:
            raise IndexError(
                f"CalculatorProblems: index {index} out of range for {self.num_samples}"
            )
        if self._heldout is not None:
            return self._heldout[index]
        rng = random.Random(f"calculator:{self.seed}:train:{index}")
        while True:
            expression = self._draw(rng)
            if split_of(expression) == "train":
                return expression

    def __getitem__(self, index: int) -> dict[str, Any]:
        expression = self.expression(index)
        question = f"What is {expression}?"
        return {
            "id": f"calc-{self.split}-s{self.seed}-{index}",
            "prompt": [{"role": "user", "content": f"{question} {self.instruction}".strip()}],
            "answer": calculate(expression),
            "expression": expression,
        }


class CalculatorDemonstrations(CalculatorProblems):
    """Supervised tool-use episodes on the training split, for an SFT warm start: the prompt
    holds the user question, the assistant's ``calculate`` call and the tool's response; the
    ``target`` is the final answer. ``tool_rate`` is the share of demonstrations that use the
    tool; the rest answer at once with the true result, so imitation learns a mix of tool use
    and guessing that RL can shift (a stand-in for demonstration data that under-uses tools).
    The SFT tokenizer must render the tool's schema (``from_pretrained``'s ``tools``)."""

    def __init__(
        self,
        num_samples: int,
        seed: int = 0,
        kinds: tuple[Kind, ...] | list[Kind] = ("mul", "two_step"),
        instruction: str = _DEFAULT_INSTRUCTION,
        tool_rate: float = 1.0,
    ) -> None:
        super().__init__("train", num_samples, seed, kinds, instruction)
        if not 0.0 <= tool_rate <= 1.0:
            raise ValueError(
                f"CalculatorDemonstrations: tool_rate must be in [0, 1], got {tool_rate}"
            )
        self.tool_rate = tool_rate

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        if random.Random(f"calculator:{self.seed}:demo:{index}").random() < self.tool_rate:
            call = {"name": "calculate", "arguments": {"expression": sample["expression"]}}
            sample["prompt"] = [
                *sample["prompt"],
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": call}],
                },
                {"role": "tool", "name": "calculate", "content": sample["answer"]},
            ]
        sample["target"] = sample["answer"]
        return sample
