"""The ``peer`` part: GRPO steps of composer-tune against TRL's ``GRPOTrainer`` in one process
(bench/bench_grpo_vs_trl.py's method)."""

from __future__ import annotations

from composer_tune.gpu_check.common import PEER_GOAL, PEER_PHASES, PartResult, Settings, require


def run_peer(settings: Settings) -> PartResult:
    require("torchtune", "trl", "datasets")
    from bench import bench_grpo_vs_trl as bench

    if settings.tiny:
        sizes = ["--model", "tiny", "--prompts", "2", "--group-size", "4"]
        sizes += ["--max-new-tokens", "8", "--repeats", "1"]
    else:
        # Every row runs to 128 tokens (same work on both sides) and six timed steps: with
        # 64 tokens and three steps an H200 step took 0.4 s and the verdict was within noise.
        sizes = ["--model", "qwen3-0.6b-4l", "--prompts", "8", "--group-size", "8"]
        sizes += ["--max-new-tokens", "128", "--no-stop", "--warmup", "2", "--repeats", "6"]
    # The recipe as it ships (each group's prompt once), then with one row per completion.
    variants = ["shared_prefix_forward=true", "shared_prefix_forward=false"]
    argv = [*sizes, "--device", settings.device.type, "--skip-memory"]
    argv += [item for variant in variants for item in ("--variant", variant)]
    args = bench.parse_args(argv)
    result = bench.measure(args)
    sides = result["sides"]
    trl_seconds = sides["trl"]["median_s"]
    rows = []
    for name, side in sides.items():
        label = name if name == "trl" else f"{name}: {side['variant']}"
        rows.append(
            {
                "side": label,
                "step_s": side["median_s"],
                **{phase: side["phases"][phase] for phase in PEER_PHASES},
                "completion_tokens": side["completion_tokens"],
                "ratio": trl_seconds / side["median_s"] if name != "trl" else None,
                # The goal is the recipe's step as it ships (the first variant).
                "status": settings.verdict(trl_seconds / side["median_s"] >= PEER_GOAL)
                if side.get("variant") == variants[0]
                else "INFO",
            }
        )
    setup = result["setup"]
    return PartResult(
        columns=[
            ("side", "side", ""),
            ("step_s", "median s / step", ".3f"),
            *((phase, f"{phase} s", ".3f") for phase in PEER_PHASES),
            ("completion_tokens", "mean completion tokens", ".1f"),
            ("ratio", "TRL / this side", ".2f"),
        ],
        rows=rows,
        notes=[
            f"bench/bench_grpo_vs_trl.py (imported): model {setup['model']} "
            f"({setup['params']:,} parameters), {setup['prompts']} prompts x "
            f"{setup['group_size']} completions, <= {setup['max_new_tokens']} new tokens, "
            f"{args.warmup} warm-up + {args.repeats} timed steps per side, alternating in one "
            "process, fp32 on both sides (the bench fixes it for its random models). Prompt "
            f"token ids identical between the two chat renderers: {setup['same_prompts']}.",
            f"Goal: TRL's median step / composer-tune's (the recipe as it ships, "
            f"{variants[0]}) >= {PEER_GOAL:g}.",
            *(
                f"not equal: {line}"
                for line in [*bench.NOT_EQUAL, *([bench.NO_STOP_NOT_EQUAL] if args.no_stop else [])]
            ),
        ],
    )
