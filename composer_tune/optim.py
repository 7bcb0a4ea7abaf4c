"""Muon for every recipe, correct under FSDP2: ``optimizer._component_=composer_tune.optim.Muon``.

Muon (Keller Jordan, 2024; "Muon is Scalable for LLM Training", arXiv 2502.16982) steps each
hidden weight matrix along the orthogonalised momentum of its gradient: a few Newton-Schulz
iterations turn the momentum ``M = U S V^T`` into roughly ``U V^T``. Embeddings, the output head,
norms and biases keep AdamW. :class:`Muon` is one optimizer holding both: it splits a model's
named parameters by shape and name (:func:`split_parameters`), steps the matrices itself and
the rest with ``torch.optim.AdamW``'s own step, and saves one state dict (a fp32
``momentum_buffer`` per matrix; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq`` for the rest).

Under FSDP2 each rank holds a row block of every matrix, and orthogonalising a block is not
orthogonalising the matrix. The step therefore sends whole matrices to owners: matrices are
ordered by size and dealt round-robin, ``world_size`` at a time; in each round one
``all_to_all`` sends every rank's block of matrix ``k`` to rank ``k``, which assembles the
matrix, runs Newton-Schulz and sends each rank its block of the result with a second
``all_to_all``. Each rank sends (and receives) about ``2 / world_size`` of the matrices'
elements per step in the Newton-Schulz dtype (bf16 where the device multiplies it natively),
where gathering every matrix on every rank would bring each rank all of them and repeat every
orthogonalisation ``world_size`` times. A stacked mixture-of-experts weight ``[experts, out, in]`` is
orthogonalised one expert at a time; FSDP2 shards it on the expert dimension, so each rank
holds whole experts and needs no communication. A fused matrix (``gate_up_proj``: the gate's
rows above the up projection's) is orthogonalised as its parts.

Single-process, on the same matrices, the step equals ``torch.optim.Muon``'s (and AdamW's on the
rest); tests/test_muon.py checks that, under FSDP2 on two processes too, and exact resume.
docs/muon.md has the details and the cost.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

# Keller Jordan's quintic Newton-Schulz coefficients (torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ADJUST_LR_FNS = ("original", "match_rms_adamw")
# Parameters kept on AdamW whatever their shape (regular expressions searched in the name):
# input embeddings (``tok_embeddings``, ``embed_tokens``), the output head (``lm_head``, the
# native decoder's untied ``output``).
ADAMW_PATTERNS = (r"embed", r"lm_head", r"(^|\.)output\.weight$")
# Matrices that are several matrices stacked along their rows, and into how many parts.
FUSED_PARTS = {r"gate_up_proj": 2}


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    parts: int = 1,
) -> torch.Tensor:
    """The approximate orthogonalisation ``U S' V^T`` (``S'`` near 1) of each matrix in the last
    two dimensions of ``matrix``, in its dtype; ``parts`` > 1 splits each along its rows into
    that many matrices first. For one 2-D matrix it computes exactly what ``torch.optim.Muon``
    does (same operations, same order)."""
    if parts > 1:
        *batch, rows, cols = matrix.shape
        if rows % parts:
            raise ValueError(f"a matrix of {rows} rows does not split into {parts} parts")
        split = matrix.reshape(*batch, parts, rows // parts, cols)
        return newton_schulz(split, coefficients, steps, eps).reshape(matrix.shape)
    a, b, c = coefficients
    tall = matrix.size(-2) > matrix.size(-1)
    x = matrix.mT if tall else matrix
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        batch_shape = x.shape[:-2]
        x = x.reshape(-1, *x.shape[-2:])
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(*batch_shape, *x.shape[-2:])
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str, rows: int, cols: int) -> float:
    """The learning rate of a ``rows x cols`` matrix's orthogonalised update: ``original``
    (Keller Jordan's) scales by ``sqrt(max(1, rows / cols))``, ``match_rms_adamw`` (Moonlight's)
    by ``0.2 sqrt(max(rows, cols))``, which gives the update AdamW's typical RMS so that AdamW's
    learning rate and weight decay carry over."""
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def split_parameters(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    adamw_patterns: Sequence[str] = ADAMW_PATTERNS,
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(Muon's, AdamW's): parameters of two or more dimensions go to Muon (a 3-D one is a stack
    of matrices, e.g. a mixture of experts' weights) unless their name matches one of
    ``adamw_patterns``; the rest (norms, biases, embeddings, output head) to AdamW."""
    patterns = [re.compile(pattern) for pattern in adamw_patterns]
    muon, adamw = [], []
    for name, param in named_parameters:
        is_matrix = param.ndim >= 2 and not any(p.search(name) for p in patterns)
        (muon if is_matrix else adamw).append((name, param))
    return muon, adamw


def optimizer_parameters(optimizer_cfg: DictConfig, model: nn.Module) -> Iterable[Any]:
    """What the optimizer ``optimizer_cfg`` names is built over: ``model.named_parameters()``
    for one that splits parameters by name (a class with ``takes_parameter_names``, as
    :class:`Muon`), ``model.parameters()`` for any other."""
    from torchtune.config._utils import _get_component_from_path

    component = _get_component_from_path(optimizer_cfg._component_)
    if getattr(component, "takes_parameter_names", False):
        return model.named_parameters()
    return model.parameters()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage: in-place changes reach the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_dim(param: torch.Tensor, name: str) -> int | None:
    """The matrix dimension (one of the last two) ``param`` is sharded on across ranks, or None
    when each rank holds whole matrices: not a DTensor, replicated, or sharded on a leading
    (expert) dimension. Raises for layouts the step does not handle."""
    if not isinstance(param, DTensor):
        return None
    if param.device_mesh.ndim != 1:
        raise ValueError(
            f"Muon: parameter {name!r} is laid out on a {param.device_mesh.ndim}-D device mesh; "
            "only a 1-D mesh (FSDP2 over all ranks) is supported"
        )
    placement = param.placements[0]
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, Shard):
        raise ValueError(f"Muon: parameter {name!r} has placement {placement}: not supported")
    dim = placement.dim % param.ndim
    return dim if dim >= param.ndim - 2 else None


def _block_sizes(length: int, world_size: int) -> list[int]:
    """Each rank's share of a dimension of ``length`` sharded ``Shard``-style (torch.chunk)."""
    block = math.ceil(length / world_size)
    return [max(0, min(block, length - rank * block)) for rank in range(world_size)]


@dataclass
class _Matrix:
    """A sharded Muon parameter in a round: its update (this rank's block, Newton-Schulz
    dtype), its fused parts and the dimension it is sharded on."""

    param: torch.Tensor
    update: torch.Tensor
    parts: int
    sharded_dim: int


class Muon(torch.optim.Optimizer):
    """Muon on the hidden weight matrices, AdamW on the rest, in one optimizer; correct under
    FSDP2 (module docstring). Built over ``model.named_parameters()`` (the recipes do that for
    any optimizer with ``takes_parameter_names``). The keyword arguments that AdamW configs set
    (``lr``, ``betas``, ``eps``, ``weight_decay``, ``fused``, ``foreach``) keep their meaning,
    so replacing ``optimizer._component_`` alone switches a config to Muon.

    Args:
        params: ``(name, parameter)`` pairs.
        lr: learning rate of both parts: with ``adjust_lr_fn="match_rms_adamw"`` (the default)
            a matrix's update has AdamW's typical RMS, so AdamW's tuned rate is a start.
        weight_decay: decoupled weight decay of both parts (times ``lr``, unadjusted, as
            ``torch.optim.Muon``).
        momentum: Muon's momentum (an exponential average of gradients).
        nesterov: orthogonalise ``grad.lerp(momentum_buffer, momentum)`` instead of the buffer.
        adjust_lr_fn: ``"match_rms_adamw"`` or ``"original"`` (:func:`adjusted_lr`).
        ns_coefficients, ns_steps, ns_eps: the Newton-Schulz iteration (torch.optim.Muon's).
        ns_dtype: dtype of the iteration and of its communication: ``"bf16"``, ``"fp32"`` or
            ``"auto"`` (bf16 where the parameter's device multiplies it natively: a GPU or a
            CPU with AVX512-BF16; fp32 elsewhere). The momentum is fp32 whatever this says.
        adamw_lr: AdamW's learning rate when it should differ from ``lr`` (None: ``lr``; with
            ``adjust_lr_fn="original"`` Muon's rate is typically ~0.02, AdamW's far lower).
        betas, eps, fused, foreach: AdamW's, for the rest.
        adamw_patterns: regular expressions; a matrix whose name matches one stays on AdamW.
        fused_parts: ``{pattern: n}``: a matrix whose name matches is ``n`` matrices stacked
            along its rows, orthogonalised separately.
    """

    takes_parameter_names = True

    def __init__(
        self,
        params: Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
        ns_steps: int = NS_STEPS,
        ns_eps: float = NS_EPS,
        ns_dtype: str = "auto",
        adamw_lr: float | None = None,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
        foreach: bool | None = None,
        adamw_patterns: Sequence[str] = ADAMW_PATTERNS,
        fused_parts: Mapping[str, int] = FUSED_PARTS,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}"
            )
        if ns_dtype not in (*NS_DTYPES, "auto"):
            raise ValueError(
                f"Muon: ns_dtype must be one of {[*NS_DTYPES, 'auto']}, got {ns_dtype!r}"
            )
        if len(ns_coefficients) != 3 or ns_steps < 1:
            raise ValueError("Muon: ns_coefficients must be 3 numbers and ns_steps >= 1")
        named = list(params)
        if not all(isinstance(item, tuple) and len(item) == 2 for item in named):
            raise TypeError(
                "Muon splits parameters by name: build it over model.named_parameters()"
            )
        muon, adamw = split_parameters(named, adamw_patterns)
        parts_patterns = [(re.compile(p), int(n)) for p, n in fused_parts.items()]
        self._parts: dict[torch.Tensor, int] = {}
        self._sharded_dims: dict[torch.Tensor, int | None] = {}
        for name, param in muon:
            parts = next((n for p, n in parts_patterns if p.search(name)), 1)
            if param.shape[-2] % parts:
                raise ValueError(
                    f"Muon: {name!r} of shape {tuple(param.shape)} does not split into {parts} "
                    "fused parts along its rows (fused_parts)"
                )
            self._parts[param] = parts
            self._sharded_dims[param] = _sharded_dim(param, name)
        groups = []
        if muon:
            groups.append(
                {
                    "params": [param for _, param in muon],
                    "muon": True,
                    "lr": lr,
                    "weight_decay": weight_decay,
                    "momentum": momentum,
                    "nesterov": nesterov,
                    "adjust_lr_fn": adjust_lr_fn,
                    "ns_coefficients": tuple(ns_coefficients),
                    "ns_steps": ns_steps,
                    "ns_eps": ns_eps,
                    "ns_dtype": ns_dtype,
                }
            )
        adamw_group = {
            "params": [param for _, param in adamw],
            "muon": False,
            "lr": lr if adamw_lr is None else adamw_lr,
        }
        # AdamW's own step runs on our AdamW group and state (re-pointed before every step:
        # load_state_dict replaces both); it fills the group with its settings.
        self._adamw = (
            torch.optim.AdamW(
                [adamw_group],
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                fused=fused,
                foreach=foreach,
            )
            if adamw
            else None
        )
        if adamw:
            groups.append(adamw_group)
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - torch.optim.Optimizer's
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        """Matrices held whole first, then the sharded ones a round at a time (module
        docstring): only one round's updates exist at once."""
        ns = {
            "coefficients": group["ns_coefficients"],
            "steps": group["ns_steps"],
            "eps": group["ns_eps"],
        }
        params = [param for param in group["params"] if param.grad is not None]
        sharded: dict[Any, list[torch.Tensor]] = {}
        for param in params:
            if self._sharded_dims[param] is None:
                update = self._update(param, group, param.device)
                self._apply(param, newton_schulz(update, parts=self._parts[param], **ns), group)
                del update  # before the next matrix's: one matrix's temporaries at a time
            else:
                sharded.setdefault(param.device_mesh, []).append(param)
        for mesh, members in sharded.items():
            process_group = mesh.get_group()
            world_size = dist.get_world_size(process_group)
            device = _exchange_device(process_group, members[0].device)
            members.sort(key=lambda param: -param.numel())  # stable: the same order on every rank
            for start in range(0, len(members), world_size):
                matrices = [
                    _Matrix(param, self._update(param, group, device), self._parts[param],
                            self._sharded_dims[param])
                    for param in members[start : start + world_size]
                ]  # fmt: skip
                blocks = _orthogonalise_round(matrices, process_group, ns)
                for matrix, ortho in zip(matrices, blocks, strict=True):
                    self._apply(matrix.param, ortho, group)
                del matrices, blocks, ortho  # before the next round's: one round at a time

    def _update(
        self, param: torch.Tensor, group: dict[str, Any], device: torch.device
    ) -> torch.Tensor:
        """The momentum step (fp32, where the state lives) and the update to orthogonalise:
        this rank's block of it, on ``device`` in the Newton-Schulz dtype."""
        momentum = group["momentum"]
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
        grad = _local(param.grad).float()
        buffer = _local(state["momentum_buffer"])
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        return update.to(device, newton_schulz_dtype(group["ns_dtype"], device))

    def _apply(self, param: torch.Tensor, ortho: torch.Tensor, group: dict[str, Any]) -> None:
        """Decoupled weight decay, then the orthogonalised update at the matrix's rate."""
        lr = float(group["lr"])
        rows, cols = param.shape[-2] // self._parts[param], param.shape[-1]
        local = _local(param)
        local.mul_(1 - lr * group["weight_decay"])
        delta = ortho.to(local.device)  # from the GPU when the state is offloaded to the host
        local.add_(delta, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))


def _exchange_device(process_group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where a round's blocks travel and its Newton-Schulz runs: the parameters' device, but
    this rank's GPU for parameters FSDP2 offloads to the host under NCCL (which moves CUDA
    tensors only): the iteration runs there too, not on the host."""
    if device.type == "cpu" and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def newton_schulz_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype ``ns_dtype=name`` runs the iteration in on ``device``."""
    if name != "auto":
        return NS_DTYPES[name]
    from composer_tune.models.build import native_bf16

    return torch.bfloat16 if native_bf16(device) else torch.float32


def _orthogonalise_round(
    matrices: list[_Matrix], process_group: dist.ProcessGroup, ns: dict[str, Any]
) -> list[torch.Tensor]:
    """One round of at most ``world_size`` matrices sharded across ``process_group`` (every rank
    passes the same matrices, holding its own blocks): one ``all_to_all`` assembles matrix ``k``
    on rank ``k``, which orthogonalises it, and another sends each rank its blocks of the
    results, which this returns in order."""
    world_size = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    first = matrices[0].update
    sent_sizes = [m.update.numel() for m in matrices] + [0] * (world_size - len(matrices))
    owned = matrices[rank] if rank < len(matrices) else None
    if owned is None:
        block_shapes, received_sizes = [], [0] * world_size
    else:
        block_shapes = _block_shapes(owned, world_size, rank)
        received_sizes = [math.prod(shape) for shape in block_shapes]
    received = first.new_empty(sum(received_sizes))
    sent = torch.cat([m.update.reshape(-1) for m in matrices])
    dist.all_to_all_single(received, sent, received_sizes, sent_sizes, group=process_group)
    del sent  # each buffer goes as soon as it is spent: a round holds a few matrices at most
    returned = first.new_empty(0)
    if owned is not None:
        blocks = received.split(received_sizes)
        whole = torch.cat(
            [block.view(shape) for block, shape in zip(blocks, block_shapes, strict=True)],
            dim=owned.sharded_dim,
        )
        del received, blocks
        ortho = newton_schulz(whole, parts=owned.parts, **ns)
        del whole
        rows = [shape[owned.sharded_dim] for shape in block_shapes]
        returned = torch.cat(
            [piece.reshape(-1) for piece in ortho.split(rows, dim=owned.sharded_dim)]
        )
        del ortho
    back = first.new_empty(sum(sent_sizes))
    dist.all_to_all_single(back, returned, sent_sizes, received_sizes, group=process_group)
    blocks = back.split(sent_sizes)[: len(matrices)]
    return [block.view(m.update.shape) for block, m in zip(blocks, matrices, strict=True)]


def _block_shapes(matrix: _Matrix, world_size: int, rank: int) -> list[tuple[int, ...]]:
    """The shape of every rank's block of ``matrix`` (sharded on ``matrix.sharded_dim``),
    checked against this rank's own."""
    shape = tuple(matrix.param.shape)
    dim = matrix.sharded_dim
    sizes = _block_sizes(shape[dim], world_size)
    shapes = [shape[:dim] + (size,) + shape[dim + 1 :] for size in sizes]
    if shapes[rank] != tuple(matrix.update.shape):
        raise RuntimeError(
            f"Muon: this rank holds a {tuple(matrix.update.shape)} block of a {shape} matrix, "
            f"expected {shapes[rank]} (an FSDP2 sharding other than torch.chunk's)"
        )
    return shapes
