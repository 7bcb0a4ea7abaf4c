"""Tools as TRL 1.16's ``GRPOTrainer`` sees them: plain callables whose JSON schemas come from
their signatures and docstrings (``transformers.utils.get_json_schema``), called with the
arguments the model wrote, every failure turned into an ``{"error": ...}`` result the model reads.

Tool calls are parsed in the Hermes convention that Qwen2.5/Qwen3 use and the project's ChatML +
Hermes template teaches SmolLM2: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from composer_tune.user_code import call_with_timeout, resolve_path

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# An opened block the turn never closed (cut off, or the model forgot the tag).
_UNCLOSED = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of an assistant turn: ``name``/``arguments`` when it parsed,
    else ``error`` says why (the model then reads that error as the call's result)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None

    def message_entry(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text (``content``, tool-call blocks removed) and calls."""

    content: str
    calls: list[ToolCall]


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split ``text`` into content and the ``<tool_call>`` JSON blocks, in order. A block that
    is not a JSON object with a string ``name`` and an object (or JSON-object string)
    ``arguments`` is kept as a call with an ``error``, so the model is told what was wrong."""
    calls: list[ToolCall] = []
    for match in _TOOL_CALL.finditer(text):
        calls.append(_parse_call(match.group(1)))
    if _UNCLOSED.search(text):
        calls.append(ToolCall("", {}, error="malformed tool call: <tool_call> is never closed"))
    content = _UNCLOSED.split(_TOOL_CALL.sub("", text))[0].strip()
    return ParsedTurn(content=content, calls=calls)


def _parse_call(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, error=f"malformed tool call: invalid JSON ({err.msg})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(
            "", {}, error='malformed tool call: expected {"name": ..., "arguments": {...}}'
        )
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(
            payload["name"], {}, error="malformed tool call: 'arguments' must be a JSON object"
        )
    return ToolCall(payload["name"], arguments)


def tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """TRL's schemas: ``get_json_schema`` of each tool (a docstring with an ``Args:`` entry per
    parameter is required; transformers names what is missing)."""
    return [get_json_schema(tool) for tool in tools]


def schemas_of_paths(paths: Sequence[str], where: str) -> list[dict[str, Any]]:
    """Schemas of tool functions and of environment classes' tools (an instance built with no
    arguments, as TRL's factory is called), by dotted path, in order."""
    tools: list[Callable[..., Any]] = []
    for path in paths:
        target = resolve_path(path, where)
        tools += environment_tools(target()) if inspect.isclass(target) else [target]
    return tool_schemas(tools)


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """An environment's tools as TRL finds them: its class's public functions other than
    ``reset`` and ``get_reward``, bound to the instance, in name order (``inspect.getmembers``;
    listed on the class so properties are never evaluated)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def call_tool(
    tools: Mapping[str, Callable[..., Any]], call: ToolCall, timeout_s: float | None
) -> tuple[str, bool]:
    """Run ``call`` and return ``(content, failed)``: the tool's result as TRL writes it
    (``str(result)``), or ``str({"error": ...})`` for a malformed call, an unknown tool, arguments
    the signature does not bind, an exception, or a call still running after ``timeout_s``
    (see :func:`call_with_timeout`). An async tool is awaited."""
    if call.error is not None:
        return str({"error": call.error}), True
    tool = tools.get(call.name)
    if tool is None:
        return str({"error": f"Tool {call.name} not found."}), True
    try:
        inspect.signature(tool).bind(**call.arguments)
    except TypeError as err:
        return str({"error": f"{call.name}: {err}"}), True
    outcome = call_with_timeout(
        functools.partial(tool, **call.arguments), timeout_s, name=f"tool-{call.name}"
    )
    if outcome.failure is not None:
        prefix = f"{call.name} " if outcome.timed_out else ""
        return str({"error": prefix + outcome.failure}), True
    return str(outcome.value), False
