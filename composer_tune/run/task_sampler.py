"""Choosing training tasks as the policy improves: :class:`TaskSampler`.

Composer 2.5's tasks are "selected and made harder as the model improves". An RL recipe with a
``task_sampler`` section draws each generation batch's prompts from the tasks whose recent pass
rate under the current policy is near a target, instead of the uniform shuffled epochs of
``epoch_batches``:

```yaml
task_sampler:
  target_pass_rate: 0.5  # draw tasks whose recent pass rate is near this
  spread: 0.25           # width of the preference around the target (a Gaussian's sigma)
  window: 4              # a task's recent pass rate: the mean over its last `window` groups
  retire_after: 2        # a task every completion of its last `retire_after` groups solved retires
  promote: true          # a retired task unlocks its harder variants
  unseen_pass_rate: null # pass rate assumed before a task's first group (null: the target)
  explore: 0.05          # share of the draw spread evenly over the drawable tasks
```

* **Pass rate.** After each rollout, every group (the ``group_size`` completions of one prompt)
  adds its fraction of correct completions (``RolloutBatch.correct``) to its task's history; a
  group none of whose rows could be scored adds nothing. Histories are summed over ranks, so
  every rank of a run holds the same state.
* **Drawing.** Each drawable task weighs ``exp(-((p - target) / spread)^2 / 2)`` (``p``: its
  recent pass rate, or ``unseen_pass_rate`` before its first group), normalised, with
  ``explore`` of the total spread evenly so that a task judged too hard or too easy long ago
  is tried again as the policy changes; the batch's ``num_prompts_per_generation`` tasks are
  drawn without replacement from one generator that every rank seeds alike (DiLoCo replicas
  each their own), and each rank takes its share.
* **Retirement.** A task whose last ``retire_after`` groups were all fully solved is retired:
  never drawn again (unless every task is retired; then the retired ones are drawn evenly).
* **Promotion.** A sample may name easier tasks in ``harder_than`` (a list of sample ``id``s):
  it is a harder variant of them (more of the feature deleted, fewer visible tests...), locked
  until one of them retires (with ``promote: false`` every variant is drawable from the start).
  ``composer_tune.data.feature_tasks.load_feature_task_dataset`` links a task to the tasks whose
  deletion it contains (a class to its methods, a module to its functions).
* **Resume.** The histories, the states and the generator are saved in the run's checkpoint
  (``RunProgress``), so a resumed run draws exactly what the uninterrupted one would have.
* **Metrics** (per generation batch): ``task_sampler/active``, ``/locked``, ``/retired`` (task
  counts), ``/promoted`` (unlocks so far), ``/drawn_pass_rate`` (the drawn tasks' mean recent
  pass rate before the batch) and ``/batch_pass_rate`` (the batch's own).

Tasks are told apart by their sample's ``id`` (its position in the dataset without one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_tune.distributed import DistInfo, all_reduce_sum

ACTIVE, LOCKED, RETIRED = 0, 1, 2


@dataclass
class TaskSamplerSection:
    """The ``task_sampler`` section of an RL recipe (see the module docstring)."""

    target_pass_rate: float = 0.5
    spread: float = 0.25
    window: int = 4
    retire_after: int = 2
    promote: bool = True
    unseen_pass_rate: float | None = None
    explore: float = 0.05

    def __post_init__(self) -> None:
        checks = {
            "target_pass_rate": 0.0 <= self.target_pass_rate <= 1.0,
            "spread": self.spread > 0,
            "window": self.window >= 1,
            "retire_after": self.retire_after >= 1,
            "unseen_pass_rate": self.unseen_pass_rate is None or 0 <= self.unseen_pass_rate <= 1,
            "explore": 0.0 <= self.explore <= 1.0,
        }
        for name, fine in checks.items():
            if not fine:
                raise ValueError(
                    f"task_sampler.{name}: {getattr(self, name)!r} is out of range "
                    "(rates and explore in [0, 1], spread > 0, window and retire_after >= 1)"
                )


class TaskSampler:
    """Draws generation batches from ``dataset`` by recent pass rate (see the module docstring).

    Args:
        dataset: the training samples (indexable; each a mapping, ``id`` and ``harder_than``
            read when present).
        section: the config section.
        batch_size: prompts per generation batch over every rank of the replica.
        dist: this rank's place (its share of each batch).
        seed: the run's seed; ``stream``: DiLoCo's replica (each draws its own batches).
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]],
        section: TaskSamplerSection,
        *,
        batch_size: int,
        dist: DistInfo,
        seed: int,
        stream: int = 0,
    ) -> None:
        self.dataset, self.section, self.dist = dataset, section, dist
        self.batch_size = batch_size
        self.ids = [str(dataset[i].get("id", i)) for i in range(len(dataset))]
        index = {task_id: i for i, task_id in enumerate(self.ids)}
        if len(index) != len(self.ids):
            raise ValueError("task_sampler: the dataset's sample ids are not unique")
        # easier task -> its harder variants
        self.variants: dict[int, list[int]] = {}
        self.state = [ACTIVE] * len(self.ids)
        for i in range(len(dataset)):
            easier = dataset[i].get("harder_than") or []
            unknown = [name for name in easier if name not in index]
            if unknown:
                raise ValueError(f"task_sampler: {self.ids[i]} is harder than unknown {unknown}")
            for name in easier:
                self.variants.setdefault(index[name], []).append(i)
            if easier and section.promote:
                self.state[i] = LOCKED
        if not any(state == ACTIVE for state in self.state):
            raise ValueError("task_sampler: every task is a locked variant; nothing to draw")
        self.history: dict[int, list[float]] = {}
        self.promoted = 0
        self.generator = torch.Generator()
        self.generator.manual_seed(seed * 1_000_003 + 7919 * stream + 17)
        self._drawn_pass_rate = math.nan
        self._mine: list[int] = []

    # ---------------------------------------------------------------------------- drawing

    def pass_rate(self, task: int) -> float:
        """The task's recent pass rate (the unseen prior before its first group)."""
        recent = self.history.get(task, [])[-self.section.window :]
        if recent:
            return sum(recent) / len(recent)
        prior = self.section.unseen_pass_rate
        return self.section.target_pass_rate if prior is None else prior

    def weights(self) -> torch.Tensor:
        """Each task's drawing weight (0 for locked and retired tasks)."""
        target, spread = self.section.target_pass_rate, self.section.spread
        drawable = torch.tensor([state == ACTIVE for state in self.state])
        if not drawable.any():  # every task retired: draw the retired ones evenly
            return torch.tensor([float(s == RETIRED) for s in self.state], dtype=torch.float64)
        near = torch.zeros(len(self.ids), dtype=torch.float64)
        for task in torch.nonzero(drawable).flatten().tolist():
            distance = (self.pass_rate(task) - target) / spread
            near[task] = max(math.exp(-0.5 * distance * distance), 1e-12)
        even = drawable.double() / drawable.sum()
        return (1 - self.section.explore) * near / near.sum() + self.section.explore * even

    def draw(self) -> list[int]:
        """The next batch's tasks over every rank (``batch_size`` of them)."""
        weights = self.weights()
        drawable = int((weights > 0).sum())
        first = torch.multinomial(
            weights, min(self.batch_size, drawable), replacement=False, generator=self.generator
        ).tolist()
        rest = self.batch_size - len(first)
        if rest:  # fewer drawable tasks than prompts: repeat some
            first += torch.multinomial(
                weights, rest, replacement=True, generator=self.generator
            ).tolist()
        self._drawn_pass_rate = sum(self.pass_rate(t) for t in first) / len(first)
        return first

    def batches(self) -> Iterator[list[Mapping[str, Any]]]:
        """Endless batches of this rank's samples; :meth:`observe` reads the latest one's
        rollout."""
        share = self.batch_size // self.dist.world_size
        while True:
            tasks = self.draw()
            self._mine = tasks[self.dist.rank * share : (self.dist.rank + 1) * share]
            yield [self.dataset[task] for task in self._mine]

    # ------------------------------------------------------------------------- observing

    def observe(self, correct: torch.Tensor, scored: torch.Tensor) -> dict[str, float]:
        """Adds the rollout of this rank's latest batch (``correct``/``scored``: bool per row,
        ``group_size`` rows per sample in batch order) to the tasks' histories, summed over
        every rank (collective); retires and promotes; returns the batch's metrics."""
        group_size = len(correct) // max(len(self._mine), 1)
        if group_size * len(self._mine) != len(correct):
            raise ValueError(
                f"task_sampler: {len(correct)} rows do not answer the {len(self._mine)} "
                "prompts last drawn"
            )
        totals = torch.zeros(len(self.ids), 2, dtype=torch.float64)
        for group, task in enumerate(self._mine):
            rows = slice(group * group_size, (group + 1) * group_size)
            totals[task, 0] += float((correct[rows] & scored[rows]).sum())
            totals[task, 1] += float(scored[rows].sum())
        if self.dist.is_distributed:
            totals = all_reduce_sum(totals.to(self.dist.device)).cpu()
        passed = float(totals[:, 0].sum()) / max(float(totals[:, 1].sum()), 1.0)
        for task in torch.nonzero(totals[:, 1]).flatten().tolist():
            recent = self.history.setdefault(task, [])
            recent.append(float(totals[task, 0] / totals[task, 1]))
            del recent[: -max(self.section.window, self.section.retire_after)]
            streak = recent[-self.section.retire_after :]
            if len(streak) == self.section.retire_after and min(streak) == 1.0:
                self._retire(task)
        return {**self.metrics(), "task_sampler/batch_pass_rate": passed}

    def _retire(self, task: int) -> None:
        if self.state[task] == RETIRED:
            return
        self.state[task] = RETIRED
        for variant in self.variants.get(task, []):
            if self.state[variant] == LOCKED:
                self.state[variant] = ACTIVE
                self.promoted += 1

    def metrics(self) -> dict[str, float]:
        return {
            "task_sampler/active": float(self.state.count(ACTIVE)),
            "task_sampler/locked": float(self.state.count(LOCKED)),
            "task_sampler/retired": float(self.state.count(RETIRED)),
            "task_sampler/promoted": float(self.promoted),
            "task_sampler/drawn_pass_rate": self._drawn_pass_rate,
        }

    # ---------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        return {
            "ids": list(self.ids),
            "state": list(self.state),
            "history": {self.ids[t]: list(rates) for t, rates in self.history.items()},
            "promoted": self.promoted,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s; refuses one of another task set."""
        if list(state["ids"]) != self.ids:
            raise ValueError(
                "task_sampler: the checkpoint's task set differs from the dataset's "
                f"({len(state['ids'])} tasks saved, {len(self.ids)} now)"
            )
        index = {task_id: i for i, task_id in enumerate(self.ids)}
        self.state = [int(s) for s in state["state"]]
        self.history = {index[k]: [float(r) for r in v] for k, v in state["history"].items()}
        self.promoted = int(state["promoted"])
        self.generator.set_state(state["generator"])
