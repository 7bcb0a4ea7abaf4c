"""Where one GRPO step's time goes, for a recipe config and variants of it (e.g. fp32 vs bf16).

    .venv/bin/python bench/bench_rl_step.py --config smollm2 \\
        --variant autocast=null --variant autocast=bf16 --threads 2

Each ``--variant`` (space-separated ``key=value`` overrides) is ``recipes/grpo.py``'s GRPORecipe
built from ``--config`` plus those overrides, driven through the methods its ``train()`` loop
calls (``_rollout`` -> ``group_advantages`` -> ``_optimizer_step``), on the same prompt batches. The
variants take turns step by step (A, B, A, B, ...) in one process, so load from other processes
hits all of them alike. The first ``--warmup`` steps of each are not counted. Phases: generation
(sampling; with ``rollout.engine=vllm`` also pushing the new weights into the engine), reward, old log-prob pass (no grad; absent from on-policy GRPO), train
forward (the log-prob forward with grad) and the rest (backward, clipping, AdamW). Prints the
median seconds per phase and each variant's speed-up over the first.

Asynchronous rollouts (any variant with ``rollout.max_staleness >= 1``, or ``--loop``) overlap
generation with training across steps, which a step-by-step alternation would mis-measure (one
variant's worker would generate while another trains). The variants then run the recipe's own
``train()`` in turn, ``--rounds`` times, each block ``--warmup`` + ``--repeats`` steps long
(its set-up and worker start not counted), one variant at a time; the table gives each
variant's steps per hour (median over rounds), its speed-up over the first, the thread split
(the trainer's ``--threads``; the rollout worker's ``rollout.worker.threads``, default the
same), the seconds a step waited for its rollouts and the rows' mean staleness:

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rl_step.py --config smollm2 \
        --variant rollout.max_staleness=0 --variant rollout.max_staleness=1
"""

import argparse
import functools
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/bench_rl_step.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from composer_tune.run.loop import epoch_batches  # noqa: E402

PHASES = ("generation", "reward", "old log-prob pass", "train forward", "backward + AdamW")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="smollm2", help="a recipes/grpo.py config")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="space-separated key=value overrides; repeat to compare (default: the config as is)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="uncounted steps per variant")
    parser.add_argument("--repeats", type=int, default=3, help="counted steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--loop", action="store_true", help="time train() blocks (implied by max_staleness >= 1)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="loop mode: blocks per variant")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--repeats and --rounds must be >= 1 and --warmup >= 0")
    args.variant = args.variant or [""]
    return args


def build_recipe(config_name: str, overrides: str, output_dir: Path, steps: int) -> Any:
    """``recipes/grpo.py``'s GRPORecipe for ``config_name`` + ``overrides``, set up, for
    ``steps`` steps without evaluation or periodic checkpoints."""
    from composer_tune import config
    from recipes.grpo import GRPOConfig, GRPORecipe

    cfg = config.load_config(
        config_name,
        [
            *overrides.split(),
            f"output_dir={output_dir}",
            f"max_steps={steps}",
            "eval_dataset=null",
            "checkpoint.save_every_n_steps=0",
            "logging.log_every_n_steps=1",
            "logging.progress_bar=false",
        ],
        recipe_file=REPO_ROOT / "recipes" / "grpo.py",
        schema=GRPOConfig,
    )
    recipe = GRPORecipe(cfg)
    recipe.setup()
    return recipe


class Variant:
    """One GRPORecipe and the phase times of its steps."""

    def __init__(self, config_name: str, overrides: str, output_dir: Path, steps: int) -> None:
        self.name = overrides or "(config as is)"
        self.recipe = build_recipe(config_name, overrides, output_dir, steps)
        self.steps: list[dict[str, float]] = []
        self.completion_tokens: list[float] = []

    def step(self, samples: list[dict[str, Any]], clock: "PhaseClock") -> None:
        """``GRPORecipe.train()``'s loop body for one generation batch of ``samples``."""
        recipe = self.recipe
        clock.begin()
        rollout = recipe.run.rollout(samples, recipe.objective.reference)
        batch = recipe.objective.prepare(rollout, advantage_sign=recipe.cfg.advantage_sign)
        for _, step in batch.optimizer_steps(
            recipe.cfg.steps_per_generation, recipe.cfg.num_iterations
        ):
            recipe._optimizer_step(step)
            recipe.run.progress.step += 1
        self.steps.append(clock.end())
        self.completion_tokens.append(float(rollout.completion_lengths.float().mean()))


class PhaseClock:
    """Charges the time of wrapped functions to named phases of the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.start = 0.0

    def wrap(self, phase: str | Callable[[], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = phase() if callable(phase) else phase
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start

        return timed

    def begin(self) -> None:
        self.current, self.start = {}, time.perf_counter()

    def end(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        step = dict(self.current)
        step["backward + AdamW"] = total - sum(step.values())
        step["total"] = total
        return step


def clock_phases(clock: PhaseClock, variants: list[Variant]) -> None:
    """Wrap the functions the recipe calls for each phase (module globals it looks up)."""
    from composer_tune.channels import composer
    from composer_tune.rollout import rollouts, window

    window.generate = clock.wrap("generation", window.generate)
    rollouts._batched_logprobs = clock.wrap("old log-prob pass", rollouts._batched_logprobs)
    composer.rollout_logprobs = clock.wrap("train forward", composer.rollout_logprobs)
    for variant in variants:
        task = variant.recipe.run.task
        task.reward.score = clock.wrap("reward", task.reward.score)
        engine = variant.recipe.run.engine  # rollout.engine=vllm: sampling and the weight push
        if engine is not None:
            engine.generate = clock.wrap("generation", engine.generate)
            engine.sync_weights = clock.wrap("generation", engine.sync_weights)


def time_loop(config_name: str, overrides: str, output_dir: Path, steps: int) -> dict[str, Any]:
    """One block of loop mode: the recipe's ``train()`` for ``steps`` steps; when it started
    and each step ended (``time.perf_counter``), the rollout worker's threads (None: no
    worker) and the metrics the run logged."""
    from composer_tune.analysis.metrics_log import read_metrics
    from composer_tune.run.loop import LoopChores

    recipe = build_recipe(config_name, overrides, output_dir, steps)
    ends: list[float] = []
    step_done = LoopChores.step_done

    def timed(chores: LoopChores, *args: Any, **kwargs: Any) -> None:
        step_done(chores, *args, **kwargs)
        ends.append(time.perf_counter())

    LoopChores.step_done = timed
    ends.append(time.perf_counter())
    try:
        recipe.train()
    finally:
        LoopChores.step_done = step_done
        stream = recipe.run.stream
        worker_threads = stream.worker.spec.threads if stream is not None else None
        recipe.cleanup()
    return {
        "ends": ends,
        "worker_threads": worker_threads,
        "logged": read_metrics(output_dir / "logs"),
    }


def measure_loops(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Loop mode (module docstring): the variants' ``train()`` blocks in turn, ``--rounds``
    times. Per variant: its overrides, median seconds per step, steps per hour, speed-up over
    the first variant, thread split, mean seconds a step waited for its rollouts (None without
    a worker) and the rows' mean staleness."""
    steps = args.warmup + args.repeats
    blocks: dict[int, list[dict[str, Any]]] = {index: [] for index in range(len(args.variant))}
    for round_index in range(args.rounds):
        for index, overrides in enumerate(args.variant):
            out = tmp / f"{index}_{round_index}"
            blocks[index].append(time_loop(args.config, overrides, out, steps))
    results = []
    for index, overrides in enumerate(args.variant):
        per_step = statistics.median(
            (block["ends"][-1] - block["ends"][args.warmup]) / args.repeats
            for block in blocks[index]
        )
        timed = [
            values
            for block in blocks[index]
            for step, values in block["logged"].items()
            if step > args.warmup and "loss" in values
        ]
        worker = blocks[index][0]["worker_threads"]
        waits = [v["async/wait_seconds"] for v in timed if "async/wait_seconds" in v]
        results.append(
            {
                "variant": overrides or "(config as is)",
                "step_s": per_step,
                "steps_per_hour": 3600 / per_step,
                "speed_up": results[0]["step_s"] / per_step if results else 1.0,
                "threads": f"trainer {args.threads} + worker {worker}"
                if worker is not None
                else f"trainer {args.threads} (samples too)",
                "wait_s": statistics.mean(waits) if waits else None,
                "staleness": statistics.mean(v.get("async/staleness_mean", 0.0) for v in timed),
            }
        )
    return results


def print_loops(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(
        f"config {args.config}, loop mode: {args.rounds} rounds of {args.warmup} warm-up + "
        f"{args.repeats} timed steps of train() per variant, variants in turn"
    )
    width = max([44, *(len(row["variant"]) + 2 for row in results)])  # columns never touch
    print(
        f"{'variant':<{width}}{'threads':<26}{'s/step':>9}{'steps/hour':>12}{'speed-up':>10}"
        f"{'wait s/step':>13}{'staleness':>11}"
    )
    for row in results:
        wait = f"{row['wait_s']:.2f}" if row["wait_s"] is not None else "-"
        print(
            f"{row['variant']:<{width}}{row['threads']:<26}{row['step_s']:>9.2f}"
            f"{row['steps_per_hour']:>12.1f}{row['speed_up']:>9.2f}x{wait:>13}"
            f"{row['staleness']:>11.2f}"
        )


def loop_mode(args: argparse.Namespace) -> bool:
    """``--loop``, or a variant that samples asynchronously."""
    return args.loop or any(
        re.search(r"rollout\.max_staleness=[1-9]", overrides) for overrides in args.variant
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if loop_mode(args):
        with tempfile.TemporaryDirectory() as tmp:
            print_loops(args, measure_loops(args, Path(tmp)))
        return
    steps = args.warmup + args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        variants = [
            Variant(args.config, overrides, Path(tmp) / str(index), steps)
            for index, overrides in enumerate(args.variant)
        ]
        clock = PhaseClock()
        clock_phases(clock, variants)
        # Every variant sees the same prompt batches: the first variant's data order.
        first = variants[0].recipe.run
        batches = epoch_batches(first.task.loader, first.task.sampler, first.progress)
        for _ in range(steps):
            samples = next(batches)
            for variant in variants:
                variant.step(samples, clock)

    print(f"config {args.config}, threads {args.threads}, median of {args.repeats} steps")
    header = f"{'variant':<28}" + "".join(f"{p:>19}" for p in (*PHASES, "total")) + "   speed-up"
    print(header)
    baseline = None
    for variant in variants:
        counted = variant.steps[args.warmup :]
        medians = {
            phase: statistics.median(step.get(phase, 0.0) for step in counted)
            for phase in (*PHASES, "total")
        }
        baseline = baseline or medians["total"]
        print(
            f"{variant.name:<28}"
            + "".join(f"{medians[p]:>18.2f}s" for p in (*PHASES, "total"))
            + f"   {baseline / medians['total']:.2f}x"
        )
    for variant in variants:
        tokens = statistics.mean(variant.completion_tokens[args.warmup :])
        print(f"mean completion tokens, {variant.name}: {tokens:.1f}")


if __name__ == "__main__":
    main()
