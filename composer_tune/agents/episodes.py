"""Multi-turn tool-calling episodes, batched: every live episode of a batch advances one
assistant turn per generation call (native KV-cache loop or vLLM), then its tool calls run and
the tool responses are appended as the chat template renders them.

What is trained is what was sampled: an episode's ids are the prompt, each turn's sampled ids
exactly as drawn (never re-tokenised) and, between turns, the template's tool-response ids. The
template's tokens between turns come from rendering the conversation and taking the text after
the end-of-turn token that closes the turn just sampled (split points right after a special
token tokenise the same alone as in context). Only the model's own tokens carry the loss mask.

Semantics follow TRL 1.16's ``GRPOTrainer`` tool loop: tool messages are
``{"role": "tool", "name": ..., "content": str(result)}``, failures become
``str({"error": ...})``, a turn without a tool call ends the episode, ``max_turns`` caps the
assistant turns (TRL's ``max_tool_calling_iterations`` + 1), and a tool response that would push
the episode past its token budget or the model's context is dropped and the episode ends
(flagged truncated).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_tune.agents.tools import ParsedTurn, ToolCall, call_tool, parse_tool_calls
from composer_tune.distributed import any_rank, min_over_ranks
from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.functions import ScoringBatch, prompt_text, score_completions
from composer_tune.rollout.generation import GenerationOutput, generate

# (prompts, max_new_tokens) -> one completion per prompt, GenerationOutput with log-probs.
Sampler = Callable[[list[list[int]], int], GenerationOutput]


@dataclass
class EpisodeRecord:
    """What happened in one episode, beside its ids.

    Attributes:
        turn_spans: ``[start, end)`` token columns of each assistant turn in the packed row
            (the model's own tokens, end-of-turn included).
        tool_calls: per call: ``turn``, ``name``, ``arguments``, ``content`` (the observation)
            and ``error`` (bool).
        error_turn: the turn where the episode went wrong: its first failing tool call, else
            its final answer (the turn SDPO's hint targets).
        feedback: the environment's text at ``error_turn``: the failing call's observation, or
            the reward's feedback on the final answer.
        truncated: None, or the limit the episode hit (``max_turns``, ``max_tokens_per_turn``,
            ``max_episode_tokens``, ``max_seq_len``: the model's window).
        error: why the episode could not run (its environment's ``reset`` failed, or its prompt
            alone fills the model's window); it is then unscored. None: it ran.
        conversation: the finished conversation (OpenAI messages) as the template renders it.
        env_seconds / generation_seconds: time in the environment (reset, tools) and
            this episode's share of the batched generation calls.
    """

    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error_turn: int = 0
    feedback: str = ""
    truncated: str | None = None
    error: str | None = None
    conversation: list[dict[str, Any]] = field(default_factory=list)
    env_seconds: float = 0.0
    generation_seconds: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    @property
    def tool_errors(self) -> int:
        return sum(call["error"] for call in self.tool_calls)


@dataclass
class Episode:
    """One episode's ids (prompt first), which of them the model sampled, their sampler
    log-probs, its environment instance, its prompt messages (the ``reset`` text appended),
    final answer text and record."""

    sample: Mapping[str, Any]
    environment: Any
    tools: dict[str, Callable[..., Any]]
    schemas: list[dict[str, Any]] | None
    ids: list[int]
    prompt_length: int
    model_mask: list[bool]
    logprobs: list[float]
    record: EpisodeRecord
    prompt_messages: list[dict[str, Any]] = field(default_factory=list)
    final_text: str = ""
    live: bool = True

    def completion_messages(self) -> list[dict[str, Any]]:
        """The assistant and tool messages after the prompt (TRL's ``completions`` entry)."""
        return self.record.conversation[len(self.prompt_messages) :]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int | None
    tool_timeout_s: float | None


def make_sampler(
    policy: Any,
    tokenizer: Any,
    *,
    engine: Any,
    greedy: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    sync_ranks: bool,
) -> Sampler:
    """The batched turn sampler: the vLLM ``engine`` when given, else the native loop."""
    settings = {
        "temperature": 0.0 if greedy else temperature,
        "top_k": top_k,
        "top_p": top_p,
        "stop_tokens": tokenizer.stop_tokens,
        "generator": generator,
    }

    def sample(prompts: list[list[int]], max_new_tokens: int) -> GenerationOutput:
        if engine is not None:
            return engine.generate(prompts, max_new_tokens=max_new_tokens, **settings)
        return generate(
            policy,
            prompts,
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_id,
            return_logprobs=True,
            sync_ranks=sync_ranks,
            **settings,
        )

    return sample


class EpisodeRunner:
    """Runs a batch of episodes for one tokenizer (the agent's template) and limits.

    Args:
        tokenizer: a ``ChatTokenizer`` whose template renders tool calls and tool messages.
        limits: the episode limits.
        seq_limit: the longest row generation may produce (the model's ``max_seq_len`` or the
            vLLM engine's ``max_model_len``); None: no limit beyond the token budgets.
        enable_thinking: the template switch the prompts are rendered with.
    """

    def __init__(
        self,
        tokenizer: Any,
        limits: EpisodeLimits,
        *,
        seq_limit: int | None,
        enable_thinking: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.seq_limit = seq_limit
        self.switches = {"enable_thinking": enable_thinking}
        end_of_turn = tokenizer.chat_template.end_of_turn if tokenizer.chat_template else None
        if end_of_turn is None:
            raise ValueError(
                f"{tokenizer.source}: agent episodes need a chat template with a known end of "
                "turn (set tokenizer chat_template or agent.tool_template)"
            )
        self.end_of_turn = end_of_turn
        self.end_of_turn_id = tokenizer.token_to_id(end_of_turn)

    # ------------------------------------------------------------------------- the loop

    def run(
        self,
        episodes: list[Episode],
        sampler: Sampler,
        *,
        sync_ranks: bool,
        device: torch.device | None = None,
    ) -> None:
        """Advance every episode to its end, in place: one batched generation per turn (under
        ``sync_ranks`` every rank runs equally many, with a throw-away row when it has none;
        ``device``, the model's, carries the agreement's collectives)."""
        for episode in episodes:
            if (
                episode.live
                and self.seq_limit is not None
                and episode.prompt_length >= self.seq_limit
            ):
                self._refuse_overlong_prompt(episode)
        for turn in range(self.limits.max_turns):
            live = [episode for episode in episodes if episode.live]
            for episode in live:
                if self._room(episode) < 1:
                    self._end(episode, self._binding_limit(episode))
            live = [episode for episode in live if episode.live]
            if not (any_rank(bool(live), device) if sync_ranks else live):
                return
            longest = max((len(e.ids) for e in live), default=1)
            budget = max((self._room(e) for e in live), default=self.limits.max_tokens_per_turn)
            if self.seq_limit is not None:
                budget = min(budget, self.seq_limit - longest)
            max_new = min_over_ranks(max(budget, 1), device, sync_ranks)
            prompts = [e.ids for e in live] or [[self.tokenizer.pad_id]]
            started = time.perf_counter()
            output = sampler(prompts, max_new)
            share = (time.perf_counter() - started) / max(len(live), 1)
            for row, episode in enumerate(live):
                episode.record.generation_seconds += share
                self._take_turn(
                    episode, output.completions[row], output.logprobs[row].tolist(), turn
                )

    def _refuse_overlong_prompt(self, episode: Episode) -> None:
        """A prompt that leaves the window no room to sample in: the episode ends before its
        first turn, unscored, its row cut to fit the training forward (nothing of it is
        trained: it has no model token)."""
        limit = self.seq_limit - 1
        episode.record.error = (
            f"the prompt ({episode.prompt_length} tokens, with the tool schemas) fills the "
            f"model's window ({self.seq_limit})"
        )
        episode.ids, episode.prompt_length = episode.ids[:limit], limit
        episode.model_mask, episode.logprobs = episode.model_mask[:limit], episode.logprobs[:limit]
        self._end(episode, "max_seq_len")

    def _rooms(self, episode: Episode) -> dict[str, float]:
        """Tokens the episode may still sample this turn, under each limit."""
        rooms = {"max_tokens_per_turn": self.limits.max_tokens_per_turn}
        if self.seq_limit is not None:
            rooms["max_seq_len"] = self.seq_limit - len(episode.ids)
        if self.limits.max_episode_tokens is not None:
            used = len(episode.ids) - episode.prompt_length
            rooms["max_episode_tokens"] = self.limits.max_episode_tokens - used
        return rooms

    def _room(self, episode: Episode) -> int:
        return int(min(self._rooms(episode).values()))

    def _binding_limit(self, episode: Episode) -> str:
        rooms = self._rooms(episode)
        return min(rooms, key=rooms.__getitem__)

    def _take_turn(
        self, episode: Episode, completion: list[int], logprobs: list[float], turn: int
    ) -> None:
        room, limit = self._room(episode), self._binding_limit(episode)
        cut = len(completion) > room
        completion, logprobs = completion[:room], logprobs[:room]
        start = len(episode.ids)
        episode.ids += completion
        episode.model_mask += [True] * len(completion)
        episode.logprobs += logprobs
        episode.record.turn_spans.append((start, len(episode.ids)))
        parsed = parse_tool_calls(self.tokenizer.decode(completion, skip_special_tokens=True))
        closed = bool(completion) and not cut and completion[-1] in self.tokenizer.stop_tokens
        episode.record.conversation.append(_assistant_message(parsed))
        episode.final_text = parsed.content
        if not closed:
            # Out of tokens mid-turn: the tightest limit, or the batch's shorter generation cap.
            self._end(episode, limit if cut or len(completion) >= room else "max_seq_len")
            return
        if not parsed.calls:
            self._end(episode, None)  # a final answer
            return
        if turn + 1 == self.limits.max_turns or completion[-1] != self.end_of_turn_id:
            # No turn left to read the results in (TRL leaves the last calls unexecuted), or
            # the turn ended with an EOS other than the template's end of turn.
            self._end(episode, "max_turns" if turn + 1 == self.limits.max_turns else None)
            return
        started = time.perf_counter()
        messages = [self._run_call(episode, call, turn) for call in parsed.calls]
        episode.record.env_seconds += time.perf_counter() - started
        suffix = self._response_ids(episode.record.conversation, messages, episode.schemas)
        if self.seq_limit is not None and len(episode.ids) + len(suffix) >= self.seq_limit:
            self._end(episode, "max_seq_len")  # TRL drops tool results that do not fit
            return
        used = len(episode.ids) + len(suffix) - episode.prompt_length
        if self.limits.max_episode_tokens is not None and used >= self.limits.max_episode_tokens:
            self._end(episode, "max_episode_tokens")
            return
        episode.record.conversation += messages
        episode.ids += suffix
        episode.model_mask += [False] * len(suffix)
        episode.logprobs += [0.0] * len(suffix)

    def _run_call(self, episode: Episode, call: ToolCall, turn: int) -> dict[str, Any]:
        content, failed = call_tool(episode.tools, call, self.limits.tool_timeout_s)
        record = episode.record
        if failed and not any(c["error"] for c in record.tool_calls):
            record.error_turn, record.feedback = turn, content
        record.tool_calls.append(
            {
                "turn": turn,
                "name": call.name,
                "arguments": call.arguments,
                "content": content,
                "error": failed,
            }
        )
        return {"role": "tool", "name": call.name or "unknown", "content": content}

    def _response_ids(
        self,
        conversation: list[dict[str, Any]],
        tool_messages: list[dict[str, Any]],
        schemas: list[dict[str, Any]] | None,
    ) -> list[int]:
        """The template's ids after the end of turn that closed the last assistant message:
        the tool responses and the next generation prompt. Located by counting end-of-turn
        tokens rather than by string prefix, because some templates (Qwen3) re-render the
        previous assistant turn once messages follow it (its empty think block disappears);
        that turn's ids were sampled and are kept as they are."""
        before = self.tokenizer.render(conversation, tools=schemas, **self.switches)
        after = self.tokenizer.render(
            conversation + tool_messages, tools=schemas, add_generation_prompt=True, **self.switches
        )
        closed = before.count(self.end_of_turn)
        position = -1
        for _ in range(closed):
            position = after.find(self.end_of_turn, position + 1)
            if position < 0:
                raise ValueError(
                    f"{self.tokenizer.chat_template.origin}: the chat template renders fewer "
                    f"{self.end_of_turn!r} once tool messages follow; cannot place tool responses"
                )
        return self.tokenizer.encode(after[position + len(self.end_of_turn) :])

    def _end(self, episode: Episode, truncated: str | None) -> None:
        episode.live = False
        episode.record.truncated = truncated
        if not any(call["error"] for call in episode.record.tool_calls):
            episode.record.error_turn = max(episode.record.turns - 1, 0)


def _assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    calls = [call.message_entry() for call in parsed.calls if call.error is None]
    if calls:
        message["tool_calls"] = calls
    return message


def score_episodes(episodes: Sequence[Episode], reward: Any) -> list[RewardResult]:
    """Each episode's reward, TRL's way (:class:`~composer_tune.rewards.functions.RewardFunctions`):
    the reward functions see each episode's prompt (the ``reset`` text appended), its messages
    after the prompt, its ids after the prompt, the dataset columns and the environments, and the
    environment's ``get_reward()`` is one more part of weight 1. An episode that could not run
    (``record.error``) is unscored. The record's feedback at a final-answer error turn is the
    reward's feedback, or else the environment's ``reward_feedback`` string (set by its
    ``get_reward()``, e.g. the repository environment's failing hidden test)."""
    batch = ScoringBatch(
        samples=[e.sample for e in episodes],
        texts=[e.final_text for e in episodes],
        completion_ids=[e.ids[e.prompt_length :] for e in episodes],
        prompts=[
            prompt_text(e.sample) or [dict(message) for message in e.prompt_messages]
            for e in episodes
        ],
        completions=[
            e.final_text if prompt_text(e.sample) is not None else e.completion_messages()
            for e in episodes
        ],
        # An episode that could not run has no environment state to score.
        environments=(
            [e.environment if e.record.error is None else None for e in episodes]
            if any(e.environment is not None for e in episodes)
            else None
        ),
    )
    scored: list[RewardResult] = []
    for episode, result in zip(episodes, score_completions(reward, batch), strict=True):
        if episode.record.error is not None:
            result = RewardResult(math.nan, None, episode.record.error)
        else:
            # Optional, beyond TRL's contract: the environment's own verdict text (e.g. the
            # failing hidden test) when the recipe reward has none, as the episode's feedback.
            env_feedback = getattr(episode.environment, "reward_feedback", "")
            if isinstance(env_feedback, str) and env_feedback and not result.feedback:
                result = RewardResult(result.score, result.correct, env_feedback)
            if not any(call["error"] for call in episode.record.tool_calls):
                episode.record.feedback = result.feedback
        scored.append(result)
    return scored
