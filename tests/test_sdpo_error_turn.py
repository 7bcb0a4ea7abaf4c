"""SDPO at an agent episode's error turn (``sdpo.context.distill_turns``): the teacher reads the
hinted prompt and the episode up to the turn where it went wrong, and only that turn's model
tokens are distilled; tool output never is. A scripted engine drives real episodes
(``sample_rollouts(agent=...)``) on the cpu_smoke_agent model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from composer_tune.channels.sdpo import (
    SDPOChannelConfig,
    build_sdpo_teacher_batch,
    sdpo_channel_loss,
)
from composer_tune.channels.sdpo.contexts import insert_hint
from composer_tune.data.code_tasks import read_tasks
from composer_tune.rewards import CodeExecutionReward, MathAnswerReward
from tests.test_agent_rollouts import (  # noqa: F401 - tiny: the model fixture
    CALL,
    scripted_episodes,
    tiny,
)

CODE_TASKS = Path(__file__).parent / "assets" / "code_tasks" / "train.jsonl"
AGENT = {"tools": ["composer_tune.agents.calculator.calculate"], "max_turns": 4}
SAMPLE = {"prompt": [{"role": "user", "content": "What is 347 * 68 + 5?"}], "answer": "23601"}
BAD_CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expr": "23596 + 5"}}\n</tool_call>'

# Row 0: a good tool call, a failing one (wrong argument name), then the right answer; row 1: a
# wrong answer at once.
ERROR_ON_SECOND_CALL = [[CALL, "12"], [BAD_CALL], ["23601"]]


def _episodes(tiny_fixture):
    model, tokenizer, _ = tiny_fixture
    batch = scripted_episodes(
        tiny_fixture, SAMPLE, AGENT, ERROR_ON_SECOND_CALL,
        reward=MathAnswerReward(reveal_answer=True), reference=None, compute_old_logp=False,
    )  # fmt: skip
    return model, tokenizer, batch


def _sdpo(distill_turns: str) -> SDPOChannelConfig:
    return SDPOChannelConfig.from_mapping(
        {
            "weight": 1.0,
            "context": {
                "sources": ["feedback"],
                "apply_to": "all",
                "distill_turns": distill_turns,
            },
        }
    )


def test_the_failing_call_is_the_error_turn_and_only_its_tokens_are_distilled(tiny) -> None:  # noqa: F811
    model, tokenizer, batch = _episodes(tiny)
    record = batch.episodes[0]
    assert record.turns == 3 and record.tool_errors == 1 and record.error_turn == 1
    assert "expression" in record.feedback and record.feedback.startswith("{'error':")
    cfg = _sdpo("error_turn")
    teacher = build_sdpo_teacher_batch(batch, tokenizer=tokenizer, cfg=cfg)
    assert teacher.has_teacher.tolist() == [True, True]
    assert teacher.error_turns == ["tool_error", "final_answer"]
    # The teacher's context: the prompt with the failing call's observation as the hint, then the
    # episode verbatim up to (and through) the error turn.
    prompt_length = int(batch.prompt_lengths[0])
    start, end = record.turn_spans[1]
    hinted = insert_hint(
        SAMPLE["prompt"],
        cfg.context.feedback_template.format(feedback=record.feedback.strip()),
        cfg.context,
    )
    hinted_ids, _ = tokenizer.tokenize_messages(
        hinted, add_generation_prompt=True, strip_thinking=True, enable_thinking=True
    )
    teacher_prompt = int(teacher.prompt_lengths[0])
    assert teacher.tokens[0, :teacher_prompt].tolist() == hinted_ids
    shift = teacher_prompt - prompt_length
    assert (
        teacher.tokens[0, teacher_prompt : end + shift].tolist()
        == batch.tokens[0, prompt_length:end].tolist()
    )
    # Exactly the error turn's tokens, all of them the model's.
    distilled = torch.nonzero(teacher.completion_mask[0]).flatten() + prompt_length
    assert distilled.tolist() == list(range(start, end))
    assert batch.completion_mask[0, start:end].all()
    # Row 1 (one turn, a wrong answer): that turn, with the reward's feedback as the hint.
    ((only_start, only_end),) = batch.episodes[1].turn_spans
    distilled = torch.nonzero(teacher.completion_mask[1]).flatten() + prompt_length
    assert distilled.tolist() == list(range(only_start, only_end))
    # The loss takes exactly those tokens.
    _, metrics = sdpo_channel_loss(
        model, batch, tokenizer=tokenizer, cfg=cfg, teacher_batch=teacher
    )
    assert metrics["sdpo/valid_tokens"] == (end - start) + (only_end - only_start)
    assert metrics["sdpo/error_turn_tool_fraction"] == 0.5


@pytest.mark.parametrize("distill_turns", ["all", "from_error_turn"])
def test_other_turn_choices_never_distil_tool_output(tiny, distill_turns: str) -> None:  # noqa: F811
    _, tokenizer, batch = _episodes(tiny)
    teacher = build_sdpo_teacher_batch(batch, tokenizer=tokenizer, cfg=_sdpo(distill_turns))
    record, prompt_length = batch.episodes[0], int(batch.prompt_lengths[0])
    turns = record.turn_spans if distill_turns == "all" else record.turn_spans[1:]
    distilled = torch.nonzero(teacher.completion_mask[0]).flatten() + prompt_length
    assert distilled.tolist() == [t for begin, end in turns for t in range(begin, end)]


def test_an_unknown_turn_choice_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="distill_turns must be one of"):
        _sdpo("last_turn")


def _run_tests_call(code: str) -> str:
    call = {"name": "run_tests", "arguments": {"code": code}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_on_a_code_episode_the_turn_whose_code_failed_gets_the_test_report(tiny) -> None:  # noqa: F811
    """The code agent's shape (grpo / sdpo smollm2_code_agent): a run_tests call whose code fails
    a visible test is the error turn, its report is the hint, and only that turn is distilled;
    the fixed code's turn and the final answer are not."""
    model, tokenizer, _ = tiny
    task = read_tasks(CODE_TASKS)[0]
    # A short prompt: the tiny model's tokenizer spends ~1000 tokens on the real one.
    task["prompt"] = [{"role": "user", "content": f"Write {task['entry_point']}(text)."}]
    wrong = f"def {task['entry_point']}(text):\n    return None\n"
    script = [
        [_run_tests_call(wrong), f"```python\n{wrong}```"],
        [_run_tests_call(task["solution"])],
        [f"```python\n{task['solution']}```"],
    ]
    agent = {
        "environment": {
            "_component_": "composer_tune.agents.coding.CodingEnvironment",
            "visible_tests": 2,
        },
        "max_turns": 3,
    }
    batch = scripted_episodes(
        tiny, task, agent, script, reward=CodeExecutionReward(), reference=None,
        compute_old_logp=False,
    )  # fmt: skip
    fixed, wrong_at_once = batch.episodes
    assert fixed.turns == 3 and fixed.error_turn == 0
    assert fixed.feedback.startswith("{'error': \"TestsFailed: 0/2 tests passed; test 1")
    assert "failed: expected" in fixed.feedback
    assert batch.rewards.tolist()[0] == 1.0 and batch.rewards.tolist()[1] < 1.0
    cfg = _sdpo("error_turn")
    teacher = build_sdpo_teacher_batch(batch, tokenizer=tokenizer, cfg=cfg)
    assert teacher.error_turns == ["tool_error", "final_answer"]
    prompt_length = int(batch.prompt_lengths[0])
    start, end = fixed.turn_spans[0]
    distilled = torch.nonzero(teacher.completion_mask[0]).flatten() + prompt_length
    assert distilled.tolist() == list(range(start, end))
    # The teacher's prompt carries the report of the failing run.
    teacher_prompt = tokenizer.decode(teacher.tokens[0, : int(teacher.prompt_lengths[0])].tolist())
    assert "failed: expected" in teacher_prompt
    # Row 1 answered at once with wrong code: its final answer, with the reward's report.
    assert wrong_at_once.error_turn == 0 and "failed: expected" in wrong_at_once.feedback
