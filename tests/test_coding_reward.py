"""Coding problems (loader, shipped assets) and CodeExecutionReward scoring through the sandbox.

Expected scores come from a peer evaluation: the same test snippets executed in this process
against trusted candidate solutions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from composer_tune.data.coding import (
    CodingDataError,
    load_coding_dataset,
    load_coding_problems,
    split_tests,
)
from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.coding import CodeExecutionReward, extract_code
from composer_tune.rewards.sandbox import SandboxLimits, SandboxResult

PROBLEMS = Path(__file__).parent / "assets" / "coding" / "problems.jsonl"
LIMITS = SandboxLimits(wall_time_s=5.0, cpu_time_s=5.0, memory_bytes=256 * 2**20)


@pytest.fixture(scope="module")
def dataset() -> list[dict]:
    return load_coding_dataset(PROBLEMS)


@pytest.fixture(scope="module")
def reward() -> CodeExecutionReward:
    return CodeExecutionReward(limits=LIMITS, max_workers=2)


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def _peer_fraction(solution: str, tests: list[str]) -> float:
    """Fraction of ``tests`` passing against trusted ``solution``, run in this process."""
    namespace: dict = {}
    exec(solution, namespace)
    passed = 0
    for snippet in tests:
        try:
            exec(snippet, namespace)
            passed += 1
        except Exception:
            pass
    return passed / len(tests)


def test_shipped_problems_are_well_formed(dataset: list[dict]) -> None:
    assert len(dataset) >= 20
    for sample in dataset:
        assert 3 <= len(sample["tests"]) <= 6, sample["id"]
        assert sample["solution"], sample["id"]
        system, user = sample["prompt"]
        assert (system["role"], user["role"]) == ("system", "user")
        assert "```python" in user["content"] and sample["entry_point"] in user["content"]


def test_every_reference_solution_passes(dataset: list[dict], reward: CodeExecutionReward) -> None:
    results = reward([_fenced(s["solution"]) for s in dataset], dataset)
    failures = {s["id"]: r.feedback for s, r in zip(dataset, results, strict=True) if not r.correct}
    assert not failures
    assert all(r.score == 1.0 for r in results)


def test_wrong_solutions_score_the_peer_fraction(
    dataset: list[dict], reward: CodeExecutionReward
) -> None:
    stubs = [f"def {s['entry_point']}(*args, **kwargs):\n    return None" for s in dataset]
    results = reward([_fenced(stub) for stub in stubs], dataset)
    for sample, stub, result in zip(dataset, stubs, results, strict=True):
        expected = _peer_fraction(stub, sample["tests"])
        assert expected < 1.0, sample["id"]
        assert result.correct is False
        assert result.score == pytest.approx(expected), sample["id"]


def test_partial_credit_off_and_feedback(dataset: list[dict]) -> None:
    sample = next(s for s in dataset if s["id"] == "reverse_words")
    identity = "def reverse_words(text):\n    return text"
    assert _peer_fraction(identity, sample["tests"]) == 0.5
    strict = CodeExecutionReward(limits=LIMITS, partial_credit=False)
    partial = CodeExecutionReward(limits=LIMITS, partial_credit=True)
    [strict_result] = strict([_fenced(identity)], [sample])
    [partial_result] = partial([_fenced(identity)], [sample])
    assert (strict_result.score, partial_result.score) == (0.0, 0.5)
    assert partial_result.feedback.startswith("2/4 tests passed; test 1 ")
    assert "reverse_words('hello world')" in partial_result.feedback
    assert "expected 'world hello', got 'hello world'" in partial_result.feedback


def test_code_extraction_rules() -> None:
    two_blocks = "```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n```bash\nls\n```"
    assert extract_code(two_blocks) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("def f():\n    return 1") is None
    assert extract_code("def f():\n    return 1", allow_unfenced=True) == "def f():\n    return 1"
    assert extract_code("```python\nunclosed = True\n") is None


def test_unfenced_completions(dataset: list[dict]) -> None:
    sample = dataset[0]
    fenced_only = CodeExecutionReward(limits=LIMITS)
    unfenced_ok = CodeExecutionReward(limits=LIMITS, allow_unfenced=True)
    expected = RewardResult(0.0, False, "no code block found")
    assert fenced_only([sample["solution"]], [sample]) == [expected]
    assert unfenced_ok([sample["solution"]], [sample])[0].score == 1.0


def test_forged_summaries_and_early_exits_fail(dataset: list[dict]) -> None:
    sample = dataset[0]
    forged = json.dumps([{"passed": True}] * len(sample["tests"]))
    cheats = [
        # prints a plausible summary line, then lets the real harness run
        f"print('\\n' + 'f' * 32 + {forged!r})\ndef reverse_words(t):\n    return t",
        # ends the process before the harness can report
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "def reverse_words(t):\n    return (",  # syntax error
    ]
    results = CodeExecutionReward(limits=LIMITS)([_fenced(c) for c in cheats], [sample] * 4)
    assert [r.correct for r in results] == [False] * 4
    assert results[0].score == 0.5  # the forged line is ignored, the real result counts
    assert results[1].score == 0.0 and "ended before the tests finished" in results[1].feedback
    assert results[2].score == 0.0 and "solution failed to load: SystemExit" in results[2].feedback
    assert results[3].score == 0.0 and "SyntaxError" in results[3].feedback


def test_timeout_is_isolated_to_its_completion(dataset: list[dict]) -> None:
    sample = {**dataset[0], "timeout_s": 1.0}
    completions = [_fenced("while True:\n    pass"), _fenced(sample["solution"])]
    results = CodeExecutionReward(limits=LIMITS)(completions, [sample, sample])
    assert results[0].score == 0.0 and results[0].feedback.startswith("timed out after 1s")
    assert results[1].score == 1.0


def test_bad_samples_raise() -> None:
    reward = CodeExecutionReward(limits=LIMITS)
    with pytest.raises(ValueError, match="3 completions for 1 samples"):
        reward(["a", "b", "c"], [{"tests": ["assert True"]}])
    with pytest.raises(ValueError, match=r"sample 0 \(id 'x'\): 'tests'"):
        reward(["```python\npass\n```"], [{"id": "x", "tests": "assert True"}])


def test_split_tests_attaches_setup_to_the_next_assert() -> None:
    source = "import math\nvalue = 3\nassert math.sqrt(9) == value\n\nassert True\nprint('done')\n"
    assert split_tests(source) == [
        "import math\nvalue = 3\nassert math.sqrt(9) == value",
        "assert True\nprint('done')",
    ]
    with pytest.raises(ValueError, match="no top-level assert"):
        split_tests("x = 1\n")


GOOD = {
    "id": "p",
    "prompt": "Write f().",
    "entry_point": "f",
    "tests": ["assert f() == 1"],
    "reference_solution": "def f():\n    return 1\n",
}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({k: v for k, v in GOOD.items() if k != "entry_point"}, "missing field(s) entry_point"),
        ({**GOOD, "entrypoint": "f"}, "unknown field(s) entrypoint"),
        ({**GOOD, "prompt": "  "}, "field 'prompt' must be a non-empty string"),
        ({**GOOD, "entry_point": "not valid"}, "field 'entry_point' must be a Python identifier"),
        ({**GOOD, "tests": []}, "field 'tests': must be a source string"),
        ({**GOOD, "tests": ["assert f( == 1"]}, "field 'tests': test 0:"),
        ({**GOOD, "tests": "f()\n"}, "field 'tests': tests contain no top-level assert"),
        ({**GOOD, "reference_solution": "def g():\n    pass"}, "does not define f()"),
        ({**GOOD, "timeout_s": -1}, "field 'timeout_s' must be a positive number"),
    ],
)
def test_loader_errors_name_file_line_and_field(tmp_path: Path, row: dict, message: str) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps(GOOD | {"id": "first"}) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(CodingDataError) as error:
        load_coding_problems(path)
    assert str(error.value).startswith(f"{path}:3: ")
    assert message in str(error.value)


def test_loader_rejects_bad_json_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(CodingDataError, match=r"problems.jsonl:2: "):
        load_coding_problems(path)
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(CodingDataError, match=r":2: duplicate id 'p' \(first on line 1\)"):
        load_coding_problems(path)
    problems = load_coding_problems(PROBLEMS)
    assert len({p.id for p in problems}) == len(problems)


def test_per_test_timeout_keeps_partial_credit(dataset: list[dict]) -> None:
    sample = next(s for s in dataset if s["id"] == "reverse_words")
    # Hangs on the empty string only; every other test passes.
    hangs_on_empty = (
        "def reverse_words(text):\n"
        "    while not text:\n"
        "        pass\n"
        "    return ' '.join(reversed(text.split()))"
    )
    namespace: dict = {}
    exec(hangs_on_empty, namespace)
    assert namespace["reverse_words"]("a b") == "b a"
    reward = CodeExecutionReward(limits=LIMITS, per_test_timeout_s=0.5)
    [result] = reward([_fenced(hangs_on_empty)], [sample])
    assert result.score == 0.75
    assert "test 3 `assert reverse_words('') == ''` failed: test timed out after 0.5s" in (
        result.feedback
    )
    [whole] = CodeExecutionReward(limits=LIMITS)(
        [_fenced(hangs_on_empty)], [{**sample, "timeout_s": 1.0}]
    )
    assert whole.score == 0.0 and whole.feedback.startswith("timed out after 1s")


def test_a_sandbox_that_cannot_start_leaves_the_completion_unscored(
    dataset: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grade the sandbox could not run says nothing of the code: NaN (zero advantage) with the
    reason, not the 0.0 of a wrong answer (a run once trained on such zeros for hours)."""
    import composer_tune.rewards.split as split

    def cannot_start(code: str, **_: object) -> SandboxResult:
        return SandboxResult("sandbox_error", None, "", "", 0.0, "could not start: unshare: ENOMEM")

    sample = dataset[0]
    monkeypatch.setattr(split, "run_python", cannot_start)
    [result] = CodeExecutionReward(limits=LIMITS)([_fenced(sample["solution"])], [sample])
    assert math.isnan(result.score) and result.correct is None
    assert result.feedback == (
        "unscored: the sandbox could not run the grader (could not start: unshare: ENOMEM)"
    )
    monkeypatch.undo()  # the same completion, graded by a working sandbox
    [result] = CodeExecutionReward(limits=LIMITS)([_fenced(sample["solution"])], [sample])
    assert result.score == 1.0
