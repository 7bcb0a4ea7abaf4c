"""Held-out episode success of a checkpoint (default: base SmolLM2-135M-Instruct) on the
calculator-tool task, with the agent, data and evaluation settings of
recipes/configs/grpo/smollm2_tools.yaml and the same ``evaluate_heldout(agent=...)`` the
recipes call; prints the metrics (``eval/accuracy`` is episode success, ``eval/tool_use_rate``
the share of episodes with a tool call) and a few episodes.

    python docs/agent_smollm2/eval_base.py [CHECKPOINT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from composer_tune.agents import build_agent  # noqa: E402
from composer_tune.agents.calculator import CalculatorProblems  # noqa: E402
from composer_tune.checkpointing.gguf_import import smollm2_checkpoint  # noqa: E402
from composer_tune.checkpointing.hf_checkpoint import load_decoder_from_hf  # noqa: E402
from composer_tune.data.tokenizer import from_pretrained  # noqa: E402
from composer_tune.distributed import DistInfo  # noqa: E402
from composer_tune.evaluation import evaluate_heldout  # noqa: E402
from composer_tune.rewards import MathAnswerReward  # noqa: E402


def main() -> None:
    cfg = OmegaConf.load(REPO_ROOT / "recipes/configs/grpo/smollm2_tools.yaml")
    path = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_checkpoint())
    heldout = cfg.eval_dataset
    result = evaluate_heldout(
        load_decoder_from_hf(path),
        from_pretrained(path, chat_template=cfg.tokenizer.chat_template),
        CalculatorProblems("heldout", heldout.num_samples, seed=heldout.seed),
        MathAnswerReward(),
        dist_info=DistInfo(world_size=1, rank=0, device=torch.device("cpu")),
        batch_size=cfg.eval_batch_size,
        max_new_tokens=cfg.eval_max_new_tokens,
        enable_thinking=cfg.enable_thinking,
        agent=build_agent(cfg.agent),
        num_examples=4,
    )
    print(result.metrics())
    for example in result.examples:
        print(example)


if __name__ == "__main__":
    main()
