"""The SDPO channel of a micro-batch (composer_tune/channels/sdpo/channel.py) on a tiny random Qwen3.

The reference values are computed independently: the teacher's prompt is written out by hand
(not through ``insert_hint``), both sides' full-vocabulary logits come from plain forwards
without ``head_fn``, and the divergence is the textbook Jensen-Shannon / KL formula.
"""

import math
from collections.abc import Sequence

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from composer_tune.channels.gradients import ChannelGradients
from composer_tune.channels.sdpo import (
    SDPOChannelConfig,
    TeacherContextConfig,
    build_sdpo_teacher_batch,
    logprobs_with_sdpo,
    reduce_sdpo_metrics,
    sdpo_channel_loss,
    select_teacher_rows,
)
from composer_tune.channels.sdpo.diagnostics import end_of_reply_probs
from composer_tune.channels.sdpo.teacher import EMATeacher
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.losses.distill import DistillConfig
from composer_tune.models import qwen3_tiny
from composer_tune.rollout.generation import pack_sequences
from composer_tune.rollout.rollouts import RolloutBatch, sequence_logprobs
from tests.recipe_runs import REPO_ROOT

QUESTIONS = ("What is 12 + 7?", "What is 30 - 4?", "What is 5 + 5?")
ANSWERS = ("19", "26", "10")
# Row 0 is correct (no teacher with apply_to=failed), row 1 wrong with feedback (teacher),
# row 2 wrong with no feedback (no hint: no teacher).
COMPLETIONS = ("19", "25", "11")
CORRECT = (True, False, False)
FEEDBACK = ("Your final answer 19 is correct.", "The correct answer is 26.", "")
FEEDBACK_TEMPLATE = "Feedback: {feedback}"
USER_TEMPLATE = "{content}\n\n{hint}\n\nCorrectly solve the original question."


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(REPO_ROOT / "tests" / "assets" / "tokenizer")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # A large init scale: peaky random distributions, so a wrong alignment shows.
    return qwen3_tiny(vocab_size=994, initializer_range=0.2)


def packed_rollouts(
    tokenizer: ChatTokenizer,
    samples: list[dict],
    texts: Sequence[str],
    correct: Sequence[bool],
    feedback: Sequence[str],
    group_ids: torch.Tensor,
) -> RolloutBatch:
    """Rows of ``samples`` (one per row) answered with ``texts``, packed as collect_rollouts does."""
    prompts = [
        tokenizer.tokenize_messages(s["prompt"], add_generation_prompt=True, enable_thinking=False)[
            0
        ]
        for s in samples
    ]
    completions = [tokenizer.encode(text) + [tokenizer.eos_id] for text in texts]
    packed = pack_sequences(prompts, completions, tokenizer.pad_id)
    rows = len(samples)
    return RolloutBatch(
        tokens=packed.tokens,
        input_pos=packed.input_pos,
        completion_mask=packed.completion_mask,
        old_logp=torch.zeros(packed.tokens.shape, dtype=torch.float32),
        ref_logp=None,
        rewards=torch.tensor([float(c) for c in correct]),
        correct=torch.tensor(list(correct)),
        feedback=list(feedback),
        truncated=torch.zeros(rows, dtype=torch.bool),
        prompt_lengths=packed.prompt_lengths,
        completion_lengths=packed.completion_lengths,
        group_ids=group_ids,
        texts=list(texts),
        samples=samples,
    )


def rollout_batch(tokenizer: ChatTokenizer) -> RolloutBatch:
    """Three hand-made rollouts of three prompts (one group each)."""
    samples = [
        {"id": f"q{i}", "prompt": [{"role": "user", "content": q}], "answer": a}
        for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS, strict=True))
    ]
    return packed_rollouts(
        tokenizer, samples, COMPLETIONS, CORRECT, FEEDBACK, torch.arange(len(samples))
    )


def channel_config(weight: float = 1.0, **loss: object) -> SDPOChannelConfig:
    return SDPOChannelConfig(
        weight=weight,
        context=TeacherContextConfig(
            sources=["feedback"],
            feedback_template=FEEDBACK_TEMPLATE,
            user_template=USER_TEMPLATE,
            apply_to="failed",
            enable_thinking=False,
        ),
        loss=DistillConfig(**loss),
    )


class ForwardCounter:
    """Counts a module's forward calls."""

    def __init__(self, module: nn.Module) -> None:
        self.count = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.count += 1


def reference_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (alpha 0.5) per row, from probabilities."""
    p, q = teacher_logp.exp(), student_logp.exp()
    m = 0.5 * (p + q)
    return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)


def reference_row1(
    tokenizer: ChatTokenizer, student: nn.Module, teacher: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 1 (the only row with a teacher), by hand: per-token student and teacher log-probs of
    the whole vocabulary, and of the completion tokens."""
    hint = FEEDBACK_TEMPLATE.format(feedback=FEEDBACK[1])
    message = USER_TEMPLATE.format(content=QUESTIONS[1], hint=hint)
    teacher_prompt, _ = tokenizer.tokenize_messages(
        [{"role": "user", "content": message}], add_generation_prompt=True, enable_thinking=False
    )
    student_prompt, _ = tokenizer.tokenize_messages(
        [{"role": "user", "content": QUESTIONS[1]}],
        add_generation_prompt=True,
        enable_thinking=False,
    )
    completion = tokenizer.encode(COMPLETIONS[1]) + [tokenizer.eos_id]
    n = len(completion)

    def logps(model: nn.Module, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion]))[0]
        return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + n], -1)

    student_logp, teacher_logp = logps(student, student_prompt), logps(teacher, teacher_prompt)
    target = torch.tensor(completion)[:, None]
    gap = teacher_logp.gather(1, target) - student_logp.gather(1, target)
    return student_logp, teacher_logp, gap.squeeze(1)


def test_metrics_and_loss_match_a_hand_computation(tokenizer: ChatTokenizer) -> None:
    model = tiny_model()
    rollouts = rollout_batch(tokenizer)
    loss, metrics = sdpo_channel_loss(
        model, rollouts, tokenizer=tokenizer, cfg=channel_config(weight=0.5)
    )
    student_logp, teacher_logp, gap = reference_row1(tokenizer, model, model)
    divergence = reference_jsd(student_logp, teacher_logp)
    assert metrics["sdpo/teacher_fraction"] == pytest.approx(1 / 3)
    assert metrics["sdpo/hint_feedback_fraction"] == pytest.approx(1 / 3)
    assert metrics["sdpo/valid_tokens"] == len(gap)
    assert metrics["sdpo/divergence"] == pytest.approx(float(divergence.mean()), rel=1e-4)
    assert metrics["sdpo/teacher_minus_student_logp"] == pytest.approx(float(gap.mean()), rel=1e-4)
    # weight x the token mean of the divergence
    assert float(loss) == pytest.approx(0.5 * float(divergence.mean()), rel=1e-4)


@pytest.mark.parametrize("top_k", [None, 5])
def test_ema_teacher_uses_its_own_weights(tokenizer: ChatTokenizer, top_k: int | None) -> None:
    model = tiny_model()
    ema = EMATeacher(model, rate=0.5, teacher=tiny_model(seed=1))
    with torch.no_grad():  # move the student, so teacher and student weights differ
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    cfg = channel_config(top_k=top_k)
    cfg.teacher = "ema"
    _, metrics = sdpo_channel_loss(
        model, rollout_batch(tokenizer), tokenizer=tokenizer, cfg=cfg, teacher_model=ema.module
    )
    student_logp, teacher_logp, gap = reference_row1(tokenizer, model, ema.module)
    if top_k is not None:  # the teacher's top-k tokens plus one tail bucket
        top = teacher_logp.topk(top_k, -1).indices

        def bucket(logp: torch.Tensor) -> torch.Tensor:
            kept = logp.exp().gather(-1, top)
            return torch.cat([kept, 1 - kept.sum(-1, keepdim=True)], -1).log()

        student_logp, teacher_logp = bucket(student_logp), bucket(teacher_logp)
    divergence = reference_jsd(student_logp, teacher_logp)
    assert metrics["sdpo/divergence"] == pytest.approx(float(divergence.mean()), rel=1e-4)
    assert metrics["sdpo/teacher_minus_student_logp"] == pytest.approx(float(gap.mean()), rel=1e-4)


def test_weight_zero_runs_nothing(tokenizer: ChatTokenizer) -> None:
    model = tiny_model()
    counter = ForwardCounter(model)
    rollouts = rollout_batch(tokenizer)
    loss, metrics = sdpo_channel_loss(
        model, rollouts, tokenizer=tokenizer, cfg=channel_config(weight=0.0)
    )
    assert counter.count == 0 and float(loss) == 0.0 and metrics == {}
    # The shared-forward path is then the plain policy forward, once.
    logp, entropy, loss, metrics = logprobs_with_sdpo(
        model,
        rollouts,
        tokenizer=tokenizer,
        cfg=channel_config(weight=0.0),
        temperature=0.7,
        chunk_size=8,
    )
    assert counter.count == 1 and float(loss) == 0.0 and metrics == {}
    expected = sequence_logprobs(
        model,
        rollouts.tokens,
        rollouts.input_pos,
        rollouts.completion_mask,
        temperature=0.7,
        chunk_size=8,
        return_entropy=True,
    )
    assert torch.equal(logp, expected[0]) and torch.equal(entropy, expected[1])


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_one_student_forward_gives_both_losses(tokenizer: ChatTokenizer) -> None:
    """logprobs_with_sdpo = sequence_logprobs + sdpo_channel_loss, values and gradients, with
    two forwards (teacher + student) instead of three."""
    model = tiny_model()
    rollouts = rollout_batch(tokenizer)
    cfg = channel_config(weight=0.3, chunk_size=2)
    counter = ForwardCounter(model)
    logp, entropy, loss, metrics = logprobs_with_sdpo(
        model, rollouts, tokenizer=tokenizer, cfg=cfg, temperature=1.0, chunk_size=8
    )
    assert counter.count == 2
    (loss + (logp * rollouts.completion_mask).sum() + entropy.sum()).backward()
    shared = _grads(model)

    expected_logp, expected_entropy = sequence_logprobs(
        model,
        rollouts.tokens,
        rollouts.input_pos,
        rollouts.completion_mask,
        chunk_size=8,
        return_entropy=True,
    )
    expected_loss, expected_metrics = sdpo_channel_loss(
        model, rollouts, tokenizer=tokenizer, cfg=cfg
    )
    assert torch.equal(logp, expected_logp) and torch.equal(entropy, expected_entropy)
    assert torch.equal(loss, expected_loss) and metrics == expected_metrics
    (
        expected_loss + (expected_logp * rollouts.completion_mask).sum() + expected_entropy.sum()
    ).backward()
    for ours, theirs in zip(shared, _grads(model), strict=True):
        # float32 sums in another order: equal up to rounding, relative to the gradient's size
        assert (ours - theirs).norm() <= 1e-5 * theirs.norm()


def test_teacher_batch_slices_and_normalizer(tokenizer: ChatTokenizer) -> None:
    """Micro-batches cut from a whole-batch teacher batch, with the step's token count as
    normalizer, sum to the whole batch's loss."""
    model = tiny_model()
    rollouts = rollout_batch(tokenizer)
    cfg = channel_config()
    whole, _ = sdpo_channel_loss(model, rollouts, tokenizer=tokenizer, cfg=cfg)
    teacher_batch = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
    count = float(teacher_batch.completion_mask.sum())
    parts = []
    per_micro = []
    for rows in (slice(0, 2), slice(2, 3)):
        part, metrics = sdpo_channel_loss(
            model,
            rollouts.select(rows),
            tokenizer=tokenizer,
            cfg=cfg,
            normalizer=count,
            teacher_batch=select_teacher_rows(teacher_batch, rows),
        )
        parts.append(part)
        per_micro.append(metrics)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=0)
    reduced = reduce_sdpo_metrics(per_micro)
    assert reduced["sdpo/teacher_fraction"] == pytest.approx(1 / 3)
    assert reduced["sdpo/valid_tokens"] == count
    assert math.isnan(per_micro[1]["sdpo/divergence"])  # no teacher in the second slice
    assert reduced["sdpo/divergence"] == pytest.approx(per_micro[0]["sdpo/divergence"])


def test_rows_without_a_verdict_are_judged_by_score(tokenizer: ChatTokenizer) -> None:
    """A reward that leaves ``correct`` None (e.g. a pure score) still gets sibling hints and
    ``apply_to=failed``: the score is compared with ``success_threshold``, not read as False."""
    rollouts = rollout_batch(tokenizer)
    rollouts.correct_known = torch.tensor([False, False, False])
    rollouts.correct = torch.tensor([False, False, False])
    rollouts.group_ids = torch.zeros(3, dtype=torch.long)  # one group: row 0 is a sibling
    cfg = channel_config()
    cfg.context.sources = ["sibling"]
    teacher_batch = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
    # Row 0 scored 1.0 >= 0.5: a success, so no teacher for it; rows 1 and 2 get its answer.
    assert teacher_batch.has_teacher.tolist() == [False, True, True]
    cfg.context.success_threshold = 1.5  # now nobody succeeded: no sibling to show
    teacher_batch = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
    assert teacher_batch.has_teacher.tolist() == [False, False, False]


def test_importance_clipping_without_sampling_logprobs_is_named(
    tokenizer: ChatTokenizer,
) -> None:
    rollouts = rollout_batch(tokenizer)
    rollouts.old_logp = None
    # Without is_clip the sampling policy's log-probs are not needed.
    loss, _ = sdpo_channel_loss(tiny_model(), rollouts, tokenizer=tokenizer, cfg=channel_config())
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="is_clip needs the sampling policy's log-probs"):
        sdpo_channel_loss(
            tiny_model(), rollouts, tokenizer=tokenizer, cfg=channel_config(is_clip=2.0)
        )


def test_reduce_weights_by_tokens_and_rows() -> None:
    per_micro: Sequence[dict[str, float]] = [
        {
            "sdpo/divergence": 1.0,
            "sdpo/teacher_minus_student_logp": 2.0,
            "sdpo/valid_tokens": 3.0,
            "sdpo/rows": 4.0,
            "sdpo/teacher_fraction": 0.5,
            "sdpo/hint_feedback_fraction": 0.25,
        },
        {
            "sdpo/divergence": 5.0,
            "sdpo/teacher_minus_student_logp": -1.0,
            "sdpo/valid_tokens": 1.0,
            "sdpo/rows": 2.0,
            "sdpo/teacher_fraction": 1.0,
            "sdpo/hint_feedback_fraction": 1.0,
        },
    ]
    reduced = reduce_sdpo_metrics(per_micro)
    assert reduced["sdpo/divergence"] == pytest.approx((1 * 3 + 5 * 1) / 4)
    assert reduced["sdpo/teacher_minus_student_logp"] == pytest.approx((2 * 3 - 1) / 4)
    assert reduced["sdpo/teacher_fraction"] == pytest.approx((0.5 * 4 + 1 * 2) / 6)
    assert reduced["sdpo/hint_feedback_fraction"] == pytest.approx((0.25 * 4 + 2) / 6)
    assert reduced["sdpo/valid_tokens"] == 4.0


def test_config_is_a_structured_section_and_checks_its_fields() -> None:
    schema = OmegaConf.structured(SDPOChannelConfig)
    built = OmegaConf.to_object(
        OmegaConf.merge(schema, {"weight": 2.0, "teacher": "ema", "loss": {"top_k": 7}})
    )
    assert built.weight == 2.0 and built.teacher == "ema" and built.loss.top_k == 7
    with pytest.raises(ValueError, match="teacher must be one of"):
        OmegaConf.to_object(OmegaConf.merge(schema, {"teacher": "frozen"}))
    with pytest.raises(ValueError, match="weight must be >= 0"):
        SDPOChannelConfig(weight=-1.0)
    with pytest.raises(ValueError, match="teacher=ema needs teacher_model"):
        cfg = SDPOChannelConfig(weight=1.0, teacher="ema")
        sdpo_channel_loss(nn.Linear(1, 1), None, tokenizer=None, cfg=cfg)  # type: ignore[arg-type]


def grouped_rollout_batch(tokenizer: ChatTokenizer) -> RolloutBatch:
    """Two questions with three completions each (two groups sharing their prompt), of uneven
    lengths, correct and wrong, each with feedback naming the answer."""
    texts = [("19", "18 apples", "20"), ("26", "25", "I think it is 24")]
    samples, row_texts, correct, feedback = [], [], [], []
    for i, answer in enumerate(ANSWERS[:2]):
        sample = {"id": f"q{i}", "prompt": [{"role": "user", "content": QUESTIONS[i]}]}
        for text in texts[i]:
            samples.append({**sample, "answer": answer})
            row_texts.append(text)
            correct.append(text == answer)
            feedback.append(f"The correct answer is {answer}.")
    group_ids = torch.arange(2).repeat_interleave(3)
    return packed_rollouts(tokenizer, samples, row_texts, correct, feedback, group_ids)


@pytest.mark.parametrize("top_k", [None, 3])
def test_shared_prefix_student_forward_equals_the_plain_one(
    tokenizer: ChatTokenizer, top_k: int | None
) -> None:
    """With shared_prefix each group's prompt runs once in the student forward; log-probs,
    entropy, SDPO loss, metrics and gradients are the plain forward's up to fp32 rounding."""
    model = tiny_model()
    rollouts = grouped_rollout_batch(tokenizer)
    cfg = channel_config(weight=0.5, top_k=top_k)
    results = {}
    for shared in (False, True):
        logp, entropy, loss, metrics = logprobs_with_sdpo(
            model,
            rollouts,
            tokenizer=tokenizer,
            cfg=cfg,
            temperature=0.7,
            chunk_size=8,
            shared_prefix=shared,
        )
        mask = rollouts.completion_mask
        (loss + (logp * mask).sum() + (entropy * mask).sum()).backward()
        results[shared] = (logp, entropy * mask, loss, metrics, _grads(model))
    plain, shared = results[False], results[True]
    assert float(plain[2].detach()) > 0  # the wrong rows have a teacher: a loss to compare
    for ours, theirs in zip(shared[:3], plain[:3], strict=True):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=2e-5)
    assert shared[3].keys() == plain[3].keys()
    for name in plain[3]:
        assert math.isclose(shared[3][name], plain[3][name], rel_tol=1e-4, abs_tol=1e-5), name
    for ours, theirs in zip(shared[4], plain[4], strict=True):
        assert (ours - theirs).norm() <= 1e-4 * theirs.norm() + 1e-7


def test_excluding_the_end_of_reply_leaves_its_tokens_out_of_the_channel(
    tokenizer: ChatTokenizer,
) -> None:
    """``sdpo.loss.end_of_reply: exclude``: the teacher batch distils no end-of-reply token
    (so the step's token mean does not count them), the student's end-of-reply logit gets no
    gradient, and the loss is the per-token mean over the other completion tokens; the default
    distils every completion token and moves that logit."""
    rollouts = rollout_batch(tokenizer)
    eos = tokenizer.eos_id
    losses = {}
    for setting in ("distill", "exclude"):
        model = tiny_model()
        cfg = channel_config(end_of_reply=setting)
        teacher_batch = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
        distilled = teacher_batch.tokens.gather(
            1, (teacher_batch.prediction_positions + 1)[:, : teacher_batch.completion_mask.shape[1]]
        )[teacher_batch.completion_mask]
        # The gradient on the end-of-reply logit, as log_channel_gradients reads it.
        split = ChannelGradients(model.parameters(), eos_token=eos)
        with split.channel("sdpo"):
            loss, metrics = sdpo_channel_loss(
                split.watch(model), rollouts, tokenizer=tokenizer, cfg=cfg
            )
            loss.backward()
        losses[setting] = (distilled, metrics, split.combine(distributed=False))
    distilled, metrics, gradients = losses["exclude"]
    assert eos not in distilled.tolist() and metrics["sdpo/valid_tokens"] == len(distilled)
    assert gradients["eos_push/sdpo"] == 0 and gradients["eos_share/sdpo"] == 0
    assert gradients["grad_norm/sdpo"] > 0
    all_tokens, all_metrics, default_gradients = losses["distill"]
    # One row has a teacher (row 0 succeeded, row 2 has no feedback), and it ends once.
    assert (all_tokens == eos).sum() == 1
    assert all_metrics["sdpo/valid_tokens"] == len(distilled) + 1
    assert default_gradients["eos_share/sdpo"] > 0


def test_end_of_reply_probs_read_both_prompts_at_every_completion_position(
    tokenizer: ChatTokenizer,
) -> None:
    """The diagnostic's student and teacher end-of-reply probabilities equal a softmax of the
    full logits of the plain and the hinted sequence at the positions predicting each
    completion token; rows without a teacher stay NaN."""
    model = tiny_model().eval()
    rollouts = rollout_batch(tokenizer)
    cfg = channel_config()
    teacher_batch = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
    student, teacher, top = end_of_reply_probs(
        model, rollouts, teacher_batch, tokenizer.eos_id, temperature=0.7
    )
    eos = tokenizer.eos_id
    with torch.no_grad():
        plain = torch.softmax(model(rollouts.tokens) / 0.7, -1)
        hinted = torch.softmax(model(teacher_batch.tokens) / 0.7, -1)
    for row in range(len(rollouts)):
        length = int(rollouts.completion_lengths[row])
        if not bool(teacher_batch.has_teacher[row]):
            assert torch.isnan(student[row]).all() and torch.isnan(teacher[row]).all()
            continue
        start, hinted_start = (
            int(rollouts.prompt_lengths[row]),
            int(teacher_batch.prompt_lengths[row]),
        )
        for j in range(length):
            assert float(student[row, j]) == pytest.approx(
                float(plain[row, start + j - 1, eos]), rel=1e-4
            )
            assert float(teacher[row, j]) == pytest.approx(
                float(hinted[row, hinted_start + j - 1, eos]), rel=1e-4
            )
            assert int(top[row, j]) == int(hinted[row, hinted_start + j - 1].argmax())
        assert torch.isnan(student[row, length:]).all()
    assert int(teacher_batch.has_teacher.sum()) == 1
