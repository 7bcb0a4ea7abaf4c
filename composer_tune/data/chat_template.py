"""A checkpoint's Jinja chat template, rendered as ``transformers`` renders it, and the spans of
the rendered text that the assistant generated (which the SFT loss mask needs).

The Jinja environment mirrors ``transformers.utils.chat_template_utils``: a sandbox with
``trim_blocks``/``lstrip_blocks`` and loop controls, a ``tojson`` filter that keeps non-ASCII
text, and the ``raise_exception`` and ``strftime_now`` globals; the special-token strings
(``bos_token``, ``eos_token`` ...) are template variables. So any ChatML, Llama-3 or Qwen3
template renders the text ``AutoTokenizer.apply_chat_template`` would.

Message format (OpenAI style): ``{"role": "system"|"user"|"assistant"|"tool", "content": str |
None}``; assistant messages may add ``"reasoning_content"`` and ``"tool_calls"``, where the
template supports them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


def add_no_thinking_argument(parser: argparse.ArgumentParser) -> None:
    """A command's ``--no-thinking``: ``enable_thinking=False`` for the chat template, which
    otherwise stays at its default (a template without the switch refuses False)."""
    parser.add_argument(
        "--no-thinking",
        action="store_true",
        help="enable_thinking=false in the chat template (Qwen3's non-thinking mode; SmolLM2's "
        "template has no such switch)",
    )


class ChatTemplateError(ValueError):
    """A chat template cannot render a conversation; the message names the template's source."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise naming the first malformed message (role, content type, misplaced tool calls)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} mappings")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
        if message.get("role") not in ROLES:
            raise ValueError(
                f"messages[{index}].role must be one of {ROLES}, got {message.get('role')!r}"
            )
        for key in ("content", "reasoning_content"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"messages[{index}].{key} must be a string or None, got {type(value).__name__}"
                )
        tool_calls = message.get("tool_calls") or []
        if tool_calls and message["role"] != "assistant":
            raise ValueError(f"messages[{index}] has tool_calls but role {message['role']!r}")
        for call in tool_calls:
            # OpenAI's {"function": {"name", "arguments"}} or the flat {"name", "arguments"}.
            function = (call.get("function") or call) if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not {"name", "arguments"} <= function.keys():
                raise ValueError(
                    f"messages[{index}].tool_calls entries need 'name' and 'arguments', got {call!r}"
                )


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja text.
        origin: where it came from (a file), for error messages.
        special_tokens: template variables such as ``bos_token``/``eos_token`` (strings).
        candidate_tokens: the tokenizer's special tokens, among which ``end_of_turn`` (the one
            written after an assistant message) is found (see :meth:`find_end_of_turn`).
    """

    def __init__(
        self,
        source: str,
        *,
        origin: str,
        special_tokens: Mapping[str, str] | None = None,
        candidate_tokens: Sequence[str] = (),
    ) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"{origin}: chat template line {err.lineno}: {err}") from err
        self.end_of_turn = self.find_end_of_turn(candidate_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """The chat text of ``messages``; ``variables`` (``enable_thinking`` ...) reach the
        template. A variable the template never reads is refused unless it is left at its
        default (True), so a switch is never silently ignored."""
        validate_messages(messages)
        for name, value in variables.items():
            if value is not True and name not in self.source:
                raise ChatTemplateError(
                    f"{self.origin}: the chat template has no {name!r} switch ({name}={value!r})"
                )
        try:
            return self._template.render(
                messages=[dict(message) for message in messages],
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **variables,
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self.origin}: chat template failed: {err}") from err

    def find_end_of_turn(self, candidate_tokens: Sequence[str]) -> str | None:
        """The first of ``candidate_tokens`` the template writes right after an assistant
        message's text (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3); None if none."""
        marker = "@@composer_tune_end_of_turn@@"
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        try:
            after = self._template.render(
                messages=probe, tools=None, add_generation_prompt=False, **self.special_tokens
            ).split(marker, 1)[1]
        except (jinja2.TemplateError, IndexError):
            return None
        found = [
            (after.find(token), token) for token in candidate_tokens if token and token in after
        ]
        return min(found)[1] if found else None

    def assistant_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        text: str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> list[tuple[int, int]]:
        """``[start, end)`` character spans of ``text`` (the rendering of ``messages``) that the
        assistant generated, one per assistant turn that follows some message, each through its
        end-of-turn token.

        Found without knowing the template: a turn starts where ``text`` leaves the rendering of
        the conversation before it with the generation prompt (so a prompt's empty ``<think>``
        block, which inference supplies, is not trained on) and ends after the next end-of-turn
        token. A template that re-renders earlier turns differently once later ones exist (not
        prefix-stable) is an error, since the generated text cannot be told apart.
        """
        if self.end_of_turn is None:
            raise ChatTemplateError(
                f"{self.origin}: cannot tell where an assistant turn ends in this chat template"
            )
        spans: list[tuple[int, int]] = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            history = messages[:index]
            if not history:
                continue  # nothing prompted it (a trace cut mid-conversation): context only
            before = self.render(history, tools=tools, **variables)
            prompt = self.render(history, tools=tools, add_generation_prompt=True, **variables)
            if not text.startswith(before) or (spans and spans[-1][1] > len(before)):
                raise ChatTemplateError(
                    f"{self.origin}: the chat template renders messages before messages[{index}] "
                    "differently once later messages follow, so the assistant's generated text "
                    "cannot be located for the loss mask"
                )
            start = len(before)
            while start < min(len(prompt), len(text)) and prompt[start] == text[start]:
                start += 1
            end = text.find(self.end_of_turn, start)
            if end < 0:
                raise ChatTemplateError(
                    f"{self.origin}: messages[{index}] is not closed by {self.end_of_turn!r}"
                )
            spans.append((start, end + len(self.end_of_turn)))
        return spans
