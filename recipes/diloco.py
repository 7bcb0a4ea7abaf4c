"""The composer training loop as the inner loop of DiLoCo, on torchft: one replica per process
(or per torchrun group, FSDP2-sharded over its ranks).

    # one machine, 2 replicas (lighthouse + 2 processes, CPU / gloo):
    python tools/launch_diloco.py --replicas 2 -- tune run recipes/diloco.py --config cpu_smoke

    # a cluster: one lighthouse, then one torchrun group per replica (see the qwen3_* configs):
    torchft_lighthouse --min_replicas 2 --bind [::]:29510 --join_timeout_ms 60000
    REPLICA_ID=0 NUM_REPLICAS=2 TORCHFT_LIGHTHOUSE=http://lighthouse-host:29510 \\
        tune run --nproc_per_node 8 --master_port 29600 recipes/diloco.py --config qwen3_7b \\
        dpo.pairs=/path/to/pairs.jsonl  # and the paths the config's header lists

Inner loop: the composer loop of A4 recipes/composer_full.py, any mix of the three channels
from config. Each inner optimiser step minimises ``loss.weight * policy loss + sdpo.weight *
SDPO loss + dpo.weight * DPO loss`` (the ``loss``, ``sdpo`` and ``dpo`` sections have
composer_full's keys, semantics and defaults; the step itself is
composer_tune/channels/composer.py's ``ComposerObjective``, which composer_full uses too):

* channel 1, GRPO-family RL on verifiable rewards (Cursor's Composer 2.5 recipe): ``group_size``
  sampled completions per prompt, group-relative advantages, ``loss.objective``;
* channel 2, SDPO self-distillation (Composer 2.5's "targeted RL with textual feedback"): the
  policy (or its EMA, ``sdpo.teacher: ema``) re-reads each rollout with a hint and the student
  is pulled toward it;
* channel 3, trace-replay DPO on agent-trace preference pairs: this project's OWN research
  addition, NOT part of Cursor's published recipe.

A channel at weight 0 costs nothing (no rollouts with channels 1 and 2 off, no teacher batch or
EMA teacher without channel 2, no pairs or pair reference without channel 3). Channels 2 and 3
are local to a replica like the optimizer: each replica keeps its own EMA teacher (an average of
its own weights, which a sync moves to the global ones) and trains on its own shard of the pairs.

Non-finite steps: a NaN/inf loss or gradient norm skips the update (weights, inner optimizer, LR
schedule and EMA teacher untouched, composer_tune/guards.py) but the step still takes its place
in the sync window: the recipe drops the gradients and calls ``optimizer.step()`` anyway, which
updates nothing without gradients but runs DiLoCo's hook. So a skipped step counts as an inner
step exactly as its consumed batch counts toward ``max_steps``, syncs stay between generation
batches and at the same inner steps on every replica, and the replica's pseudo-gradient is the
work of its applied steps only. ``max_consecutive_nonfinite_steps`` in a row stop the replica.

Outer loop: ``DiLoCoTrainer`` (composer_tune/diloco/trainer.py) hooks the inner optimizer. Every
``diloco.sync_every / diloco.num_fragments`` inner steps one fragment of the model is
synchronised: its pseudo-gradient (global - local weights) is averaged over the replicas of the
quorum and applied to the global weights by the outer optimizer (Nesterov SGD, lr 0.7, momentum
0.9 by default). ``max_steps`` counts inner steps of a run without failed syncs; the run stops
after ``max_steps / (sync_every / num_fragments)`` committed syncs (torchft's manager step).

Every replica starts from the same weights (same seed / warm start), samples prompts and pairs
from its own shard of the data (``REPLICA_ID`` of ``NUM_REPLICAS``, times its ranks), samples
completions with its own random stream, and writes under ``<output_dir>/replica_<id>/`` (logs,
checkpoints). Held-out evaluation (accuracy, and with channel 3 the held-out pair metrics)
always scores the GLOBAL weights, the ones the replicas agree on. Checkpoints are taken right
after a sync and hold the local model, inner optimizer, LR schedule, RNGs, data and pair-stream
positions, the pair reference table, the EMA teacher, the non-finite guard and every rank's
DiLoCo state (each fragment's global weights and outer-optimizer momentum, the manager step);
``checkpoint.resume_from_checkpoint: latest`` restores all of it. A replica healed from a live
peer receives the peer's model, inner optimizer, LR schedule and DiLoCo state only: its data and
pair positions and its EMA teacher stay its own.

The recipe reads top to bottom: ``DiLoCoRecipe.setup()`` builds each part, ``train()`` is the
loop. The inner step is composer_full's (composer_tune/channels/composer.py); ``RLRun`` and
``LoopChores`` (composer_tune/run/) are the plumbing every RL recipe shares; the outer loop is
``DiLoCoTrainer`` (composer_tune/diloco/). Copy the file and edit it.
"""

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torchtune import training

from composer_tune import config
from composer_tune.channels.composer import ComposerChannels, ComposerObjective, StepData
from composer_tune.channels.replay_dpo import pair_channel
from composer_tune.channels.sdpo.teacher import setup_sdpo_teacher
from composer_tune.diloco import DiLoCoConfig, DiLoCoTrainer, OuterStepMetrics
from composer_tune.diloco.config import restarted_by_launcher
from composer_tune.distributed import setup_distributed
from composer_tune.progress import progress_postfix
from composer_tune.run.loop import print_accuracy_summary, steps_per_generation_batch
from composer_tune.run.rl import RLRun
from composer_tune.run.schema import DPOChannelConfig, RLRecipeConfig, SDPOChannelConfig
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest

NUM_REPLICAS_ENV = "NUM_REPLICAS"


@dataclass
class DiLoCoRecipeConfig(RLRecipeConfig):
    # The outer loop (composer_tune/diloco/config.py): sync_every, outer optimizer, fragments,
    # lighthouse and addresses. replica_id / lighthouse_addr default to REPLICA_ID and
    # TORCHFT_LIGHTHOUSE, set by tools/launch_diloco.py.
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    # Replicas the dataset is sharded over; null: the NUM_REPLICAS environment variable.
    num_replicas: int | None = None
    # Held-out evaluation of the global weights every N committed syncs (0: before and after
    # training only); DiLoCo evaluates at syncs, so eval_every_n_steps must stay 0.
    eval_every_n_outer_steps: int = 0
    # Channel 2: weight (0 = off), teacher context (hints), divergence, teacher (current / ema).
    sdpo: SDPOChannelConfig = field(default_factory=SDPOChannelConfig)
    # Channel 3 (this project's own addition): pairs (pairs_per_step per replica), weight
    # (0 = off), loss, reference.
    dpo: DPOChannelConfig = field(default_factory=DPOChannelConfig)


class DiLoCoRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        self.diloco_cfg = DiLoCoConfig.coerce(cfg.diloco)
        self.replica_id = self.diloco_cfg.resolved_replica_id()
        self.num_replicas = self._resolve_num_replicas(cfg)
        # Each replica writes its own logs and checkpoints; ${output_dir} interpolations in the
        # config (e.g. the metric logger's log_dir) follow.
        cfg.output_dir = str(Path(cfg.output_dir) / f"replica_{self.replica_id}")
        # Same seed on every replica and rank: identical initial weights (DiLoCo needs them).
        training.set_seed(seed=cfg.seed)

    def _resolve_num_replicas(self, cfg: DictConfig) -> int:
        value = cfg.num_replicas
        if value is None:
            if NUM_REPLICAS_ENV not in os.environ:
                raise ValueError(
                    f"num_replicas is not set and the {NUM_REPLICAS_ENV} environment variable "
                    "is missing (tools/launch_diloco.py sets it)"
                )
            value = int(os.environ[NUM_REPLICAS_ENV])
        if not 0 <= self.replica_id < value:
            raise ValueError(
                f"replica id {self.replica_id} is outside 0 .. num_replicas - 1 = {value - 1}"
            )
        return value

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        # The inner loop's channels (loss, sdpo, dpo), as composer_full's; then the sync layout.
        self.channels = ComposerChannels.from_config(cfg, dist)
        self._check_sync_layout(cfg)
        # The replica's run: its own prompts, sampling stream and folder (a launcher restart
        # continues the run and heals from a peer, so its folder may hold checkpoints).
        self.run = RLRun(
            cfg, dist, self.channels, schema=DiLoCoRecipeConfig, replicas=self.num_replicas,
            replica_id=self.replica_id, continuing=restarted_by_launcher(),
        )  # fmt: skip
        # Channel 2's EMA teacher of this replica's weights; the frozen initial policy for KL
        # or for DPO scoring pairs live.
        self.ema_teacher = setup_sdpo_teacher(
            cfg, dist, self.channels.sdpo, self.run.model, self.run.current
        )
        reference = self.channels.reference_model(cfg, dist, self.run.initial)
        self.objective = ComposerObjective.for_recipe(
            cfg, dist, self.channels, self.run.model, self.run.tokenizer,
            reference=reference, ema_teacher=self.ema_teacher,
        )  # fmt: skip
        # The outer loop; it snapshots the current weights as the initial global weights.
        self.diloco = DiLoCoTrainer(
            self.run.model, self.run.optimizer, self.diloco_cfg, lr_scheduler=self.run.lr_scheduler
        )
        state = self.run.restore(self.objective, announce=False)
        if self.run.resumed:
            self.diloco.load_outer_state_dict(state["diloco"][dist.rank])
            if dist.is_main:
                print(
                    f"resumed from {self.run.resume_path} at step {self.run.progress.step}, "
                    f"outer step {self.diloco.outer_step}",
                    flush=True,
                )
        # Channel 3: this replica's shard of the training pairs (resumed at its position).
        self.pairs = pair_channel(
            cfg, self.channels.dpo, model=self.run.model, tokenizer=self.run.tokenizer,
            dist=dist, state=state, resumed=self.run.resumed, num_replicas=self.num_replicas,
            replica_id=self.replica_id,
        )  # fmt: skip
        self.run.finish_setup()

    def _check_sync_layout(self, cfg: DictConfig) -> None:
        """Reject step counts that do not divide into sync windows, naming the keys."""
        if cfg.eval_every_n_steps:
            raise ValueError(
                "eval_every_n_steps must be 0 for DiLoCo (it evaluates the global weights at "
                "syncs): use eval_every_n_outer_steps"
            )
        window, per_batch = self.diloco_cfg.fragment_sync_every, steps_per_generation_batch(cfg)
        # Syncs fall between generation batches: no batch is trained across a weight reset, and
        # a checkpoint taken right after a sync is also at a data-position boundary.
        if window % per_batch:
            raise ValueError(
                f"diloco.sync_every / diloco.num_fragments ({window}) must be a multiple of "
                f"steps_per_generation * num_iterations ({per_batch}) so that syncs fall "
                "between generation batches"
            )
        if cfg.max_steps < window or cfg.max_steps % window:
            raise ValueError(
                f"max_steps ({cfg.max_steps}) must be a positive multiple of diloco.sync_every / "
                f"diloco.num_fragments ({window}): the run ends on a sync"
            )
        every = cfg.checkpoint.save_every_n_steps
        if every and every % window:
            raise ValueError(
                f"checkpoint.save_every_n_steps ({every}) must be a multiple of "
                f"diloco.sync_every / diloco.num_fragments ({window}): checkpoints are taken "
                "right after a sync"
            )

    @property
    def max_outer_steps(self) -> int:
        """Committed syncs (torchft manager steps) after which the run ends."""
        return self.cfg.max_steps // self.diloco_cfg.fragment_sync_every

    # ----------------------------------------------------------------------------- training

    def train(self, stop: StopRequest) -> bool:
        """Trains to ``max_steps``; returns False if ``stop`` was signalled and ended the run
        early (after a committed sync every replica agreed on, with a checkpoint saved there)."""
        cfg, run, progress = self.cfg, self.run, self.run.progress
        if not run.resumed:
            progress.record_before(*self.evaluate())
        # The bar counts syncs; evaluation happens at syncs, not at inner steps.
        chores = run.chores(
            self.evaluate, self.save_checkpoint, eval_every=0, bar_total=self.max_outer_steps,
            bar_initial=self.diloco.outer_step, bar_unit="sync",
        )  # fmt: skip
        prompts = run.prompt_batches()
        saved_outer_step = self.diloco.outer_step if run.resumed else None
        with self.diloco:
            self.diloco.vote_to_stop(lambda: stop.signalled)
            while self.diloco.outer_step < self.max_outer_steps:
                # 1. Rollout (channels 1 and 2); channel 3 alone trains on pairs only. Weights
                # change at syncs and healing too: the engine gets them every time.
                rollout = None
                if self.channels.needs_rollouts:
                    rollout = run.rollout(next(prompts), self.objective.reference, push_always=True)
                # 2-3. Channel 1's advantages and channel 2's teacher contexts.
                batch = self.objective.prepare(rollout, advantage_sign=cfg.advantage_sign)
                # 4. Inner optimiser steps on the batch; the step that ends a sync window also
                # runs the sync (DiLoCo's hook on the inner optimizer).
                chores.train_on(batch, self._optimizer_step)
                # 5. The sync this batch ended with, if any (syncs fall between batches).
                synced = self._log_outer_steps(self.diloco.pop_outer_steps())
                if not any(outer.committed for outer in synced):
                    continue
                outer_step = self.diloco.outer_step
                chores.bar.update(outer_step - chores.bar.n)
                chores.bar.set_postfix(progress_postfix(batch.metrics))
                every_eval = cfg.eval_every_n_outer_steps
                if every_eval and outer_step % every_eval == 0:
                    self.evaluate()
                every = cfg.checkpoint.save_every_n_steps
                saved = chores.save_if_due(
                    bool(every) and (outer_step * self.diloco_cfg.fragment_sync_every) % every == 0
                )
                if saved is not None:
                    saved_outer_step = outer_step
                agreed = outer_step < self.max_outer_steps and self.diloco.stop_agreed()
                if chores.stop_if_requested(agreed, saved):
                    return False
            chores.bar.close()
            after, after_pairs = self.evaluate()
            if saved_outer_step != self.diloco.outer_step:  # the last sync was not saved yet
                self.save_checkpoint()
        where = f"{progress.step} inner steps, {self.diloco.outer_step} outer steps"
        print_accuracy_summary(
            progress, after, self.dist, qualifier=" (global weights)", detail=where
        )
        if self.pairs is not None:
            self.pairs.print_summary(progress.pairs_before, after_pairs, " (global weights)")
        return True

    def _optimizer_step(self, step: StepData) -> tuple[dict[str, float], dict[str, float]]:
        """Forward/backward of every channel that is on, clip, inner step (and, at the end of a
        sync window, the sync). A skipped (non-finite) step keeps its slot in the sync window:
        its gradients are dropped but the optimizer's step still runs DiLoCo's hook."""
        pair_batch = self.pairs.next_batch() if self.pairs is not None else None
        losses = self.objective.backward(step, pair_batch, on_policy=self.run.on_policy)
        ema = self.ema_teacher
        return self.run.apply(
            losses, after_update=ema.update if ema is not None else None, step_when_skipped=True
        )

    def _log_outer_steps(self, synced: list[OuterStepMetrics]) -> list[OuterStepMetrics]:
        """Logs each sync's metrics (bytes sent vs data-parallel, reduction factor, quorum
        size, pseudo-gradient norm) at the current inner step; returns them."""
        for outer in synced:
            self.run.metric_log.log(outer.as_dict())
            if self.dist.is_main:
                print(
                    f"[outer step {outer.outer_step}] fragment {outer.fragment} "
                    f"{'committed' if outer.committed else 'FAILED'} with {outer.participants} "
                    f"replicas: sent {outer.bytes_sent / 2**20:.2f} MiB (data-parallel "
                    f"{outer.dp_bytes_sent / 2**20:.2f} MiB, {outer.comm_reduction:.1f}x less), "
                    f"pseudo-gradient norm {outer.pseudo_grad_norm:.4g}",
                    flush=True,
                )
        return synced

    @contextlib.contextmanager
    def _global_weights(self) -> Iterator[None]:
        """The global weights (as of each fragment's last sync) in the model for the duration;
        the replica's local weights are put back after."""
        params = dict(self.run.model.named_parameters())
        global_params = self.diloco.global_parameters()
        with torch.no_grad():
            local = {name: _local(params[name]).clone() for name in global_params}
            for name, tensor in global_params.items():
                _local(params[name]).copy_(tensor)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, tensor in local.items():
                    _local(params[name]).copy_(tensor)

    def evaluate(self) -> tuple[Any, dict[str, float]]:
        """Greedy held-out accuracy (None without an eval dataset) and, with channel 3, the
        held-out pair metrics ({} otherwise), both of the GLOBAL weights (what the replicas
        agree on)."""
        where = f"step {self.run.progress.step}, outer step {self.diloco.outer_step}"
        with self._global_weights():
            result = self.run.evaluate_generation(where)
            if self.pairs is None:
                return result, {}
            return result, self.pairs.evaluate_and_report(
                self.run.model, self.objective.reference, self.run.metric_log.log, where=where
            )

    def save_checkpoint(self) -> Path:
        """Atomic run checkpoint with every rank's DiLoCo state in the recipe state; taken
        right after a sync. Collective; returns its folder."""
        return self.run.save_checkpoint(
            {
                # Channel 3's pair-stream position and reference table, channel 2's EMA teacher.
                **(self.pairs.state_dict() if self.pairs is not None else {}),
                **self.objective.state_dict(),
                "diloco": self._all_outer_states(),
            },
            where=f" at outer step {self.diloco.outer_step}",
        )

    def _all_outer_states(self) -> list[dict[str, Any]] | None:
        """Every rank's DiLoCo state on rank 0, by rank: under FSDP2 each rank holds the global
        weights and outer momentum of its own shards only."""
        state = self.diloco.outer_state_dict()
        if not self.dist.is_distributed:
            return [state]
        gathered: list[Any] | None = [None] * self.dist.world_size if self.dist.is_main else None
        torch_dist.gather_object(state, gathered, dst=0)
        return gathered

    def cleanup(self) -> None:
        self.run.close()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (the tensor itself when unsharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@config.parse(schema=DiLoCoRecipeConfig)
def recipe_main(cfg: DictConfig) -> None:
    """The composer inner loop (channels 1-3; channel 3 is this project's own addition) under
    the DiLoCo outer loop, one replica."""
    with config.setup_errors_as_one_line():
        recipe = DiLoCoRecipe(cfg)
    # Caught from set-up on: the launcher signals every replica at once, and one still setting
    # up must not die while its peers wait for it in a sync; it votes to stop at its first.
    with StopRequest(recipe.dist) as stop:
        with config.setup_errors_as_one_line():
            recipe.setup()
        finished = recipe.train(stop)
    recipe.cleanup()
    if not finished:  # stopped by a signal, after saving a checkpoint
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(recipe_main())
