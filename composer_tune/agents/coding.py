"""A coding environment in TRL's ``environment_factory`` shape over the project's coding
problems (``composer_tune.data.coding``, ``composer_tune.data.code_tasks``): the agent can run
code and run the problem's visible tests in the sandbox (``composer_tune.rewards.sandbox``,
per-call limits), and reads the failing test's output; the reward (``CodeExecutionReward`` on the
final answer) runs every test, the hidden ones included.

A ``run_tests`` call whose code fails a visible test is a failed tool call (it raises
:class:`TestsFailed`, so the observation is ``{'error': '<the test report>'}``, as TRL writes a
tool's exception): the turn that wrote that code is where the episode went wrong, and the report
is the targeted feedback SDPO's teacher reads there (``sdpo.context.distill_turns: error_turn``).

:class:`CodeAgentDemonstrations` are supervised episodes of that loop for a tool-use warm start.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from composer_tune.agents.tools import ToolCall, call_tool
from composer_tune.data.code_tasks import read_tasks, trivial_answers
from composer_tune.rewards.coding import CodeExecutionReward, extract_code
from composer_tune.rewards.sandbox import SandboxLimits, run_python

_OUTPUT_CHARS = 1200


class TestsFailed(Exception):
    """``run_tests`` on code that fails a visible test; the message is the test report."""


class CodingEnvironment:
    """One coding problem per episode.

    Args:
        visible_tests: how many of the problem's tests the agent sees and can run (the rest
            stay hidden for the reward).
        wall_time_s, cpu_time_s, memory_mb: sandbox limits of each tool call.
    """

    def __init__(
        self,
        visible_tests: int = 2,
        wall_time_s: float = 5.0,
        cpu_time_s: float = 5.0,
        memory_mb: int = 512,
    ) -> None:
        if visible_tests < 1:
            raise ValueError(f"CodingEnvironment: visible_tests must be >= 1, got {visible_tests}")
        self.visible_count = visible_tests
        self.limits = SandboxLimits(
            wall_time_s=wall_time_s, cpu_time_s=cpu_time_s, memory_bytes=memory_mb * 2**20
        )
        self._checker = CodeExecutionReward(
            limits=self.limits, max_workers=1, allow_unfenced=True, partial_credit=True
        )
        self.visible: list[str] = []

    def reset(self, **sample: Any) -> str | None:
        """Start on ``sample`` (a ``problem_to_sample`` dict): shows the visible tests."""
        tests = sample.get("tests")
        if not tests or isinstance(tests, str):
            raise ValueError(f"CodingEnvironment: sample {sample.get('id')!r} has no test list")
        self.visible = list(tests[: self.visible_count])
        return (
            "\n\nYou can run code with run_code and check a solution with run_tests. "
            "Visible tests:\n" + "\n".join(test.strip() for test in self.visible)
        )

    def run_code(self, code: str) -> str:
        """Run a Python program in a sandbox and return its status, stdout and stderr.

        Args:
            code: The complete Python program to run.
        """
        result = run_python(code, limits=self.limits)
        return (
            f"status: {result.status}{' (' + result.detail + ')' if result.detail else ''}\n"
            f"stdout:\n{result.stdout[-_OUTPUT_CHARS:]}\nstderr:\n{result.stderr[-_OUTPUT_CHARS:]}"
        )

    def run_tests(self, code: str) -> str:
        """Run the visible tests against a solution and report the first failing test.

        Args:
            code: The complete solution source (the function definitions).
        """
        sample: Mapping[str, Any] = {"tests": self.visible}
        result = self._checker([code], [sample])[0]
        if not result.correct:
            raise TestsFailed(result.feedback)
        return result.feedback


class CodeAgentDemonstrations:
    """Supervised episodes of the test-and-fix loop on code tasks (``code_tasks`` rows), for
    the tool-use warm start of ``smollm2_code_agent``: the prompt holds the task, the
    environment's reset text, the assistant's ``run_tests`` calls and their real observations;
    the ``target`` is the final answer, the reference in a fenced block.

    With probability ``fix_rate`` the first call tests a wrong program (one of the task's
    trivial answers: an empty body, ``return None``, returning the first argument), reads the
    failing report, and the second call tests the reference; otherwise the first call tests the
    reference. Observations come from :class:`CodingEnvironment` itself, so they are exactly
    what the agent will read in training.
    """

    def __init__(
        self,
        source: str,
        num_samples: int,
        seed: int = 0,
        fix_rate: float = 0.5,
        visible_tests: int = 2,
    ) -> None:
        if not 0.0 <= fix_rate <= 1.0:
            raise ValueError(f"CodeAgentDemonstrations: fix_rate must be in [0, 1], got {fix_rate}")
        self.tasks = read_tasks(source)
        if not self.tasks:
            raise ValueError(f"CodeAgentDemonstrations: no tasks in {source}")
        self.num_samples, self.seed, self.fix_rate = num_samples, seed, fix_rate
        self.visible_tests = visible_tests

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = random.Random(f"code-agent-demo:{self.seed}:{index}")
        task = self.tasks[rng.randrange(len(self.tasks))]
        environment = CodingEnvironment(visible_tests=self.visible_tests)
        messages = [dict(message) for message in task["prompt"]]
        messages[-1]["content"] += environment.reset(**task)
        attempts = [task["solution"]]
        if rng.random() < self.fix_rate:
            wrong = rng.choice(sorted(trivial_answers(task).values()))
            attempts.insert(0, extract_code(wrong))
        tools = {"run_tests": environment.run_tests}
        for code in attempts:
            call = {"name": "run_tests", "arguments": {"code": code}}
            # The observation exactly as the episode loop writes it.
            observation, _ = call_tool(tools, ToolCall(**call), timeout_s=None)
            messages += [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": call}],
                },
                {"role": "tool", "name": "run_tests", "content": observation},
            ]
        return {**task, "prompt": messages, "target": f"```python\n{task['solution']}```"}
