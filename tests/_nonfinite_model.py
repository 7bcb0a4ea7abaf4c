"""Test device for tests/test_crash_safety.py: the tiny Qwen3 with NaN outputs at chosen steps.

Passed to a recipe as ``model._component_=tests._nonfinite_model.qwen3_tiny_nan_at`` with
``+model.nan_steps=[...]``: the n-th forward pass in training mode (the n-th optimizer step of a
fresh run without gradient accumulation) returns NaN, so its loss and gradients are NaN.
Evaluation (eval mode) is never touched. The weights and their names are qwen3_tiny's, so the
recipe saves ordinary checkpoints.
"""

from collections.abc import Sequence
from typing import Any

from composer_tune.models import CausalDecoder, qwen3_tiny


def qwen3_tiny_nan_at(nan_steps: Sequence[int], **model_kwargs: Any) -> CausalDecoder:
    model = qwen3_tiny(**model_kwargs)
    poisoned = {int(step) for step in nan_steps}
    calls = 0

    def poison(module: CausalDecoder, _args: Any, output: Any) -> Any:
        nonlocal calls
        if not module.training:
            return None
        calls += 1
        return output * float("nan") if calls in poisoned else None

    model.register_forward_hook(poison)
    return model
