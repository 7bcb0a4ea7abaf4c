"""Reward for coding problems: run the completion's code against the problem's tests.

Code extraction: the LAST closed fenced block whose language tag is empty, ``python``,
``python3`` or ``py`` wins (models often sketch before the final answer). Without such a block
the completion scores 0 with feedback "no code block found", unless ``allow_unfenced`` is set,
in which case the whole completion is treated as code.

The tests never run where the solution can reach them. Each completion is a split run
(``composer_tune.rewards.split``): the solution's code runs in one sandboxed process that
sees no test, the test snippets run in a second sandboxed process (its own uid, private root,
memory and files) that never imports the solution, and the two talk only through a pipe
carrying plain data (``composer_tune.rewards.bridge``): when a test calls the solution's
function, the arguments cross, the function runs in the solution's process, and its result
comes back decoded into exact builtin types, so every ``==`` of a test is the grader's. An
object whose ``__eq__`` always says yes, patched builtins, a forged "all passed" line, an
early ``os._exit(0)``, reading the tests from memory or disk: none of it reaches the grader's
verdict (tests/test_grader_hostile.py). See docs/grader.md.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from composer_tune.rewards.base import RewardResult
from composer_tune.rewards.sandbox import SandboxLimits
from composer_tune.rewards.split import SplitRun, run_split

# ```python ... ``` (tag optional); the closing fence must start a line.
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
_PYTHON_TAGS = {"", "python", "python3", "py"}
_FEEDBACK_CHARS = 600
# Sandbox wall-clock slack beyond the tests' budget, so that the grader can report a timeout.
_REPORT_SLACK_S = 2.0


def extract_code(completion: str, allow_unfenced: bool = False) -> str | None:
    """The last fenced Python block of ``completion`` (see module docstring), or None."""
    blocks = [body for tag, body in _FENCE.findall(completion) if tag.lower() in _PYTHON_TAGS]
    if blocks:
        return blocks[-1]
    if allow_unfenced and completion.strip():
        return completion
    return None


class CodeExecutionReward:
    """Scores completions by running their code against ``sample["tests"]`` (split run).

    score: 1.0 when every test passes, else the fraction passed when ``partial_credit`` (0.0
    otherwise). ``sample["code_prefix"]`` (when set) runs before the completion's code, in the
    solution's process: a problem's given imports and helpers (HumanEval's prompt). ``sample["timeout_s"]`` (when set) replaces ``limits.wall_time_s``, the budget
    of all the tests together; ``per_test_timeout_s`` (off by default) gives each test its own
    budget instead, so that a slow test fails alone without losing the others' credit.
    feedback: the first failing test and its error, or what went wrong ("timed out after 2s"):
    short, meant as a hint for a teacher model.
    """

    def __init__(
        self,
        limits: SandboxLimits | Mapping[str, Any] | None = None,
        max_workers: int = 4,
        partial_credit: bool = True,
        allow_unfenced: bool = False,
        per_test_timeout_s: float | None = None,
    ) -> None:
        # A mapping comes from YAML (torchtune does not instantiate nested components).
        if isinstance(limits, Mapping):
            limits = SandboxLimits(**limits)
        if max_workers < 1:
            raise ValueError(f"CodeExecutionReward: max_workers must be >= 1, got {max_workers}")
        self.limits = limits or SandboxLimits(wall_time_s=5.0, cpu_time_s=5.0)
        self.max_workers = max_workers
        self.partial_credit = partial_credit
        self.allow_unfenced = allow_unfenced
        self.per_test_timeout_s = per_test_timeout_s

    def __call__(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        if len(completions) != len(samples):
            raise ValueError(f"got {len(completions)} completions for {len(samples)} samples")
        results: list[RewardResult | None] = [None] * len(completions)
        jobs: list[tuple[int, str]] = []
        for index, (completion, sample) in enumerate(zip(completions, samples, strict=True)):
            tests = sample.get("tests")
            if not tests or isinstance(tests, str):
                raise ValueError(
                    f"sample {index} (id {sample.get('id')!r}): 'tests' must be a non-empty "
                    "list of test snippets (see composer_tune.data.coding)"
                )
            code = extract_code(completion, self.allow_unfenced)
            if code is None:
                results[index] = RewardResult(0.0, False, "no code block found")
            else:
                prefix = sample.get("code_prefix")
                jobs.append((index, f"{prefix}\n{code}" if prefix else code))
        with ThreadPoolExecutor(self.max_workers, thread_name_prefix="coding-reward") as pool:
            scored = pool.map(lambda job: self._score(job[1], samples[job[0]]), jobs)
            for (index, _), result in zip(jobs, scored, strict=True):
                results[index] = result
        return [r for r in results if r is not None]

    def _score(self, code: str, sample: Mapping[str, Any]) -> RewardResult:
        tests = list(sample["tests"])
        budget = float(sample.get("timeout_s") or self.limits.wall_time_s)
        per_test = self.per_test_timeout_s
        # Per-test budgets: the whole run may take each test its budget (the sample's or the
        # limit's wall clock still caps it).
        total = budget if not per_test else max(budget, per_test * len(tests))
        limits = replace(self.limits, wall_time_s=total + _REPORT_SLACK_S)
        run = run_split(
            grader_entry="snippet_grader",
            grader_config={"tests": tests, "per_test_timeout_s": per_test, "time_budget_s": total},
            solution_entry="snippet_solution",
            solution_arguments={"code": code},
            limits=limits,
            nonce=secrets.token_hex(16),
        )
        return self._verdict(run, tests, budget)

    def _verdict(self, run: SplitRun, tests: Sequence[str], budget: float) -> RewardResult:
        report, num_tests = run.report, len(tests)
        if run.sandbox_failure is not None:  # the machine's failure, not the completion's
            return RewardResult(math.nan, None, f"unscored: {run.sandbox_failure}")
        if report is None or report.get("timed_out"):
            if report is not None or run.grader.status == "timeout":
                return RewardResult(0.0, False, f"timed out after {budget:g}s")
            reason = f"the grader failed ({run.grader.status}: {run.grader.detail})"
            return RewardResult(
                0.0, False, (reason + "\n" + run.grader.stderr[-300:])[:_FEEDBACK_CHARS]
            )
        if report.get("load_error"):
            reason = str(report["load_error"])
            if run.solution.status in ("timeout", "cpu_limit", "oom", "output_limit", "killed"):
                reason = f"{reason} ({run.solution.status}: {run.solution.detail})"
            stderr = run.solution.stderr.strip()
            if stderr and "solution failed to load" not in reason:
                reason += "\n" + stderr[-_FEEDBACK_CHARS // 2 :]
            return RewardResult(0.0, False, reason[:_FEEDBACK_CHARS])
        outcomes = report.get("results")
        if not isinstance(outcomes, list) or len(outcomes) != num_tests:
            return RewardResult(0.0, False, "the grader's report is incomplete")
        passed = sum(outcome.get("passed") is True for outcome in outcomes)
        if passed == num_tests:
            return RewardResult(1.0, True, f"all {num_tests} tests passed")
        first = next(i for i, outcome in enumerate(outcomes) if outcome.get("passed") is not True)
        source = tests[first].strip().splitlines()[-1][:200]
        feedback = (
            f"{passed}/{num_tests} tests passed; test {first + 1} `{source}` failed: "
            f"{outcomes[first].get('error', '')}"
        )
        score = passed / num_tests if self.partial_credit else 0.0
        return RewardResult(score, False, feedback[:_FEEDBACK_CHARS])
