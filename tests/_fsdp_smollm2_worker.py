"""torchrun worker for tests/test_smollm2.py: one FSDP2 training step on SmolLM2-135M-Instruct.

Every rank builds the decoder the way the recipes do (``build_decoder``: meta init, FSDP2
sharding, the HF checkpoint loaded shard by shard), takes its half of a fixed batch, and runs
one AdamW step with activation checkpointing. Rank 0 writes the global mean loss and, after the
step, the full updated weights of a few parameters to the file named on the command line.
Run with one process it is the unsharded reference.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import training

from composer_tune.distributed import (
    all_reduce_sum,
    finish_process,
    setup_distributed,
    teardown_distributed,
)
from composer_tune.models.build import build_decoder

WATCHED = (
    "tok_embeddings.weight",
    "layers.0.attn.q_proj.weight",
    "layers.29.mlp.w2.weight",
    "norm.scale",
)


def main(checkpoint: str, out: str) -> None:
    dist_info = setup_distributed("cpu")
    model_cfg = OmegaConf.create(
        {
            "_component_": "composer_tune.models.from_pretrained",
            "path": checkpoint,
            "max_seq_len": 64,
        }
    )
    model = build_decoder(
        model_cfg,
        checkpoint=checkpoint,
        dtype=torch.float32,
        dist_info=dist_info,
        seed=0,
        activation_checkpointing=True,
        fsdp_cpu_offload=False,
    )
    tokens = torch.randint(0, 49152, (4, 24), generator=torch.Generator().manual_seed(0))
    rows = tokens.chunk(dist_info.world_size)[dist_info.rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    logits = model(rows[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()  # FSDP2 averages gradients over ranks: equal halves give the batch mean
    optimizer.step()
    global_loss = all_reduce_sum(loss.detach().clone()) / dist_info.world_size
    state = (
        training.gather_cpu_state_dict(model, dist_info.is_main)
        if dist_info.is_distributed
        else model.state_dict()
    )
    if dist_info.is_main:
        torch.save({"loss": global_loss.item(), **{k: state[k] for k in WATCHED}}, out)
    teardown_distributed()


if __name__ == "__main__":
    finish_process(lambda: main(sys.argv[1], sys.argv[2]))
