"""Process-group set-up and FSDP2 helpers shared by the recipes.

One code path serves a single CPU process, ``torchrun`` on CPU (gloo) and ``torchrun`` on GPUs
(nccl): outside torchrun the collectives below are no-ops.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torchtune import training

T = TypeVar("T")

# The shell's convention for a process ended by SIGINT (128 + 2): scripts see "interrupted".
# A stopped recipe exits with it (composer_tune.stop re-exports it), and so does a process
# that ``finish_process`` ends after a KeyboardInterrupt. Defined here, below stop.py, which
# imports this module.
STOPPED_EXIT_CODE = 130

# Set once this process starts a gloo process group: see ``finish_process``.
_started_gloo = False


@dataclass(frozen=True)
class DistInfo:
    world_size: int
    rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str) -> DistInfo:
    """Initialises the process group when launched by torchrun and picks this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("config asks for device: cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    elif device == "cpu":
        torch_device = torch.device("cpu")
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got '{device}'")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        global _started_gloo
        _started_gloo = _started_gloo or backend == "gloo"
    return DistInfo(world_size=world_size, rank=rank, device=torch_device)


def shard_decoder(
    model: nn.Module, *, cpu_offload: bool = False, reshard_after_forward: bool = True
) -> None:
    """FSDP2-shards each transformer layer (``model.decoder_layers()``: a mixture of experts'
    layer holds all its experts, gathered whole in its forward), then the root (embeddings,
    final norm, output)."""
    layers = {id(layer) for layer in model.decoder_layers()}
    training.shard_model(
        model,
        [lambda _name, module: id(module) in layers],
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
    )


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place and returned); identity in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (a max all-reduce: collective, every rank gets the
    same answer); ``flag`` itself in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def min_over_ranks(value: int, device: torch.device | None, sync_ranks: bool) -> int:
    """``value``'s minimum over every rank (collective under ``sync_ranks``; else ``value``)."""
    if not sync_ranks:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def teardown_distributed() -> None:
    """Leave the process group together: a barrier first, so that no rank destroys the group
    (closing its gloo connections) while another still has a collective in flight. Destroying
    it joins gloo's worker threads only if nothing else holds the group; FSDP2's DeviceMesh
    does, which is why recipes end through ``finish_process``."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def finish_process(run: Callable[[], T]) -> T:
    """Returns ``run()``, except in a process that started a gloo group (``setup_distributed``):
    that process ends here with ``os._exit`` and the status Python would give it (0,
    ``SystemExit``'s code, or 1 after printing the traceback), output flushed, without
    finalizing the interpreter.

    Why: PyTorch 2.13's backward pass stashes a Python object in the thread-local state that
    every collective issued during it copies (pytorch#173568), FSDP2 issues gloo collectives
    there, and gloo's worker threads release finished work themselves. Those threads outlive
    ``destroy_process_group`` while any DeviceMesh holds the group, so one may still be
    releasing such work when the interpreter finalizes: it then cannot take the GIL, exits
    inside a noexcept destructor, and the process aborts ("terminate called without an active
    exception"), in about one 2-rank run in ten on a 2-core machine.
    """
    try:
        result = run()
    except SystemExit as exit_request:
        if not _started_gloo:
            raise
        status = _exit_status(exit_request.code)
    except BaseException as error:
        if not _started_gloo:
            raise
        sys.excepthook(type(error), error, error.__traceback__)
        status = STOPPED_EXIT_CODE if isinstance(error, KeyboardInterrupt) else 1
    else:
        if not _started_gloo:
            return result
        status = _exit_status(result)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives a process."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def gather_generator_states(generator: torch.Generator, dist_info: DistInfo) -> list[torch.Tensor]:
    """Every rank's state of ``generator`` (collective), indexed by rank: rank 0 writes a run
    checkpoint's recipe state alone, and each rank restores its own entry on resume."""
    state = generator.get_state()
    gathered = torch.zeros((dist_info.world_size, state.numel()), dtype=torch.int64)
    gathered[dist_info.rank] = state.long()
    gathered = all_reduce_sum(gathered.to(dist_info.device)).cpu()
    return [row.to(torch.uint8) for row in gathered]


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """The process's peak memory so far, for metric logs: CUDA's allocator peak on a GPU, the
    resident-set high-water mark elsewhere (Linux reports ``ru_maxrss`` in KiB)."""
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
