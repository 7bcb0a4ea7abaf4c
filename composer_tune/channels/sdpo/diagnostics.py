"""Does the SDPO teacher know better? The gold answer's log-probability with and without the hint;
and where does it want the reply to end?

SDPO's premise is that the policy, shown a hint (here: the verifier's feedback naming the
correct answer), puts more probability on the right answer than it does without it. For a model
and a set of problems, :func:`gold_answer_gap` scores the gold answer as the completion of each
plain prompt (the student) and of the prompt the SDPO channel builds for a failed attempt (the
teacher), and returns the difference per problem in nats.

The hint also changes what the teacher expects of the reply's length: :func:`end_of_reply_probs`
reads, at every completion position of sampled rollouts, the probability the student (plain
prompt) and the teacher (hinted prompt) give the end-of-reply token, e.g. at the position where
the student ended its reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from composer_tune.channels.sdpo.channel import SDPOChannelConfig, build_sdpo_teacher_batch
from composer_tune.channels.sdpo.contexts import TeacherBatch, prediction_positions
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout import encode_prompts
from composer_tune.rollout.generation import pack_sequences
from composer_tune.rollout.rollouts import RolloutBatch, sequence_logprobs


def gold_answer_rollouts(
    tokenizer: Any, samples: Sequence[Mapping[str, Any]], *, enable_thinking: bool
) -> RolloutBatch:
    """One row per sample whose completion is its gold ``answer`` then the end of turn, scored
    as a wrong attempt (the answer plus one), so that the channel's hint is the verifier's
    feedback naming the answer (``MathAnswerReward(reveal_answer=True)``)."""
    prompts = encode_prompts(tokenizer, samples, enable_thinking=enable_thinking)
    completions = [tokenizer.encode(sample["answer"]) + [tokenizer.eos_id] for sample in samples]
    wrong = [str(int(sample["answer"]) + 1) for sample in samples]
    results = MathAnswerReward(reveal_answer=True)(wrong, samples)
    packed = pack_sequences(prompts, completions, tokenizer.pad_id)
    rows = len(samples)
    return RolloutBatch(
        tokens=packed.tokens,
        input_pos=packed.input_pos,
        completion_mask=packed.completion_mask,
        old_logp=torch.zeros(packed.tokens.shape),
        ref_logp=None,
        rewards=torch.zeros(rows),
        correct=torch.zeros(rows, dtype=torch.bool),
        feedback=[result.feedback for result in results],
        truncated=torch.zeros(rows, dtype=torch.bool),
        prompt_lengths=packed.prompt_lengths,
        completion_lengths=packed.completion_lengths,
        group_ids=torch.arange(rows),
        texts=wrong,
        samples=list(samples),
    )


@torch.no_grad()
def gold_answer_gap(
    model: nn.Module,
    tokenizer: Any,
    samples: Sequence[Mapping[str, Any]],
    cfg: SDPOChannelConfig,
    *,
    enable_thinking: bool,
    batch_size: int = 16,
) -> Tensor:
    """``float64[len(samples)]``: log p(gold answer | hinted prompt) - log p(gold answer |
    prompt) under ``model``, summed over the answer's tokens (its end of turn not counted), at
    the distillation temperature ``cfg.loss.temperature``.

    Raises:
        ValueError: when the channel gives some sample no teacher (e.g. its prompt is longer
            than ``cfg.context.max_teacher_tokens``), naming how many.
    """
    rollouts = gold_answer_rollouts(tokenizer, samples, enable_thinking=enable_thinking)
    teacher = build_sdpo_teacher_batch(rollouts, tokenizer=tokenizer, cfg=cfg)
    missing = int((~teacher.has_teacher).sum())
    if missing:
        raise ValueError(f"gold_answer_gap: {missing} of {len(samples)} samples get no teacher")
    gaps = []
    for start in range(0, len(samples), batch_size):
        rows = slice(start, start + batch_size)
        answer_lengths = rollouts.completion_lengths[rows] - 1
        student = _answer_logprob(
            model,
            rollouts.tokens[rows],
            rollouts.prompt_lengths[rows],
            answer_lengths,
            cfg.loss.temperature,
        )
        hinted = _answer_logprob(
            model,
            teacher.tokens[rows],
            teacher.prompt_lengths[rows],
            answer_lengths,
            cfg.loss.temperature,
        )
        gaps.append(hinted - student)
    return torch.cat(gaps)


def _answer_logprob(
    model: nn.Module, tokens: Tensor, starts: Tensor, lengths: Tensor, temperature: float
) -> Tensor:
    """Summed log-prob of ``tokens[b, starts[b] : starts[b] + lengths[b]]`` per right-padded row."""
    columns = torch.arange(tokens.shape[1])
    mask = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    input_pos = columns.expand_as(tokens)
    logp = sequence_logprobs(model, tokens, input_pos, mask, temperature=temperature)
    return logp.double().sum(dim=1)


@torch.no_grad()
def end_of_reply_probs(
    model: nn.Module,
    rollouts: RolloutBatch,
    teacher_batch: TeacherBatch,
    end_of_reply_token: int,
    *,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(student, teacher, teacher_top)``, each ``[N, C]`` over the completion positions of
    ``rollouts`` (``C`` its longest completion): the end-of-reply token's probability under
    the plain prompt (the student) and under ``teacher_batch``'s hinted prompt, at
    ``temperature``, and the teacher's most likely token there. Every completion token of a row
    with a teacher is read, whatever the channel distils; NaN (-1 for the top token) elsewhere.
    Position ``j`` predicts completion token ``j``: a row that ended has the end-of-reply token
    last, so its last position is where the student stopped."""
    width = max(int(rollouts.completion_lengths.max()), 1)
    lengths = torch.where(teacher_batch.has_teacher, rollouts.completion_lengths, 0)
    student_positions, mask = prediction_positions(rollouts.prompt_lengths, lengths, width=width)
    teacher_positions, _ = prediction_positions(teacher_batch.prompt_lengths, lengths, width=width)
    rows, columns = mask.nonzero(as_tuple=True)
    student = torch.full(mask.shape, float("nan"))
    teacher = torch.full(mask.shape, float("nan"))
    teacher_top = torch.full(mask.shape, -1, dtype=torch.long)
    for tokens, positions, probs in (
        (rollouts.tokens, student_positions, student),
        (teacher_batch.tokens, teacher_positions, teacher),
    ):

        def head(hidden: Tensor, output: Any, positions: Tensor = positions) -> Tensor:
            logits = output(hidden[rows, positions[rows, columns]]).float() / temperature
            return torch.log_softmax(logits, dim=-1)

        logp = model(tokens, head_fn=head)
        probs[rows, columns] = logp[:, end_of_reply_token].exp().cpu()
        if probs is teacher:
            teacher_top[rows, columns] = logp.argmax(-1).cpu()
    return student, teacher, teacher_top
