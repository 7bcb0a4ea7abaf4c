"""torchrun worker of tests/test_vllm_engine.py: the vLLM engine beside an FSDP2-sharded policy
on 2 gloo ranks, one engine per rank (``tensor_parallel_size`` 1) or one shared by both (2).

    python -m torch.distributed.run --nproc_per_node 2 tests/_vllm_torchrun_worker.py OUT TP [MEET]

Each rank samples its own prompts (rank 1's are longer and more), and writes to OUT/rank<r>.json
whether greedy decoding equalled an unsharded copy's native decoding, and the largest gap
between the engine's and the sharded trainer's log-probs before and after the trainer's weights
change and are pushed (and, as a control, after they change without a push).

With MEET, a folder shared with another launch of this worker, rank 0 waits there until both
launches' engines have started, records the shared-memory segments of vLLM's CPU tensor
parallelism it has mapped (``shm_segments``), and waits until both have recorded them before
going on: the two engines live at once.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.distributed import (
    finish_process,
    setup_distributed,
    shard_decoder,
    teardown_distributed,
)
from composer_tune.rollout.engines import VLLMSection
from composer_tune.rollout.generation import generate, pack_sequences
from composer_tune.rollout.rollouts import sequence_logprobs
from composer_tune.rollout.vllm_engine import VLLMEngine

REPO_ROOT = Path(__file__).resolve().parent.parent


def _gap(engine: VLLMEngine, model: torch.nn.Module, prompts: list[list[int]], seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    out = engine.generate(prompts, max_new_tokens=8, temperature=1.0, generator=generator)
    packed = pack_sequences(prompts, out.completions, 0)
    with torch.no_grad():  # a sharded forward: both ranks run it
        trainer = sequence_logprobs(model, packed.tokens, packed.input_pos, packed.completion_mask)
    sampler = torch.zeros_like(trainer)
    sampler[packed.completion_mask] = torch.cat(out.logprobs)
    return float((trainer - sampler).abs().max())


def _meet(folder: Path, stage: str) -> None:
    """Announces ``stage`` for this launch in ``folder`` and waits until the other launch has
    announced it too (generous: two launches share the machine with whatever else runs)."""
    (folder / f"{stage}_{os.environ['MASTER_PORT']}").touch()
    deadline = time.monotonic() + 600
    while len(list(folder.glob(f"{stage}_*"))) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other launch did not reach {stage!r} within 600 s")
        time.sleep(0.1)


def main(out_dir: Path, tensor_parallel_size: int, meet: Path | None) -> None:
    dist_info = setup_distributed("cpu")
    section = OmegaConf.load(REPO_ROOT / "recipes" / "configs" / "grpo" / "cpu_smoke.yaml").model
    torch.manual_seed(0)
    policy = config.instantiate(section, initializer_range=0.5).eval()
    reference = copy.deepcopy(policy)
    shard_decoder(policy)
    engine = VLLMEngine(
        policy,
        dist_info,
        VLLMSection(tensor_parallel_size=tensor_parallel_size),
        run_dtype="fp32",
        seed=0,
    )
    segments = None
    if meet is not None and dist_info.rank == 0:
        _meet(meet, "started")
        maps = Path("/proc/self/maps").read_text()
        segments = sorted(set(re.findall(r"/dev/shm/(\S*cpushm\S*)", maps)))
        _meet(meet, "recorded")
    if dist_info.rank == 0:
        prompts = [[5, 9, 33, 100], [7, 8]]
    else:
        prompts = [[900, 3, 4, 5, 6, 7, 12], [11, 12, 13], [40, 41, 42, 43, 44]]
    greedy = engine.generate(prompts, max_new_tokens=8, temperature=0.0)
    native = generate(reference, prompts, max_new_tokens=8, pad_id=0, greedy=True)
    result = {
        "rows": len(greedy.completions),
        "greedy_equal": greedy.completions == native.completions,
        "gap_at_start": _gap(engine, policy, prompts, seed=1),
        "shm_segments": segments,
    }
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    result["gap_without_push"] = _gap(engine, policy, prompts, seed=2)
    engine.sync_weights(policy, version=1)
    result["gap_after_push"] = _gap(engine, policy, prompts, seed=2)
    engine.close()
    (out_dir / f"rank{dist_info.rank}.json").write_text(json.dumps(result))
    teardown_distributed()


if __name__ == "__main__":
    meet_folder = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    finish_process(lambda: main(Path(sys.argv[1]), int(sys.argv[2]), meet_folder))
