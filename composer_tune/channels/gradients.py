"""Each channel's part of one optimiser step's gradient (config key ``log_channel_gradients``).

The loss channels add up: the step's gradient ``g`` is the sum of each channel's ``g_c``. To
tell them apart, the backward of channel ``c`` accumulates into ``c``'s own buffers (the
parameters' ``.grad`` is swapped to them around that backward, so nothing is copied), and
:meth:`ChannelGradients.combine` leaves ``g = sum_c g_c`` in ``.grad`` for the clip and the
optimiser, with two figures per channel:

* ``grad_norm/<channel>``: ``|g_c|``, before clipping;
* ``grad_share/<channel>``: ``<g_c, g> / |g|^2``, the channel's share of the step the optimiser
  takes (clipping scales every channel alike, so it is also the share of the clipped step). The
  shares sum to 1; a negative share is a channel pulling against the others.

The cost: one gradient-sized buffer per channel, and channels 1 and 2, which otherwise share
one student forward, each take their own forward and backward. The sum in ``.grad`` equals the
shared backward's up to float rounding, so runs with and without the switch are not bit-for-bit
alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from composer_tune.distributed import all_reduce_sum


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) gradient; the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class ChannelGradients:
    """Per-channel gradient buffers for the parameters of ``model`` that train."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.grads: dict[str, list[torch.Tensor | None]] = {}

    @contextmanager
    def channel(self, name: str) -> Iterator[None]:
        """Backward passes inside accumulate into channel ``name``'s buffers."""
        outside = [p.grad for p in self.parameters]
        own = self.grads.get(name, [None] * len(self.parameters))
        for parameter, grad in zip(self.parameters, own, strict=True):
            parameter.grad = grad
        try:
            yield
        finally:
            self.grads[name] = [p.grad for p in self.parameters]
            for parameter, grad in zip(self.parameters, outside, strict=True):
                parameter.grad = grad

    def combine(self, *, distributed: bool) -> dict[str, float]:
        """Adds every channel's buffers into ``.grad`` (onto what was there) and returns each
        channel's norm and share. Collective when ``distributed`` (FSDP2 shards are disjoint,
        so the squared sums and dot products add over ranks)."""
        names = list(self.grads)
        for index, parameter in enumerate(self.parameters):
            for name in names:
                grad = self.grads[name][index]
                if grad is None:
                    continue
                parameter.grad = grad if parameter.grad is None else parameter.grad + grad
        # [|g_c|^2 for c] + [<g_c, g> for c] + [|g|^2], in float64 on this rank's shards.
        sums = torch.zeros(2 * len(names) + 1, dtype=torch.float64)
        device = next((p.grad.device for p in self.parameters if p.grad is not None), None)
        if device is not None:
            sums = sums.to(device)
        for index, parameter in enumerate(self.parameters):
            if parameter.grad is None:
                continue
            total = _local(parameter.grad).double()
            sums[-1] += total.square().sum()
            for position, name in enumerate(names):
                grad = self.grads[name][index]
                if grad is None:
                    continue
                own = _local(grad).double()
                sums[position] += own.square().sum()
                sums[len(names) + position] += (own * total).sum()
        if distributed:
            sums = all_reduce_sum(sums)
        sums = sums.cpu()
        self.grads.clear()
        step_norm_squared = float(sums[-1])
        metrics = {}
        for position, name in enumerate(names):
            metrics[f"grad_norm/{name}"] = float(sums[position].sqrt())
            metrics[f"grad_share/{name}"] = (
                float(sums[len(names) + position]) / step_norm_squared
                if step_norm_squared > 0
                else float("nan")
            )
        return metrics


def channel_scope(split: ChannelGradients | None, name: str) -> AbstractContextManager[None]:
    """``split.channel(name)``, or nothing to do when gradients are not told apart."""
    return split.channel(name) if split is not None else nullcontext()
