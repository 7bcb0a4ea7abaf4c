"""The ``agent:`` section of an RL recipe config, built once at set-up: :func:`build_agent`.

```yaml
agent:
  environment:                     # TRL's environment_factory: one instance per episode
    _component_: composer_tune.agents.coding.CodingEnvironment
    timeout_s: 5                   # constructor arguments
  # or several, chosen per sample by its "environment" key (TRL's dict of factories):
  # environment: {calc: {_component_: ...}, code: {_component_: ...}}
  tools: [composer_tune.agents.calculator.calculate]   # TRL's tools=[...]: plain functions
  max_turns: 4                     # assistant turns per episode
  max_tokens_per_turn: 64
  max_episode_tokens: 256          # sampled + tool tokens after the prompt (null: no cap)
  tool_timeout_s: 10               # per tool call
  tool_template: null              # null: the tokenizer's template; hermes: ChatML + Hermes
```
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from composer_tune.agents.episodes import (
    Episode,
    EpisodeLimits,
    EpisodeRecord,
    EpisodeRunner,
    make_sampler,
    score_episodes,
)
from composer_tune.agents.tools import environment_tools, tool_schemas
from composer_tune.rewards.base import RewardResult
from composer_tune.rollout.rollouts import RolloutBatch, _batched_logprobs
from composer_tune.rollout.window import model_window
from composer_tune.user_code import call_with_timeout, resolve_path

_KEYS = {
    "environment",
    "tools",
    "max_turns",
    "max_tokens_per_turn",
    "max_episode_tokens",
    "tool_timeout_s",
    "tool_template",
}
# The sample key that picks an environment when several are configured (TRL's name).
ENVIRONMENT_KEY = "environment"


def _factory(node: Any, where: str) -> Callable[[], Any]:
    """An environment factory from a dotted class path or a ``_component_`` node (its other
    keys are constructor arguments; ``_partial_`` is accepted and implied)."""
    if isinstance(node, str):
        node = {"_component_": node}
    if not isinstance(node, Mapping) or not isinstance(node.get("_component_"), str):
        raise ValueError(
            f"{where}: expected a class path or a mapping with _component_, got {node!r}"
        )
    kwargs = {k: v for k, v in node.items() if k not in ("_component_", "_partial_")}
    cls = resolve_path(node["_component_"], where)
    if not callable(cls):
        raise ValueError(f"{where}: {node['_component_']!r} is not callable")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise ValueError(f"{where}: {node['_component_']} does not take {kwargs}: {err}") from err
    return functools.partial(cls, **kwargs)


@dataclass
class AgentRuntime:
    """Environments, tools and limits of a recipe's agent episodes.

    Attributes:
        factories: environment name -> factory (None: a single unnamed environment), or None
            when the tools alone make the episode.
        tools: standalone tool functions, exposed in every episode before the environment's.
        limits: turns, token budgets and the per-call tool timeout.
        tool_template: None (the tokenizer's chat template) or a template name/path for
            ``ChatTokenizer.with_chat_template``.
        environment_schemas: each environment's tool schemas (from the instance probed at
            set-up), for rendering prompts without starting an episode.
        environment_reward: some environment defines ``get_reward()`` (then it is a reward, and
            the only one when no reward function is configured: TRL's rule).
    """

    factories: dict[str | None, Callable[[], Any]] | None
    tools: list[Callable[..., Any]]
    limits: EpisodeLimits
    tool_template: str | None = None
    environment_schemas: dict[str | None, list[dict[str, Any]]] = field(default_factory=dict)
    environment_reward: bool = False

    def __post_init__(self) -> None:
        self._tokenizers: dict[int, Any] = {}

    def tokenizer_for(self, tokenizer: Any) -> Any:
        """The tokenizer episodes render with: ``tokenizer`` itself or, with a
        ``tool_template``, a copy using that template (cached per tokenizer)."""
        if self.tool_template is None:
            return tokenizer
        key = id(tokenizer)
        if key not in self._tokenizers:
            self._tokenizers[key] = tokenizer.with_chat_template(self.tool_template)
        return self._tokenizers[key]

    def start(
        self, samples: Sequence[Mapping[str, Any]], tokenizer: Any, enable_thinking: bool
    ) -> list[Episode]:
        """One fresh episode per sample: a new environment instance, ``reset(**sample)`` (its
        string appended to the last user message, as TRL does), the tool schemas and the
        prompt ids (chat template with the tools and the generation prompt). A ``reset`` that
        raises or outlasts ``tool_timeout_s`` ends its episode before it starts (``record.error``;
        unscored)."""
        episodes = []
        for sample in samples:
            environment, tools = None, list(self.tools)
            conversation = [dict(message) for message in sample["prompt"]]
            record = EpisodeRecord()
            if self.factories is not None:
                environment = self._environment_for(sample)
                reset_kwargs = dict(sample)
                if None not in self.factories:  # the selector is control data, as in TRL
                    reset_kwargs.pop(ENVIRONMENT_KEY, None)
                started = time.perf_counter()
                outcome = call_with_timeout(
                    functools.partial(environment.reset, **reset_kwargs),
                    self.limits.tool_timeout_s,
                    name=f"{type(environment).__name__}.reset",
                )
                record.env_seconds += time.perf_counter() - started
                if outcome.failure is not None:
                    record.error = f"{type(environment).__name__}.reset {outcome.failure}"
                    record.feedback = record.error
                elif isinstance(outcome.value, str):
                    last = conversation[-1]
                    conversation[-1] = {
                        **last,
                        "content": (last.get("content") or "") + outcome.value,
                    }
                tools += environment_tools(environment)
            schemas = tool_schemas(tools) or None
            ids = tokenizer.tokenize_messages(
                conversation,
                tools=schemas,
                add_generation_prompt=True,
                enable_thinking=enable_thinking,
            )[0]
            record.conversation = conversation
            episodes.append(
                Episode(
                    sample=sample,
                    environment=environment,
                    tools={tool.__name__: tool for tool in tools},
                    schemas=schemas,
                    ids=list(ids),
                    prompt_length=len(ids),
                    model_mask=[False] * len(ids),
                    logprobs=[0.0] * len(ids),
                    record=record,
                    prompt_messages=[dict(message) for message in conversation],
                    live=record.error is None,
                )
            )
        return episodes

    def _environment_name(self, sample: Mapping[str, Any]) -> str | None:
        assert self.factories is not None
        if None in self.factories:
            return None
        name = sample.get(ENVIRONMENT_KEY)
        if name not in self.factories:
            raise ValueError(
                f"sample {sample.get('id', '')!r} has {ENVIRONMENT_KEY}={name!r}, not among the "
                f"configured environments {sorted(self.factories)}"
            )
        return name

    def _environment_for(self, sample: Mapping[str, Any]) -> Any:
        assert self.factories is not None
        return self.factories[self._environment_name(sample)]()

    def prompt_ids(
        self, sample: Mapping[str, Any], tokenizer: Any, enable_thinking: bool
    ) -> list[int]:
        """The ids an episode of ``sample`` starts from, without starting one (no environment
        is built or reset, so a ``reset`` text is not in them): the prompt with every tool
        schema the episode would show, in the agent's template. ``tokenizer``: the recipe's."""
        schemas = tool_schemas(self.tools)
        if self.factories is not None:
            schemas += self.environment_schemas[self._environment_name(sample)]
        return self.tokenizer_for(tokenizer).tokenize_messages(
            sample["prompt"],
            tools=schemas or None,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )[0]

    def run(
        self,
        policy: nn.Module,
        tokenizer: Any,
        samples: Sequence[Mapping[str, Any]],
        reward: Any,
        *,
        greedy: bool,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        engine: Any = None,
        sync_ranks: bool = False,
        enable_thinking: bool = False,
    ) -> tuple[list[Episode], list[RewardResult]]:
        """Run one episode per sample to its end and score it. ``tokenizer`` is the recipe's
        (the agent's template is applied here)."""
        tokenizer = self.tokenizer_for(tokenizer)
        episodes = self.start(samples, tokenizer, enable_thinking)
        runner = EpisodeRunner(
            tokenizer,
            self.limits,
            seq_limit=model_window(policy, engine),
            enable_thinking=enable_thinking,
        )
        sampler = make_sampler(
            policy,
            tokenizer,
            engine=engine,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            sync_ranks=sync_ranks,
        )
        runner.run(
            episodes, sampler, sync_ranks=sync_ranks, device=next(policy.parameters()).device
        )
        return episodes, score_episodes(episodes, reward)


def _positive_int(section: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = section.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"agent.{key} must be a positive integer, got {value!r}")
    return value


def _check_schemas(tools: Sequence[Callable[..., Any]], where: str) -> None:
    try:
        tool_schemas(tools)
    except Exception as err:  # transformers' schema errors name the tool and its docstring
        raise ValueError(f"{where}: a tool has no usable schema: {err}") from err


def build_agent(section: DictConfig | Mapping[str, Any] | None) -> AgentRuntime | None:
    """The recipe's agent from its ``agent:`` section (see the module doc); None for None.

    Every environment is probed once (as TRL does): it must construct, define ``reset``, and
    its tools must have schemas, so a bad section fails at set-up with a ValueError naming it.
    """
    if section is None:
        return None
    if isinstance(section, DictConfig):
        section = OmegaConf.to_container(section, resolve=True)
    if not isinstance(section, Mapping):
        raise ValueError(f"agent: expected a mapping, got {section!r}")
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ValueError(f"agent: unknown keys {unknown}; the section takes {sorted(_KEYS)}")
    tools = [resolve_path(path, "agent.tools") for path in section.get("tools") or []]
    for tool in tools:
        if not callable(tool):
            raise ValueError(f"agent.tools: {tool!r} is not callable")
    factories = None
    node = section.get("environment")
    if node is not None:
        named = isinstance(node, Mapping) and "_component_" not in node
        items = node.items() if named else [(None, node)]
        factories = {
            name: _factory(value, f"agent.environment{'.' + name if name else ''}")
            for name, value in items
        }
    if not tools and factories is None:
        raise ValueError("agent: needs an environment, tools, or both")
    _check_schemas(tools, "agent.tools")
    environment_schemas: dict[str | None, list[dict[str, Any]]] = {}
    environment_reward = False
    for name, factory in (factories or {}).items():
        where = f"agent.environment{'.' + name if name else ''}"
        try:
            probe = factory()
        except Exception as err:  # the user's constructor: name it, whatever it raised
            raise ValueError(f"{where}: constructing the environment failed: {err!r}") from err
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"{where}: {type(probe).__name__} has no callable reset()")
        _check_schemas(environment_tools(probe), where)
        environment_schemas[name] = tool_schemas(environment_tools(probe))
        environment_reward |= callable(getattr(probe, "get_reward", None))
    limits = EpisodeLimits(
        max_turns=_positive_int(section, "max_turns", 4),
        max_tokens_per_turn=_positive_int(section, "max_tokens_per_turn", 128),
        max_episode_tokens=_positive_int(section, "max_episode_tokens", None),
        tool_timeout_s=section.get("tool_timeout_s", 10.0),
    )
    return AgentRuntime(
        factories=factories,
        tools=tools,
        limits=limits,
        tool_template=section.get("tool_template"),
        environment_schemas=environment_schemas,
        environment_reward=environment_reward,
    )


def collect_episodes(
    agent: AgentRuntime,
    policy: nn.Module,
    tokenizer: Any,
    samples: Sequence[Mapping[str, Any]],
    reward: Any,
    *,
    group_size: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    reference: nn.Module | None,
    enable_thinking: bool,
    logprob_chunk_size: int,
    forward_batch_size: int | None,
    sync_ranks: bool,
    compute_old_logp: bool,
    engine: Any = None,
    shared_prefix: bool = False,
) -> RolloutBatch:
    """``group_size`` sampled episodes per sample, scored and packed as a :class:`RolloutBatch`
    whose completion mask covers exactly the model's tokens (see ``collect_rollouts`` for the
    arguments; the episode's reward is on every row of its group's advantage). A group's
    episodes share their first prompt, which ``shared_prefix`` log-prob forwards run once."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for rollouts, got {temperature}")
    row_samples = [sample for sample in samples for _ in range(group_size)]
    episodes, results = agent.run(
        policy,
        tokenizer,
        row_samples,
        reward,
        greedy=False,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        engine=engine,
        sync_ranks=sync_ranks,
        enable_thinking=enable_thinking,
    )
    device = next(policy.parameters()).device
    width = max(len(e.ids) for e in episodes)
    pad_id = tokenizer.pad_id
    tokens = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(episodes), width), dtype=torch.bool)
    sampling_logp = torch.zeros((len(episodes), width), dtype=torch.float32)
    for row, episode in enumerate(episodes):
        length = len(episode.ids)
        tokens[row, :length] = torch.tensor(episode.ids, dtype=torch.long)
        completion_mask[row, :length] = torch.tensor(episode.model_mask, dtype=torch.bool)
        sampling_logp[row, :length] = torch.tensor(episode.logprobs, dtype=torch.float32)
    tokens, completion_mask = tokens.to(device), completion_mask.to(device)
    input_pos = torch.arange(width, device=device).expand(len(episodes), width).clone()
    prompt_lengths = torch.tensor([e.prompt_length for e in episodes], device=device)
    total_lengths = torch.tensor([len(e.ids) for e in episodes], device=device)
    group_ids = torch.arange(len(samples), device=device).repeat_interleave(group_size)
    # The sampling policy's and the reference's log-probs, at the model's tokens only.
    old_logp, ref_logp = (
        _batched_logprobs(
            model,
            tokens,
            input_pos,
            completion_mask,
            temperature=temperature,
            chunk_size=logprob_chunk_size,
            forward_batch_size=forward_batch_size or len(episodes),
            group_ids=group_ids if shared_prefix else None,
            prompt_lengths=prompt_lengths if shared_prefix else None,
        )
        if model is not None
        else None
        for model in (policy if compute_old_logp else None, reference)
    )
    return RolloutBatch(
        tokens=tokens,
        input_pos=input_pos,
        completion_mask=completion_mask,
        old_logp=old_logp,
        ref_logp=ref_logp,
        truncated=torch.tensor(
            [e.record.truncated is not None for e in episodes], dtype=torch.bool, device=device
        ),
        prompt_lengths=prompt_lengths,
        completion_lengths=total_lengths - prompt_lengths,
        group_ids=group_ids,
        texts=[e.final_text for e in episodes],
        samples=row_samples,
        sampling_logp=sampling_logp.to(device),
        episodes=[e.record for e in episodes],
        window_truncated=torch.tensor(
            [e.record.truncated == "max_seq_len" for e in episodes], device=device
        ),
        **RolloutBatch.scored(results, device),
    )
