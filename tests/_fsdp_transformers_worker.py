"""torchrun worker for tests/test_transformers_backend_fsdp.py: FSDP2 training of
transformers-backend models on 2 ranks vs one process.

Every rank builds each checkpoint's model the recipes' way (``build_decoder``: meta device,
activation checkpointing, FSDP2 per decoder layer, sharded load) and trains on its half of a
fixed batch with the chunked log-prob head inside the sharded forward. Rank 0 also trains an
unsharded copy (``build_decoder`` in one process) on the whole batch: FSDP's gradient average
over equal halves equals the full-batch mean gradient. Rank 0 writes per-step losses, the
largest final-weight difference and whether a tied output projection is still tied, per
checkpoint, to the JSON file named first on the command line; the checkpoints follow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from composer_tune.distributed import (
    DistInfo,
    finish_process,
    setup_distributed,
    teardown_distributed,
)
from composer_tune.losses.logprobs import logprob_head
from composer_tune.models.build import build_decoder
from tests._fsdp_worker import _full_state

STEPS = 3


def _build(path: Path, dist_info: DistInfo, sharded: bool) -> nn.Module:
    section = {"_component_": "composer_tune.models.from_pretrained", "path": str(path)}
    return build_decoder(
        OmegaConf.create({**section, "backend": "transformers"}),
        checkpoint=path,
        dtype=torch.float32,
        dist_info=dist_info if sharded else DistInfo(1, 0, torch.device("cpu")),
        seed=0,
        activation_checkpointing=sharded,
        fsdp_cpu_offload=False,
    ).train()


def _train(model: nn.Module, tokens: torch.Tensor, average_ranks: bool) -> list[float]:
    # SGD: its update is linear in the gradient, so the weights compare as closely as the
    # gradients do (AdamW's normalisation magnifies rounding in near-zero entries).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        logprobs = model(tokens[:, :-1], head_fn=logprob_head(tokens[:, 1:], chunk_size=5))
        loss = -logprobs.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if average_ranks:
            dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        losses.append(reported.item())
    return losses


def main(out_path: str, checkpoints: list[str]) -> None:
    dist_info = setup_distributed("cpu")
    torch.manual_seed(1234)
    results = {}
    for checkpoint in map(Path, checkpoints):
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        tokens = torch.randint(3, vocab, (4, 12))
        local = tokens.chunk(dist_info.world_size)[dist_info.rank]
        model = _build(checkpoint, dist_info, sharded=True)
        losses = _train(model, local, average_ranks=True)
        state = _full_state(model)
        head = model.get_submodule("lm_head").weight
        still_tied = head is model.tok_embeddings.weight
        if dist_info.is_main:
            reference = _build(checkpoint, dist_info, sharded=False)
            initial = _full_state(reference)
            reference_losses = _train(reference, tokens, average_ranks=False)
            reference_state = _full_state(reference)
            results[checkpoint.name] = {
                "fsdp_losses": losses,
                "reference_losses": reference_losses,
                "max_weight_diff": max(
                    (state[k] - reference_state[k]).abs().max().item() for k in state
                ),
                "max_weight_change": max(
                    (reference_state[k] - initial[k]).abs().max().item() for k in initial
                ),
                "still_tied": still_tied,
            }
        dist.barrier()
    if dist_info.is_main:
        Path(out_path).write_text(json.dumps(results, indent=2))
    teardown_distributed()


if __name__ == "__main__":
    finish_process(lambda: main(sys.argv[1], sys.argv[2:]))
