"""The task sampler on a toy task set with a scripted, deterministic policy: draws near the
target pass rate, retirement, promotion to harder variants, exact resume, its metrics, and its
config errors; the feature-task dataset's variant links; a GRPO run with it resumes exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from composer_tune.data.feature_tasks import (
    harder_than,
    load_feature_task_dataset,
    load_feature_tasks,
)
from composer_tune.distributed import DistInfo
from composer_tune.run.task_sampler import TaskSampler, TaskSamplerSection
from tests.recipe_runs import run_recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
GROUP = 4
SINGLE = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))


def _tasks() -> list[dict]:
    """40 tasks of difficulty 0 .. 0.975, and harder variants of the two easiest."""
    tasks = [{"id": f"t{i:03d}", "difficulty": i / 40} for i in range(40)]
    tasks += [
        {"id": "t000-harder", "difficulty": 0.5, "harder_than": ["t000"]},
        {"id": "t001-harder", "difficulty": 0.6, "harder_than": ["t001", "t000"]},
    ]
    return tasks


def _solved(task: dict, step: int) -> int:
    """The scripted policy: completions of a group of GROUP it solves, a deterministic function
    of its skill (rising with the step) and the task's difficulty."""
    skill = 0.3 + 0.005 * step
    rate = min(max(0.5 + 2.0 * (skill - task["difficulty"]), 0.0), 1.0)
    return round(rate * GROUP)


def _run(sampler: TaskSampler, steps: range) -> list[list[str]]:
    """Draws and observes ``steps`` batches; returns the ids drawn per batch."""
    drawn = []
    batches = sampler.batches()
    for step in steps:
        batch = next(batches)
        correct = torch.tensor(
            [row < _solved(task, step) for task in batch for row in range(GROUP)]
        )
        sampler.observe(correct, torch.ones_like(correct))
        drawn.append([task["id"] for task in batch])
    return drawn


def _sampler(tasks: list[dict] | None = None, **section) -> TaskSampler:
    return TaskSampler(
        tasks if tasks is not None else _tasks(),
        TaskSamplerSection(**section),
        batch_size=8,
        dist=SINGLE,
        seed=3,
    )


def test_draws_near_the_target_retire_the_solved_and_promote_their_variants() -> None:
    sampler = _sampler(target_pass_rate=0.5, spread=0.15, window=2, retire_after=2)
    assert sampler.metrics()["task_sampler/locked"] == 2
    drawn = _run(sampler, range(80))

    # Near the target: the pass rate the policy has on the drawn tasks, over the last 60
    # batches, is closer to 0.5 than on tasks drawn uniformly (same policy, same steps).
    def distance(batches: list[list[str]], first_step: int) -> float:
        by_id = {task["id"]: task for task in _tasks()}
        rates = [
            _solved(by_id[task_id], first_step + n) / GROUP
            for n, batch in enumerate(batches)
            for task_id in batch
        ]
        return sum(abs(rate - 0.5) for rate in rates) / len(rates)

    uniform = TaskSampler(
        _tasks(), TaskSamplerSection(spread=1e6), batch_size=8, dist=SINGLE, seed=3
    )
    near, even = distance(drawn[20:], 20), distance(_run(uniform, range(80))[20:], 20)
    assert near < 0.6 * even, (near, even)  # measured: 0.156 against 0.303
    # Retired: a task the policy always solves is drawn no more once retired.
    metrics = sampler.metrics()
    retired = [t for t, state in enumerate(sampler.state) if state == 2]
    assert metrics["task_sampler/retired"] == len(retired) > 0
    ids = [sampler.ids[t] for t in retired]
    assert "t000" in ids and "t039" not in ids
    last = {task_id: max(n for n, batch in enumerate(drawn) if task_id in batch) for task_id in ids}
    for task_id in ids:
        history = sampler.history[sampler.ids.index(task_id)]
        assert history[-2:] == [1.0, 1.0], task_id
    # Promoted: the variants unlocked when t000 retired (after its last batch), drawn since.
    assert metrics["task_sampler/promoted"] == 2 and metrics["task_sampler/locked"] == 0
    first_variant = min(n for n, batch in enumerate(drawn) if "t000-harder" in batch)
    assert first_variant > last["t000"]
    counts = ("active", "locked", "retired")
    assert sum(metrics[f"task_sampler/{name}"] for name in counts) == len(_tasks())


def test_locked_variants_wait_for_their_easier_task() -> None:
    # Nothing is ever fully solved: no retirement, so the variants stay locked and undrawn.
    tasks = [{**task, "difficulty": task["difficulty"] + 2.0} for task in _tasks()]
    sampler = _sampler(tasks, window=2, retire_after=1)
    drawn = _run(sampler, range(20))
    assert not any(task_id.endswith("-harder") for batch in drawn for task_id in batch)
    assert sampler.metrics()["task_sampler/locked"] == 2
    # promote: false draws every variant from the start.
    assert _sampler(promote=False).metrics()["task_sampler/locked"] == 0


def test_resume_continues_exactly() -> None:
    straight = _sampler(window=3, retire_after=2)
    expected = _run(straight, range(24))
    first = _sampler(window=3, retire_after=2)
    before = _run(first, range(10))
    resumed = _sampler(window=3, retire_after=2)
    resumed.load_state_dict(first.state_dict())
    assert before + _run(resumed, range(10, 24)) == expected
    assert resumed.state_dict()["history"] == straight.state_dict()["history"]
    # A negative control: without the saved state the draws differ.
    fresh = _sampler(window=3, retire_after=2)
    assert _run(fresh, range(10, 24)) != expected[10:]
    with pytest.raises(ValueError, match="task set differs"):
        _sampler(_tasks()[:-1]).load_state_dict(first.state_dict())


def test_bad_sections_and_datasets_are_named() -> None:
    for section, field in [
        ({"target_pass_rate": 1.5}, "target_pass_rate"),
        ({"spread": 0}, "spread"),
        ({"window": 0}, "window"),
        ({"retire_after": 0}, "retire_after"),
    ]:
        with pytest.raises(ValueError, match=f"task_sampler.{field}"):
            TaskSamplerSection(**section)
    with pytest.raises(ValueError, match="not unique"):
        _sampler([{"id": "a"}, {"id": "a"}])
    with pytest.raises(ValueError, match="harder than unknown"):
        _sampler([{"id": "a"}, {"id": "b", "harder_than": ["c"]}])
    sampler = _sampler()
    next(sampler.batches())
    with pytest.raises(ValueError, match="rows do not answer"):
        sampler.observe(torch.ones(5, dtype=torch.bool), torch.ones(5, dtype=torch.bool))


def test_feature_tasks_link_harder_variants() -> None:
    store = REPO_ROOT / "tests" / "assets" / "feature_tasks"
    task = next(t for t in load_feature_tasks(store) if t.id.endswith(":Parser.search"))
    whole = replace(
        task,
        id="parse:Parser",
        deletion=replace(task.deletion, start=task.deletion.start - 3, end=task.deletion.end + 3),
    )
    # A deletion that holds another is its harder variant, never the reverse or itself.
    assert harder_than(whole, [task, whole]) == [task.id]
    assert harder_than(task, [task, whole]) == []
    samples = load_feature_task_dataset(store)
    links = {sample["id"]: sample["harder_than"] for sample in samples if sample["harder_than"]}
    # A class deleted whole is the harder variant of its methods' deletions; bugs link nothing.
    middleware = "tinydb-4.8.2:tinydb/middlewares.py:CachingMiddleware"
    assert f"{middleware}.read" in links[middleware]
    kinds = {t.id: t.feature.kind for t in load_feature_tasks(store)}
    linked = {task_id for harder, easier in links.items() for task_id in (harder, *easier)}
    assert "bug" in kinds.values() and all(kinds[task_id] != "bug" for task_id in linked)
    TaskSampler(samples, TaskSamplerSection(), batch_size=8, dist=SINGLE, seed=0)


@pytest.mark.slow  # two 4-step GRPO runs of the toy model, random init (a minute each)
def test_grpo_with_the_task_sampler_resumes_exactly(tmp_path: Path) -> None:
    from tests.test_grpo_recipe import QUICK, _log_files, _logged, _without_timing

    common = [
        "warm_start=null",
        *QUICK,
        "dataset.num_samples=64",
        "max_new_tokens=4",
        "max_steps=4",
        "eval_every_n_steps=0",
        "checkpoint.save_every_n_steps=2",
        "checkpoint.keep_last=null",
        "task_sampler.target_pass_rate=0.5",
        "task_sampler.retire_after=1",
    ]
    straight = run_recipe("grpo", "cpu_smoke", tmp_path / "straight", *common)
    expected = _without_timing(_logged(_log_files(straight.output_dir)[0]))
    assert {"task_sampler/active", "task_sampler/drawn_pass_rate"} <= set(expected[1])
    middle = min((straight.output_dir / "checkpoints").glob("step_*"))  # step 2 of 4
    resumed = run_recipe(
        "grpo",
        "cpu_smoke",
        tmp_path / "resumed",
        *common,
        f"checkpoint.resume_from_checkpoint={middle}",
        f"logging.metric_logger.log_dir={tmp_path / 'resumed_logs'}",
    )
    assert "at step 2" in resumed.stdout
    (log,) = (tmp_path / "resumed_logs").glob("log_*.txt")
    after = _without_timing(_logged(log))
    for step in (3, 4):
        assert after[step] == expected[step], step
