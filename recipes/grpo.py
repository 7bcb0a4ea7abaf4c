"""A1: GRPO-family policy optimisation on verifiable rewards (channel 1 of the Composer 2.5
recipe replication), single process or FSDP2 under torchrun.

    tune run recipes/grpo.py --config cpu_smoke
    tune run recipes/grpo.py --config cpu_smoke loss.objective=dapo
    tune run --nproc_per_node 2 recipes/grpo.py --config cpu_smoke

Each generation: sample ``group_size`` completions for each prompt with the current policy (or
agent episodes, with an ``agent`` section), score them with a verifiable reward, turn rewards
into group-relative advantages, then take ``steps_per_generation * num_iterations`` optimiser
steps on that batch with the objective chosen by ``loss.objective`` (grpo, dr_grpo, bnpo, dapo,
gspo, cispo, sapo; see composer_tune/losses/policy.py). A frozen reference model is built only
when ``loss.beta > 0``. Held-out accuracy is measured by greedy generation before, during
(``eval_every_n_steps``) and after training.

The recipe reads top to bottom: ``setup()`` builds the run and the channel step, ``train()`` is
the loop. The channel step is ``ComposerObjective`` with channel 1 alone, the step A2-A4 and
DiLoCo take too (composer_tune/channels/composer.py); ``RLRun`` is the plumbing every RL recipe
shares (policy, optimizer, prompts, resumable ``RunProgress``, engine, checkpoints) and
``LoopChores`` the loop's chores (logging, evaluation, checkpoints, graceful stop), both in
composer_tune/run/. Copy the file and edit it.
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torchtune import training

from composer_tune import config
from composer_tune.channels.composer import ComposerChannels, ComposerObjective, StepData
from composer_tune.distributed import setup_distributed
from composer_tune.run.loop import print_accuracy_summary
from composer_tune.run.rl import RLRun
from composer_tune.run.schema import RLRecipeConfig
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest


@dataclass
class GRPOConfig(RLRecipeConfig):
    """A1 reads the shared RL sections only (channel 1 is ``loss``)."""


class GRPORecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        # The sampler splits the prompts; random init is seeded in build_model.
        training.set_seed(seed=cfg.seed)

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        # Channel 1 alone (A1 has no sdpo or dpo section): which models and log-probs it needs.
        self.channels = ComposerChannels.from_config(cfg, dist)
        # Tokenizer, the checkpoint to resume or start from, policy, optimizer, prompts, reward.
        self.run = RLRun(cfg, dist, self.channels, schema=GRPOConfig)
        # The KL term's reference: the starting policy, never a resumed one (none without KL).
        reference = self.channels.reference_model(cfg, dist, self.run.initial)
        self.objective = ComposerObjective.for_recipe(
            cfg, dist, self.channels, self.run.model, self.run.tokenizer, reference=reference
        )
        self.run.restore(self.objective)
        self.run.finish_setup()

    def train(self) -> bool:
        """Trains to ``max_steps``; False if a stop signal ended the run early (checkpointed)."""
        cfg, run, progress = self.cfg, self.run, self.run.progress
        if not run.resumed:
            progress.record_before(self.evaluate())
        chores = run.chores(self.evaluate, self.save_checkpoint)
        prompts = run.prompt_batches()
        with StopRequest(self.dist) as stop:
            while progress.step < cfg.max_steps:
                # 1. Rollout: G completions per prompt, rewards, old (and reference) log-probs.
                rollout = run.rollout(next(prompts), self.objective.reference)
                # 2. Group-relative advantages (after the KL penalty, in kl_mode=reward).
                batch = self.objective.prepare(rollout, advantage_sign=cfg.advantage_sign)
                # 3. Optimiser steps on its slices, num_iterations times (logged, evaluated).
                chores.train_on(batch, self._optimizer_step)
                if chores.batch_done(stop):
                    return False
        print_accuracy_summary(progress, chores.finish(), self.dist)
        return True

    def _optimizer_step(self, step: StepData) -> tuple[dict[str, float], dict[str, float]]:
        """Channel 1's forward/backward over the step's micro-batches, then clip, guard, step."""
        losses = self.objective.backward(step, None, on_policy=self.run.on_policy)
        return self.run.apply(losses)

    def evaluate(self) -> Any:
        """Greedy held-out accuracy (None without an eval dataset)."""
        return self.run.evaluate_generation()

    def save_checkpoint(self) -> Path:
        return self.run.save_checkpoint()

    def cleanup(self) -> None:
        self.run.close()


@config.parse(schema=GRPOConfig)
def recipe_main(cfg: DictConfig) -> None:
    """A1 GRPO-family policy optimisation on verifiable rewards."""
    with config.setup_errors_as_one_line():
        recipe = GRPORecipe(cfg)
        recipe.setup()
    finished = recipe.train()
    recipe.cleanup()
    if not finished:  # stopped by a signal, after saving a checkpoint
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(recipe_main())
