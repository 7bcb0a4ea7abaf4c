"""tools/hinted_teacher_pairs.py: channel-3 pairs from a model's own replies and hinted teachers
(trace-replay DPO is this project's own addition, not Cursor's recipe)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from composer_tune.data.pairs import mine_step
from composer_tune.data.preference import PreferenceDataset
from composer_tune.data.tokenizer import ChatTokenizer
from tests.recipe_runs import load_tool

tool = load_tool("hinted_teacher_pairs")

SAMPLE = {
    "id": "arith-train-s2-7",
    "prompt": [{"role": "user", "content": "What is 12 + 11? Answer with just the number."}],
    "answer": "23",
}
RULES = tool.RULES


def test_teachers_see_the_answer_and_the_trace_does_not() -> None:
    teacher = tool.hinted(SAMPLE, tool.TEACHER_HINTS["verifier"])
    assert teacher["prompt"][-1]["content"].endswith(
        "number. A verifier checked this problem: the correct answer is 23."
    )
    assert SAMPLE["prompt"][-1]["content"].endswith("number.")  # not mutated
    with pytest.raises(ValueError, match="must end with a user message"):
        tool.hinted({**SAMPLE, "prompt": [{"role": "assistant", "content": "hi"}]}, "{answer}")


def test_teachers_agreeing_against_the_trace_make_a_consensus_pair() -> None:
    trace = "To solve this problem, we add 12 and 11 to get 22."
    record = tool.replayed_record(SAMPLE, 7, trace, dict.fromkeys(tool.TEACHER_HINTS, "23"), "m")
    pair, mode = mine_step(record, RULES)
    assert mode == "consensus_over_trace"
    assert pair["chosen"]["content"] == "23" and pair["rejected"]["content"] == trace
    assert pair["prompt_messages"] == SAMPLE["prompt"]  # the plain problem, no hint
    assert pair["provenance"]["gold_answer"] == "23"


def test_a_lone_dissenting_teacher_makes_a_trace_over_outlier_pair() -> None:
    replies = {
        "verifier": "23",
        "teacher": "23",
        "answer_key": "The answer is twenty-three, I think.",
    }
    pair, mode = mine_step(tool.replayed_record(SAMPLE, 0, "23", replies, "m"), RULES)
    assert mode == "trace_over_outlier"
    assert pair["chosen"]["content"] == "23"
    assert pair["rejected"]["content"] == replies["answer_key"]


def test_agreement_with_the_trace_makes_no_pair() -> None:
    """Replies agree on their final answer whatever their wording."""
    replies = {"verifier": "23", "teacher": "The answer is 23.", "answer_key": "12 + 11 = 23"}
    record = tool.replayed_record(SAMPLE, 0, "It is 23", replies, "m")
    assert mine_step(record, RULES) == (None, "consensus_not_against_trace")


def test_end_to_end_on_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    """The tool on the shipped smollm2 config: real greedy replies, pairs that SmolLM2's template
    renders, a summary that counts every problem."""
    out = tmp_path / "pairs.jsonl"
    status = tool.main(
        ["--config", "smollm2", "--num-problems", "6", "--max-new-tokens", "8", "--out", str(out)]
    )
    assert status == 0
    replayed = [json.loads(line) for line in Path(f"{out}.replayed.jsonl").read_text().splitlines()]
    assert len(replayed) == 6
    assert all(set(r["teachers"]) == set(tool.TEACHER_HINTS) for r in replayed)
    # Real replies, cut at 8 tokens: some already hold a number, others are still on their way
    # to one (which depends on the precision: fp32 or bf16 autocast, by the CPU).
    replies = [r["step"]["action"]["text"] for r in replayed]
    assert all(reply.strip() for reply in replies), replies
    assert any(re.search(r"\d", reply) for reply in replies), replies
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["kept"] + summary["skipped"] == 6
    pairs = PreferenceDataset(out, ChatTokenizer.from_dir(smollm2_dir), split="all")
    assert len(pairs) == summary["kept"]


def test_a_config_without_a_pretrained_checkpoint_is_refused(capsys) -> None:
    status = tool.main(["--config", "cpu_smoke", "--out", "unused.jsonl"])
    assert status == 1
    assert "has no checkpoint.initial_checkpoint" in capsys.readouterr().err


CODE_SAMPLE = {
    "id": "train/count_even/0",
    "prompt": [{"role": "user", "content": "Write a Python function `count_even(nums)` ..."}],
    "tests": ["assert count_even([2]) == 1"] * 6,
    "solution": "def count_even(nums):\n    return sum(1 for x in nums if x % 2 == 0)\n",
}
CODE_RULES = tool.CODE_RULES


def test_code_teachers_see_the_reference_solution() -> None:
    teacher = tool.hinted(CODE_SAMPLE, tool.CODE_TEACHER_HINTS["teacher"])
    assert teacher["prompt"][-1]["content"].endswith(
        "passes the tests:\n```python\n" + CODE_SAMPLE["solution"] + "```"
    )
    assert tool.is_code_task(CODE_SAMPLE) and not tool.is_code_task(SAMPLE)


def test_code_replies_agree_only_when_both_pass_the_tests() -> None:
    """On code, teachers agree by passing, not by wording: two different passing programs are
    a consensus against a failing trace; a consensus of failing programs is none."""
    replies = {"verifier": "```python\nA\n```", "teacher": "```python\nB\n```", "answer_key": "C"}
    passing = {"trace": False, "verifier": True, "teacher": True, "answer_key": True}
    record = tool.replayed_record(CODE_SAMPLE, 0, "wrong", replies, "m", passing)
    pair, mode = mine_step(record, CODE_RULES)
    assert mode == "consensus_over_trace"
    assert pair["rejected"]["content"] == "wrong" and pair["chosen"]["content"] in replies.values()
    assert "gold_answer" not in pair["provenance"]
    all_fail = dict.fromkeys(passing, False)
    record = tool.replayed_record(CODE_SAMPLE, 0, "wrong", replies, "m", all_fail)
    assert mine_step(record, CODE_RULES) == (None, "no_consensus")
    one_fails = {**passing, "trace": True, "answer_key": False}
    record = tool.replayed_record(CODE_SAMPLE, 0, "right", replies, "m", one_fails)
    pair, mode = mine_step(record, CODE_RULES)
    assert mode == "trace_over_outlier"
    assert pair["chosen"]["content"] == "right" and pair["rejected"]["content"] == "C"
