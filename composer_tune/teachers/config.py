"""Teacher declarations (YAML) and the retry policy of the replay engine.

A teacher is one OpenAI-compatible chat-completions endpoint + model. The API key is never part of
the configuration: ``api_key_env`` names the environment variable that holds it, so configs,
caches, logs and outputs can be shared without leaking credentials.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_REQUIRED_FIELDS = (
    "name",
    "base_url",
    "model",
    "api_key_env",
    "price_per_input_token",
    "price_per_output_token",
    "max_concurrency",
    "temperature",
    "max_tokens",
    "timeout_s",
)
_OPTIONAL_FIELDS = ("extra_body", "system_prompt", "tool_choice")
TOOL_CHOICES = ("auto", "required", "none")
# Teacher names become keys in outputs and part of cache keys: keep them path- and JSON-friendly.
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TeacherConfigError(ValueError):
    """A teacher declaration is malformed; the message names the file, teacher and field."""


@dataclass(frozen=True)
class TeacherConfig:
    """One teacher endpoint. Prices are USD per token (not per million tokens)."""

    name: str
    base_url: str
    model: str
    api_key_env: str
    price_per_input_token: float
    price_per_output_token: float
    max_concurrency: int
    temperature: float
    max_tokens: int
    timeout_s: float
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Put before the step's own system text: one model under two system prompts is two teachers.
    system_prompt: str | None = None
    # Sent with requests that declare tools: "required" makes servers that support it (vLLM,
    # OpenAI) answer with a schema-valid tool call. None: the server's default ("auto").
    tool_choice: str | None = None

    def api_key(self) -> str:
        """Read the key from the environment at call time (never stored on the object)."""
        value = os.environ.get(self.api_key_env)
        if not value:
            raise TeacherConfigError(
                f"teacher {self.name!r}: environment variable {self.api_key_env!r} "
                "(api_key_env) is not set or empty"
            )
        return value

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        """USD cost of one response from its token usage."""
        return (
            input_tokens * self.price_per_input_token + output_tokens * self.price_per_output_token
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: attempt k waits ~base * 2**(k-1), capped at max_delay_s.

    ``Retry-After`` from the server overrides the computed delay (capped at max_retry_after_s so a
    misbehaving server cannot stall the run for hours).
    """

    max_attempts: int = 5
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    max_retry_after_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0 or self.max_retry_after_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")


def _where(source: str, index: int, name: Any) -> str:
    label = f"teacher #{index}" + (f" ({name!r})" if isinstance(name, str) else "")
    return f"{source}: {label}"


def _number(where: str, key: str, value: Any, *, minimum: float, integer: bool = False) -> Any:
    """Validate a numeric field; bools are rejected because YAML ``yes`` would otherwise pass.

    Numeric strings are accepted for float fields because PyYAML (YAML 1.1) reads ``1e-6`` (no
    dot) as a string, a common way to write per-token prices.
    """
    if not integer and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise TeacherConfigError(f"{where}: field {key!r} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise TeacherConfigError(f"{where}: field {key!r} must be >= {minimum}, got {value!r}")
    return value if integer else float(value)


def parse_teacher(raw: Any, *, index: int, source: str = "<teachers>") -> TeacherConfig:
    """Validate one teacher mapping, raising TeacherConfigError that names the bad field."""
    if not isinstance(raw, Mapping):
        raise TeacherConfigError(f"{source}: teacher #{index} must be a mapping, got {raw!r}")
    where = _where(source, index, raw.get("name"))
    unknown = sorted(set(raw) - set(_REQUIRED_FIELDS) - set(_OPTIONAL_FIELDS))
    if unknown:
        hint = " (put the key's variable name in api_key_env)" if "api_key" in unknown else ""
        raise TeacherConfigError(f"{where}: unknown field(s) {unknown}{hint}")
    missing = [key for key in _REQUIRED_FIELDS if key not in raw]
    if missing:
        raise TeacherConfigError(f"{where}: missing field(s) {missing}")
    for key in ("name", "base_url", "model", "api_key_env"):
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise TeacherConfigError(f"{where}: field {key!r} must be a non-empty string")
    if not _NAME_PATTERN.match(raw["name"]):
        raise TeacherConfigError(
            f"{where}: field 'name' must match {_NAME_PATTERN.pattern}, got {raw['name']!r}"
        )
    if not raw["base_url"].startswith(("http://", "https://")):
        raise TeacherConfigError(
            f"{where}: field 'base_url' must start with http:// or https://, got {raw['base_url']!r}"
        )
    if not _ENV_PATTERN.match(raw["api_key_env"]):
        raise TeacherConfigError(
            f"{where}: field 'api_key_env' must be an environment variable NAME "
            "(letters, digits, underscores), not the key itself"
        )
    extra_body = raw.get("extra_body") or {}
    if not isinstance(extra_body, Mapping):
        raise TeacherConfigError(
            f"{where}: field 'extra_body' must be a mapping, got {extra_body!r}"
        )
    system_prompt = raw.get("system_prompt")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt):
        raise TeacherConfigError(
            f"{where}: field 'system_prompt' must be a non-empty string, got {system_prompt!r}"
        )
    tool_choice = raw.get("tool_choice")
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise TeacherConfigError(
            f"{where}: field 'tool_choice' must be one of {list(TOOL_CHOICES)}, got {tool_choice!r}"
        )
    return TeacherConfig(
        name=raw["name"],
        base_url=raw["base_url"].rstrip("/"),
        model=raw["model"],
        api_key_env=raw["api_key_env"],
        price_per_input_token=_number(
            where, "price_per_input_token", raw["price_per_input_token"], minimum=0
        ),
        price_per_output_token=_number(
            where, "price_per_output_token", raw["price_per_output_token"], minimum=0
        ),
        max_concurrency=_number(
            where, "max_concurrency", raw["max_concurrency"], minimum=1, integer=True
        ),
        temperature=_number(where, "temperature", raw["temperature"], minimum=0),
        max_tokens=_number(where, "max_tokens", raw["max_tokens"], minimum=1, integer=True),
        timeout_s=_number(where, "timeout_s", raw["timeout_s"], minimum=0.001),
        extra_body=dict(extra_body),
        system_prompt=system_prompt,
        tool_choice=tool_choice,
    )


def parse_teachers(raw: Any, *, source: str = "<teachers>") -> list[TeacherConfig]:
    """Validate a list of teachers (or a mapping with a ``teachers:`` list); names must be unique."""
    if isinstance(raw, Mapping):
        if "teachers" not in raw:
            raise TeacherConfigError(f"{source}: expected a top-level 'teachers:' list")
        raw = raw["teachers"]
    if not isinstance(raw, list) or not raw:
        raise TeacherConfigError(f"{source}: 'teachers' must be a non-empty list")
    teachers = [parse_teacher(item, index=i, source=source) for i, item in enumerate(raw)]
    seen: set[str] = set()
    for teacher in teachers:
        if teacher.name in seen:
            raise TeacherConfigError(f"{source}: duplicate teacher name {teacher.name!r}")
        seen.add(teacher.name)
    return teachers


def load_teachers(path: str | Path) -> list[TeacherConfig]:
    """Load and validate teacher declarations from a YAML file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise TeacherConfigError(f"{path}: invalid YAML: {error}") from error
    return parse_teachers(raw, source=str(path))
