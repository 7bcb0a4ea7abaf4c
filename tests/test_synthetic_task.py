"""Tests for the synthetic arithmetic task: determinism, split disjointness, correctness."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from itertools import product

import pytest
from omegaconf import OmegaConf

from composer_tune.data import SyntheticArithmetic
from composer_tune.data.synthetic import ArithmeticProblem, split_of

QUESTION = re.compile(r"What is (-?\d+) ([-+*]) (-?\d+)\?")
# Rationale equations such as "7+8=15", "4-1-6<0", "14-1-6=7" or "3*9+2=29".
EQUATION = re.compile(r"(\d+(?:[-+*]\d+)+)=(\d+)")


def _problem_key(sample: dict) -> tuple[str, int, int]:
    a, op, b = QUESTION.fullmatch(sample["prompt"][-1]["content"]).groups()
    return op, int(a), int(b)


def _expected(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _evaluate(expression: str) -> int:
    """Left-to-right evaluation with * binding tighter, for the rationale's tiny expressions."""
    terms = re.findall(r"[-+]?[^-+]+", expression)
    total = 0
    for term in terms:
        sign = -1 if term.startswith("-") else 1
        factors = [int(f) for f in term.lstrip("+-").split("*")]
        value = 1
        for factor in factors:
            value *= factor
        total += sign * value
    return total


def test_same_arguments_give_identical_samples_and_seed_changes_them() -> None:
    first = SyntheticArithmetic("train", 50, seed=3)
    again = SyntheticArithmetic("train", 50, seed=3)
    other = SyntheticArithmetic("train", 50, seed=4)
    assert [first[i] for i in range(50)] == [again[i] for i in range(50)]
    # Reading out of order must not change what an index holds (map-style, per-index RNG).
    assert first[17] == again[17] and first[49] == again[49]
    assert sum(first[i]["answer"] != other[i]["answer"] for i in range(50)) > 40


def test_samples_are_stable_across_processes_with_different_hash_seeds() -> None:
    code = (
        "import json; from composer_tune.data import SyntheticArithmetic as S;"
        "print(json.dumps([S('heldout', 20, seed=7)[i] for i in range(20)]))"
    )
    # A hash seed other than this process's, so salted hash() would move problems.
    hash_seed = "1" if os.environ.get("PYTHONHASHSEED") == "2" else "2"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    local = [SyntheticArithmetic("heldout", 20, seed=7)[i] for i in range(20)]
    assert json.loads(result.stdout) == local


def test_splits_partition_a_small_problem_space_exhaustively() -> None:
    """With one-digit operands every problem is drawn many times; the splits never overlap."""
    kwargs = dict(operations=("add", "sub", "mul"), min_digits=1, max_digits=1)
    kwargs["heldout_fraction"] = 0.3
    space = (
        [ArithmeticProblem("add", a, b) for a, b in product(range(10), repeat=2)]
        + [ArithmeticProblem("sub", a, b) for a, b in product(range(10), repeat=2) if a >= b]
        + [ArithmeticProblem("mul", a, b) for a, b in product(range(10), range(2, 10))]
    )
    heldout_size = sum(split_of(p, 0.3) == "heldout" for p in space)
    train, heldout = set(), set()
    for seed in range(3):
        train |= {_problem_key(s) for s in SyntheticArithmetic("train", 2000, seed, **kwargs)}
        # Held-out problems are distinct, so asking for the split's size draws all of it.
        drawn = SyntheticArithmetic("heldout", heldout_size, seed, **kwargs)
        heldout |= {_problem_key(s) for s in drawn}
        with pytest.raises(RuntimeError, match="no new 'heldout' problem .* lower num_samples"):
            SyntheticArithmetic("heldout", heldout_size + 1, seed, **kwargs)
    assert not train & heldout
    # every problem lands in exactly one split
    assert train | heldout == {(p.symbol, p.a, p.b) for p in space}
    assert 0.2 < heldout_size / len(space) < 0.4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heldout_problems_are_distinct_and_the_first_indices_keep_their_problems(seed: int) -> None:
    kwargs = dict(operations=("add", "sub", "mul"), min_digits=1, max_digits=2)
    heldout = SyntheticArithmetic("heldout", 256, seed, **kwargs)
    problems = [heldout.problem(i) for i in range(len(heldout))]
    assert len(set(problems)) == len(problems)
    # A longer set extends a shorter one: index i's problem depends on indices < i only.
    assert [SyntheticArithmetic("heldout", 64, seed, **kwargs).problem(i) for i in range(64)] == (
        problems[:64]
    )


def test_heldout_share_of_a_large_space_matches_the_fraction() -> None:
    problems = [ArithmeticProblem("add", a, b) for a in range(10, 100) for b in range(10, 100)]
    counts = Counter(split_of(p, 0.1) for p in problems)
    assert abs(counts["heldout"] / len(problems) - 0.1) < 0.015
    # Growing the fraction only moves problems into held-out, never out of it.
    assert all(split_of(p, 0.2) == "heldout" for p in problems if split_of(p, 0.1) == "heldout")


@pytest.mark.parametrize("operations", [("add",), ("sub",), ("mul",), ("add", "sub", "mul")])
def test_answers_and_rationales_are_correct(operations: tuple[str, ...]) -> None:
    dataset = SyntheticArithmetic("train", 300, seed=0, operations=operations, max_digits=4)
    for sample in dataset:
        op, a, b = _problem_key(sample)
        expected = _expected(op, a, b)
        assert sample["answer"] == sample["target"] == str(expected)
        rationale = sample["solution"]
        assert rationale.startswith(f"{a} {op} {b}: ")
        assert rationale.endswith(f" -> {expected}")
        equations = EQUATION.findall(rationale)
        assert equations, rationale
        for left, right in equations:
            assert _evaluate(left) == int(right), (left, right, rationale)
        written = re.findall(r"write (\d)", rationale)
        assert int("".join(reversed(written))) == abs(expected), rationale


def test_negative_subtraction_rationale() -> None:
    rationale = ArithmeticProblem("sub", 68, 347).rationale()
    assert rationale.endswith("-> -279")
    assert int("".join(reversed(re.findall(r"write (\d)", rationale)))) == 279


def test_difficulty_knobs_are_respected() -> None:
    dataset = SyntheticArithmetic(
        "heldout", 400, seed=1, operations=("sub", "mul"), min_digits=3, max_digits=4
    )
    digit_counts = Counter()
    for sample in dataset:
        op, a, b = _problem_key(sample)
        assert 3 <= len(str(a)) <= 4
        if op == "*":
            assert 2 <= b <= 9
        else:
            assert 3 <= len(str(b)) <= 4
            assert a - b >= 0  # allow_negative defaults to False
        digit_counts[len(str(a))] += 1
    assert digit_counts[3] > 100 and digit_counts[4] > 100
    negative = SyntheticArithmetic("train", 200, seed=1, operations=("sub",), allow_negative=True)
    assert any(sample["answer"].startswith("-") for sample in negative)


def test_sample_format_and_system_prompt() -> None:
    sample = SyntheticArithmetic(
        "train", 1, seed=0, system_prompt="Answer with a number.", prompt_template="{a}{op}{b}="
    )[0]
    assert set(sample) == {"id", "prompt", "answer", "target", "solution"}
    assert sample["prompt"][0] == {"role": "system", "content": "Answer with a number."}
    a, op, b = re.fullmatch(r"(\d+)([-+])(\d+)=", sample["prompt"][1]["content"]).groups()
    assert sample["answer"] == str(_expected(op, int(a), int(b)))
    with pytest.raises(IndexError, match="index 1 out of range"):
        SyntheticArithmetic("train", 1)[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "test"}, "split must be"),
        ({"operations": ("add", "div")}, "operations must be"),
        ({"min_digits": 3, "max_digits": 2}, "min_digits <= max_digits"),
        ({"heldout_fraction": 0.0}, "heldout_fraction"),
        ({"prompt_template": "{question}"}, "prompt_template"),
        ({"num_samples": -1}, "num_samples"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs: dict, message: str) -> None:
    arguments = {"split": "train", "num_samples": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        SyntheticArithmetic(**arguments)


def test_instantiable_from_yaml() -> None:
    from torchtune import config

    cfg = OmegaConf.create(
        """
        dataset:
          _component_: composer_tune.data.SyntheticArithmetic
          split: heldout
          num_samples: 8
          seed: 5
          operations: [add]
          max_digits: 2
        """
    )
    dataset = config.instantiate(cfg.dataset)
    direct = SyntheticArithmetic("heldout", 8, seed=5, operations=("add",), max_digits=2)
    assert len(dataset) == 8
    assert [dataset[i] for i in range(8)] == [direct[i] for i in range(8)]


def _operands(question: str) -> tuple[int, str, int]:
    a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", question).groups()
    return int(a), op, int(b)


def test_slip_rate_changes_only_carry_demonstrations() -> None:
    kwargs = dict(split="train", num_samples=3000, seed=4, min_digits=1, max_digits=2)
    clean = SyntheticArithmetic(**kwargs)
    slipped = SyntheticArithmetic(**kwargs, slip_rate=0.6)
    carries = slips = 0
    for index in range(len(clean)):
        plain, sample = clean[index], slipped[index]
        # Same problem, same gold answer: the knob only touches the demonstration.
        assert sample["prompt"] == plain["prompt"] and sample["answer"] == plain["answer"]
        a, op, b = _operands(sample["prompt"][0]["content"])
        carry = (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)
        carries += carry
        if sample["target"] != sample["answer"]:
            assert carry, sample
            # The tens column ignores the units carry / borrow.
            forgot = a + b - 10 if op == "+" else a - b + 10
            assert int(sample["target"]) == forgot, sample
            slips += 1
    assert carries > 800
    assert abs(slips / carries - 0.6) < 0.05


def test_hint_rate_puts_the_answer_in_the_question() -> None:
    dataset = SyntheticArithmetic(
        "train", 2000, seed=5, min_digits=1, max_digits=2, slip_rate=1.0, hint_rate=0.25
    )
    hinted = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        question, _, hint = sample["prompt"][0]["content"].partition("\n\n")
        _operands(question)  # the question itself is untouched
        if not hint:
            continue
        hinted += 1
        assert sample["target"] == sample["answer"]  # hinted demonstrations are never slipped
        feedback = re.fullmatch(
            r"Your final answer (-?\d+) is wrong\. The correct answer is (-?\d+)\.", hint
        )
        if feedback:
            assert feedback.group(2) == sample["answer"]
            assert feedback.group(1) != sample["answer"]
        else:
            assert hint == f"Correct solution:\n\n{sample['answer']}"
    assert abs(hinted / len(dataset) - 0.25) < 0.03


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slip_rate": 1.5}, "slip_rate must be in"),
        ({"hint_rate": -0.1}, "hint_rate must be in"),
        ({"hint_rate": 0.5, "hint_templates": []}, "needs at least one hint template"),
        ({"hint_templates": ["{solution}"]}, "hint_templates may only use"),
        ({"hinted_question_template": "{content}"}, None),
        ({"hinted_question_template": "{question} {hint}"}, "hinted_question_template"),
    ],
)
def test_demonstration_knobs_reject_bad_values(kwargs: dict, message: str | None) -> None:
    if message is None:
        SyntheticArithmetic("train", 4, **kwargs)  # a template may leave a field out
        return
    with pytest.raises(ValueError, match=message):
        SyntheticArithmetic("train", 4, **kwargs)


def test_word_style_poses_the_same_problems_in_words() -> None:
    kwargs = {"operations": ("add", "sub", "mul"), "min_digits": 1, "max_digits": 2}
    symbolic = SyntheticArithmetic("heldout", 60, seed=3, **kwargs)
    words = SyntheticArithmetic(
        "heldout", 60, seed=3, style="word", instruction="Answer with just the number.", **kwargs
    )
    wordings = set()
    for index in range(60):
        problem, sample = words.problem(index), words[index]
        assert problem == symbolic.problem(index)  # the style never changes the problem
        question = sample["prompt"][-1]["content"]
        assert question.endswith("? Answer with just the number.")
        assert [int(n) for n in re.findall(r"\d+", question)] in (
            [problem.a, problem.b],
            [problem.b, problem.a],
        )
        assert sample["answer"] == str(problem.result) == symbolic[index]["answer"]
        wordings.add(question.split(" ")[0])
    assert len(wordings) > 3  # names and templates vary


def test_unknown_style_is_named() -> None:
    with pytest.raises(ValueError, match="style must be 'symbolic' or 'word', got 'prose'"):
        SyntheticArithmetic("train", 1, style="prose")
