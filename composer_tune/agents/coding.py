"""A coding environment in TRL's ``environment_factory`` shape over the project's coding
problems (``composer_tune.data.coding``): the agent can run code and run the problem's visible
tests in the sandbox (``composer_tune.rewards.sandbox``, per-call limits), and reads the failing
test's output; the reward (``CodeExecutionReward`` on the final answer) runs every test, the
hidden ones included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_tune.rewards.coding import CodeExecutionReward
from composer_tune.rewards.sandbox import SandboxLimits, run_python

_OUTPUT_CHARS = 1200


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
        return self._checker([code], [sample])[0].feedback
