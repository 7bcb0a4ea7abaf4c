"""A seeded synthetic arithmetic task with a verifiable answer.

"What is 347 + 68?" -> "415". It is small enough for a ~1M-parameter transformer to learn on a
CPU in minutes, yet 2-3 digit carries and borrows keep it imperfect, which leaves the RL arms
room to improve. The target is the bare number so sequences stay short; the ``solution`` field
holds a column-by-column rationale that the SDPO channel can show its teacher as a hint.

Train and held-out splits are disjoint by construction: every problem ``(op, a, b)`` belongs to
exactly one split, decided by a stable hash of the problem itself (not of the seed or the index),
so no held-out problem can ever be drawn for training, whatever the sizes or seeds.

Two knobs shape the *demonstrations* (the ``target`` an SFT run imitates), never the gold
``answer`` that rewards and held-out evaluation read:

* ``slip_rate``: the share of problems with a carry (addition) or borrow (subtraction) out of
  the units column whose demonstration forgets it (27 + 15 demonstrated as 32, 21 - 2 as 29), a
  stand-in for the systematic mistakes of real demonstration data, which imitation learns and a
  verifiable reward may unlearn (an experiment the knob makes possible).
* ``hint_rate``: the share of samples whose question carries a hint that reveals the answer,
  in the wordings of SDPO's teacher contexts (composer_tune/channels/sdpo/contexts.py). SDPO's
  self-teacher relies on the model reading a hint, which pretrained LLMs do and a model trained
  from scratch on bare questions does not. Hinted demonstrations are always correct.

recipes/configs/sft/cpu_smoke.yaml uses ``hint_rate`` (with the hint before the question) and
records what each placement and rate did to the ~0.9M-parameter smoke model; no shipped config
uses ``slip_rate``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Literal

from torch.utils.data import Dataset

Operation = Literal["add", "sub", "mul"]
Split = Literal["train", "heldout"]
Style = Literal["symbolic", "word"]

_SYMBOLS: dict[str, str] = {"add": "+", "sub": "-", "mul": "*"}
# Multiplication is by one digit; 0 and 1 would make trivial problems.
_MUL_DIGITS = range(2, 10)
# SDPO's verifier-feedback and successful-sibling hints as the smoke configs word them.
DEFAULT_HINT_TEMPLATES: tuple[str, ...] = (
    "Your final answer {wrong} is wrong. The correct answer is {answer}.",
    "Correct solution:\n\n{answer}",
)
# style="word": everyday wordings per operation, for instruct models. ``{a}``/``{b}`` are the
# operands (``b`` is the one-digit factor of "mul"); the name and the item vary by sample.
WORD_PROBLEM_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box?",
    ),
    "sub": (
        "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
        "A shelf holds {a} {item}. {name} takes {b} of them. How many {item} are left on the shelf?",
    ),
    "mul": (
        "{name} buys {b} bags with {a} {item} in each bag. How many {item} does {name} buy?",
        "Each of {b} boxes holds {a} {item}. How many {item} are there in all the boxes?",
    ),
}
_NAMES = ("Tom", "Anna", "Lena", "Omar", "Priya", "Ben", "Sofia", "Ken")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "coins", "cards", "shells")
# Rejection sampling draws problems until one falls in the requested split; with a sane
# heldout_fraction this takes a handful of draws, so hitting the cap means a misconfiguration.
_MAX_DRAWS = 10_000


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem ``a <op> b``; subtraction may give a negative result only if asked for."""

    op: Operation
    a: int
    b: int

    @property
    def result(self) -> int:
        """The exact integer answer."""
        if self.op == "add":
            return self.a + self.b
        if self.op == "sub":
            return self.a - self.b
        return self.a * self.b

    @property
    def symbol(self) -> str:
        """The operator as written in the question and the rationale."""
        return _SYMBOLS[self.op]

    @property
    def units_carry(self) -> bool:
        """Whether the units column carries (addition) or borrows (subtraction of a >= b)."""
        if self.op == "add":
            return self.a % 10 + self.b % 10 >= 10
        if self.op == "sub":
            return self.a >= self.b and self.a % 10 < self.b % 10
        return False

    @property
    def slipped_result(self) -> int:
        """The answer with the units carry or borrow forgotten in the tens column."""
        if not self.units_carry:
            raise ValueError(f"{self.a} {self.symbol} {self.b} has no units carry or borrow")
        return self.result - 10 if self.op == "add" else self.result + 10

    def rationale(self) -> str:
        """A column-by-column working, least significant digit first, ending in ``-> result``."""
        head = f"{self.a} {self.symbol} {self.b}: "
        if self.op == "add":
            return head + _add_columns(self.a, self.b)
        if self.op == "mul":
            return head + _mul_columns(self.a, self.b)
        if self.a >= self.b:
            return head + _sub_columns(self.a, self.b)
        working = _sub_columns(self.b, self.a).rsplit(" -> ", 1)[0]
        return head + f"{self.b} - {self.a} then negate; {working} -> {self.result}"


def split_of(problem: ArithmeticProblem, heldout_fraction: float) -> Split:
    """The split a problem belongs to: a stable hash of ``(op, a, b)`` against the fraction.

    blake2b rather than ``hash()``, whose per-process salt would move problems between splits
    from one run to the next. Raising ``heldout_fraction`` only moves problems into held-out.
    """
    key = f"{problem.op} {problem.a} {problem.b}".encode()
    bucket = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
    return "heldout" if bucket < heldout_fraction else "train"


def _digits_low_first(n: int, width: int) -> list[int]:
    return [(n // 10**i) % 10 for i in range(width)]


def _carry_columns(columns: list[tuple[str, int]]) -> str:
    """Working for a sum or one-digit product: per column, low first, its expression and value
    before the incoming carry; each step writes the last digit and carries the rest."""
    steps, carry = [], 0
    for expression, value in columns:
        total = value + carry
        step = expression + (f"+{carry}" if carry else "") + f"={total} write {total % 10}"
        carry = total // 10
        steps.append(step + (f" carry {carry}" if carry else ""))
    if carry:
        steps.append(f"carry {carry} write {carry}")
    return "; ".join(steps)


def _add_columns(a: int, b: int) -> str:
    width = max(len(str(a)), len(str(b)))
    pairs = zip(_digits_low_first(a, width), _digits_low_first(b, width), strict=True)
    return _carry_columns([(f"{da}+{db}", da + db) for da, db in pairs]) + f" -> {a + b}"


def _mul_columns(a: int, b: int) -> str:
    """Working for ``a * b`` with a single-digit ``b``."""
    digits = _digits_low_first(a, len(str(a)))
    return _carry_columns([(f"{da}*{b}", da * b) for da in digits]) + f" -> {a * b}"


def _sub_columns(a: int, b: int) -> str:
    """Working for ``a - b`` with ``a >= b``, borrowing from the next column."""
    width = len(str(a))
    steps, borrow = [], 0
    for da, db in zip(_digits_low_first(a, width), _digits_low_first(b, width), strict=True):
        minus_borrow = "-1" if borrow else ""
        top = da - borrow
        if top < db:
            diff = top + 10 - db
            steps.append(
                f"{da}{minus_borrow}-{db}<0 borrow 1: 1{da}{minus_borrow}-{db}={diff} write {diff}"
            )
            borrow = 1
        else:
            steps.append(f"{da}{minus_borrow}-{db}={top - db} write {top - db}")
            borrow = 0
    return "; ".join(steps) + f" -> {a - b}"


class SyntheticArithmetic(Dataset):
    """Map-style dataset of seeded arithmetic problems in the project's sample format.

    Sample ``i`` is a function of ``(seed, split, i)`` and the difficulty knobs only, so any
    worker or rank sees the same problem at the same index. Training problems are drawn with
    replacement; held-out problems are all distinct (index ``i`` takes its first draw that no
    earlier index holds), so an accuracy over ``num_samples`` counts ``num_samples`` problems.

    Args:
        split: "train" or "heldout"; the two never share a problem (see ``split_of``).
        num_samples: dataset length.
        seed: varies which problems are drawn, never which split a problem belongs to.
        operations: subset of ("add", "sub", "mul"); "mul" multiplies by one digit in 2..9.
        min_digits: fewest digits of an operand (1 allows 0..9).
        max_digits: most digits of an operand; each operand's digit count is uniform in range,
            then its value uniform among numbers of that many digits.
        allow_negative: if False, subtraction operands are ordered so the result is >= 0.
        heldout_fraction: share of the problem space reserved for the held-out split.
        prompt_template: user message of ``style="symbolic"``; ``{a}``, ``{op}`` (the symbol)
            and ``{b}`` are filled in.
        style: "symbolic" (``prompt_template``) or "word": a word problem from
            ``WORD_PROBLEM_TEMPLATES`` with a seeded name and item (a separate random stream, so
            the style never changes which problem an index draws; splits stay disjoint).
        instruction: appended to the question after a space, e.g. "Answer with just the
            number." ("" appends nothing).
        system_prompt: optional system message placed before the user message.
        slip_rate: share of units-carry/borrow problems whose ``target`` forgets the carry (see
            the module doc); ``answer`` is always the true result.
        hint_rate: share of samples whose question carries a hint revealing the answer.
        hint_templates: hint wordings (one drawn per hinted sample); fields ``{answer}`` and
            ``{wrong}`` (a wrong answer near the true one).
        hinted_question_template: how the hint joins the question; fields ``{content}`` and
            ``{hint}`` (SDPO's ``user_template``).
    """

    def __init__(
        self,
        split: Split,
        num_samples: int,
        seed: int = 0,
        operations: tuple[Operation, ...] | list[Operation] = ("add", "sub"),
        min_digits: int = 2,
        max_digits: int = 3,
        allow_negative: bool = False,
        heldout_fraction: float = 0.1,
        prompt_template: str = "What is {a} {op} {b}?",
        style: Style = "symbolic",
        instruction: str = "",
        system_prompt: str | None = None,
        slip_rate: float = 0.0,
        hint_rate: float = 0.0,
        hint_templates: tuple[str, ...] | list[str] = DEFAULT_HINT_TEMPLATES,
        hinted_question_template: str = "{content}\n\n{hint}",
    ) -> None:
        if split not in ("train", "heldout"):
            raise ValueError(
                f"SyntheticArithmetic: split must be 'train' or 'heldout', got {split!r}"
            )
        if num_samples < 0:
            raise ValueError(f"SyntheticArithmetic: num_samples must be >= 0, got {num_samples}")
        operations = tuple(operations)
        unknown = [op for op in operations if op not in _SYMBOLS]
        if not operations or unknown:
            raise ValueError(
                f"SyntheticArithmetic: operations must be a non-empty subset of "
                f"{tuple(_SYMBOLS)}, got {operations!r}"
            )
        if not 1 <= min_digits <= max_digits:
            raise ValueError(
                f"SyntheticArithmetic: need 1 <= min_digits <= max_digits, got "
                f"min_digits={min_digits}, max_digits={max_digits}"
            )
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(
                f"SyntheticArithmetic: heldout_fraction must be in (0, 1), got {heldout_fraction}"
            )
        _check_fields("prompt_template", prompt_template, a="1", op="+", b="2")
        if style not in ("symbolic", "word"):
            raise ValueError(
                f"SyntheticArithmetic: style must be 'symbolic' or 'word', got {style!r}"
            )
        for name, rate in (("slip_rate", slip_rate), ("hint_rate", hint_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"SyntheticArithmetic: {name} must be in [0, 1], got {rate}")
        hint_templates = tuple(hint_templates)
        if hint_rate > 0 and not hint_templates:
            raise ValueError("SyntheticArithmetic: hint_rate > 0 needs at least one hint template")
        for template in hint_templates:
            _check_fields("hint_templates", template, answer="1", wrong="2")
        _check_fields("hinted_question_template", hinted_question_template, content="", hint="")
        self.split = split
        self.num_samples = num_samples
        self.seed = seed
        self.operations = operations
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.allow_negative = allow_negative
        self.heldout_fraction = heldout_fraction
        self.prompt_template = prompt_template
        self.style = style
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.slip_rate = slip_rate
        self.hint_rate = hint_rate
        self.hint_templates = hint_templates
        self.hinted_question_template = hinted_question_template
        self._heldout = self._distinct_heldout_problems() if split == "heldout" else None

    def __len__(self) -> int:
        return self.num_samples

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def _draw(self, rng: random.Random) -> ArithmeticProblem:
        op = rng.choice(self.operations)
        a = self._operand(rng)
        b = rng.choice(_MUL_DIGITS) if op == "mul" else self._operand(rng)
        if op == "sub" and not self.allow_negative and a < b:
            a, b = b, a
        return ArithmeticProblem(op, a, b)

    def _draw_in_split(self, index: int, taken: set[ArithmeticProblem]) -> ArithmeticProblem:
        """Index ``index``'s first draw that falls in this dataset's split and is not taken."""
        # A string seed is hashed with SHA-512 by `random`, so it is stable across processes.
        rng = random.Random(f"{self.seed}:{self.split}:{index}")
        for _ in range(_MAX_DRAWS):
            problem = self._draw(rng)
            if problem not in taken and split_of(problem, self.heldout_fraction) == self.split:
                return problem
        raise RuntimeError(
            f"SyntheticArithmetic: no {'new ' if taken else ''}{self.split!r} problem in "
            f"{_MAX_DRAWS} draws for index {index} with operations={self.operations}, digits "
            f"{self.min_digits}-{self.max_digits}, heldout_fraction={self.heldout_fraction}; "
            f"widen the problem space or lower num_samples"
        )

    def _distinct_heldout_problems(self) -> list[ArithmeticProblem]:
        problems: list[ArithmeticProblem] = []
        taken: set[ArithmeticProblem] = set()
        for index in range(self.num_samples):
            problems.append(self._draw_in_split(index, taken))
            taken.add(problems[-1])
        return problems

    def problem(self, index: int) -> ArithmeticProblem:
        """The problem at ``index`` (held out: distinct from every other index's)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(
                f"SyntheticArithmetic: index {index} out of range for {self.num_samples} samples"
            )
        if self._heldout is not None:
            return self._heldout[index]
        return self._draw_in_split(index, set())

    def _question(self, problem: ArithmeticProblem, index: int) -> str:
        if self.style == "word":
            rng = random.Random(f"{self.seed}:{self.split}:{index}:wording")
            question = _word_problem(problem, rng)
        else:
            question = self.prompt_template.format(a=problem.a, op=problem.symbol, b=problem.b)
        return f"{question} {self.instruction}" if self.instruction else question

    def __getitem__(self, index: int) -> dict[str, Any]:
        problem = self.problem(index)
        question = self._question(problem, index)
        answer = str(problem.result)
        target = answer
        if self.hint_rate or self.slip_rate:
            # A separate stream, so the knobs never change which problem an index draws.
            rng = random.Random(f"{self.seed}:{self.split}:{index}:demonstration")
            if rng.random() < self.hint_rate:
                wrong = problem.result + rng.choice([-1, 1]) * rng.randint(1, 10)
                hint = rng.choice(self.hint_templates).format(answer=answer, wrong=wrong)
                question = self.hinted_question_template.format(content=question, hint=hint)
            elif problem.units_carry and rng.random() < self.slip_rate:
                target = str(problem.slipped_result)
        messages = [{"role": "user", "content": question}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return {
            "id": f"arith-{self.split}-s{self.seed}-{index}",
            "prompt": messages,
            "answer": answer,
            "target": target,
            "solution": problem.rationale(),
        }


def _word_problem(problem: ArithmeticProblem, rng: random.Random) -> str:
    template = rng.choice(WORD_PROBLEM_TEMPLATES[problem.op])
    return template.format(
        a=problem.a, b=problem.b, name=rng.choice(_NAMES), item=rng.choice(_ITEMS)
    )


def _check_fields(name: str, template: str, **fields: str) -> None:
    """A template may use only ``fields``; a bad one is named with the key it came from."""
    try:
        template.format(**fields)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"SyntheticArithmetic: {name} may only use {{{'}, {'.join(fields)}}}; "
            f"{template!r} fails: {err!r}"
        ) from err
