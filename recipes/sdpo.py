"""A2: SDPO self-distillation on top of GRPO (channels 1 + 2 of the Composer 2.5 recipe
replication), single process or FSDP2 under torchrun.

    tune run recipes/sdpo.py --config cpu_smoke
    tune run recipes/sdpo.py --config cpu_smoke sdpo.teacher=ema
    tune run recipes/sdpo.py --config cpu_smoke sdpo.weight=0   # A1's updates, from this warm start
    tune run --nproc_per_node 2 recipes/sdpo.py --config cpu_smoke

A2 = A1 + ``sdpo.weight`` x SDPO loss. Each generation: sample ``group_size`` completions for
each prompt with the current policy, score them with a verifiable reward, turn rewards into
group-relative advantages (A1's channel 1, objective ``loss.objective``). Channel 2, Composer
2.5's published "targeted RL with textual feedback" (SDPO, arXiv 2601.20802): the same policy
(``sdpo.teacher=current``) or an EMA copy of it (``ema``) re-reads each sampled completion with a
hint in its prompt -- the verifier's feedback, a successful sibling of the group, the reference
solution (``sdpo.context``) -- and a token-level divergence (``sdpo.loss``) pulls the student's
next-token distributions toward that teacher's. Both losses come from one student forward per
micro-batch (composer_tune/channels/sdpo/channel.py). With ``sdpo.weight: 0`` nothing of channel 2 runs and
the updates are A1's exactly.

The self-teacher is only as good as the policy's reading of its hint: a pretrained LLM reads one,
a model trained from scratch on bare questions does not. So the cpu_smoke run starts from
``recipes/sft.py --config cpu_smoke_hints`` (hints in a quarter of its questions), not from A1's
warm start; that config's header has the measurements.

The recipe reads top to bottom: ``SDPORecipe.setup()`` builds each part, ``train()`` is the loop.
The channel step (composer_tune/channels/composer.py) is the one A1, A3, A4 and DiLoCo take,
here with channels 1 and 2 on; the EMA teacher is ``EMATeacher`` (channels/sdpo/teacher.py);
the run's resumable state and the loop's chores come from composer_tune/run/. Copy the file and
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
from composer_tune.channels.sdpo.teacher import setup_sdpo_teacher
from composer_tune.distributed import setup_distributed
from composer_tune.run.loop import print_accuracy_summary
from composer_tune.run.rl import RLRun
from composer_tune.run.schema import RLRecipeConfig, SDPOChannelConfig
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest


@dataclass
class SDPOConfig(RLRecipeConfig):
    # Channel 2: weight (0 = off), teacher context (hints), divergence, teacher (current / ema).
    sdpo: SDPOChannelConfig = field(default_factory=SDPOChannelConfig)


class SDPORecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        # Per-rank RNG streams (torchtune offsets the seed by the rank); random init is seeded
        # identically on every rank in build_model.
        training.set_seed(seed=cfg.seed)

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        # Channels 1 and 2 (loss, sdpo), checked; with sdpo.weight 0 nothing of channel 2 is
        # built or run, and the updates are A1's.
        self.channels = ComposerChannels.from_config(cfg, dist)
        self.run = RLRun(cfg, dist, self.channels, schema=SDPOConfig)
        reference = self.channels.reference_model(cfg, dist, self.run.initial)
        # sdpo.teacher=ema: an EMA of the policy teaches (restored below when resuming);
        # current: the policy itself, re-run with the hint.
        self.ema_teacher = setup_sdpo_teacher(
            cfg, dist, self.channels.sdpo, self.run.model, self.run.current
        )
        self.objective = ComposerObjective.for_recipe(
            cfg, dist, self.channels, self.run.model, self.run.tokenizer,
            reference=reference, ema_teacher=self.ema_teacher,
        )  # fmt: skip
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
                # 2-3. Advantages and SDPO's hinted teacher contexts (each row sees its group).
                batch = self.objective.prepare(rollout, advantage_sign=cfg.advantage_sign)
                # 4. Optimiser steps on its slices, num_iterations times (logged, evaluated).
                chores.train_on(batch, self._optimizer_step)
                if chores.batch_done(stop):
                    return False
        print_accuracy_summary(progress, chores.finish(), self.dist)
        return True

    def _optimizer_step(self, step: StepData) -> tuple[dict[str, float], dict[str, float]]:
        """One student forward per micro-batch gives the policy loss and the SDPO loss; then
        clip, guard, step, and move the EMA teacher (if any) toward the new weights."""
        losses = self.objective.backward(step, None, on_policy=self.run.on_policy)
        ema = self.ema_teacher
        return self.run.apply(losses, after_update=ema.update if ema is not None else None)

    def evaluate(self) -> Any:
        """Greedy held-out accuracy (None without an eval dataset)."""
        return self.run.evaluate_generation()

    def save_checkpoint(self) -> Path:
        # The EMA teacher, gathered on rank 0 (collective), saved with the training state.
        return self.run.save_checkpoint(self.objective.state_dict())

    def cleanup(self) -> None:
        self.run.close()


@config.parse(schema=SDPOConfig)
def recipe_main(cfg: DictConfig) -> None:
    """A2: GRPO-family policy optimisation plus SDPO self-distillation."""
    with config.setup_errors_as_one_line():
        recipe = SDPORecipe(cfg)
        recipe.setup()
    finished = recipe.train()
    recipe.cleanup()
    if not finished:  # stopped by a signal, after saving a checkpoint
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(recipe_main())
