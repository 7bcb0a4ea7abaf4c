"""Held-out episode success of checkpoints (default: base SmolLM2-135M-Instruct) on the
calculator-tool task, with the agent, data and evaluation settings of
recipes/configs/grpo/smollm2_tools.yaml and the same ``evaluate_heldout(agent=...)`` the
recipes call; prints each checkpoint's metrics (``eval/accuracy`` is episode success,
``eval/tool_use_rate`` the share of episodes with a tool call) and a few episodes.

    python docs/agent_smollm2/eval_base.py [CHECKPOINT_DIR ...] [--seed S] [--num-samples N]
        [--samples-per-problem K [--temperature T]]

``--samples-per-problem`` scores the mean success of K sampled episodes per problem (the
config's ``eval_sampling``; temperature 1 as in training) instead of one greedy episode.

``--seed`` picks another draw of held-out problems: the A0 checkpoint was chosen on seed 3
(a validation set) so that the config's held-out set (seed 1) stays unseen by that choice.
"""

from __future__ import annotations

import argparse
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
from composer_tune.evaluation import EvalSampling, evaluate_heldout  # noqa: E402
from composer_tune.rewards import MathAnswerReward  # noqa: E402


def main() -> None:
    cfg = OmegaConf.load(REPO_ROOT / "recipes/configs/grpo/smollm2_tools.yaml")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*", help="HF checkpoint folders (default: base)")
    parser.add_argument("--seed", type=int, default=cfg.eval_dataset.seed)
    parser.add_argument("--num-samples", type=int, default=cfg.eval_dataset.num_samples)
    parser.add_argument("--samples-per-problem", type=int, help="sampled episodes per problem")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    sampling = None
    if args.samples_per_problem:
        sampling = EvalSampling(args.samples_per_problem, args.temperature)
    problems = CalculatorProblems("heldout", args.num_samples, seed=args.seed)
    for path in args.checkpoints or [str(smollm2_checkpoint())]:
        result = evaluate_heldout(
            load_decoder_from_hf(path),
            from_pretrained(path, chat_template=cfg.tokenizer.chat_template),
            problems,
            MathAnswerReward(),
            dist_info=DistInfo(world_size=1, rank=0, device=torch.device("cpu")),
            batch_size=cfg.eval_batch_size,
            max_new_tokens=cfg.eval_max_new_tokens,
            enable_thinking=cfg.enable_thinking,
            agent=build_agent(cfg.agent),
            num_examples=4,
            sampling=sampling,
        )
        print(path, result.metrics(), flush=True)
        for example in result.examples:
            print(example)


if __name__ == "__main__":
    main()
