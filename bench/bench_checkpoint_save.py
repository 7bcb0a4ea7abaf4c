"""What a periodic checkpoint costs: time and disk per `save_run_checkpoint` of a recipe config's
model with its AdamW state, as the recipes write it (HF weights, optimizer, RNG and recipe state;
older checkpoints pruned by ``keep_last``). The figures go into the configs' ``checkpoint`` headers.

    OMP_NUM_THREADS=1 python bench/bench_checkpoint_save.py --recipe grpo --config smollm2
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from composer_tune import config  # noqa: E402
from composer_tune.checkpointing.run_state import save_run_checkpoint  # noqa: E402
from composer_tune.distributed import DistInfo  # noqa: E402
from composer_tune.models.build import build_decoder  # noqa: E402

SCHEMAS = {"sft": "SFTConfig", "grpo": "GRPOConfig", "sdpo": "SDPOConfig"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="grpo", choices=sorted(SCHEMAS))
    parser.add_argument("--config", default="cpu_smoke")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    schema = getattr(importlib.import_module(f"recipes.{args.recipe}"), SCHEMAS[args.recipe])
    cfg = config.load_config(
        args.config,
        ["output_dir=/unused", "warm_start=null"]
        if args.recipe != "sft"
        else ["output_dir=/unused"],
        recipe_file=REPO / "recipes" / f"{args.recipe}.py",
        schema=schema,
    )
    one = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
    model = build_decoder(
        cfg.model,
        checkpoint=cfg.checkpoint.initial_checkpoint,
        dtype=torch.float32,
        dist_info=one,
        seed=0,
        activation_checkpointing=False,
        fsdp_cpu_offload=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for parameter in model.parameters():  # one step: AdamW's moments exist, as in a real run
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    times = []
    with tempfile.TemporaryDirectory() as output_dir:
        for step in range(1, args.saves + 1):
            start = time.perf_counter()
            path = save_run_checkpoint(
                output_dir=output_dir,
                step=step,
                model=model,
                model_config=model.config,
                optimizer=optimizer,
                lr_scheduler=None,
                recipe_state={"step": step},
                dist_info=one,
                tokenizer_dir=cfg.tokenizer.path,
                keep_last=1,
            )
            times.append(time.perf_counter() - start)
        size_mb = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"{args.recipe} --config {args.config}: {params:.1f}M parameters, {size_mb:.0f} MB per "
        f"checkpoint, {min(times):.2f}-{max(times):.2f} s per save ({args.saves} saves, "
        f"{args.threads} thread(s))"
    )


if __name__ == "__main__":
    main()
