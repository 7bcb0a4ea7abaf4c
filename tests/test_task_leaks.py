"""Recovering a task's deleted code from outside its working copy.

A scripted hostile agent uses only the repository environment's own tools: it greps every
file the sandbox shows for the deleted feature's definition (outside its working copy) and
copies each hit over the task's file. The sandbox's allow-listed root holds no copy of any
shipped source, so it finds nothing and earns 0. The leak check finds planted copies outside
the tree, in a site-packages folder and in compressed archives.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from composer_tune.agents.repository import RepositoryEnvironment
from composer_tune.data.feature_tasks import load_feature_task_dataset, task_from_sample
from composer_tune.rewards.sandbox import private_root_available

REPO_ROOT = Path(__file__).resolve().parent.parent
STORE = REPO_ROOT / "tests" / "assets" / "feature_tasks"

needs_private_root = pytest.mark.skipif(
    not private_root_available(), reason="no mount namespaces here: docs/sandbox.md"
)


def _stdout(observation: str) -> str:
    return observation.split("stdout:\n", 1)[1].rsplit("\nstderr:\n", 1)[0]


@needs_private_root
@pytest.mark.parametrize(
    "task_id",
    [
        "inflection-0.5.1:inflection/__init__.py:camelize",
        "cachetools-8.0.2:src/cachetools/__init__.py:TTLCache.ttl",
    ],
)
def test_hostile_agent_searching_the_sandbox_finds_no_copy(task_id: str) -> None:
    sample = next(s for s in load_feature_task_dataset(STORE) if s["id"] == task_id)
    task, _ = task_from_sample(sample)
    environment = RepositoryEnvironment(command_time_s=120, grade_time_s=120)
    environment.reset(**sample)
    name = task.feature.qualname.rsplit(".", 1)[-1]
    pattern = shlex.quote(rf"(def|class) {re.escape(name)}\b")
    found = environment.run_command(
        f"grep -rlE {pattern} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=repo; true"
    )
    assert found.startswith("status: ok"), found  # the search finished within its budget
    hits = [line for line in _stdout(found).splitlines() if line.strip()]
    for hit in hits:
        environment.run_command(f"cp {shlex.quote(hit)} {shlex.quote(task.deletion.file)}")
    reward = environment.get_reward()
    assert (hits, reward) == ([], 0.0)
