"""A4: all three channels in one objective, single process or FSDP2 under torchrun.

    tune run recipes/composer_full.py --config qwen3_7b
    tune run recipes/composer_full.py --config cpu_smoke
    tune run --nproc_per_node 2 recipes/composer_full.py --config cpu_smoke

Each optimiser step minimises ``loss.weight * policy loss + sdpo.weight * SDPO loss +
dpo.weight * DPO loss``:

* channel 1, GRPO-family RL on verifiable rewards (Composer 2.5's recipe, as in A1
  recipes/grpo.py): ``group_size`` sampled completions per prompt, group-relative advantages,
  the objective ``loss.objective`` (grpo, dr_grpo, bnpo, dapo, gspo, cispo);
* channel 2, SDPO self-distillation (Composer 2.5's "targeted RL with textual feedback", as in
  A2 recipes/sdpo.py): a teacher (the policy itself, or its EMA) re-reads each rollout with a
  hint (verifier feedback, a successful sibling, the reference solution) and the student is
  pulled toward it (composer_tune/channels/sdpo/channel.py);
* channel 3, trace-replay DPO, this project's OWN research addition, NOT part of Cursor's
  published recipe (as in A3 recipes/replay_dpo.py): preference pairs mined from agent traces
  replayed by teacher models (composer_tune/channels/replay_dpo.py).

A channel whose weight is 0 costs nothing: no rollouts when channels 1 and 2 are both off, no
policy-loss forward without channel 1, no teacher batch, teacher forward or EMA teacher without
channel 2, no pairs, reference log-probs or pair forward without channel 3, and a reference
model only for a KL term (``loss.beta > 0``) or live DPO scoring (``dpo.reference: live``).
The ladder arms are special cases: ``sdpo.weight=0 dpo.weight=0`` is A1, ``dpo.weight=0`` A2,
``sdpo.weight=0`` A3. When channels 1 and 2 are both on they share one student forward
(``logprobs_with_sdpo``).

Held-out accuracy (greedy generation) and, with channel 3, the DPO loss, reward margin and
preference accuracy on the held-out pairs are measured before, during (``eval_every_n_steps``)
and after training.

The recipe reads top to bottom: ``setup()`` builds the run and each channel's parts, ``train()``
is the loop. The channel step (composer_tune/channels/composer.py: advantages, teacher contexts,
every channel's forward and backward) is the one A1-A3 and DiLoCo's inner loop take; the pair
stream is ``PairChannel`` (channels/replay_dpo.py), the EMA teacher ``EMATeacher``
(channels/sdpo/teacher.py); ``RLRun`` (the plumbing every RL recipe shares) and ``LoopChores``
(logging, evaluation, checkpoints, graceful stop) live in composer_tune/run/. Copy the file and
edit it.
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
from composer_tune.channels.sdpo.teacher import setup_sdpo_teacher
from composer_tune.distributed import setup_distributed
from composer_tune.run.loop import print_accuracy_summary
from composer_tune.run.rl import RLRun
from composer_tune.run.schema import DPOChannelConfig, RLRecipeConfig, SDPOChannelConfig
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest


@dataclass
class ComposerFullConfig(RLRecipeConfig):
    # Channel 2: weight (0 = off), teacher context (hints), divergence, teacher (current / ema).
    sdpo: SDPOChannelConfig = field(default_factory=SDPOChannelConfig)
    # Channel 3 (this project's own addition): pairs, weight (0 = off), loss, reference.
    dpo: DPOChannelConfig = field(default_factory=DPOChannelConfig)


class ComposerFullRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        # The sampler splits the prompts; random init is seeded in build_model.
        training.set_seed(seed=cfg.seed)

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        # The three channels' sections (loss, sdpo, dpo), checked; a channel at weight 0 is
        # off and nothing below is built for it.
        self.channels = ComposerChannels.from_config(cfg, dist)
        self.run = RLRun(cfg, dist, self.channels, schema=ComposerFullConfig)
        # Channel 2's EMA teacher (sdpo.teacher=ema; else the policy teaches); the frozen
        # initial policy, only for KL or for DPO scoring pairs live.
        self.ema_teacher = setup_sdpo_teacher(
            cfg, dist, self.channels.sdpo, self.run.model, self.run.current
        )
        reference = self.channels.reference_model(cfg, dist, self.run.initial)
        self.objective = ComposerObjective.for_recipe(
            cfg, dist, self.channels, self.run.model, self.run.tokenizer,
            reference=reference, ema_teacher=self.ema_teacher,
        )  # fmt: skip
        state = self.run.restore(self.objective)
        # Channel 3's pairs: the training stream (resumed at its saved position), the held-out
        # pairs and the reference table.
        self.pairs = pair_channel(
            cfg, self.channels.dpo, model=self.run.model, tokenizer=self.run.tokenizer,
            dist=dist, state=state, resumed=self.run.resumed,
        )  # fmt: skip
        # Channel 3 alone samples nothing: the run then starts no rollout engine.
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
                # 1. Rollout (channels 1 and 2): G completions per prompt, rewards, old (and
                # reference) log-probs. Channel 3 alone trains on pairs only.
                rollout = None
                if self.channels.needs_rollouts:
                    rollout = run.rollout(next(prompts), self.objective.reference)
                # 2-3. Channel 1's advantages (after the KL penalty, in kl_mode=reward) and
                # channel 2's teacher contexts, over the whole batch (every row sees its group).
                batch = self.objective.prepare(rollout, advantage_sign=cfg.advantage_sign)
                # 4. Optimiser steps on its slices, num_iterations times (logged, evaluated).
                chores.train_on(batch, self._optimizer_step)
                if chores.batch_done(stop):
                    return False
        after, after_pairs = chores.finish()
        print_accuracy_summary(progress, after, self.dist)
        if self.pairs is not None:
            self.pairs.print_summary(progress.pairs_before, after_pairs)
        return True

    def _optimizer_step(self, step: StepData) -> tuple[dict[str, float], dict[str, float]]:
        """Forward/backward of every channel that is on (channels 1 and 2 share one student
        forward; channel 3 runs over this rank's pairs), clip, guard, step, EMA teacher."""
        pair_batch = self.pairs.next_batch() if self.pairs is not None else None
        losses = self.objective.backward(step, pair_batch, on_policy=self.run.on_policy)
        ema = self.ema_teacher
        return self.run.apply(losses, after_update=ema.update if ema is not None else None)

    def evaluate(self) -> tuple[Any, dict[str, float]]:
        """Greedy held-out accuracy (None without an eval dataset) and held-out pair metrics
        ({} with channel 3 off)."""
        result = self.run.evaluate_generation()
        if self.pairs is None:
            return result, {}
        return result, self.pairs.evaluate_and_report(
            self.run.model, self.objective.reference, self.run.metric_log.log,
            where=f"step {self.run.progress.step}",
        )  # fmt: skip

    def save_checkpoint(self) -> Path:
        # Channel 3's pair-stream position and reference table, channel 2's EMA teacher.
        return self.run.save_checkpoint(
            {
                **(self.pairs.state_dict() if self.pairs is not None else {}),
                **self.objective.state_dict(),
            }
        )

    def cleanup(self) -> None:
        self.run.close()


@config.parse(schema=ComposerFullConfig)
def recipe_main(cfg: DictConfig) -> None:
    """A4: GRPO, SDPO and trace-replay DPO (channel 3, this project's own addition)."""
    with config.setup_errors_as_one_line():
        recipe = ComposerFullRecipe(cfg)
        recipe.setup()
    finished = recipe.train()
    recipe.cleanup()
    if not finished:  # stopped by a signal, after saving a checkpoint
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(recipe_main())
