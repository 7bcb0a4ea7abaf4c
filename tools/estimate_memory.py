"""Per-GPU peak memory of a recipe config (or a bare model shape), component by component.

    python tools/estimate_memory.py --config qwen3_7b --recipe grpo --world-size 8
    python tools/estimate_memory.py --config path/to/run.yaml --world-size 4 batch_size=2
    python tools/estimate_memory.py --model qwen3_32b --world-size 8 --batch-size 1 --seq-len 4096

``--config`` takes a bare name (``recipes/configs/<recipe>/<name>.yaml``) or a YAML path;
``key=value`` arguments override config keys as ``tune run`` does. Which models an RL config
builds (reference, EMA teacher) and whether it samples rollouts are what the recipes' own
``ComposerChannels`` says at that world size. Flags override what the config says. Values
neither gives are assumed (documented defaults) and listed. The model, its
assumptions and the measured error of the estimate are in docs/memory.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/estimate_memory.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from composer_tune.analysis import memory  # noqa: E402
from composer_tune.config import ConfigError, resolve_config_path  # noqa: E402

# Flag name -> MemoryPlan field; None defaults mean "not given".
PLAN_FLAGS = {
    "batch_size": "micro_batch_size",
    "seq_len": "seq_len",
    "dtype": "param_dtype",
    "chunk_size": "logprob_chunk_size",
    "rollout_batch_size": "rollout_batch_size",
    "prompt_len": "prompt_len",
    "completion_len": "completion_len",
    "activation_checkpointing": "activation_checkpointing",
    "cpu_offload": "cpu_offload",
    "master_weights": "master_weights",
    "reference_model": "reference_model",
    "ema_teacher": "ema_teacher",
    "grad_dtype": "grad_dtype",
    "optimizer_state_dtype": "optimizer_state_dtype",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="config name (see --recipe) or YAML path")
    source.add_argument("--model", help="a composer_tune.models preset, e.g. qwen3_8b")
    parser.add_argument("--recipe", default="grpo", help="recipe whose configs --config names")
    parser.add_argument("--world-size", type=int, help="FSDP2 ranks (GPUs); default 1")
    parser.add_argument("--batch-size", type=int, help="sequences per training forward per rank")
    parser.add_argument("--seq-len", type=int, help="tokens per training sequence")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="parameter/compute dtype")
    parser.add_argument("--chunk-size", type=int, help="logprob_chunk_size")
    parser.add_argument("--grad-dtype", choices=["bf16", "fp32"], help="stored gradients")
    parser.add_argument(
        "--optimizer-state-dtype",
        choices=["bf16", "fp32"],
        help="AdamW moments (default: that of the stored parameters, as torch.optim.AdamW)",
    )
    parser.add_argument("--rollout-batch-size", type=int, help="sequences sampled at once/rank")
    parser.add_argument("--prompt-len", type=int, help="rollout prompt length")
    parser.add_argument("--completion-len", type=int, help="rollout max_new_tokens")
    for name, text in (
        ("activation-checkpointing", "checkpoint every layer"),
        ("cpu-offload", "FSDP2 CPUOffloadPolicy: params/grads/optimizer on the host"),
        ("master-weights", "fp32 sharded master weights, bf16 compute"),
        ("reference-model", "a frozen reference copy (default: as the recipe builds one)"),
        ("ema-teacher", "an EMA copy of the policy (default: as the recipe builds one)"),
    ):
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, help=text)
    parser.add_argument("--gpu-gib", type=float, default=79.2, help="usable GPU memory (GiB)")
    parser.add_argument("--reserve-gib", type=float, default=3.0, help="CUDA context, NCCL")
    parser.add_argument("--fragmentation", type=float, default=0.05, help="allocator margin")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser.parse_args(argv)


def read_config(ns: argparse.Namespace) -> DictConfig:
    """The config with its ``key=value`` overrides, neither validated nor resolved: the
    estimate needs the shape keys only, and a launch config's required run values
    (``checkpoint.initial_checkpoint: ???``, data paths) should not be needed for it."""
    path = resolve_config_path(ns.config, REPO_ROOT / "recipes" / f"{ns.recipe}.py")
    bad = [item for item in ns.overrides if "=" not in item]
    if bad:
        raise ValueError(f"overrides must be key=value, got {bad}")
    try:
        return OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(ns.overrides))
    except Exception as err:  # noqa: BLE001 - YAML and OmegaConf errors alike
        raise ValueError(f"cannot read config {path}: {err}") from None


def build_plan(ns: argparse.Namespace) -> memory.ConfigPlan:
    """The plan the command line describes (config + overrides + flags)."""
    flags = {field: getattr(ns, flag) for flag, field in PLAN_FLAGS.items()}
    if ns.config is not None:
        return memory.plan_from_config(
            read_config(ns), world_size=ns.world_size, gpu_gib=ns.gpu_gib, **flags
        )
    if ns.overrides:
        raise ValueError(f"key=value overrides {ns.overrides} need --config")
    if ns.seq_len is None:  # the model's max_seq_len (40960) would be a useless default
        raise ValueError("--model needs --seq-len (tokens per training sequence)")
    # A GPU run of the recipes' shape: bf16, torch AdamW; flags change the rest.
    node = OmegaConf.create(
        {
            "model": {"_component_": f"composer_tune.models.{ns.model}"},
            "device": "cuda",
            "dtype": "bf16",
            "optimizer": {"_component_": "torch.optim.AdamW"},
        }
    )
    if flags["seq_len"] is not None:  # a shorter RoPE table; the shape is the same
        node.model.max_seq_len = flags["seq_len"]
    return memory.plan_from_config(node, world_size=ns.world_size, **flags)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        plan = build_plan(ns)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    estimate = memory.estimate_memory(plan.args, plan.plan)
    fit = memory.fit_report(
        estimate,
        capacity_gib=ns.gpu_gib,
        reserve_gib=ns.reserve_gib,
        fragmentation=ns.fragmentation,
    )
    args = plan.args
    print(
        f"model: {memory.count_params(args) / 1e6:,.1f}M parameters, {args.num_layers} layers, "
        f"dim {args.embed_dim}, ffn {args.intermediate_dim}, heads {args.num_heads}/"
        f"{args.num_kv_heads}, vocab {args.vocab_size}"
    )
    print(f"plan: {plan.plan}")
    assumed = plan.assumed()
    if assumed:
        print("assumed (no config key or flag gave these):")
        for line in assumed:
            print(f"  {line}")
    print()
    print(memory.format_table(estimate, fit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
