"""Group rollouts for GRPO-family training: sample, score, pack, and compute old log-probs.

For a batch of prompts (dataset samples), :func:`collect_rollouts` samples ``group_size``
completions per prompt with the KV-cache generator (or a vLLM engine), scores the decoded texts
with a verifiable reward, packs prompt + completion rows into one right-padded batch, and
recomputes the sampling policy's per-token log-probabilities with a no-grad chunked forward
(plus a frozen reference model's, when one is given). The result is a :class:`RolloutBatch`.

Every per-token tensor of a ``RolloutBatch`` is ``[N, T]`` in the *target* frame of
:class:`~composer_tune.rollout.generation.PackedBatch`: column ``t`` describes token
``tokens[:, t]`` as predicted from position ``t - 1``. ``completion_mask[:, t]`` marks the
completion tokens, ``old_logp[:, t]`` is ``log pi_old(tokens[:, t] | tokens[:, :t])`` there and 0
elsewhere (column 0, which has no predecessor, is always 0). :func:`sequence_logprobs` returns
the same frame for the training forward, so ``logp``, ``old_logp``, ``ref_logp`` and
``completion_mask`` line up element for element.

Log-probabilities are taken at the sampling temperature (logits / temperature), as TRL does, so
that with one optimisation step per generation the importance ratio starts at exactly 1.
Top-k / top-p truncation is not reflected in them (TRL does not either).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from dataclasses import field as dataclass_field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from composer_tune.distributed import all_reduce_sum
from composer_tune.losses.logprobs import IGNORE_INDEX, logprob_head
from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.functions import ScoringBatch
from composer_tune.rollout.generation import encode_prompts, pack_sequences
from composer_tune.rollout.shared_prefix import shared_prefix_logprobs
from composer_tune.rollout.window import generate_in_window, model_window, score_in_window

if TYPE_CHECKING:
    from composer_tune.agents.episodes import EpisodeRecord


@dataclass
class RolloutBatch:
    """``N = num_prompts * group_size`` completions, grouped: rows ``g*G .. g*G + G - 1`` answer
    prompt ``g``.

    Attributes:
        tokens: ``long[N, T]`` prompt + completion, right-padded with the pad id.
        input_pos: ``long[N, T]`` position ids (``t`` in column ``t``).
        completion_mask: ``bool[N, T]`` True where ``tokens[:, t]`` is a completion token, i.e. a
            training target predicted from position ``t - 1``.
        old_logp: ``float32[N, T]`` log-prob of each target under the sampling policy (0 off the
            mask), computed without grad; None when not asked for (an on-policy step uses the
            detached current log-probs instead, as TRL does, and skips this forward).
        ref_logp: same under the reference model, or None when no reference was given.
        rewards: ``float32[N]`` reward scores.
        correct: ``bool[N]`` task success (False where the reward has no notion of it).
        feedback: the verifier's message per completion (for SDPO's teacher hints).
        truncated: ``bool[N]`` the completion hit ``max_new_tokens`` (an episode: one of its
            limits) without a stop token.
        prompt_lengths: ``long[N]`` prompt tokens per row.
        completion_lengths: ``long[N]`` completion tokens per row.
        group_ids: ``long[N]`` index of the row's prompt within this batch.
        texts: decoded completions (special tokens skipped), as the reward saw them.
        samples: the dataset sample each row answers (the same object ``group_size`` times).
        correct_known: ``bool[N]`` whether the reward judged success for the row (its
            ``RewardResult.correct`` was not None), so consumers such as SDPO's hint selection
            can fall back to a score threshold; None means known for every row.
        sampling_logp: ``float32[N, T]`` each target's log-prob as the sampler reported it
            while drawing it (0 off the mask), for the sampler/trainer gap and its correction;
            None when the sampler gave none.
        episodes: for agent episodes (``composer_tune.agents``), each row's
            :class:`~composer_tune.agents.EpisodeRecord` (turn spans, tool calls and errors,
            error turn and its feedback, timings); None for single-turn rollouts. The row's
            ``completion_mask`` then covers only the model's own turns, never tool output.
        window_truncated: ``bool[N]`` the model's window (``max_seq_len``, a vLLM engine's
            ``max_model_len``) stopped the row: it was cut there (and is ``truncated``), or its
            prompt alone filled the window (no completion, unscored); None: never.
        policy_version: ``long[N]`` the optimiser step whose weights sampled each row, for rows
            a rollout worker or server sampled (``composer_tune.rollout.async_rollouts``);
            None: the trainer's current weights sampled them.
        draw_metrics: how the batch's prompts were chosen (the task sampler's metrics, and
            dynamic sampling's), logged with the rollout metrics; a whole-batch field that
            :meth:`select` copies.
        sampled_tokens: the completion tokens this rank sampled to make the batch where that is
            more than it holds (dynamic sampling's dropped groups); None: its own, the
            ``completion_mask`` count. A whole-batch field that :meth:`select` leaves out.
    """

    tokens: Tensor
    input_pos: Tensor
    completion_mask: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None
    rewards: Tensor
    correct: Tensor
    feedback: list[str]
    truncated: Tensor
    prompt_lengths: Tensor
    completion_lengths: Tensor
    group_ids: Tensor
    texts: list[str]
    samples: list[Mapping[str, Any]]
    correct_known: Tensor | None = None
    sampling_logp: Tensor | None = None
    episodes: list[EpisodeRecord] | None = None
    window_truncated: Tensor | None = None
    policy_version: Tensor | None = None
    draw_metrics: dict[str, float] = dataclass_field(default_factory=dict)
    sampled_tokens: float | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def scored(results: Sequence[RewardResult], device: torch.device) -> dict[str, Any]:
        """The per-row fields a reward's results fill: ``rewards``, ``correct``, ``feedback``
        and ``correct_known``."""
        return {
            "rewards": torch.tensor([r.score for r in results], dtype=torch.float32, device=device),
            "correct": torch.tensor([bool(r.correct) for r in results], device=device),
            "feedback": [r.feedback for r in results],
            "correct_known": torch.tensor([r.correct is not None for r in results], device=device),
        }

    def select(self, rows: slice) -> RolloutBatch:
        """The rows ``rows`` as a new batch, with trailing all-padding columns dropped.

        Group ids are kept as they are, so a slice that cuts through a group still says which
        prompt each row answers.
        """
        picked: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name not in _WHOLE_BATCH_FIELDS:
                picked[field.name] = value[rows] if value is not None else None
        width = int((picked["prompt_lengths"] + picked["completion_lengths"]).max())
        for name in _COLUMN_FIELDS:
            if picked[name] is not None:
                picked[name] = picked[name][:, :width]
        return RolloutBatch(**picked, draw_metrics=dict(self.draw_metrics))

    @classmethod
    def cat(cls, parts: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
        """The rows of ``parts`` in order as one batch, right-padded to the widest row
        (``tokens`` with ``pad_id``, masks False, log-probs 0); each part's prompts are numbered
        after the previous part's, so rows of different batches never share a group. The
        whole-batch fields are left at their defaults."""
        if not parts:
            raise ValueError("RolloutBatch.cat: no batches to join")
        width = max(part.tokens.shape[1] for part in parts)
        joined: dict[str, Any] = {}
        for field in fields(cls):
            name = field.name
            values = [getattr(part, name) for part in parts]
            if name in _WHOLE_BATCH_FIELDS:
                continue
            if all(value is None for value in values):
                joined[name] = None
            elif any(value is None for value in values):
                raise ValueError(f"RolloutBatch.cat: {name} is set in some batches only")
            elif name == "group_ids":
                joined[name] = torch.cat(_numbered_after(values))
            elif name in _COLUMN_FIELDS:
                joined[name] = torch.cat([_widened(name, v, width, pad_id) for v in values])
            elif isinstance(values[0], Tensor):
                joined[name] = torch.cat(values)
            else:  # per-row lists
                joined[name] = [item for value in values for item in value]
        return cls(**joined)

    def micro_batches(self, micro_batch_size: int) -> list[RolloutBatch]:
        """Consecutive row slices of at most ``micro_batch_size`` rows (the last may be shorter).

        Raises:
            ValueError: if ``micro_batch_size`` is not positive.
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [
            self.select(slice(start, start + micro_batch_size))
            for start in range(0, len(self), micro_batch_size)
        ]


# [N, T] fields in the target frame (the module docstring), and fields of the whole batch.
_COLUMN_FIELDS = ("tokens", "input_pos", "completion_mask", "old_logp", "ref_logp", "sampling_logp")
_WHOLE_BATCH_FIELDS = ("draw_metrics", "sampled_tokens")


def _widened(name: str, value: Tensor, width: int, pad_id: int) -> Tensor:
    """The ``[N, T]`` field ``name`` right-padded to ``width`` columns as packing pads it."""
    extra = width - value.shape[1]
    if extra == 0:
        return value
    if name == "input_pos":  # position t in column t
        columns = torch.arange(value.shape[1], width, device=value.device, dtype=value.dtype)
        return torch.cat([value, columns.expand(value.shape[0], extra)], dim=1)
    fill = pad_id if name == "tokens" else 0
    return F.pad(value, (0, extra), value=fill)


def _numbered_after(group_ids: list[Tensor]) -> list[Tensor]:
    """Each batch's group ids renumbered 0, 1, ... in order of appearance, after the previous
    batch's."""
    numbered, offset = [], 0
    for ids in group_ids:
        _, index = torch.unique_consecutive(ids, return_inverse=True)
        numbered.append(index + offset)
        offset += int(index.max()) + 1 if ids.numel() else 0
    return numbered


def sequence_logprobs(
    model: nn.Module,
    tokens: Tensor,
    input_pos: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-target log-probs of the completion tokens in the rollout (target) frame.

    Runs ``model`` on ``tokens[:, :-1]`` with the chunked :func:`logprob_head`, so full
    ``[N, T, V]`` logits never exist, and shifts the result right by one column: entry
    ``[:, t]`` is ``log softmax(logits[:, t - 1] / temperature)[tokens[:, t]]`` where
    ``completion_mask[:, t]``, else 0. Grad flows when it is enabled by the caller.

    Args:
        model: a decoder accepting ``forward(tokens, input_pos=..., head_fn=...)``.
        tokens: ``long[N, T]`` right-padded rows (``T >= 2``).
        input_pos: ``long[N, T]`` position ids.
        completion_mask: ``bool[N, T]`` the targets to score.
        temperature: logits are divided by it (the sampling temperature).
        chunk_size: rows per chunk of the log-prob head.
        return_entropy: also return each target position's entropy, same frame (0 at column 0).

    Returns:
        ``float32[N, T]`` log-probs, or ``(logprobs, entropy)``.
    """
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"sequence_logprobs: tokens must be [N, T] with T >= 2, got {tokens.shape}"
        )
    if completion_mask.shape != tokens.shape or input_pos.shape != tokens.shape:
        raise ValueError(
            f"sequence_logprobs: completion_mask {tuple(completion_mask.shape)} and input_pos "
            f"{tuple(input_pos.shape)} must match tokens {tuple(tokens.shape)}"
        )
    targets = torch.where(completion_mask[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    head = logprob_head(
        targets, chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy
    )
    output = model(tokens[:, :-1], input_pos=input_pos[:, :-1], head_fn=head)
    # Column 0 has no predecessor: pad it with 0 to return to the [N, T] target frame.
    if return_entropy:
        logprobs, entropy = output
        return F.pad(logprobs, (1, 0)), F.pad(entropy, (1, 0))
    return F.pad(output, (1, 0))


def rollout_logprobs(
    model: nn.Module,
    rows: RolloutBatch,
    *,
    shared_prefix: bool,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    row_head: Callable[[Tensor, Any], Any] | None = None,
) -> Any:
    """The training (or old/reference) log-prob forward of ``rows``, one call for either path:
    :func:`~composer_tune.rollout.shared_prefix.shared_prefix_logprobs` (each group's prompt
    run once) with ``shared_prefix``, else :func:`sequence_logprobs`. Both return the same
    ``[N, T]`` frame; see the shared-prefix module for the entropy off the completion mask. Rows
    without a completion token (nothing to share) take the plain forward.

    ``row_head`` (e.g. SDPO's distillation head) runs in the same forward on the hidden states
    in the plain forward's layout (``[N, T - 1, D]``, the state predicting token ``t`` at column
    ``t - 1``) and the output module; its result follows the log-probs: ``(result, its)``.
    """
    settings = {
        "temperature": temperature,
        "chunk_size": chunk_size,
        "return_entropy": return_entropy,
    }
    if shared_prefix and bool(rows.completion_mask.any()):
        return shared_prefix_logprobs(
            model,
            rows.tokens,
            rows.input_pos,
            rows.completion_mask,
            group_ids=rows.group_ids,
            prompt_lengths=rows.prompt_lengths,
            row_head=row_head,
            **settings,
        )
    inputs = (rows.tokens, rows.input_pos, rows.completion_mask)
    if row_head is None:
        return sequence_logprobs(model, *inputs, **settings)
    captured: dict[str, Any] = {}

    def both_heads(tokens: Tensor, *, input_pos: Tensor, head_fn: Callable) -> Any:
        """The model, with ``row_head`` run on the same hidden states as ``head_fn``."""

        def head(hidden: Tensor, output: Any) -> Any:
            captured["row"] = row_head(hidden, output)
            return head_fn(hidden, output)

        return model(tokens, input_pos=input_pos, head_fn=head)

    return sequence_logprobs(both_heads, *inputs, **settings), captured["row"]


@torch.no_grad()
def _batched_logprobs(
    model: nn.Module,
    tokens: Tensor,
    input_pos: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float,
    chunk_size: int,
    forward_batch_size: int,
    group_ids: Tensor | None = None,
    prompt_lengths: Tensor | None = None,
) -> Tensor:
    """No-grad log-probs over row slices of ``forward_batch_size``, in eval mode:
    :func:`sequence_logprobs`, or the shared-prefix forward when ``group_ids`` and
    ``prompt_lengths`` give the rows' groups.

    Eval mode: the sampled tokens came from the model with dropout off, so their log-probs must
    be taken with it off too.
    """
    was_training = model.training
    model.eval()
    parts = []
    try:
        for start in range(0, tokens.shape[0], forward_batch_size):
            rows = slice(start, start + forward_batch_size)
            args = (model, tokens[rows], input_pos[rows], completion_mask[rows])
            kwargs = {"temperature": temperature, "chunk_size": chunk_size}
            if group_ids is None or prompt_lengths is None or not completion_mask[rows].any():
                parts.append(sequence_logprobs(*args, **kwargs))
            else:
                groups = {"group_ids": group_ids[rows], "prompt_lengths": prompt_lengths[rows]}
                parts.append(shared_prefix_logprobs(*args, **groups, **kwargs))
    finally:
        model.train(was_training)
    return torch.cat(parts).float()


def batch_logprobs(
    model: nn.Module,
    rows: RolloutBatch,
    *,
    temperature: float,
    chunk_size: int,
    forward_batch_size: int,
    shared_prefix: bool,
) -> Tensor:
    """No-grad log-probs of ``rows``' completion tokens under ``model``, in the target frame:
    the old or reference pass over rows sampled elsewhere (a rollout worker's)."""
    return _batched_logprobs(
        model,
        rows.tokens,
        rows.input_pos,
        rows.completion_mask,
        temperature=temperature,
        chunk_size=chunk_size,
        forward_batch_size=forward_batch_size,
        group_ids=rows.group_ids if shared_prefix else None,
        prompt_lengths=rows.prompt_lengths if shared_prefix else None,
    )


def collect_rollouts(
    policy: nn.Module,
    tokenizer: Any,
    samples: Sequence[Mapping[str, Any]],
    reward: Any,
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    reference: nn.Module | None = None,
    enable_thinking: bool = False,
    logprob_chunk_size: int = 1024,
    forward_batch_size: int | None = None,
    sync_ranks: bool = False,
    compute_old_logp: bool = True,
    engine: Any = None,
    shared_prefix: bool = False,
) -> RolloutBatch:
    """Sample ``group_size`` completions for each of ``samples``, score and pack them.

    Args:
        policy: the current policy (also the sampling policy).
        tokenizer: a :class:`~composer_tune.data.tokenizer.ChatTokenizer`-like object
            (``tokenize_messages``, ``decode``, ``pad_id``, ``stop_tokens``).
        samples: dataset samples with a chat ``prompt`` and whatever the reward reads.
        reward: scores the completions (a ``RewardFunctions``, a project reward or a TRL
            reward function; :func:`~composer_tune.rewards.functions.score_completions`).
        group_size: completions per prompt (G >= 1; GRPO needs G >= 2 for any advantage).
        max_new_tokens: completion length cap; rows that reach it without a stop token are
            flagged ``truncated``. It is cut to the room left in the model's window
            (:func:`generate_in_window`); a prompt that fills the window gets no completion and
            is unscored.
        temperature, top_k, top_p: sampling settings (``temperature > 0``).
        generator: source of sampling randomness (save its state to resume reproducibly).
        reference: frozen reference model; its log-probs fill ``ref_logp`` (None: no reference
            forward at all).
        enable_thinking: Qwen3 chat-template thinking switch for the prompts.
        logprob_chunk_size: rows per chunk of the log-prob head.
        forward_batch_size: rows per no-grad log-prob forward (None: all at once).
        sync_ranks: passed to ``generate`` under torchrun, so FSDP ranks run equally many
            forwards (sharded forwards are collectives).
        compute_old_logp: run the no-grad forward that fills ``old_logp``; off-policy steps
            (several per generation batch) and KL-in-reward need it, a single on-policy step
            does not.
        engine: a :class:`~composer_tune.rollout.vllm_engine.VLLMEngine` holding the policy's
            current weights samples the completions instead of ``policy`` (None: the native
            KV-cache loop); ``generator`` then seeds each batch.
        shared_prefix: the old and reference log-prob forwards run each group's prompt once
            (:mod:`composer_tune.rollout.shared_prefix`); same values up to float rounding.

    Returns:
        A :class:`RolloutBatch` of ``len(samples) * group_size`` rows, on the policy's device.
    """

    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 for rollouts (a group of greedy copies has no spread), "
            f"got {temperature}"
        )
    if not samples:
        raise ValueError("samples is empty: need at least one prompt")
    if forward_batch_size is not None and forward_batch_size < 1:
        raise ValueError(f"forward_batch_size must be >= 1 or None, got {forward_batch_size}")

    prompts = encode_prompts(tokenizer, samples, enable_thinking=enable_thinking)
    row_prompts = [prompt for prompt in prompts for _ in range(group_size)]
    row_samples = [sample for sample in samples for _ in range(group_size)]
    sampling = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "stop_tokens": tokenizer.stop_tokens,
        "generator": generator,
    }
    windowed = generate_in_window(
        policy,
        row_prompts,
        max_new_tokens=max_new_tokens,
        pad_id=tokenizer.pad_id,
        engine=engine,
        sync_ranks=sync_ranks,
        **sampling,
    )
    output = windowed.output
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in output.completions]
    results = score_in_window(
        reward, ScoringBatch(row_samples, texts, output.completions), windowed.over_window
    )
    window = model_window(policy, engine)
    # A prompt that filled the window keeps what the training forward can take (nothing of
    # its row is trained: it has no completion).
    row_prompts = [
        prompt[: window - 1] if over else prompt
        for prompt, over in zip(row_prompts, windowed.over_window, strict=True)
    ]

    packed = pack_sequences(row_prompts, output.completions, tokenizer.pad_id)
    device = next(policy.parameters()).device
    tokens = packed.tokens.to(device)
    input_pos = packed.input_pos.to(device)
    completion_mask = packed.completion_mask.to(device)
    # The sampler's log-probs, into the target frame: row i's completion tokens are its True
    # columns of the mask, in order.
    sampling_logp = torch.zeros(completion_mask.shape, dtype=torch.float32)
    sampling_logp[packed.completion_mask] = torch.cat(output.logprobs).float()
    group_ids = torch.arange(len(samples), device=device).repeat_interleave(group_size)
    prompt_lengths = packed.prompt_lengths.to(device)
    logprob_args = {
        "temperature": temperature,
        "chunk_size": logprob_chunk_size,
        "forward_batch_size": forward_batch_size or len(row_prompts),
        "group_ids": group_ids if shared_prefix else None,
        "prompt_lengths": prompt_lengths if shared_prefix else None,
    }
    old_logp = (
        _batched_logprobs(policy, tokens, input_pos, completion_mask, **logprob_args)
        if compute_old_logp
        else None
    )
    ref_logp = (
        _batched_logprobs(reference, tokens, input_pos, completion_mask, **logprob_args)
        if reference is not None
        else None
    )
    return RolloutBatch(
        tokens=tokens,
        input_pos=input_pos,
        completion_mask=completion_mask,
        old_logp=old_logp,
        ref_logp=ref_logp,
        truncated=output.truncated.to(device),
        prompt_lengths=prompt_lengths,
        completion_lengths=packed.completion_lengths.to(device),
        group_ids=group_ids,
        texts=texts,
        samples=row_samples,
        sampling_logp=sampling_logp.to(device),
        window_truncated=torch.tensor(windowed.window_truncated, device=device),
        **RolloutBatch.scored(results, device),
    )


def rollout_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """Reward, accuracy, length, truncation and group statistics over every rank's rollouts
    (collective). Reward statistics are over the scored rows; ``reward/unscored`` is the
    fraction whose reward is NaN (the reward could not score them: zero advantage).
    ``groups/zero_reward_std`` is the share of groups whose scored rewards are all equal (fewer
    than two count as equal), so GRPO's advantage is zero for every row (TRL's
    ``frac_reward_zero_std``); ``groups/no_correct`` the share with no correct row, where a
    group has no success of its own to learn from (SDPO's premise)."""
    rewards = rollout.rewards.double()
    scored = ~torch.isnan(rewards)
    scored_rewards = torch.where(scored, rewards, torch.zeros_like(rewards))
    lengths = rollout.completion_lengths.double()
    groups = rollout.group_ids.long()
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    lowest = torch.full((num_groups,), math.inf, dtype=torch.float64, device=rewards.device)
    lowest = lowest.scatter_reduce(0, groups, torch.where(scored, rewards, math.inf), "amin")
    highest = torch.full_like(lowest, -math.inf)
    highest = highest.scatter_reduce(0, groups, torch.where(scored, rewards, -math.inf), "amax")
    correct_per_group = torch.zeros_like(lowest).index_add(0, groups, rollout.correct.double())
    sums = torch.stack(
        [
            torch.tensor(float(len(rollout)), dtype=torch.float64, device=rewards.device),
            scored.double().sum(),
            scored_rewards.sum(),
            scored_rewards.square().sum(),
            rollout.correct.double().sum(),
            lengths.sum(),
            rollout.truncated.double().sum(),
            _window_truncated(rollout).double().sum(),
            torch.tensor(float(num_groups), dtype=torch.float64, device=rewards.device),
            (~(highest > lowest)).double().sum(),
            (correct_per_group == 0).double().sum(),
        ]
    )
    (
        count, num_scored, reward_sum, reward_sq, correct, length_sum, truncated,
        window_truncated, group_count, zero_std_groups, no_correct_groups,
    ) = all_reduce_sum(sums).tolist()  # fmt: skip
    mean = reward_sum / max(num_scored, 1.0)
    metrics = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(reward_sq / max(num_scored, 1.0) - mean**2, 0.0)),
        "reward/unscored": (count - num_scored) / count,
        "accuracy": correct / count,
        "completion_length/mean": length_sum / count,
        "truncation_rate": truncated / count,
        "window_truncation_rate": window_truncated / count,
        "groups/zero_reward_std": zero_std_groups / max(group_count, 1.0),
        "groups/no_correct": no_correct_groups / max(group_count, 1.0),
    }
    episodes = getattr(rollout, "episodes", None)  # duck-typed batches may lack the field
    if episodes is not None:
        metrics.update(episode_metrics(episodes, "episode/", rewards.device))
    metrics.update(getattr(rollout, "draw_metrics", None) or {})
    return metrics


def _window_truncated(rollout: RolloutBatch) -> Tensor:
    """``bool[N]``: the rows the model's window stopped (none when the batch does not say)."""
    flags = getattr(rollout, "window_truncated", None)  # duck-typed batches may lack the field
    return flags if flags is not None else torch.zeros_like(rollout.truncated, dtype=torch.bool)


def episode_metrics(records: Sequence[EpisodeRecord], prefix: str, device: Any) -> dict[str, float]:
    """Per-episode means over every rank (collective): turns, tool calls, tool errors, the
    truncated share, the share the model's window stopped (``window_truncated``), the share that
    could not run (``errors``: a failed ``reset``, a prompt filling the window), and seconds in the
    environment vs in generation."""
    names = (
        "turns",
        "tool_calls",
        "tool_errors",
        "truncated",
        "window_truncated",
        "errors",
        "env_seconds",
        "generation_seconds",
    )
    sums = torch.tensor(
        [
            float(len(records)),
            sum(r.turns for r in records),
            sum(len(r.tool_calls) for r in records),
            sum(r.tool_errors for r in records),
            sum(r.truncated is not None for r in records),
            sum(r.truncated == "max_seq_len" for r in records),
            sum(r.error is not None for r in records),
            sum(r.env_seconds for r in records),
            sum(r.generation_seconds for r in records),
        ],
        dtype=torch.float64,
        device=device,
    )
    count, *totals = all_reduce_sum(sums).tolist()
    return {
        prefix + name: total / max(count, 1.0) for name, total in zip(names, totals, strict=True)
    }
