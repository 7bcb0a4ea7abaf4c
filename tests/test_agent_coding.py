"""The coding environment through tool calls: visible tests, failing-test observations, hidden
tests in the reward, and the sandbox's hostile-program suite run as a tool call (contained)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from composer_tune.agents import build_agent
from composer_tune.agents.coding import CodingEnvironment
from composer_tune.agents.tools import ToolCall, call_tool, environment_tools
from composer_tune.data.coding import load_coding_dataset
from composer_tune.rewards.coding import CodeExecutionReward
from composer_tune.rewards.sandbox import run_python
from tests.test_sandbox import _host_processes_with

PROBLEMS = Path(__file__).parent / "assets" / "coding" / "problems.jsonl"


def _tool_call(environment: CodingEnvironment, name: str, code: str) -> tuple[str, bool]:
    tools = {tool.__name__: tool for tool in environment_tools(environment)}
    return call_tool(tools, ToolCall(name, {"code": code}), timeout_s=30)


@pytest.fixture(scope="module")
def sample() -> dict:
    return next(s for s in load_coding_dataset(PROBLEMS) if s["id"] == "reverse_words")


def test_coding_environment_tools_and_hidden_test_reward(sample: dict) -> None:
    agent = build_agent(
        {
            "environment": {
                "_component_": "composer_tune.agents.coding.CodingEnvironment",
                "visible_tests": 2,
            }
        }
    )
    environment = agent.factories[None]()
    observation = environment.reset(**sample)
    assert (
        sample["tests"][0].strip() in observation and sample["tests"][3].strip() not in observation
    )
    assert [t.__name__ for t in environment_tools(environment)] == ["run_code", "run_tests"]
    # A solution that passes the visible tests but not a hidden one.
    partial = "def reverse_words(text):\n    return ' '.join(reversed(text.split(' '))) if text.strip() else ''\n"
    # Failing a visible test is a failed call: the report is the error SDPO's teacher reads.
    feedback, failed = _tool_call(environment, "run_tests", partial)
    assert failed
    assert "TestsFailed: 1/2 tests passed" in feedback and "expected" in feedback
    feedback, _ = _tool_call(environment, "run_tests", sample["solution"])
    assert feedback == "all 2 tests passed"
    output, _ = _tool_call(environment, "run_code", "print(6 * 7)")
    assert output.startswith("status: ok") and "42" in output
    # The reward runs every test, hidden ones included.
    reward = CodeExecutionReward(allow_unfenced=True)
    [hidden] = reward([partial], [sample])
    assert hidden.correct is False and hidden.score < 1.0


def test_hostile_programs_through_a_tool_call_are_contained(tmp_path: Path) -> None:
    environment = CodingEnvironment(wall_time_s=2.0, cpu_time_s=2.0, memory_mb=96)
    environment.reset(tests=["assert True"])
    marker = f"agent-hostile-{os.getpid()}-{time.monotonic_ns()}"
    target = tmp_path / "escaped.txt"
    tmp_path.chmod(0o777)
    programs = {
        "infinite loop": ("import time\nwhile True:\n    time.sleep(0.01)", {"timeout"}),
        "cpu burner": ("while True:\n    pass", {"cpu_limit", "timeout"}),
        "fork bomb": (
            f"import os\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            {"timeout", "cpu_limit"},
        ),
        # Contained either way; on a loaded machine the 2 s clock may strike before the allocation.
        "memory bomb": ("huge = bytearray(10**11)", {"oom", "timeout"}),
        "huge output": (
            "import sys\nwhile True:\n    sys.stdout.write('x' * 10000)",
            {"output_limit"},
        ),
        "kill the parent": (
            f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGKILL)\nexcept OSError as exc:\n    print('failed', exc.errno)\n",
            {"ok", "error", "killed"},
        ),
        "escape the temp dir": (f"open({str(target)!r}, 'w').write('pwned')", {"ok", "error"}),
    }
    for name, (code, statuses) in programs.items():
        started = time.monotonic()
        output, failed = _tool_call(environment, "run_code", code)
        assert not failed, name  # the tool answered; the program's fate is in the observation
        status = output.split("\n", 1)[0].removeprefix("status: ").split(" ")[0]
        assert status in statuses, (name, output[:300])
        assert time.monotonic() - started < 25, name
        assert len(output) < 4000, name  # output capped before it reaches the model
    assert not _host_processes_with(marker)
    if "private_tmp" in run_python("pass", limits=environment.limits).isolation:
        assert not target.exists()
    output, _ = _tool_call(environment, "run_code", "print(6 * 7)")  # still responsive
    assert "42" in output
