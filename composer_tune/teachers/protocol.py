"""Translate trace ``Step``s into chat-completions requests and teacher replies into ``Action``s.

Tools: agent traces do not carry the tool definitions the agent was given, only the calls it made.
The replay therefore declares, per session (``provenance.file`` + ``session_id``), one function tool
per tool name called anywhere in that session (in any step's context or action). Its JSON schema
is inferred from the observed arguments: every key seen becomes a property whose ``type`` lists
the JSON types seen for it; keys present in every call are ``required``. Tools whose arguments
were never JSON objects get an open ``{"type": "object"}`` schema. Tools are sent only when the
session has tool calls at all, so text-only traces stay plain chat requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from composer_tune.data.traces.schema import Action, Step, ToolCall

# Characters per token used to estimate prompt size before a request is sent (budget reservation)
# and when a server omits ``usage``; a coarse but conservative figure for English and code.
CHARS_PER_TOKEN = 4
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
_JSON_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
    (type(None), "null"),
)


class MalformedResponseError(ValueError):
    """A 2xx reply whose body is not a usable chat completion (retried like a server error)."""


def canonical_json(value: Any) -> str:
    """Key-sorted, compact JSON: equal requests always serialise to equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _tool_call_parts(call: dict[str, Any]) -> tuple[str, Any, str | None]:
    """(name, arguments, id) of a tool call in OpenAI nested form or flat ``ToolCall`` form."""
    function = call.get("function")
    source = function if isinstance(function, dict) else call
    if "name" not in source:
        raise ValueError(f"tool call without a name: {call!r}")
    return source["name"], source.get("arguments", {}), call.get("id")


def openai_tool_call(name: str, arguments: Any, call_id: str | None, index: int) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry; arguments always a JSON string as the API requires."""
    return {
        "id": call_id or f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": _arguments_text(arguments)},
    }


def normalise_message(message: dict[str, Any]) -> dict[str, Any]:
    """Keep only chat-completions keys and put tool calls in the API's exact shape."""
    out = {key: message[key] for key in _MESSAGE_KEYS if key in message}
    if out.get("tool_calls"):
        out["tool_calls"] = [
            openai_tool_call(*_tool_call_parts(call), index=i)
            for i, call in enumerate(out["tool_calls"])
        ]
    else:
        out.pop("tool_calls", None)
    return out


def action_to_message(action: Action) -> dict[str, Any]:
    """The assistant message that performs ``action`` (thinking is not part of the message)."""
    message: dict[str, Any] = {"role": "assistant", "content": action.text or ""}
    if action.tool_calls:
        message["tool_calls"] = [
            openai_tool_call(call.name, call.arguments, call.id, i)
            for i, call in enumerate(action.tool_calls)
        ]
    return message


def _json_type(value: Any) -> str:
    for python_type, name in _JSON_TYPES:
        if isinstance(value, python_type):
            return name
    raise TypeError(f"not a JSON value: {value!r}")


class ToolCatalog:
    """Tool names and argument shapes observed in one session, rendered as function schemas."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = {}
        self._object_calls: dict[str, int] = {}
        self._key_types: dict[str, dict[str, set[str]]] = {}
        self._key_counts: dict[str, dict[str, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def observe(self, name: str, arguments: Any) -> None:
        """Record one call of tool ``name`` with the given (parsed or raw) arguments."""
        self._calls[name] = self._calls.get(name, 0) + 1
        types = self._key_types.setdefault(name, {})
        counts = self._key_counts.setdefault(name, {})
        if isinstance(arguments, dict):
            self._object_calls[name] = self._object_calls.get(name, 0) + 1
            for key, value in arguments.items():
                types.setdefault(key, set()).add(_json_type(value))
                counts[key] = counts.get(key, 0) + 1

    def observe_step(self, step: Step) -> None:
        """Record every tool call in the step's context and in its action."""
        for message in step.context:
            for call in message.get("tool_calls") or []:
                name, arguments, _ = _tool_call_parts(call)
                self.observe(name, _parse_arguments(arguments))
        for call in step.action.tool_calls:
            self.observe(call.name, call.arguments)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries, sorted by name so equal catalogs give equal requests."""
        tools = []
        for name in sorted(self._calls):
            parameters: dict[str, Any] = {"type": "object"}
            if self._object_calls.get(name):
                properties = {}
                for key, seen in sorted(self._key_types[name].items()):
                    if {"integer", "number"} <= seen:
                        seen = seen - {"integer"}
                    kinds = sorted(seen)
                    properties[key] = {"type": kinds[0] if len(kinds) == 1 else kinds}
                parameters["properties"] = properties
                parameters["required"] = sorted(
                    key
                    for key, count in self._key_counts[name].items()
                    if count == self._object_calls[name] == self._calls[name]
                )
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": "Tool used in the replayed agent trace "
                        "(schema inferred from its observed calls).",
                        "parameters": parameters,
                    },
                }
            )
        return tools


def session_key(step: Step) -> str:
    """Identifies the session (trace) a step belongs to, for per-session tool catalogs."""
    return f"{step.provenance.file}::{step.provenance.session_id}"


def build_tool_catalogs(steps: Iterable[Step]) -> dict[str, ToolCatalog]:
    """One pass over ``steps``: the tool catalog of every session."""
    catalogs: dict[str, ToolCatalog] = {}
    for step in steps:
        catalogs.setdefault(session_key(step), ToolCatalog()).observe_step(step)
    return catalogs


def build_request(
    step: Step,
    *,
    model: str,
    temperature: float,
    max_tokens: int,
    tools: list[dict[str, Any]],
    extra_body: dict[str, Any],
    system_prompt: str | None = None,
    tool_choice: str | None = None,
) -> dict[str, Any]:
    """The chat-completions body asking a teacher for the next action after ``step.context``.

    ``system_prompt`` goes before the step's own system text (merged into one system turn, which
    is all that many chat templates accept), or becomes the system turn when the step has none.
    ``tool_choice`` is sent only when there are tools (servers reject it without them).
    """
    messages = [normalise_message(message) for message in step.context]
    if system_prompt is not None:
        if messages and messages[0]["role"] == "system":
            own = messages[0].get("content") or ""
            messages[0] = {**messages[0], "content": f"{system_prompt}\n\n{own}".rstrip()}
        else:
            messages.insert(0, {"role": "system", "content": system_prompt})
    request: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": temperature,
        "max_tokens": max_tokens,
    }
    if tools:
        request["tools"] = tools
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
    # extra_body keys are provider options (e.g. reasoning effort); they may not override ours.
    clash = sorted(set(extra_body) & set(request))
    if clash:
        raise ValueError(f"extra_body must not override request fields {clash}")
    request.update(extra_body)
    return request


def _parse_arguments(arguments: Any) -> dict[str, Any] | str:
    """Arguments as a dict when they are a JSON object, else the raw string (schema convention)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return json.dumps(arguments)


@dataclass(frozen=True)
class Completion:
    """A parsed teacher reply."""

    action: Action
    input_tokens: int
    output_tokens: int
    finish_reason: str | None
    # True when the server omitted usage and the token counts are CHARS_PER_TOKEN estimates.
    usage_estimated: bool


def _usage_count(usage: Any, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_completion(body: Any, *, request_chars: int) -> Completion:
    """Parse a chat-completions JSON body; raises MalformedResponseError if it is unusable."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as error:
        raise MalformedResponseError(f"no choices[0].message in reply: {error!r}") from error
    if not isinstance(message, dict):
        raise MalformedResponseError("choices[0].message is not an object")
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise MalformedResponseError("choices[0].message.content is not a string")
    calls = []
    for call in message.get("tool_calls") or []:
        try:
            name, arguments, call_id = _tool_call_parts(call)
        except (ValueError, TypeError, AttributeError) as error:
            raise MalformedResponseError(f"bad tool call in reply: {call!r}") from error
        calls.append(ToolCall(name=name, arguments=_parse_arguments(arguments), id=call_id))
    # Reasoning fields differ by provider (vLLM/DeepSeek: reasoning_content, others: reasoning).
    thinking = message.get("reasoning_content") or message.get("reasoning")
    action = Action(
        text=content, tool_calls=calls, thinking=thinking if isinstance(thinking, str) else None
    )
    usage = body.get("usage")
    input_tokens = _usage_count(usage, "prompt_tokens")
    output_tokens = _usage_count(usage, "completion_tokens")
    estimated = input_tokens is None or output_tokens is None
    if input_tokens is None:
        input_tokens = -(-request_chars // CHARS_PER_TOKEN)
    if output_tokens is None:
        reply_chars = len(content) + sum(len(_arguments_text(c.arguments)) for c in calls)
        output_tokens = -(-reply_chars // CHARS_PER_TOKEN)
    return Completion(
        action=action,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        finish_reason=choice.get("finish_reason"),
        usage_estimated=estimated,
    )
