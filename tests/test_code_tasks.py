"""The code ladder's tasks (composer_tune/data/code_tasks.py, tools/make_code_tasks.py): the
shipped files are what the generator makes, the splits are disjoint as documented, hidden tests
stay out of the prompts, and validation through the split grader refuses a wrong reference and a
task a trivial answer passes; the reward's partial credit and feedback on one of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_tune.data.code_tasks import (
    SPLITS,
    CodeTaskError,
    GenerationSettings,
    generate_tasks,
    heldout_params,
    read_tasks,
    split_path,
    trivial_answers,
    validate_tasks,
)
from composer_tune.data.code_templates import HELDOUT_TEMPLATES, TEMPLATES
from composer_tune.data.task_dataset import TaskDataset
from composer_tune.rewards import CodeExecutionReward

SHIPPED = Path(__file__).parent / "assets" / "code_tasks"


@pytest.fixture(scope="module")
def shipped() -> dict[str, list[dict]]:
    return {split: read_tasks(split_path(SHIPPED, split)) for split in SPLITS}


@pytest.fixture(scope="module")
def reward() -> CodeExecutionReward:
    return CodeExecutionReward(max_workers=2)


def test_the_shipped_files_are_the_generators_output(shipped):
    """`python tools/make_code_tasks.py` regenerates exactly what is shipped."""
    assert shipped == generate_tasks(GenerationSettings())


def test_splits_are_disjoint_by_template_and_by_parameter(shipped):
    train_templates = {task["template"] for task in shipped["train"]}
    assert {task["template"] for task in shipped["heldout_templates"]} == set(HELDOUT_TEMPLATES)
    assert not train_templates & HELDOUT_TEMPLATES
    trained = {(task["template"], task["params"]) for task in shipped["train"]}
    for task in shipped["heldout_params"]:
        assert task["template"] in train_templates
        assert (task["template"], task["params"]) not in trained
    prompts = [task["prompt"][-1]["content"] for split in SPLITS for task in shipped[split]]
    assert len(prompts) == len(set(prompts))
    # Every category and difficulty is trained on.
    assert {task["category"] for task in shipped["train"]} == {t.category for t in TEMPLATES}
    assert {task["difficulty"] for task in shipped["train"]} == {1, 2, 3}


def test_heldout_parameters_are_a_stable_quarter_of_each_grid():
    for template in TEMPLATES:
        held = heldout_params(template)
        if len(template.params) < 2:
            assert held == []
        else:
            assert 1 <= len(held) <= len(template.params) // 2
            assert held == heldout_params(template)


def test_hidden_tests_never_appear_in_the_prompt(shipped):
    for split in SPLITS:
        for task in shipped[split]:
            prompt = json.dumps(task["prompt"])
            assert len(task["tests"]) >= 6, task["id"]
            for test in task["tests"]:
                call = test.removeprefix("assert ").split(" == ")[0]
                assert call not in prompt, (task["id"], call)


def test_the_rows_load_as_trl_conversational_data():
    train = TaskDataset(source=str(split_path(SHIPPED, "train")))
    heldout = TaskDataset(source=str(SHIPPED / "heldout"))
    assert train[0]["prompt"][0]["role"] == "system"
    assert {heldout[i]["split"] for i in range(len(heldout))} == {
        "heldout_templates",
        "heldout_params",
    }


def test_validation_refuses_a_wrong_reference_and_a_trivially_passed_task(shipped, reward):
    good = shipped["train"][0]
    wrong_reference = {**good, "id": "wrong_reference"}
    expected = wrong_reference["tests"][2].split(" == ")[-1]
    wrong_reference["tests"] = [
        *good["tests"][:2],
        good["tests"][2].replace(f" == {expected}", " == 'surely not this'"),
        *good["tests"][3:],
    ]
    echo = {
        "id": "echo",
        "entry_point": "same",
        "solution": "def same(x):\n    return x\n",
        "tests": [f"assert same({n}) == {n}" for n in range(6)],
        "timeout_s": 5.0,
    }
    report = validate_tasks([good, wrong_reference, echo], reward)
    assert report.checked == 3
    assert set(report.refused) == {"wrong_reference", "echo"}
    assert "the reference fails" in report.refused["wrong_reference"]
    assert "'return_input' passes every test" in report.refused["echo"]


def test_a_sample_of_the_shipped_tasks_validates(shipped, reward):
    """The full check is `python tools/make_code_tasks.py --check` (all 464 tasks, minutes): here
    a spread of a dozen over the three splits."""
    sample = (
        shipped["heldout_templates"][::8] + shipped["train"][::90] + shipped["heldout_params"][::28]
    )
    report = validate_tasks(sample, reward)
    assert report.ok, report.refused


def test_trivial_answers_use_the_functions_own_signature(shipped):
    task = next(t for t in shipped["train"] if t["template"] == "interleave")
    answers = trivial_answers(task)
    assert (
        answers["return_input"]
        == "```python\ndef interleave(first, second):\n    return first\n```"
    )
    with pytest.raises(CodeTaskError, match="does not define"):
        trivial_answers({**task, "entry_point": "missing"})


def test_partial_credit_and_the_test_report_as_feedback(shipped, reward):
    task = next(t for t in shipped["train"] if t["template"] == "count_even")
    half_right = "```python\ndef count_even(nums):\n    return sum(1 for x in nums if x % 2 == 0 and x > 0)\n```"
    [result] = reward([half_right], [task])
    passed = sum(
        eval(test.removeprefix("assert ").split(" == ")[1])  # noqa: S307 (our own literals)
        == sum(1 for x in eval(test[test.index("(") + 1 : test.index(")")]) if x % 2 == 0 and x > 0)  # noqa: S307
        for test in task["tests"]
    )
    assert 0 < passed < len(task["tests"])
    assert result.score == pytest.approx(passed / len(task["tests"]))
    assert result.correct is False
    assert result.feedback.startswith(f"{passed}/{len(task['tests'])} tests passed; test ")
    assert "failed: expected" in result.feedback and ", got " in result.feedback
