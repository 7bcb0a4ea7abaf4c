"""torchrun worker for tests/test_qwen3_fsdp.py: FSDP2 training of the tiny Qwen3 vs one process.

Every rank builds the same seeded model, shards it with torchtune's ``shard_model`` (one FSDP
unit per layer plus the root), turns on activation checkpointing and trains on its half of a
fixed batch. Rank 0 also trains an unsharded copy on the whole batch in-process (the reference:
FSDP's gradient averaging over equal halves equals the full-batch mean gradient). Rank 0 writes
per-step losses and the largest final-weight difference for every case to the JSON file named
on the command line.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules import TiedLinear, TransformerSelfAttentionLayer
from torchtune.training import set_activation_checkpointing, shard_model

from composer_tune.distributed import finish_process, setup_distributed, teardown_distributed
from composer_tune.models import qwen3_tiny

VOCAB = 96
BATCH = 4  # split 2 + 2 over the ranks
SEQ = 12
STEPS = 3
# (name, tied embeddings, optimizer, use head_fn for the loss)
CASES = [
    ("tied_adamw_head_fn", True, "adamw", True),
    ("untied_adamw", False, "adamw", False),
    ("untied_sgd_head_fn", False, "sgd", True),
]


def _loss_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _chunked_head_loss(targets: torch.Tensor) -> Callable[[torch.Tensor, object], torch.Tensor]:
    """A head_fn that never builds full logits: token log-probs two positions at a time."""

    def head_fn(h_normed: torch.Tensor, output: nn.Module | TiedLinear) -> torch.Tensor:
        picked = []
        for h_chunk, t_chunk in zip(h_normed.split(2, dim=1), targets.split(2, dim=1), strict=True):
            logp = torch.log_softmax(output(h_chunk).float(), dim=-1)
            picked.append(logp.gather(-1, t_chunk.unsqueeze(-1)).squeeze(-1))
        return -torch.cat(picked, dim=1).mean()

    return head_fn


def _step_loss(model: nn.Module, tokens: torch.Tensor, use_head_fn: bool) -> torch.Tensor:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if use_head_fn:
        return model(inputs, head_fn=_chunked_head_loss(targets))
    return _loss_from_logits(model(inputs), targets)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _train(model: nn.Module, tokens: torch.Tensor, opt_name: str, use_head_fn: bool) -> list[float]:
    """Train STEPS steps; return the loss of the full batch at each step (averaged over ranks)."""
    optimizer = _optimizer(opt_name, model.parameters())
    losses = []
    for _ in range(STEPS):
        loss = _step_loss(model, tokens, use_head_fn)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if dist.is_initialized() and isinstance(next(model.parameters()), DTensor):
            dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        losses.append(reported.item())
    return losses


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def main(out_path: str) -> None:
    setup_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise RuntimeError(f"expected 2 ranks, got {world}")
    torch.manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    local = tokens.chunk(world)[rank]
    results = {}
    for name, tied, opt_name, use_head_fn in CASES:
        torch.manual_seed(0)
        model = qwen3_tiny(vocab_size=VOCAB, tie_word_embeddings=tied, max_seq_len=32)
        reference = copy.deepcopy(model)
        initial = _full_state(reference)
        if tied:
            # deepcopy keeps TiedLinear pointing at the copy's own embedding.
            assert reference.output.tied_module is reference.tok_embeddings
        set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
        shard_model(
            model,
            [lambda _name, module: isinstance(module, TransformerSelfAttentionLayer)],
            cpu_offload=False,
        )
        fsdp_losses = _train(model, local, opt_name, use_head_fn)
        state = _full_state(model)
        if rank == 0:
            # The reference always uses plain logits, so this also checks head_fn under FSDP2.
            ref_losses = _train(reference, tokens, opt_name, use_head_fn=False)
            ref_state = _full_state(reference)
            results[name] = {
                "fsdp_losses": fsdp_losses,
                "ref_losses": ref_losses,
                "keys_match": sorted(state) == sorted(ref_state),
                "has_output_weight": "output.weight" in state,
                "still_tied": isinstance(model.output, TiedLinear)
                and model.output.tied_module is model.tok_embeddings,
                "max_weight_diff": max((state[k] - ref_state[k]).abs().max().item() for k in state),
                "max_weight_change": max(
                    (ref_state[k] - initial[k]).abs().max().item() for k in ref_state
                ),
            }
        dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    teardown_distributed()


if __name__ == "__main__":
    finish_process(lambda: main(sys.argv[1]))
