"""Does the task fit the model's window? Checked at set-up, before any weight is read.

A prompt (rendered with the chat template and, for agent episodes, every tool schema) plus the
tokens a completion or an episode may add must fit ``model.max_seq_len`` (and a vLLM engine's
``rollout.vllm.max_model_len``). At run time an episode or completion is stopped at the window
and marked truncated whatever its prompt (``generate_in_window``, ``EpisodeRunner``); this
check turns a config that would truncate by design into one error line naming the keys.

An environment's ``reset`` text is not known before an episode runs, so it is not counted; the
first :data:`CHECKED_ROWS` rows of each dataset are rendered (a bounded set-up cost on datasets
of any size; a longer prompt further on is still stopped safely at run time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from composer_tune.rollout.generation import encode_prompts

if TYPE_CHECKING:
    from composer_tune.agents import AgentRuntime

CHECKED_ROWS = 1024


def _longest_prompt(
    dataset: Any, tokenizer: Any, agent: AgentRuntime | None, enable_thinking: bool
) -> tuple[int, int]:
    """``(tokens, row)`` of the longest prompt among the dataset's first rows."""
    longest, where = 0, 0
    for row in range(min(len(dataset), CHECKED_ROWS)):
        sample = dataset[row]
        if agent is not None:
            ids = agent.prompt_ids(sample, tokenizer, enable_thinking)
        else:
            (ids,) = encode_prompts(tokenizer, [sample], enable_thinking=enable_thinking)
        if len(ids) > longest:
            longest, where = len(ids), row
    return longest, where


def _window(cfg: DictConfig, *, rollouts: bool) -> tuple[str, int] | None:
    """The config key and size of the window a dataset's rows must fit (None: not given)."""
    window = cfg.model.get("max_seq_len")
    if window is None:
        return None
    vllm_len = cfg.rollout.vllm.max_model_len
    if rollouts and cfg.rollout.engine != "native" and vllm_len is not None and vllm_len < window:
        return "rollout.vllm.max_model_len", vllm_len
    return "model.max_seq_len", window


def check_prompt_lengths(
    cfg: DictConfig, tokenizer: Any, dataset: Any, eval_dataset: Any, agent: AgentRuntime | None
) -> None:
    """Raises a one-line ValueError when a prompt of ``dataset`` (``eval_dataset``) plus what a
    completion may add (``max_new_tokens``, ``eval_max_new_tokens``; with an ``agent``, its
    ``max_episode_tokens``, else ``max_tokens_per_turn``) passes the model's window."""
    if agent is not None:
        limits = agent.limits
        key = (
            "agent.max_episode_tokens" if limits.max_episode_tokens else "agent.max_tokens_per_turn"
        )
        budget = limits.max_episode_tokens or limits.max_tokens_per_turn
        budgets = {"dataset": (key, budget), "eval_dataset": (key, budget)}
    else:
        budgets = {
            "dataset": ("max_new_tokens", cfg.max_new_tokens),
            "eval_dataset": ("eval_max_new_tokens", cfg.eval_max_new_tokens),
        }
    with_tools = " with the tool schemas" if agent is not None else ""
    for name, rows in (("dataset", dataset), ("eval_dataset", eval_dataset)):
        window = _window(cfg, rollouts=name == "dataset")
        if rows is None or window is None:
            continue
        window_key, size = window
        budget_key, budget = budgets[name]
        longest, row = _longest_prompt(rows, tokenizer, agent, cfg.enable_thinking)
        if longest + budget > size:
            raise ValueError(
                f"{name} row {row}: its prompt is {longest} tokens{with_tools}, and with "
                f"{budget_key}={budget} a row reaches {longest + budget}, past "
                f"{window_key}={size}: raise {window_key} or lower {budget_key}"
            )
