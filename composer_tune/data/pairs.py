"""DPO preference pairs mined from teacher replays of agent traces (trace-replay DPO).

Channel 3 of composer-tune's data is this project's OWN research addition, not part of Cursor's
published Composer recipe: ``tools/replay_traces.py`` asks several teacher models for the next
action of every recorded agent step; this module compares their proposals with each other and
with the action the agent actually took, and keeps the steps where that comparison says which
action is better.

Agreement score of two actions, in [0, 1]:

* both call tools: calls are matched one-to-one greedily by best score; the sum of matched call
  scores is divided by the larger call count (so a missing or extra call costs its share). A call
  pair scores 0 if the tool names differ, else ``TOOL_NAME_WEIGHT + (1 - TOOL_NAME_WEIGHT) * args``:
  the tool name is the dominant signal. ``args`` compares arguments key by key over the union of
  keys (a key missing on one side scores 0): strings by token Jaccard similarity (lower-cased word
  and punctuation tokens), numbers exactly (1 == 1.0), booleans and null exactly, lists position
  by position, objects recursively. Accompanying text is ignored: it is commentary.
* neither calls tools: token Jaccard similarity of the texts (two empty texts agree fully), or
  with ``text_match: final_answer`` (tasks with a verifiable answer, where wording is not the
  action) 1 when both texts end in the same answer (``composer_tune.rewards.answer
  .extract_answer``: "So 21 - 2 = 19." and "The answer is 19" agree), else 0, also when
  either has none; or with ``text_match: verified`` (code, where two different programs can both
  be right) 1 when both actions carry ``"verified": true`` (the task's tests passed on each: the
  replay records it), else 0, so replies agree only in being right.
* one calls a tool and the other only talks: 0.

Mining rules (YAML mapping, every key optional)::

    min_teachers: 2              # successful teacher answers needed (after exclusions)
    consensus_threshold: 0.8     # teachers agree if every pair of them scores >= this
    disagreement_threshold: 0.4  # an action disagrees with the trace if it scores < this
    modes: [consensus_over_trace]   # and/or trace_over_outlier
    exclude_teachers: []         # e.g. the model that produced the traces (it agrees with itself)
    text_match: tokens           # or final_answer, verified: how two text-only actions compare

Decision per replayed step:

1. fewer than ``min_teachers`` successful, non-empty, complete answers (a reply with neither
   text nor tool call proposes nothing; one cut off at ``max_tokens``, ``finish_reason:
   length``, is half an action): skip ``too_few_teachers``; an empty trace action: skip
   ``empty_trace_action``.
2. the teachers agree (all pairwise scores >= consensus_threshold):
   if every teacher disagrees with the trace: ``consensus_over_trace`` pair, chosen = the most
   central teacher answer (highest summed agreement with the others), rejected = the trace action;
   otherwise skip ``consensus_not_against_trace``.
3. they do not agree: if exactly one teacher disagrees with the trace and all others agree with it
   (score >= consensus_threshold): ``trace_over_outlier`` pair, chosen = the trace action,
   rejected = the outlier's answer; otherwise skip ``no_consensus``.

A pair whose mode is not listed in ``modes`` is skipped as ``mode_disabled``.

Output rows (JSONL, loadable with ``datasets.load_dataset("json", data_files=...)``): tool-call
arguments are JSON strings and tool definitions a JSON string (``tools_json``), as the chat API
expects and so that every row has the same Arrow schema::

    {prompt_messages, tools_json, chosen, rejected, scores, provenance, teachers}
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

from composer_tune.data.traces.schema import Action, ToolCall
from composer_tune.rewards.answer import extract_answer
from composer_tune.teachers.protocol import action_to_message, normalise_message

TOOL_NAME_WEIGHT = 0.5
MODES = ("consensus_over_trace", "trace_over_outlier")
TEXT_MATCHES = ("tokens", "final_answer", "verified")
_TOKEN = re.compile(r"\w+|[^\w\s]")


class PairRulesError(ValueError):
    """Pair-mining rules are malformed; the message names the file and key."""


class ReplayedFileError(ValueError):
    """A replayed-steps line is unusable; the message names file and line."""


# --------------------------------------------------------------------------------- agreement


def text_similarity(a: str, b: str) -> float:
    """Jaccard similarity of the sets of lower-cased word/punctuation tokens; 1.0 if both empty."""
    tokens_a, tokens_b = set(_TOKEN.findall(a.lower())), set(_TOKEN.findall(b.lower()))
    if not tokens_a and not tokens_b:
        return 1.0
    return len(tokens_a & tokens_b) / len(tokens_a | tokens_b)


def value_similarity(a: Any, b: Any) -> float:
    """Similarity of two JSON values in [0, 1] (see the module docstring for the rules)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return 1.0 if type(a) is type(b) and a == b else 0.0
    if isinstance(a, int | float) and isinstance(b, int | float):
        return 1.0 if a == b else 0.0
    if isinstance(a, str) and isinstance(b, str):
        return text_similarity(a, b)
    if isinstance(a, list) and isinstance(b, list):
        if not a and not b:
            return 1.0
        # Positions beyond the shorter list score 0 (zip stops there on purpose).
        matched = sum(value_similarity(x, y) for x, y in zip(a, b, strict=False))
        return matched / max(len(a), len(b))
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        if not keys:
            return 1.0
        return sum(value_similarity(a[k], b[k]) for k in keys if k in a and k in b) / len(keys)
    return 0.0


def tool_call_similarity(a: ToolCall, b: ToolCall) -> float:
    """0 for different tools; else TOOL_NAME_WEIGHT plus the weighted argument similarity."""
    if a.name != b.name:
        return 0.0
    args_a, args_b = a.arguments, b.arguments
    if isinstance(args_a, str) != isinstance(args_b, str):
        # One side's arguments did not parse as a JSON object: compare serialised texts.
        args_a, args_b = (x if isinstance(x, str) else json.dumps(x) for x in (args_a, args_b))
    return TOOL_NAME_WEIGHT + (1 - TOOL_NAME_WEIGHT) * value_similarity(args_a, args_b)


def final_answer_agreement(a: str, b: str) -> float:
    """1.0 when both texts have a final answer and it is the same, else 0.0."""
    answer = extract_answer(a)
    return 1.0 if answer is not None and answer == extract_answer(b) else 0.0


@dataclass
class VerifiedAction(Action):
    """A replayed action with the verifier's verdict on it (None: not checked)."""

    verified: bool | None = None


def action_agreement(a: Action, b: Action, text_match: str = "tokens") -> float:
    """Agreement of two actions in [0, 1] (see the module docstring)."""
    if not a.tool_calls and not b.tool_calls:
        if text_match == "verified":
            both = getattr(a, "verified", None) is True and getattr(b, "verified", None) is True
            return 1.0 if both else 0.0
        if text_match == "final_answer":
            return final_answer_agreement(a.text, b.text)
        return text_similarity(a.text, b.text)
    if not a.tool_calls or not b.tool_calls:
        return 0.0
    scores = sorted(
        (
            (tool_call_similarity(x, y), i, j)
            for i, x in enumerate(a.tool_calls)
            for j, y in enumerate(b.tool_calls)
        ),
        key=lambda item: -item[0],
    )
    used_a: set[int] = set()
    used_b: set[int] = set()
    total = 0.0
    for score, i, j in scores:
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            total += score
    return total / max(len(a.tool_calls), len(b.tool_calls))


# ------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class PairRules:
    """Thresholds and modes of pair mining (see the module docstring)."""

    min_teachers: int = 2
    consensus_threshold: float = 0.8
    disagreement_threshold: float = 0.4
    modes: tuple[str, ...] = ("consensus_over_trace",)
    exclude_teachers: tuple[str, ...] = ()
    text_match: str = "tokens"


def parse_pair_rules(raw: Any, *, source: str = "<rules>") -> PairRules:
    """Validate a rules mapping; errors name the source and the offending key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise PairRulesError(f"{source}: rules must be a mapping, got {type(raw).__name__}")
    known = set(PairRules.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PairRulesError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
    values = dict(raw)
    min_teachers = values.get("min_teachers", PairRules.min_teachers)
    if isinstance(min_teachers, bool) or not isinstance(min_teachers, int) or min_teachers < 1:
        raise PairRulesError(
            f"{source}: 'min_teachers' must be an integer >= 1, got {min_teachers!r}"
        )
    thresholds = {}
    for key in ("consensus_threshold", "disagreement_threshold"):
        value = values.get(key, getattr(PairRules, key))
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise PairRulesError(f"{source}: {key!r} must be a number in [0, 1], got {value!r}")
        thresholds[key] = float(value)
    if thresholds["disagreement_threshold"] > thresholds["consensus_threshold"]:
        raise PairRulesError(
            f"{source}: 'disagreement_threshold' ({thresholds['disagreement_threshold']}) must not "
            f"exceed 'consensus_threshold' ({thresholds['consensus_threshold']})"
        )
    modes = values.get("modes", list(PairRules.modes))
    if not isinstance(modes, list) or not modes or any(mode not in MODES for mode in modes):
        raise PairRulesError(
            f"{source}: 'modes' must be a non-empty list from {list(MODES)}, got {modes!r}"
        )
    excluded = values.get("exclude_teachers", [])
    if not isinstance(excluded, list) or not all(isinstance(name, str) for name in excluded):
        raise PairRulesError(f"{source}: 'exclude_teachers' must be a list of teacher names")
    text_match = values.get("text_match", PairRules.text_match)
    if text_match not in TEXT_MATCHES:
        raise PairRulesError(
            f"{source}: 'text_match' must be one of {list(TEXT_MATCHES)}, got {text_match!r}"
        )
    return PairRules(
        min_teachers=min_teachers,
        modes=tuple(modes),
        exclude_teachers=tuple(excluded),
        text_match=text_match,
        **thresholds,
    )


def load_pair_rules(path: str | Path) -> PairRules:
    """Load and validate pair-mining rules from a YAML file."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise PairRulesError(f"{path}: invalid YAML: {error}") from error
    return parse_pair_rules(raw, source=str(path))


# -------------------------------------------------------------------------------------- mining


@dataclass
class PairSummary:
    """Counts of kept pairs (by mode) and skipped steps (by reason)."""

    steps: int = 0
    kept: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready counts."""
        return {
            "steps": self.steps,
            "kept": sum(self.kept.values()),
            "kept_by_mode": dict(self.kept),
            "skipped": sum(self.skipped.values()),
            "skipped_by_reason": dict(self.skipped),
        }


def _action(data: Mapping[str, Any]) -> VerifiedAction:
    return VerifiedAction(
        text=data.get("text") or "",
        tool_calls=[ToolCall(**call) for call in data.get("tool_calls", [])],
        thinking=data.get("thinking"),
        verified=data.get("verified"),
    )


def mine_step(record: Mapping[str, Any], rules: PairRules) -> tuple[dict[str, Any] | None, str]:
    """Apply the rules to one replayed step: (pair, mode) when kept, else (None, skip reason)."""
    trace = _action(record["step"]["action"])
    answers = {
        name: _action(result["action"])
        for name, result in record["teachers"].items()
        if result.get("status") == "ok"
        and name not in rules.exclude_teachers
        # Cut off at max_tokens: a half-written tool call or answer is not an action.
        and result.get("finish_reason") != "length"
    }
    # An empty reply (no text, no tool call) proposes nothing: count it as no answer.
    answers = {name: a for name, a in answers.items() if a.tool_calls or a.text.strip()}
    if len(answers) < rules.min_teachers:
        return None, "too_few_teachers"
    if not trace.text.strip() and not trace.tool_calls:
        return None, "empty_trace_action"
    names = list(answers)
    match = rules.text_match
    with_trace = {name: action_agreement(answers[name], trace, match) for name in names}
    pairwise = {
        (a, b): action_agreement(answers[a], answers[b], match) for a, b in combinations(names, 2)
    }
    consensus = min(pairwise.values(), default=1.0)

    if consensus >= rules.consensus_threshold:
        if max(with_trace.values()) >= rules.disagreement_threshold:
            return None, "consensus_not_against_trace"
        # The most central answer represents the consensus; ties go to the first teacher listed.
        centrality = {
            name: sum(score for pair, score in pairwise.items() if name in pair) for name in names
        }
        best = max(names, key=lambda name: centrality[name])
        mode = "consensus_over_trace"
        chosen, chosen_from = answers[best], f"teacher:{best}"
        rejected, rejected_from = trace, "trace"
    else:
        outliers = [n for n in names if with_trace[n] < rules.disagreement_threshold]
        agreeing = [n for n in names if with_trace[n] >= rules.consensus_threshold]
        if len(outliers) != 1 or not agreeing or len(agreeing) != len(names) - 1:
            return None, "no_consensus"
        mode = "trace_over_outlier"
        chosen, chosen_from = trace, "trace"
        rejected, rejected_from = answers[outliers[0]], f"teacher:{outliers[0]}"
    if mode not in rules.modes:
        return None, "mode_disabled"

    step = record["step"]
    pair = {
        "prompt_messages": [normalise_message(message) for message in step["context"]],
        "tools_json": json.dumps(record.get("tools") or [], ensure_ascii=False),
        "chosen": action_to_message(chosen),
        "rejected": action_to_message(rejected),
        "scores": {
            "teacher_consensus": consensus,
            "chosen_vs_rejected": action_agreement(chosen, rejected, match),
            "agreement_with_trace": with_trace,
        },
        "provenance": {
            **step["provenance"],
            "replay_step_index": record.get("step_index"),
            "mode": mode,
            "chosen_from": chosen_from,
            "rejected_from": rejected_from,
        },
        "teachers": {
            name: {
                "model": result.get("model"),
                "status": result.get("status"),
                "excluded": name in rules.exclude_teachers,
            }
            for name, result in record["teachers"].items()
        },
    }
    return pair, mode


def read_replayed(path: str | Path) -> Iterator[dict[str, Any]]:
    """Stream replayed-step records, checking the fields mining needs (errors name file:line)."""
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ReplayedFileError(f"{path}:{line_number}: invalid JSON: {error}") from error
            problem = _replayed_record_problem(record)
            if problem:
                raise ReplayedFileError(f"{path}:{line_number}: {problem}")
            yield record


def _replayed_record_problem(record: Any) -> str | None:
    """What makes ``record`` unusable for mining, or None."""
    if not isinstance(record, dict):
        return "a line must be a JSON object"
    step, teachers = record.get("step"), record.get("teachers")
    if not isinstance(step, dict) or not isinstance(teachers, dict):
        return "missing object field 'step' or 'teachers'"
    for key in ("context", "action", "provenance"):
        if key not in step:
            return f"missing field 'step.{key}'"
    for name, result in teachers.items():
        if not isinstance(result, dict) or "status" not in result:
            return f"teacher {name!r}: result must be an object with a 'status'"
        if result["status"] == "ok" and not isinstance(result.get("action"), dict):
            return f"teacher {name!r}: status 'ok' without an 'action' object"
    return None


def mine_pairs(
    records: Iterable[Mapping[str, Any]], rules: PairRules, summary: PairSummary
) -> Iterator[dict[str, Any]]:
    """Yield the pairs of ``records``, counting kept/skipped steps into ``summary``."""
    for record in records:
        summary.steps += 1
        pair, outcome = mine_step(record, rules)
        if pair is None:
            summary.skipped[outcome] += 1
        else:
            summary.kept[outcome] += 1
            yield pair


def write_pairs(replayed_path: str | Path, rules: PairRules, out_path: str | Path) -> PairSummary:
    """Mine ``replayed_path`` into ``out_path`` (JSONL, written atomically) and return counts."""
    out_path = Path(out_path)
    temp_path = out_path.with_name(out_path.name + ".partial")
    summary = PairSummary()
    try:
        with temp_path.open("w", encoding="utf-8") as out:
            for pair in mine_pairs(read_replayed(replayed_path), rules, summary):
                out.write(json.dumps(pair, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp_path, out_path)
    finally:
        temp_path.unlink(missing_ok=True)
    return summary
