"""Decode steps replayed as CUDA graphs: the sampler's loop without per-token host work.

A decode step of a small batch is launch-bound on a GPU: hundreds of kernels, each waiting on
the Python that issues it, while the weights take a few milliseconds to read. Captured once as
a CUDA graph, a step is replayed with one call and no Python in between. The sampler
(:mod:`composer_tune.rollout.generation`) makes its step capturable: every tensor the step
reads or writes is allocated once per call (static KV cache, token, position, mask and output
buffers; the next column to write is a device counter), sampling, stop-token checks and
log-probabilities run on the device, and nothing is read back to the host inside it. The
attention of a step reads a fixed span of cache slots, so one graph is captured per span
bucket (:data:`SPAN_BUCKET` slots) as the completion grows.

Graphs live for one :func:`~composer_tune.rollout.generation.generate` call: capturing costs
about one eager step per bucket, and graphs kept between calls would hold their KV cache
through the training step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Cache slots a captured decode step reads, rounded up to a multiple of this: one graph per
# bucket, and at most this many masked slots read in vain per step.
SPAN_BUCKET = 256
# Eager steps before the first capture (on a side stream, as PyTorch's CUDA-graph notes ask):
# they initialise the kernels' workspaces and fill autocast's weight-cast cache.
WARMUP_STEPS = 2

# Captures ``step`` (a function of no arguments that changes tensors in place), runs it once
# and returns the function that replays it.
StepCapture = Callable[[Callable[[], None]], Callable[[], None]]


def cuda_graph_capture(generator: torch.Generator | None) -> StepCapture:
    """A :data:`StepCapture` into CUDA graphs sharing one memory pool (they run one at a
    time), with ``generator``'s state registered so that each replay draws fresh numbers."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=pool):
            step()
        graph.replay()  # capturing records the step without running it
        return graph.replay

    return capture


class CapturedSteps:
    """Runs the sampler's decode step ``step(span)``: the first :data:`WARMUP_STEPS` eagerly,
    then replays of one captured graph per ``span``. A step whose capture fails (a model with
    data-dependent shapes, such as a mixture of experts' routing) runs eagerly from then on,
    with one warning naming the error."""

    def __init__(self, step: Callable[[int], None], capture: StepCapture, device: torch.device):
        self.step = step
        self.capture = capture
        self.device = device
        self.warmup_left = WARMUP_STEPS
        self.replays: dict[int, Callable[[], None]] = {}
        self.failed = False

    def __call__(self, span: int) -> None:
        if self.failed:
            self.step(span)
        elif self.warmup_left > 0:
            self.warmup_left -= 1
            self._warm_up(span)
        elif span in self.replays:
            self.replays[span]()
        else:
            try:
                self.replays[span] = self.capture(lambda: self.step(span))
            except RuntimeError as error:
                log.warning("decode step not captured (%s): decoding eagerly", error)
                self.failed = True
                self.step(span)

    def _warm_up(self, span: int) -> None:
        if self.device.type != "cuda":
            self.step(span)
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(span)
        torch.cuda.current_stream(self.device).wait_stream(side)


def span_bucket(filled: int, cache_len: int) -> int:
    """The span a captured step reads when ``filled`` slots are in use: ``filled`` rounded up
    to a multiple of :data:`SPAN_BUCKET`, at most the cache length."""
    return min(cache_len, -(-filled // SPAN_BUCKET) * SPAN_BUCKET)
