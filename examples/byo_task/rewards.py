"""The reward functions of the "Bring your own task" example, in TRL 1.16's signature
``f(prompts, completions, completion_ids, **columns) -> list[float | None]``: the dataset's
other columns (here ``stock``) arrive as keyword lists; None means "not applicable"."""

import re


def _final_reply(completion) -> str | None:
    """The last assistant message's text (a conversational completion is a list of messages:
    assistant turns and tool results), or None when there is none."""
    if isinstance(completion, str):
        return completion
    replies = [message["content"] for message in completion if message["role"] == "assistant"]
    return replies[-1] if replies else None


def reports_stock(completions, stock, **kwargs) -> list[float]:
    """1.0 when the final reply states the number of boxes in stock, else 0.0."""
    rewards = []
    for completion, count in zip(completions, stock, strict=True):
        reply = _final_reply(completion) or ""
        rewards.append(1.0 if str(count) in re.findall(r"\d+", reply) else 0.0)
    return rewards


def short_reply(completions, **kwargs) -> list[float | None]:
    """1.0 for a final reply of at most five words, 0.0 for a longer one, None (not
    applicable) when the episode ended without a reply."""
    rewards = []
    for completion in completions:
        reply = _final_reply(completion)
        rewards.append(None if not reply else float(len(reply.split()) <= 5))
    return rewards
