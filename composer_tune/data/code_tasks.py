"""Synthetic Python function-synthesis tasks at graded difficulty, in TRL's conversational format.

Each task asks for one function (``keep_greater(nums)``: "returns a list of the numbers of
`nums` that are greater than 3, in order"), shows one worked example, and is scored on hidden
``assert`` tests that never appear in the prompt (the example's input is never a test). The
kinds of function are the templates of ``composer_tune.data.code_templates``; every task's
expected outputs come from running its template's reference solution.

Three splits, written as JSONL rows that ``TaskDataset`` reads (``prompt`` as chat messages;
the other columns reach the reward, SDPO's hints and evaluation):

* ``train``: the training templates at their training parameters;
* ``heldout_templates``: templates never trained on (``HELDOUT_TEMPLATES``);
* ``heldout_params``: training templates at parameter values never trained on (a quarter of
  each template's grid, chosen by a stable hash, so the split does not depend on the seed).

Columns: ``id``, ``prompt``, ``entry_point``, ``tests`` (one assert per test),
``solution`` (the reference: SDPO's ``reference`` hint source), ``timeout_s``, ``split``,
``template``, ``category``, ``difficulty``, ``params``. The reward is
``CodeExecutionReward`` (split grader; fraction of tests passed or all-pass), whose feedback
names the first failing test with expected and actual values: the targeted textual feedback
SDPO's teacher reads.

:func:`validate_tasks` runs each task through that grader: the reference must pass every test
and no trivial wrong answer (an empty body, ``return None``, returning the first argument) may
pass them all. ``python tools/make_code_tasks.py`` writes and validates the shipped set.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_tune.data.code_templates import HELDOUT_TEMPLATES, TEMPLATES, CodeTemplate, Params
from composer_tune.data.coding import DEFAULT_SYSTEM_PROMPT

SPLITS = ("train", "heldout_templates", "heldout_params")
# The share of a template's parameter grid held out (at least one value when it has two).
HELDOUT_PARAM_FRACTION = 0.25
# Trivial wrong answers every task must fail (name -> body, given the first argument's name).
TRIVIAL_BODIES: dict[str, str] = {
    "empty_body": "pass",
    "return_none": "return None",
    "return_input": "return {first}",
}


class CodeTaskError(ValueError):
    """A task that cannot be built or does not validate; the message names it."""


@dataclass(frozen=True)
class GenerationSettings:
    """How many tasks each split gets.

    train_per_template: training tasks per training template (spread over its training
        parameters, each with its own example and tests).
    heldout_per_template: tasks per held-out template (spread over its parameters).
    heldout_per_param: tasks per held-out parameter value of each training template.
    min_tests: hidden tests per task (edge cases first, then random inputs).
    timeout_s: the grader's wall-clock budget per task.
    """

    train_per_template: int = 8
    heldout_per_template: int = 4
    heldout_per_param: int = 2
    min_tests: int = 6
    timeout_s: float = 5.0
    seed: int = 0


def heldout_params(template: CodeTemplate) -> list[Params]:
    """The parameter values of ``template`` held out of training (by a stable hash)."""
    grid = list(template.params)
    if len(grid) < 2:
        return []
    count = max(1, math.floor(len(grid) * HELDOUT_PARAM_FRACTION))
    ranked = sorted(grid, key=lambda params: _stable_hash(template.name, params))
    return ranked[:count]


def _stable_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _call_source(entry: str, args: Sequence[Any]) -> str:
    return f"{entry}({', '.join(repr(arg) for arg in args)})"


def _run_reference(template: CodeTemplate, params: Params) -> Any:
    """The reference solution's function (our own trusted source, run in this process)."""
    namespace: dict[str, Any] = {}
    exec(compile(template.solution(params), f"<{template.name}>", "exec"), namespace)  # noqa: S102
    return namespace[template.function_name(params)]


def _check_value(template: CodeTemplate, value: Any) -> None:
    """Test values are written as Python literals: they must read back equal."""
    try:
        same = eval(repr(value), {}) == value  # noqa: S307 (our own literals)
    except Exception as exc:  # pragma: no cover - a template bug
        raise CodeTaskError(f"template {template.name}: {value!r} is not a literal") from exc
    if not same:
        raise CodeTaskError(f"template {template.name}: {value!r} does not round-trip")


def build_task(
    template: CodeTemplate,
    params: Params,
    split: str,
    rng: random.Random,
    *,
    settings: GenerationSettings,
    index: int,
) -> dict[str, Any]:
    """One task row: the prompt (statement and one example), hidden tests and the reference."""
    function = _run_reference(template, params)
    entry = template.function_name(params)
    example = template.random_inputs(rng, params)
    inputs: list[tuple[Any, ...]] = []
    seen = {repr(example)}
    for args in template.edge_inputs(params):
        if repr(args) not in seen:
            seen.add(repr(args))
            inputs.append(args)
    for _ in range(200):  # random inputs until there are enough distinct ones
        if len(inputs) >= settings.min_tests:
            break
        args = template.random_inputs(rng, params)
        if repr(args) not in seen:
            seen.add(repr(args))
            inputs.append(args)
    if len(inputs) < settings.min_tests:
        raise CodeTaskError(f"template {template.name} {params}: too few distinct inputs")
    tests = []
    for args in inputs:
        expected = function(*copy.deepcopy(args))
        _check_value(template, expected)
        tests.append(f"assert {_call_source(entry, args)} == {expected!r}")
    example_output = function(*copy.deepcopy(example))
    signature = f"{entry}({', '.join(template.args)})"
    statement = (
        f"Write a Python function `{signature}` that returns {template.statement(params)}.\n"
        f"For example, `{_call_source(entry, example)}` returns `{example_output!r}`."
    )
    user = (
        f"{statement}\n\nReply with the complete implementation in a single ```python fenced "
        "code block."
    )
    return {
        "id": f"{split}/{template.name}/{index}",
        "prompt": [
            {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": user},
        ],
        "entry_point": entry,
        "tests": tests,
        "solution": template.solution(params),
        "timeout_s": settings.timeout_s,
        "split": split,
        "template": template.name,
        "category": template.category,
        "difficulty": template.difficulty,
        "params": json.dumps(dict(params), sort_keys=True),  # one string type for every row
    }


def _tasks_for(
    template: CodeTemplate,
    grid: Sequence[Params],
    count: int,
    split: str,
    rng: random.Random,
    settings: GenerationSettings,
) -> list[dict[str, Any]]:
    """``count`` tasks cycling through ``grid``, with distinct prompts."""
    tasks: list[dict[str, Any]] = []
    prompts: set[str] = set()
    attempts = 0
    while len(tasks) < count:
        attempts += 1
        if attempts > 50 * count:
            raise CodeTaskError(f"template {template.name}: cannot make {count} distinct tasks")
        params = grid[len(tasks) % len(grid)]
        task = build_task(template, params, split, rng, settings=settings, index=len(tasks))
        text = task["prompt"][-1]["content"]
        if text not in prompts:
            prompts.add(text)
            tasks.append(task)
    return tasks


def generate_tasks(settings: GenerationSettings | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every split's tasks (unvalidated), deterministic for ``settings.seed``."""
    settings = settings or GenerationSettings()
    unknown = HELDOUT_TEMPLATES - {template.name for template in TEMPLATES}
    if unknown:
        raise CodeTaskError(f"HELDOUT_TEMPLATES names unknown templates: {sorted(unknown)}")
    splits: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for template in TEMPLATES:
        rng = random.Random(_stable_hash(settings.seed, template.name))
        if template.name in HELDOUT_TEMPLATES:
            splits["heldout_templates"] += _tasks_for(
                template, list(template.params), settings.heldout_per_template,
                "heldout_templates", rng, settings,
            )  # fmt: skip
            continue
        held = heldout_params(template)
        train_grid = [params for params in template.params if params not in held]
        splits["train"] += _tasks_for(
            template, train_grid, settings.train_per_template, "train", rng, settings
        )
        if held:
            splits["heldout_params"] += _tasks_for(
                template, held, settings.heldout_per_param * len(held), "heldout_params",
                rng, settings,
            )  # fmt: skip
    return splits


def _fenced(source: str) -> str:
    return f"```python\n{source}```"


def trivial_answers(task: Mapping[str, Any]) -> dict[str, str]:
    """The trivial wrong answers of ``task`` (name -> fenced source) that must all fail."""
    args = _signature_args(task)
    first = args[0] if args else "None"
    header = f"def {task['entry_point']}({', '.join(args)}):\n"
    return {
        name: _fenced(header + "    " + body.format(first=first) + "\n")
        for name, body in TRIVIAL_BODIES.items()
    }


def _signature_args(task: Mapping[str, Any]) -> list[str]:
    """The argument names of the task's reference solution."""
    import ast

    tree = ast.parse(task["solution"])
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == task["entry_point"]:
            return [arg.arg for arg in node.args.args]
    raise CodeTaskError(f"task {task['id']}: its solution does not define {task['entry_point']}")


@dataclass
class ValidationReport:
    """Per task, why it was refused (empty: every task validated)."""

    refused: dict[str, str]
    checked: int

    @property
    def ok(self) -> bool:
        return not self.refused


def validate_tasks(tasks: Sequence[Mapping[str, Any]], reward: Any) -> ValidationReport:
    """Grade every task's reference and trivial answers with ``reward`` (a
    ``CodeExecutionReward``: the split grader). A task is refused when its reference fails a
    hidden test or a trivial answer passes all of them; the reason names which."""
    completions: list[str] = []
    samples: list[Mapping[str, Any]] = []
    labels: list[tuple[str, str]] = []
    for task in tasks:
        if len(task["tests"]) < 5:
            raise CodeTaskError(f"task {task['id']}: {len(task['tests'])} tests, at least 5 needed")
        for name, answer in {
            "reference": _fenced(task["solution"]),
            **trivial_answers(task),
        }.items():
            completions.append(answer)
            samples.append(task)
            labels.append((task["id"], name))
    results = reward(completions, samples)
    refused: dict[str, str] = {}
    for (task_id, name), result in zip(labels, results, strict=True):
        if name == "reference" and not result.correct:
            refused.setdefault(task_id, f"the reference fails: {result.feedback}")
        elif name != "reference" and result.correct:
            refused.setdefault(task_id, f"the trivial answer {name!r} passes every test")
    return ValidationReport(refused=refused, checked=len(tasks))


def split_path(out_dir: str | Path, split: str) -> Path:
    """Where ``split`` is written: ``train.jsonl``, the held-out splits under ``heldout/`` (a
    folder ``TaskDataset`` reads as one held-out set, its ``split`` column telling them apart)."""
    out = Path(out_dir)
    return out / f"{split}.jsonl" if split == "train" else out / "heldout" / f"{split}.jsonl"


def write_tasks(splits: Mapping[str, Iterable[Mapping[str, Any]]], out_dir: str | Path) -> None:
    """Each split's rows as JSONL at :func:`split_path`."""
    for split, tasks in splits.items():
        path = split_path(out_dir, split)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as handle:
            for task in tasks:
                handle.write(json.dumps(task, ensure_ascii=False) + "\n")


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one written split (CodeTaskError naming the line when one is malformed)."""
    rows = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CodeTaskError(f"{path}:{number}: not JSON ({exc.msg})") from exc
    return rows
