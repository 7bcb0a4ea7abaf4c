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

With an ``eos_token`` (the recipes pass the end-of-reply token, ``<|im_end|>``), two more
figures per channel, read off the gradient of the channel's loss with respect to the output
logits (every position of every row the channel scores):

* ``eos_push/<channel>``: ``-sum over positions of dL_c/dz_tok``, the channel's gradient on
  a bias added to that token's logit everywhere: > 0 where the channel's step makes the token
  more likely (the end-of-reply token: the channel shortens replies), < 0 where it lengthens
  them;
* ``eos_share/<channel>``: ``sum |dL_c/dz_tok| / sum_v |dL_c/dz_v|``, the share of the
  channel's logit gradient that falls on that token.

The cost: one gradient-sized buffer per channel, and channels 1 and 2, which otherwise share
one student forward, each take their own forward and backward. The sum in ``.grad`` equals the
shared backward's up to float rounding, so runs with and without the switch are not bit-for-bit
alike. Watching a token adds a pass over each chunk's logit gradient in backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from composer_tune.distributed import all_reduce_sum


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) gradient; the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class ChannelGradients:
    """Per-channel gradient buffers for the parameters of ``model`` that train, and, with an
    ``eos_token``, each channel's logit gradient on that token (:meth:`watch`)."""

    def __init__(self, parameters: Iterable[nn.Parameter], *, eos_token: int | None = None) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.grads: dict[str, list[torch.Tensor | None]] = {}
        self.eos_token = eos_token
        # Per channel, float64 [sum of -dL/dz_eos, sum of |dL/dz_eos|, sum of |dL/dz|] over the
        # positions of this rank's logits.
        self.eos_sums: dict[str, Tensor] = {}
        self.current: str | None = None

    @contextmanager
    def channel(self, name: str) -> Iterator[None]:
        """Backward passes inside accumulate into channel ``name``'s buffers; logits computed
        inside (through :meth:`watch`'s model) count as this channel's."""
        outside = [p.grad for p in self.parameters]
        own = self.grads.get(name, [None] * len(self.parameters))
        for parameter, grad in zip(self.parameters, own, strict=True):
            parameter.grad = grad
        self.current = name
        try:
            yield
        finally:
            self.current = None
            self.grads[name] = [p.grad for p in self.parameters]
            for parameter, grad in zip(self.parameters, outside, strict=True):
                parameter.grad = grad

    def watch(self, model: Any) -> Any:
        """``model``, or with an ``eos_token`` a stand-in that calls it and records the gradient
        of every logit chunk its ``head_fn`` computes with grad inside :meth:`channel`."""
        return model if self.eos_token is None else _LogitWatch(model, self)

    def _record_logits(self, logits: Tensor) -> Tensor:
        """Hooks ``logits`` (``[n, V]``) so that its gradient is added to the current channel's
        end-of-reply sums in backward (the hook belongs to this forward's graph, so a
        checkpointed chunk's recomputation, which hooks tensors no gradient reaches, does not
        count twice)."""
        if self.current is None or not logits.requires_grad:
            return logits
        name, token = self.current, self.eos_token

        def record(grad: Tensor) -> None:
            on_token = grad[..., token].double()
            update = torch.stack(
                [-on_token.sum(), on_token.abs().sum(), grad.abs().sum(dtype=torch.float64)]
            )
            earlier = self.eos_sums.get(name)
            self.eos_sums[name] = update if earlier is None else earlier + update

        logits.register_hook(record)
        return logits

    def combine(self, *, distributed: bool) -> dict[str, float]:
        """Adds every channel's buffers into ``.grad`` (onto what was there) and returns each
        channel's norm and share. Collective when ``distributed`` (FSDP2 shards are disjoint,
        so the squared sums and dot products add over ranks)."""
        names = list(self.grads)
        # Every channel when watching (the same list on every rank, for the reduction).
        watched = names if self.eos_token is not None else []
        for index, parameter in enumerate(self.parameters):
            for name in names:
                grad = self.grads[name][index]
                if grad is None:
                    continue
                parameter.grad = grad if parameter.grad is None else parameter.grad + grad
        # [|g_c|^2 for c] + [<g_c, g> for c] + [|g|^2], in float64 on this rank's shards, then
        # each watched channel's three end-of-reply sums (this rank's positions).
        sums = torch.zeros(2 * len(names) + 1, dtype=torch.float64)
        device = next((p.grad.device for p in self.parameters if p.grad is not None), None)
        if device is not None:
            sums = sums.to(device)
        nothing = torch.zeros(3, dtype=torch.float64)
        sums = torch.cat(
            [sums, *(self.eos_sums.get(name, nothing).to(sums.device) for name in watched)]
        )
        step = 2 * len(names)
        for index, parameter in enumerate(self.parameters):
            if parameter.grad is None:
                continue
            total = _local(parameter.grad).double()
            sums[step] += total.square().sum()
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
        self.eos_sums.clear()
        step_norm_squared = float(sums[step])
        metrics = {}
        for position, name in enumerate(names):
            metrics[f"grad_norm/{name}"] = float(sums[position].sqrt())
            metrics[f"grad_share/{name}"] = (
                float(sums[len(names) + position]) / step_norm_squared
                if step_norm_squared > 0
                else float("nan")
            )
        for position, name in enumerate(watched):
            start = step + 1 + 3 * position
            push, on_eos, everywhere = sums[start : start + 3].tolist()
            metrics[f"eos_push/{name}"] = push
            metrics[f"eos_share/{name}"] = on_eos / everywhere if everywhere > 0 else 0.0
        return metrics


class _LogitWatch:
    """A model stand-in for :meth:`ChannelGradients.watch`: its ``head_fn`` receives an output
    projection whose logits are hooked; everything else is the model's."""

    def __init__(self, model: Any, split: ChannelGradients) -> None:
        self._model = model
        self._split = split

    def __call__(self, *args: Any, head_fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        if head_fn is None:
            return self._model(*args, **kwargs)

        def watched_head(hidden: Tensor, output: Callable[[Tensor], Tensor]) -> Any:
            return head_fn(hidden, lambda rows: self._split._record_logits(output(rows)))

        return self._model(*args, head_fn=watched_head, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def channel_scope(split: ChannelGradients | None, name: str) -> AbstractContextManager[None]:
    """``split.channel(name)``, or nothing to do when gradients are not told apart."""
    return split.channel(name) if split is not None else nullcontext()
