"""SDPO teacher contexts: hint choice and wording, placement, options, and exact token alignment.

Expected teacher prompts are written out by hand (message text assembled here, rendered with the
tokenizer's chat template) rather than taken from the module's own helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune.channels.sdpo import (
    TeacherContextConfig,
    build_teacher_batch,
    prediction_positions,
    strip_reasoning,
)
from composer_tune.data.gsm8k import GSM8K
from composer_tune.data.synthetic import SyntheticArithmetic
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.losses.distill import DistillConfig, distill_loss
from composer_tune.losses.logprobs import naive_token_logprobs
from composer_tune.models import qwen3_tiny
from composer_tune.rewards.base import RewardResult
from composer_tune.rollout.generation import pack_sequences

ASSETS = Path(__file__).resolve().parent / "assets"
SUFFIX = "\n\nCorrectly solve the original question."


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(ASSETS / "tokenizer")


@pytest.fixture(scope="module")
def gsm8k() -> list[dict]:
    data = GSM8K(source=str(ASSETS / "gsm8k" / "train.jsonl"), num_samples=2)
    return [data[0], data[1]]


def rollouts(tokenizer: ChatTokenizer, gsm8k: list[dict]) -> dict:
    """Two prompts x three completions. Group 0: rows 0 (wrong), 1 (right), 2 (right).
    Group 1: rows 3 (wrong, no feedback), 4 (wrong), 5 (right, the group's only success)."""
    texts = [
        "<think>\n48/2 = 20\n</think>\n\nThe answer is 68.",
        "<think>\nHalf of 48 is 24.\n</think>\n\nMay: 24. Total 72. The answer is 72.",
        "<think>\n48 + 24\n</think>\n\nThe answer is 72.",
        "<think>\n12 x 50 = 600",  # cut off inside its reasoning
        "<think>\n12/60\n</think>\n\nThe answer is 1.",
        "<think>\n0.2 per minute\n</think>\n\nShe earned 0.2 x 50 = 10. The answer is 10.",
    ]
    completions = [
        tokenizer.encode(text, add_eos=not text.startswith("<think>\n12 x")) for text in texts
    ]
    results = [
        RewardResult(0.0, False, "Your final answer 68 is wrong."),
        RewardResult(1.0, True),
        RewardResult(1.0, True),
        RewardResult(0.0, False, ""),
        RewardResult(0.0, False, "Your final answer 1 is wrong."),
        RewardResult(1.0, True),
    ]
    return {
        "samples": [gsm8k[0]] * 3 + [gsm8k[1]] * 3,
        "completions": completions,
        "results": results,
        "texts": texts,
        "group_ids": [0, 0, 0, 1, 1, 1],
    }


def build(tokenizer: ChatTokenizer, data: dict, **config):
    return build_teacher_batch(tokenizer, TeacherContextConfig(**config), **data)


def prompt_ids(tokenizer: ChatTokenizer, messages: list[dict], **kwargs) -> list[int]:
    ids, _ = tokenizer.tokenize_messages(messages, add_generation_prompt=True, **kwargs)
    return ids


def with_user_text(sample: dict, text: str) -> list[dict]:
    """The sample's prompt with its (single) user message replaced by ``text``."""
    return [{**m, "content": text} if m["role"] == "user" else dict(m) for m in sample["prompt"]]


def row_prompt(batch, row: int) -> list[int]:
    return batch.tokens[row, : int(batch.prompt_lengths[row])].tolist()


def assert_aligned(batch, completions: list[list[int]], pad_id: int) -> None:
    """The teacher's target at every mapped position is exactly the student's token."""
    for row, completion in enumerate(completions):
        if not batch.has_teacher[row]:
            assert not batch.completion_mask[row].any()
            assert torch.all(batch.tokens[row] == pad_id) and not batch.padding_mask[row].any()
            continue
        length = len(completion)
        assert batch.completion_mask[row].sum() == length
        positions = batch.prediction_positions[row, :length]
        assert batch.tokens[row, positions + 1].tolist() == completion
        end = int(batch.prompt_lengths[row]) + length
        assert batch.padding_mask[row].tolist() == [True] * end + [False] * (
            batch.tokens.shape[1] - end
        )
        assert torch.all(batch.tokens[row, end:] == pad_id)


def test_sibling_then_feedback_default(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    batch = build(tokenizer, data)
    user = gsm8k[0]["prompt"][-1]["content"]
    sibling_1 = "May: 24. Total 72. The answer is 72."  # row 1, reasoning stripped
    sibling_2 = "The answer is 72."
    expected = {
        0: with_user_text(gsm8k[0], f"{user}\n\nCorrect solution:\n\n{sibling_1}{SUFFIX}"),
        1: with_user_text(gsm8k[0], f"{user}\n\nCorrect solution:\n\n{sibling_2}{SUFFIX}"),
        2: with_user_text(gsm8k[0], f"{user}\n\nCorrect solution:\n\n{sibling_1}{SUFFIX}"),
    }
    other = gsm8k[1]["prompt"][-1]["content"]
    sibling_5 = "She earned 0.2 x 50 = 10. The answer is 10."
    expected[3] = with_user_text(gsm8k[1], f"{other}\n\nCorrect solution:\n\n{sibling_5}{SUFFIX}")
    expected[4] = expected[3]
    for row, messages in expected.items():
        assert row_prompt(batch, row) == prompt_ids(tokenizer, messages), row
    # Row 5 is its group's only success: it never gets its own completion, and has no feedback.
    assert batch.has_teacher.tolist() == [True] * 5 + [False]
    assert batch.no_teacher_reasons == [None] * 5 + ["no_hint"]
    assert batch.hint_sources == ["sibling"] * 5 + [None]
    assert_aligned(batch, data["completions"], tokenizer.pad_id)


def test_feedback_first_and_combined(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    user = gsm8k[0]["prompt"][-1]["content"]
    feedback = "The following is feedback from your unsuccessful earlier attempt:\n\n"
    first = build(tokenizer, data, sources=["feedback", "sibling"])
    assert row_prompt(first, 0) == prompt_ids(
        tokenizer,
        with_user_text(gsm8k[0], f"{user}\n\n{feedback}Your final answer 68 is wrong.{SUFFIX}"),
    )
    assert first.hint_sources[:4] == ["feedback", "sibling", "sibling", "sibling"]

    combined = build(tokenizer, data, sources=["feedback", "sibling"], combine="all")
    sibling = "Correct solution:\n\nMay: 24. Total 72. The answer is 72."
    assert row_prompt(combined, 0) == prompt_ids(
        tokenizer,
        with_user_text(
            gsm8k[0], f"{user}\n\n{feedback}Your final answer 68 is wrong.\n\n{sibling}{SUFFIX}"
        ),
    )
    assert combined.hint_sources[0] == "feedback+sibling"
    metrics = combined.metrics()
    assert metrics["sdpo/hint_feedback_fraction"] == pytest.approx(2 / 6)
    assert metrics["sdpo/hint_sibling_fraction"] == pytest.approx(5 / 6)
    assert metrics["sdpo/teacher_fraction"] == pytest.approx(5 / 6)
    assert_aligned(combined, data["completions"], tokenizer.pad_id)


def test_reference_solution_from_gsm8k_and_synthetic(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    batch = build(tokenizer, data, sources=["reference"], reference_template="Worked: {solution}")
    user = gsm8k[1]["prompt"][-1]["content"]
    assert row_prompt(batch, 3) == prompt_ids(
        tokenizer, with_user_text(gsm8k[1], f"{user}\n\nWorked: {gsm8k[1]['solution']}{SUFFIX}")
    )
    assert "<<" not in gsm8k[1]["solution"] and gsm8k[1]["solution"]  # the annotated rationale
    assert batch.has_teacher.all()

    synthetic = SyntheticArithmetic("train", num_samples=2, seed=1)[0]
    completion = tokenizer.encode("42", add_eos=True)
    one = build_teacher_batch(
        tokenizer,
        TeacherContextConfig(sources=["reference"], apply_to="failed"),
        samples=[synthetic],
        completions=[completion],
        results=[RewardResult(0.0, False)],
        texts=["42"],
        group_ids=[0],
    )
    question = synthetic["prompt"][-1]["content"]
    assert row_prompt(one, 0) == prompt_ids(
        tokenizer,
        with_user_text(
            synthetic, f"{question}\n\nCorrect solution:\n\n{synthetic['solution']}{SUFFIX}"
        ),
    )
    assert_aligned(one, [completion], tokenizer.pad_id)


def test_apply_to_failed_and_skip_if_no_hint(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    failed = build(tokenizer, data, apply_to="failed")
    assert failed.has_teacher.tolist() == [True, False, False, True, True, False]
    assert failed.no_teacher_reasons == [None, "succeeded", "succeeded", None, None, "succeeded"]

    # Without skipping, a row with no hint is taught from its unmodified prompt.
    keep = build(tokenizer, data, sources=["feedback"], skip_if_no_hint=False)
    assert keep.has_teacher.all()
    assert keep.hint_sources == ["feedback", "", "", "", "feedback", ""]
    assert row_prompt(keep, 3) == prompt_ids(tokenizer, gsm8k[1]["prompt"])
    assert_aligned(keep, data["completions"], tokenizer.pad_id)
    skip = build(tokenizer, data, sources=["feedback"])
    assert skip.has_teacher.tolist() == [True, False, False, False, True, False]
    assert_aligned(skip, data["completions"], tokenizer.pad_id)


def test_success_without_correct_uses_score_threshold(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    data["results"] = [RewardResult(score) for score in (0.2, 0.9, 0.1, 0.0, 0.0, 0.0)]
    batch = build(tokenizer, data, apply_to="failed", success_threshold=0.5)
    # Row 1 (0.9) succeeded and is the sibling of rows 0 and 2; group 1 has no success.
    assert batch.has_teacher.tolist() == [True, False, True, False, False, False]
    assert batch.no_teacher_reasons[1] == "succeeded"


def test_strip_thinking_from_hint_and_cut_off_reasoning(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    # Row 3's completion never closed its reasoning: as a stripped hint it is empty, so the
    # failed row 4 finds no usable sibling when row 3 is the only "success".
    data["results"] = list(data["results"])
    data["results"][3] = RewardResult(1.0, True)
    data["results"][5] = RewardResult(0.0, False)
    stripped = build(tokenizer, data, sources=["sibling"])
    assert stripped.no_teacher_reasons[3:] == ["no_hint", "no_hint", "no_hint"]
    kept = build(tokenizer, data, sources=["sibling"], strip_thinking_from_hint=False)
    user = gsm8k[1]["prompt"][-1]["content"]
    assert row_prompt(kept, 4) == prompt_ids(
        tokenizer,
        with_user_text(gsm8k[1], f"{user}\n\nCorrect solution:\n\n<think>\n12 x 50 = 600{SUFFIX}"),
    )
    assert strip_reasoning("<think>\na\n</think>\n\nb") == "b"
    assert strip_reasoning("<think>\nnever closed") == ""
    assert strip_reasoning("  plain  ") == "plain"


def test_system_placement(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    batch = build(tokenizer, data, sources=["feedback"], placement="system")
    hint = "The following is feedback from your unsuccessful earlier attempt:\n\nYour final answer 68 is wrong."
    assert row_prompt(batch, 0) == prompt_ids(
        tokenizer, [{"role": "system", "content": hint}, *gsm8k[0]["prompt"]]
    )
    with_system = {
        **gsm8k[0],
        "prompt": [{"role": "system", "content": "Be brief."}, *gsm8k[0]["prompt"]],
    }
    data["samples"] = [with_system] * 6
    batch = build(tokenizer, data, sources=["feedback"], placement="system")
    assert row_prompt(batch, 0) == prompt_ids(
        tokenizer, [{"role": "system", "content": f"Be brief.\n\n{hint}"}, *gsm8k[0]["prompt"]]
    )
    assert_aligned(batch, data["completions"], tokenizer.pad_id)


def test_thinking_options_reach_the_chat_template(tokenizer) -> None:
    """strip_thinking for earlier turns and enable_thinking, as the tokenizer renders them."""
    prompt = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    completion = tokenizer.encode("6", add_eos=True)
    common = {
        "samples": [{"prompt": prompt}],
        "completions": [completion],
        "results": [RewardResult(0.0, False, "Wrong.")],
        "texts": ["6"],
        "group_ids": [0],
    }
    hinted = [*prompt[:2], {"role": "user", "content": "And 3 + 3?\n\nHint: Wrong." + SUFFIX}]
    for strip in (True, False):
        for thinking in (True, False):
            batch = build_teacher_batch(
                tokenizer,
                TeacherContextConfig(
                    sources=["feedback"],
                    feedback_template="Hint: {feedback}",
                    strip_thinking=strip,
                    enable_thinking=thinking,
                ),
                **common,
            )
            expected = prompt_ids(tokenizer, hinted, strip_thinking=strip, enable_thinking=thinking)
            assert row_prompt(batch, 0) == expected
            text = tokenizer.decode(expected, skip_special_tokens=False)
            assert ("two and two" in text) is (not strip)
            assert text.endswith("<think>\n\n</think>\n\n") is (not thinking)
            assert_aligned(batch, [completion], tokenizer.pad_id)


def test_hint_skips_wrapped_tool_responses(tokenizer) -> None:
    """An agent step whose tool result arrives as a user turn: the hint goes into the task
    message, so the earlier step keeps its reasoning under Qwen3's stripping rule."""
    call = {"name": "run", "arguments": {"cmd": "ls"}}
    prompt = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "reasoning_content": "use ls", "tool_calls": [call]},
        {"role": "user", "content": "<tool_response>\na.py\n</tool_response>"},
    ]
    completion = tokenizer.encode("One file.", add_eos=True)
    batch = build_teacher_batch(
        tokenizer,
        TeacherContextConfig(sources=["feedback"], feedback_template="Hint: {feedback}"),
        samples=[{"prompt": prompt}],
        completions=[completion],
        results=[RewardResult(0.0, False, "Count them.")],
        texts=["One file."],
        group_ids=[0],
    )
    hinted = [
        {"role": "user", "content": "List the files.\n\nHint: Count them." + SUFFIX},
        *prompt[1:],
    ]
    expected = prompt_ids(tokenizer, hinted)
    assert row_prompt(batch, 0) == expected
    assert "use ls" in tokenizer.decode(expected, skip_special_tokens=False)
    assert_aligned(batch, [completion], tokenizer.pad_id)


def test_max_teacher_tokens(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    full = build(tokenizer, data)
    lengths = (full.prompt_lengths + full.completion_lengths).tolist()
    limit = sorted(lengths[:5])[2]
    capped = build(tokenizer, data, max_teacher_tokens=limit)
    for row in range(5):
        assert bool(capped.has_teacher[row]) is (lengths[row] <= limit)
        if lengths[row] > limit:
            assert capped.no_teacher_reasons[row] == "too_long"
    assert_aligned(capped, data["completions"], tokenizer.pad_id)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"feedback_template": "Note: {feedbak}"}, r"feedback_template uses the field \{feedbak\}"),
        ({"sibling_template": "{solution}"}, r"sibling_template uses the field \{solution\}"),
        (
            {"user_template": "{content} {hint} {answer}"},
            r"user_template uses the field \{answer\}",
        ),
        ({"reference_template": "Solution: {}"}, r"reference_template uses the field \{\}"),
        (
            {"reference_template": "no field"},
            r"reference_template must contain the field \{solution\}",
        ),
        ({"system_template": "{hint"}, "system_template is not a valid"),
        ({"sources": ["hint"]}, "unknown hint source 'hint'"),
        ({"sources": []}, "at least one"),
        ({"placement": "assistant"}, "placement"),
        ({"apply_to": "some"}, "apply_to"),
        ({"combine": "best"}, "combine"),
        ({"max_teacher_tokens": 0}, "max_teacher_tokens"),
    ],
)
def test_config_errors_name_the_culprit(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TeacherContextConfig(**kwargs)


def test_input_errors(tokenizer, gsm8k) -> None:
    data = rollouts(tokenizer, gsm8k)
    with pytest.raises(ValueError, match="texts has 5 entries"):
        build(tokenizer, {**data, "texts": data["texts"][:5]})
    with pytest.raises(ValueError, match=r"completions\[2\] is empty"):
        build(
            tokenizer,
            {**data, "completions": [*data["completions"][:2], [], *data["completions"][3:]]},
        )
    no_user = {"id": "sys-only", "prompt": [{"role": "system", "content": "hi"}]}
    with pytest.raises(ValueError, match="'sys-only'.*no user query"):
        build(tokenizer, {**data, "samples": [no_user] * 6})
    with pytest.raises(KeyError, match="no 'prompt'"):
        build(tokenizer, {**data, "samples": [{"id": "x"}] * 6})
    short = ChatTokenizer.from_dir(ASSETS / "tokenizer", max_seq_len=20)
    with pytest.raises(ValueError, match="max_seq_len=20"):
        build(short, data)


def test_prediction_positions() -> None:
    positions, mask = prediction_positions(torch.tensor([3, 1, 5]), torch.tensor([2, 0, 3]))
    assert positions.tolist() == [[2, 3, 0], [0, 0, 0], [4, 5, 6]]
    assert mask.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    with pytest.raises(ValueError, match="width=2"):
        prediction_positions(torch.tensor([3]), torch.tensor([3]), width=2)


def test_teacher_logprobs_through_a_model_match_unpadded_rows(tokenizer, gsm8k) -> None:
    """End to end on a tiny Qwen3: the padded teacher batch, read at prediction_positions, gives
    each row's own unpadded log-probs of the student's tokens; and a teacher that sees exactly
    the student's context (no hint) has zero divergence from the student."""
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=tokenizer.vocab_size, initializer_range=0.5).eval()
    data = rollouts(tokenizer, gsm8k)
    batch = build(tokenizer, data, sources=["feedback", "sibling"], combine="all")
    with torch.no_grad():
        hidden = model(batch.tokens, head_fn=lambda h, _: h)
        # Rows 0 and 4: different prompts, hint lengths and completion lengths.
        assert batch.prompt_lengths[0] != batch.prompt_lengths[4]
        for row in (0, 4):
            length = int(batch.prompt_lengths[row] + batch.completion_lengths[row])
            logits = model(batch.tokens[row : row + 1, :length])[0]
            positions = batch.prediction_positions[row, : int(batch.completion_lengths[row])]
            targets = torch.tensor(data["completions"][row])
            want = naive_token_logprobs(logits[positions], targets)
            got = naive_token_logprobs(model.output(hidden[row, positions]), targets)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # Student rows exactly as a rollout packs them; teacher = same context, no hint.
    student_prompts = [prompt_ids(tokenizer, sample["prompt"]) for sample in data["samples"]]
    packed = pack_sequences(student_prompts, data["completions"], tokenizer.pad_id)
    data_no_feedback = {
        **data,
        "results": [RewardResult(r.score, r.correct) for r in data["results"]],
    }
    same = build(tokenizer, data_no_feedback, sources=["feedback"], skip_if_no_hint=False)
    assert torch.equal(same.tokens, packed.tokens)
    student_positions, student_mask = prediction_positions(
        packed.prompt_lengths, packed.completion_lengths
    )
    targets = torch.zeros_like(student_positions)
    for row, completion in enumerate(data["completions"]):
        targets[row, : len(completion)] = torch.tensor(completion)
    student_hidden = model(packed.tokens, head_fn=lambda h, _: h)
    with torch.no_grad():
        teacher_hidden = model(same.tokens, head_fn=lambda h, _: h)
    for alpha in (0.0, 0.5, 1.0):
        out = distill_loss(
            student_hidden,
            teacher_hidden,
            model.output,
            student_positions=student_positions,
            teacher_positions=same.prediction_positions,
            targets=targets,
            completion_mask=student_mask,
            has_teacher=same.has_teacher,
            config=DistillConfig(alpha=alpha),
        )
        assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    # With hints the teacher differs, and the student gets a gradient.
    hinted_hidden = model(batch.tokens, head_fn=lambda h, _: h).detach()
    out = distill_loss(
        student_hidden,
        hinted_hidden,
        model.output,
        student_positions=student_positions,
        teacher_positions=batch.prediction_positions,
        targets=targets,
        completion_mask=student_mask,
        has_teacher=batch.has_teacher,
        config=DistillConfig(alpha=0.5),
    )
    assert out.loss.item() > 1e-4
    out.loss.backward()
    assert model.tok_embeddings.weight.grad.abs().sum() > 0


def test_configs_are_omegaconf_sections() -> None:
    """Both configs work as structured-config sections of a recipe, validated on to_object."""

    @dataclass
    class Section:
        context: TeacherContextConfig = field(default_factory=TeacherContextConfig)
        distill: DistillConfig = field(default_factory=DistillConfig)

    schema = OmegaConf.structured(Section)
    overrides = {"context": {"sources": ["reference"], "max_teacher_tokens": 64}}
    overrides["distill"] = {"top_k": 100, "is_clip": 2.0, "alpha": 1.0}
    built = OmegaConf.to_object(OmegaConf.merge(schema, overrides))
    assert built.context.sources == ["reference"] and built.context.max_teacher_tokens == 64
    assert built.distill == DistillConfig(alpha=1.0, top_k=100, is_clip=2.0)
    bad = OmegaConf.merge(schema, {"context": {"sibling_template": "{sibing}"}})
    with pytest.raises(ValueError, match=r"sibling_template uses the field \{sibing\}"):
        OmegaConf.to_object(bad)
