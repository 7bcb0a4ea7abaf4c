"""A3: GRPO (channel 1) plus trace-replay DPO (channel 3), single process or FSDP2 under
torchrun.

    tune run recipes/replay_dpo.py --config cpu_smoke
    tune run recipes/replay_dpo.py --config cpu_smoke dpo.loss_type=ipo dpo.reference=live
    tune run --nproc_per_node 2 recipes/replay_dpo.py --config cpu_smoke

Channel 3, trace-replay DPO, is this project's OWN research addition, NOT part of Cursor's
published Composer 2.5 recipe (which has GRPO-family RL and SDPO self-distillation): agent traces
are replayed by teacher models, and where the teachers agree against the trace (or the trace
against an outlier) the pair becomes a DPO preference (``tools/build_pairs.py``).

The objective of each optimiser step is A1's policy loss plus ``dpo.weight`` times the DPO loss
(``dpo.loss_type``: sigmoid, ipo or hinge; see composer_tune/losses/dpo.py) of
``dpo.pairs_per_step`` training pairs, drawn epoch after epoch beside the rollouts. Everything
else is A1 (recipes/grpo.py): each generation samples ``group_size`` completions per prompt,
scores them with a verifiable reward, turns rewards into group-relative advantages and takes
``steps_per_generation * num_iterations`` optimiser steps with the objective ``loss.objective``.

DPO's reference is the frozen initial policy. ``dpo.reference: precomputed`` scores every pair
with it once before training (cached in ``dpo.cache_dir``; the table travels in run checkpoints),
so no reference model stays in memory; ``live`` keeps a frozen copy and scores each batch. A
reference model exists only when ``loss.beta > 0`` or ``dpo.reference: live``. Held-out
accuracy (greedy generation) and the DPO loss, reward margin and preference accuracy on the
held-out pair split are measured before, during (``eval_every_n_steps``) and after training.

The recipe reads top to bottom: ``ReplayDPORecipe.setup()`` builds each part, ``train()`` is the
loop. The channel step (composer_tune/channels/composer.py) is the one A1, A2, A4 and DiLoCo
take, here with channels 1 and 3 on; the pair stream is ``PairChannel``
(channels/replay_dpo.py); the run's resumable state and the loop's chores come from
composer_tune/run/. Copy the file and edit it.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torchtune import training

from composer_tune import config
from composer_tune.channels.composer import ComposerChannels, ComposerObjective, StepData
from composer_tune.channels.replay_dpo import pair_channel
from composer_tune.distributed import setup_distributed
from composer_tune.run.loop import print_accuracy_summary
from composer_tune.run.rl import RLRun
from composer_tune.run.schema import DPOChannelConfig, RLRecipeConfig
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest


@dataclass
class ReplayDPOConfig(RLRecipeConfig):
    # Channel 3 (this project's own addition): pairs, weight (0 = off: A1), loss, reference.
    dpo: DPOChannelConfig = field(default_factory=DPOChannelConfig)


class ReplayDPORecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        training.set_seed(seed=cfg.seed)

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        # Channels 1 and 3 (loss, dpo), checked; with dpo.weight 0 no pair is loaded and the
        # run is A1.
        self.channels = ComposerChannels.from_config(cfg, dist)
        self.run = RLRun(cfg, dist, self.channels, schema=ReplayDPOConfig)
        # The frozen initial policy: for a KL term, or scoring each pair batch (dpo.reference:
        # live); precomputed reference log-probs need no model.
        reference = self.channels.reference_model(cfg, dist, self.run.initial)
        self.objective = ComposerObjective.for_recipe(
            cfg, dist, self.channels, self.run.model, self.run.tokenizer, reference=reference
        )
        state = self.run.restore(self.objective)
        # The pairs: the training stream (resumed at its saved position), the held-out split
        # and the reference table (from the checkpoint, else scored now by the initial policy).
        self.pairs = pair_channel(
            cfg, self.channels.dpo, model=self.run.model, tokenizer=self.run.tokenizer,
            dist=dist, state=state, resumed=self.run.resumed,
        )  # fmt: skip
        self.run.finish_setup()

    def train(self) -> bool:
        """Trains to ``max_steps``; False if a stop signal ended the run early (checkpointed)."""
        cfg, run, progress = self.cfg, self.run, self.run.progress
        if not run.resumed:
            progress.record_before(*self.evaluate())
        chores = run.chores(self.evaluate, self.save_checkpoint)
        prompts = run.prompt_batches()
        with StopRequest(self.dist) as stop:
            while progress.step < cfg.max_steps:
                # 1. Rollout: G completions per prompt, rewards, old (and reference) log-probs.
                rollout = run.rollout(next(prompts), self.objective.reference)
                # 2. Group-relative advantages (after the KL penalty, in kl_mode=reward).
                batch = self.objective.prepare(rollout, advantage_sign=cfg.advantage_sign)
                # 3. Optimiser steps on its slices (each with its own pair batch).
                chores.train_on(batch, self._optimizer_step)
                if chores.batch_done(stop):
                    return False
        after, after_pairs = chores.finish()
        print_accuracy_summary(progress, after, self.dist)
        if self.pairs is not None:
            self.pairs.print_summary(progress.pairs_before, after_pairs)
        return True

    def _optimizer_step(self, step: StepData) -> tuple[dict[str, float], dict[str, float]]:
        """Channel 1 over the micro-batches, channel 3 over this rank's pairs; clip, guard, step."""
        pair_batch = self.pairs.next_batch() if self.pairs is not None else None
        return self.run.apply(
            self.objective.backward(step, pair_batch, on_policy=self.run.on_policy)
        )

    def evaluate(self) -> tuple[Any, dict[str, float]]:
        """Greedy held-out accuracy (None without an eval dataset) and the DPO loss, margin and
        accuracy on the held-out pairs ({} without them)."""
        result = self.run.evaluate_generation()
        if self.pairs is None:
            return result, {}
        return result, self.pairs.evaluate_and_report(
            self.run.model, self.objective.reference, self.run.metric_log.log,
            where=f"step {self.run.progress.step}",
        )  # fmt: skip

    def save_checkpoint(self) -> Path:
        # The pair stream's position and the reference table travel with the checkpoint.
        return self.run.save_checkpoint(self.pairs.state_dict() if self.pairs else None)

    def cleanup(self) -> None:
        self.run.close()


@config.parse(schema=ReplayDPOConfig)
def recipe_main(cfg: DictConfig) -> None:
    """A3: GRPO plus trace-replay DPO (channel 3, this project's own addition)."""
    with config.setup_errors_as_one_line():
        recipe = ReplayDPORecipe(cfg)
        recipe.setup()
    finished = recipe.train()
    recipe.cleanup()
    if not finished:  # stopped by a signal, after saving a checkpoint
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(recipe_main())
