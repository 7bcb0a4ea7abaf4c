"""The ``async`` part: steps per hour of ``recipes/grpo.py`` at ``rollout.max_staleness`` 0 and 1
on one device."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from composer_tune.gpu_check.common import ASYNC_GOAL, PartResult, Settings, require


def run_async(settings: Settings) -> PartResult:
    require("torchtune")
    from bench import bench_grpo_vs_trl, bench_rl_step

    if settings.tiny:
        model, sizes = "tiny", ["num_prompts_per_generation=2", "group_size=4", "max_new_tokens=8"]
        timing = ["--warmup", "1", "--repeats", "2", "--rounds", "1"]
    else:  # the peer part's Qwen3-0.6B layer shape (a random model rarely stops early)
        model = "qwen3-0.6b-4l"
        sizes = ["num_prompts_per_generation=8", "group_size=8", "max_new_tokens=128"]
        timing = ["--warmup", "2", "--repeats", "6", "--rounds", "2"]
    common = [
        "warm_start=null", f"device={settings.device.type}", "dtype=fp32", "eval_dataset=null",
        "enable_thinking=false", "reward._component_=composer_tune.rewards.FormatReward",
        r"reward.pattern=\d*[13579]$", "micro_batch_size=64", *sizes,
        *(f"model.{k}={v}" for k, v in bench_grpo_vs_trl.RANDOM_MODELS[model].items()),
    ]  # fmt: skip
    variants = [" ".join([*common, f"rollout.max_staleness={k}"]) for k in (0, 1)]
    argv = ["--config", "cpu_smoke", "--threads", str(torch.get_num_threads()), *timing]
    args = bench_rl_step.parse_args([*argv, *(x for v in variants for x in ("--variant", v))])
    with tempfile.TemporaryDirectory() as tmp:
        results = bench_rl_step.measure_loops(args, Path(tmp))
    rows = []
    for staleness, result in enumerate(results):
        rows.append(
            {
                "max_staleness": staleness,
                "step_s": result["step_s"],
                "steps_per_hour": result["steps_per_hour"],
                "speed_up": result["speed_up"],
                "wait_s": result["wait_s"],
                "staleness": result["staleness"],
                "threads": result["threads"],
                "status": settings.verdict(result["speed_up"] > ASYNC_GOAL)
                if staleness
                else "INFO",
            }
        )
    return PartResult(
        columns=[
            ("max_staleness", "rollout.max_staleness", ""),
            ("step_s", "median s / step", ".3f"),
            ("steps_per_hour", "steps / hour", ".0f"),
            ("speed_up", "speed-up over 0", ".2f"),
            ("wait_s", "s a step waited for rollouts", ".3f"),
            ("staleness", "mean row staleness", ".2f"),
            ("threads", "CPU threads", ""),
        ],
        rows=rows,
        notes=[
            f"bench/bench_rl_step.py's loop mode (imported): recipes/grpo.py's train() on "
            f"random {model} ({', '.join(sizes)}), {args.warmup} warm-up + {args.repeats} timed "
            f"steps per block, {args.rounds} rounds, the two settings in turn; at staleness 1 "
            "the rollout worker (its own process, native engine) shares the device with the "
            "trainer and samples the next batch while the current one trains.",
            f"Goal: seconds per step at max_staleness 0 / at 1 > {ASYNC_GOAL:g}.",
        ],
    )
