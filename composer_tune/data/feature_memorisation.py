"""Memorisation, measured: how much of a feature-task store a model knows before training.

A model that was pretrained on a source's code may put a deleted feature back from memory
instead of from the repository, so a source's tasks teach it little and its held-out pass
rate overstates what it can do. Two measures per deletion task (a procedural bug deletes no
code, so bug tasks are skipped):

* **pass without work**: the model reads the task's statement (the chat prompt
  ``task_to_sample`` makes, with a system prompt that offers no tools) and answers once,
  greedily; its reply's code (the last fenced Python block, else the whole reply; of a
  definition named like the feature, only its body) takes the deleted lines' place in the
  agent's tree at their indentation, and the hidden tests decide through the split grader.
  A pass is every hidden test passing; a grade the sandbox could not run is unscored.
* **verbatim recall**: the model continues the original file's text up to the deleted lines
  (its last ``context_tokens`` tokens, plain text, no chat template) greedily for as many
  tokens as the deleted code has (at most ``max_recall_tokens``); the recall is the length of
  the longest common prefix of the continuation and the deleted code's first tokens, in
  normalised characters (each line's runs of whitespace made one space, ends stripped, blank
  lines dropped), over the latter's length: 1.0 when the model writes the deleted code out,
  0.0 when its first character differs.

Limits: one greedy reply says nothing of what sampling or an agent's episode would find; the
reply has no tool and no view of the repository beyond the statement, so a pass means the
feature is guessable from its name and documentation or remembered, and the two cannot be told
apart from this number alone (recall is the one that points at memory); a prefix match stops
at the first difference, so a model that remembers the code but words one line differently
scores what came before it.
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from composer_tune.data.feature_generator import (
    GenerationSettings,
    docstring_node,
    first_line,
)
from composer_tune.data.feature_tasks import (
    COUNTS_FILE,
    FeatureTask,
    FeatureTaskError,
    load_feature_tasks,
    materialize_agent_tree,
    materialize_tests_tree,
    read_source_file,
    removed_code,
    sample_tasks,
    task_to_sample,
)
from composer_tune.data.tokenizer import from_pretrained
from composer_tune.models.build import load_pretrained
from composer_tune.rewards.coding import extract_code
from composer_tune.rewards.repository import HiddenTestsResult, grade_repository
from composer_tune.rewards.sandbox import SandboxLimits
from composer_tune.rollout import encode_prompts
from composer_tune.rollout.window import generate_in_window

# The statement as the environment shows it, without the tools the environment's system prompt
# offers: a model that answered with a tool call would fail for want of the tool, not of memory.
PROBE_SYSTEM_PROMPT = (
    "You are a software engineer working in a Python repository. You cannot run any tool or "
    "read any file. Reply with the missing code in a single ```python fenced code block."
)
REPLY_MAX_TOKENS = 512
RECALL_CONTEXT_TOKENS = 1024
RECALL_MAX_TOKENS = 256
# The budget the store's own tasks were validated under.
GRADE_LIMITS = GenerationSettings().grade_limits


class ProbeModel(Protocol):
    """What the probe asks of a model (greedy decoding throughout); tests pass stand-ins."""

    def reply(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int) -> str:
        """The assistant's answer to a chat."""
        ...

    def continuation(self, prefix: str, max_new_tokens: int) -> str:
        """The plain text that follows ``prefix``."""
        ...

    def count_tokens(self, text: str) -> int: ...

    def first_tokens(self, text: str, count: int) -> str:
        """The text of ``text``'s first ``count`` tokens."""
        ...


class CheckpointModel:
    """A Hugging Face checkpoint directory's model and tokenizer on the CPU, decoding greedily
    with the repository's sampler (``generate_in_window``)."""

    def __init__(
        self,
        checkpoint: str | Path,
        threads: int,
        context_tokens: int = RECALL_CONTEXT_TOKENS,
        enable_thinking: bool = True,
    ) -> None:
        torch.set_num_threads(threads)
        # The template's default unless asked (SmolLM2's has no switch; Qwen3's does).
        self.enable_thinking = enable_thinking
        self.model = load_pretrained(checkpoint)
        self.tokenizer = from_pretrained(str(checkpoint))
        self.context_tokens = context_tokens

    def _greedy(self, prompt: list[int], max_new_tokens: int) -> str:
        windowed = generate_in_window(
            self.model,
            [prompt],
            max_new_tokens=max_new_tokens,
            pad_id=self.tokenizer.pad_id,
            greedy=True,
            stop_tokens=self.tokenizer.stop_tokens,
        )
        return self.tokenizer.decode(windowed.output.completions[0], skip_special_tokens=True)

    def reply(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int) -> str:
        prompt = encode_prompts(
            self.tokenizer, [{"prompt": messages}], enable_thinking=self.enable_thinking
        )
        return self._greedy(prompt[0], max_new_tokens)

    def continuation(self, prefix: str, max_new_tokens: int) -> str:
        # A file whose deleted code starts at its first line: the text starts a new document.
        ids = self.tokenizer.encode(prefix)[-self.context_tokens :] or [self.tokenizer.eos_id]
        return self._greedy(ids, max_new_tokens)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def first_tokens(self, text: str, count: int) -> str:
        return self.tokenizer.decode(self.tokenizer.encode(text)[:count])


@dataclass(frozen=True)
class TaskProbe:
    """One task's two measures: ``passed`` is None when the sandbox could not grade (unscored);
    ``feedback`` is the grader's (the first failure, or why nothing ran)."""

    task_id: str
    repo: str
    passed: bool | None
    hidden_passed: int
    hidden_total: int
    recall: float
    feedback: str


@dataclass(frozen=True)
class SourceMemorisation:
    """One source's probe: ``pass_rate`` over its scored tasks (None when none was),
    ``recall`` the mean over its tasks, ``unscored`` the tasks the sandbox could not grade."""

    repo: str
    tasks: int
    pass_rate: float | None
    recall: float
    unscored: int

    def as_counts(self, model: str, date: str) -> dict[str, Any]:
        """The source's ``"memorisation"`` entry in counts.json."""
        return {
            "model": model,
            "date": date,
            "tasks": self.tasks,
            "pass_rate": self.pass_rate,
            "recall": self.recall,
            "unscored": self.unscored,
        }


def deletion_tasks(tasks: Sequence[FeatureTask]) -> list[FeatureTask]:
    """The tasks that deleted code (a bug task's code is all there: nothing to recall)."""
    return [task for task in tasks if task.feature.kind != "bug"]


def normalised(text: str) -> str:
    """``text``'s non-blank lines, each with its runs of whitespace made one space and its ends
    stripped, joined by newlines: indentation and spacing do not count towards recall."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines() if line.strip())


def prefix_recall(continuation: str, reference: str) -> float:
    """The share of ``reference``'s normalised characters that ``continuation`` reproduces
    from the start (the longest common prefix of both, normalised); 1.0 for an empty
    reference."""
    wanted, written = normalised(reference), normalised(continuation)
    if not wanted:
        return 1.0
    return len(os.path.commonprefix([wanted, written])) / len(wanted)


def _reindented(lines: Sequence[str], indent: str) -> str:
    """``lines`` moved from their first non-blank line's indentation to ``indent``; a line
    indented less (inside a multi-line string) is kept as it is."""
    first = next((line for line in lines if line.strip()), "")
    own = first[: len(first) - len(first.lstrip())]
    text = "".join(
        indent + line[len(own) :] if line.strip() and line.startswith(own) else line
        for line in lines
    )
    return text if text.endswith("\n") or not text else text + "\n"


def _definition_body(code: str, task: FeatureTask) -> list[str] | None:
    """The lines of the body (after its docstring) of ``code``'s first definition named like
    the deleted feature, or None when ``code`` holds none (or does not parse)."""
    function = (ast.FunctionDef, ast.AsyncFunctionDef)
    kinds = (ast.ClassDef,) if task.feature.kind == "class" else function
    name = task.feature.qualname.rsplit(".", 1)[-1]
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.name == name:
            rest = node.body[1:] if docstring_node(node.body) else node.body
            lines = code.splitlines(keepends=True)
            return lines[first_line(rest[0]) - 1 : node.end_lineno] if rest else []
    return None


def reply_replacement(task: FeatureTask, code: str) -> str:
    """The text that takes the deleted lines' place: ``code``'s body of a definition named like
    the feature when it holds one (a reply often writes the whole function), else ``code``
    itself, at the indentation of the deletion's placeholder (a module's: none)."""
    placeholder = task.deletion.replacement
    indent = placeholder[: len(placeholder) - len(placeholder.lstrip())]
    lines = code.splitlines(keepends=True)
    if task.feature.kind != "module":
        dedented = _reindented(lines, "")
        body = _definition_body(dedented, task)
        lines = body if body is not None else lines
    return _reindented(lines, indent)


def grade_reply(
    store: str | Path,
    task: FeatureTask,
    code: str,
    limits: SandboxLimits = GRADE_LIMITS,
) -> tuple[bool | None, HiddenTestsResult]:
    """``code`` put in the deleted lines' place in the agent's tree (the hidden tests cut out,
    as the agent gets it), graded on the hidden tests: (all passed, or None when the sandbox
    could not grade; the HiddenTestsResult)."""
    spliced = replace(
        task, deletion=replace(task.deletion, replacement=reply_replacement(task, code))
    )
    with tempfile.TemporaryDirectory(prefix="composer-memorisation-") as scratch:
        tree, tests = Path(scratch) / "agent", Path(scratch) / "tests"
        materialize_agent_tree(store, spliced, tree)
        materialize_tests_tree(store, task, tests)
        result = grade_repository(
            tree, tests_tree=tests, import_root=task.import_root, packages=task.packages,
            node_ids=task.hidden_tests, limits=limits,
        )  # fmt: skip
    return (None if result.sandbox_failure else result.all_passed), result


def probe_task(
    model: ProbeModel,
    store: str | Path,
    task: FeatureTask,
    *,
    system_prompt: str = PROBE_SYSTEM_PROMPT,
    reply_tokens: int = REPLY_MAX_TOKENS,
    max_recall_tokens: int = RECALL_MAX_TOKENS,
    limits: SandboxLimits = GRADE_LIMITS,
) -> TaskProbe:
    """Both measures of one deletion task (see the module docstring)."""
    if task.feature.kind == "bug":
        raise ValueError(f"{task.id}: a bug task deleted no code to recall")
    original = read_source_file(store, task, task.deletion.file)
    sample = task_to_sample(task, store, system_prompt, original)
    reply = model.reply(sample["prompt"], reply_tokens)
    passed, graded = grade_reply(
        store, task, extract_code(reply, allow_unfenced=True) or "", limits
    )
    prefix = "".join(original.splitlines(keepends=True)[: task.deletion.start - 1])
    deleted = removed_code(task, original)
    budget = min(max_recall_tokens, model.count_tokens(deleted))
    recall = prefix_recall(model.continuation(prefix, budget), model.first_tokens(deleted, budget))
    return TaskProbe(
        task_id=task.id,
        repo=task.repo,
        passed=passed,
        hidden_passed=graded.passed,
        hidden_total=graded.total,
        recall=recall,
        feedback=graded.feedback,
    )


def probe_store(
    model: ProbeModel,
    store: str | Path,
    per_source_tasks: int,
    *,
    max_recall_tokens: int = RECALL_MAX_TOKENS,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[list[TaskProbe], int]:
    """``per_source_tasks`` deletion tasks of each source of ``store`` (spread over its tasks)
    probed, a line for each to ``progress``; the probes and how many bug tasks were skipped."""
    tasks = load_feature_tasks(store)
    deletions = deletion_tasks(tasks)
    probes = []
    for task in sample_tasks(deletions, per_source_tasks):
        probe = probe_task(model, store, task, max_recall_tokens=max_recall_tokens)
        verdict = {True: "pass", False: "fail", None: "unscored"}[probe.passed]
        progress(
            f"{verdict} {task.id}: hidden {probe.hidden_passed}/{probe.hidden_total}, "
            f"recall {probe.recall:.2f}"
        )
        probes.append(probe)
    return probes, len(tasks) - len(deletions)


def per_source(probes: Sequence[TaskProbe]) -> list[SourceMemorisation]:
    """The probes summed up per source, in the order the sources first appear."""
    summaries = []
    for repo in dict.fromkeys(probe.repo for probe in probes):
        own = [probe for probe in probes if probe.repo == repo]
        scored = [probe.passed for probe in own if probe.passed is not None]
        summaries.append(
            SourceMemorisation(
                repo=repo,
                tasks=len(own),
                pass_rate=sum(scored) / len(scored) if scored else None,
                recall=sum(probe.recall for probe in own) / len(own),
                unscored=len(own) - len(scored),
            )
        )
    return summaries


def write_memorisation_counts(
    store: str | Path, summaries: Sequence[SourceMemorisation], model: str, date: str
) -> None:
    """Store each summary under its source's ``"memorisation"`` key of counts.json (replacing
    an earlier probe's), the rest of the file as it was; written beside it and renamed, so an
    interrupted write keeps the old file."""
    path = Path(store) / COUNTS_FILE
    counts = json.loads(path.read_text(encoding="utf-8"))
    for summary in summaries:
        if summary.repo not in counts:
            raise FeatureTaskError(f"{path}: no entry for {summary.repo}")
        counts[summary.repo]["memorisation"] = summary.as_counts(model, date)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(counts, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)
