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

The recipe reads top to bottom: ``DiLoCoRecipe.setup()`` builds each part in a ``_setup_*``
method, ``train()`` is the loop. Copy the file and edit it; shared building blocks live in
composer_tune/.
"""

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from omegaconf import MISSING, DictConfig
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import training
from tqdm import tqdm

from composer_tune import config
from composer_tune.channels.composer import ComposerChannels, ComposerObjective
from composer_tune.channels.policy import group_advantages, sample_rollouts
from composer_tune.channels.replay_dpo import PairChannel
from composer_tune.channels.sdpo.channel import build_sdpo_teacher_batch, select_teacher_rows
from composer_tune.channels.sdpo.teacher import (
    check_teacher_length,
    ema_teacher_state,
    load_ema_teacher_state,
)
from composer_tune.checkpointing.run_identity import check_resume_identity, run_identity
from composer_tune.checkpointing.run_state import (
    check_checkpoint_section,
    checkpoints_a_fresh_run_replaces,
    load_training_state,
    remove_checkpoints,
    remove_stale_staging,
    resolve_resume_path,
    save_run_checkpoint,
)
from composer_tune.checkpointing.warm_start import WarmStartSection, initial_checkpoint
from composer_tune.diloco import DiLoCoConfig, DiLoCoTrainer, OuterStepMetrics
from composer_tune.diloco.config import restarted_by_launcher
from composer_tune.distributed import (
    all_reduce_sum,
    barrier,
    gather_generator_states,
    peak_memory_metrics,
    setup_distributed,
    teardown_distributed,
)
from composer_tune.evaluation import evaluate_heldout
from composer_tune.guards import NonFiniteGuard
from composer_tune.losses.distill import EMATeacher
from composer_tune.models.build import build_decoder
from composer_tune.progress import progress_postfix
from composer_tune.rollout.engines import RolloutSection, build_rollout_engine
from composer_tune.rollout.rollouts import RolloutBatch, rollout_metrics
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest, print_stopped

NUM_REPLICAS_ENV = "NUM_REPLICAS"


@dataclass
class DiLoCoRecipeConfig(config.TrainingConfig):
    dataset: Any = MISSING  # training prompts in the sample convention (prompt + answer)
    reward: Any = MISSING  # verifiable reward scoring the sampled completions
    eval_dataset: Any = None  # held-out prompts; null skips evaluation
    eval_reward: Any = None  # null: the training reward decides held-out correctness
    # The supervised run to start from; trained first (by one replica) if it has no checkpoint.
    # Mutually exclusive with checkpoint.initial_checkpoint.
    warm_start: WarmStartSection | None = None
    # The outer loop (composer_tune/diloco/config.py): sync_every, outer optimizer, fragments,
    # lighthouse and addresses. replica_id / lighthouse_addr default to REPLICA_ID and
    # TORCHFT_LIGHTHOUSE, set by tools/launch_diloco.py.
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    # Replicas the dataset is sharded over; null: the NUM_REPLICAS environment variable.
    num_replicas: int | None = None
    # Prompts per generation batch over this replica's ranks (each rank takes an equal share).
    num_prompts_per_generation: int = 16
    group_size: int = 8  # completions per prompt (G)
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # Optimiser steps the generation batch is split into, and passes over it (TRL's names).
    steps_per_generation: int = 1
    num_iterations: int = 1
    micro_batch_size: int = 32  # completions per forward/backward on each rank
    # Channel 1: ``weight`` (default 1; 0 turns the policy loss off) and a PolicyLossConfig
    # mapping (objective, epsilon_low/high, beta, kl_estimator, kl_mode, scale_rewards,
    # mask_truncated_completions). max_completion_length defaults to max_new_tokens.
    loss: Any = None
    # FSDP2 CPU offload of parameters, gradients and optimizer state (policy and reference).
    fsdp_cpu_offload: bool = False
    enable_thinking: bool = False
    eval_every_n_outer_steps: int = 0  # 0: evaluate only before and after training
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 16
    # NaN/inf losses skip the step (it still counts toward the sync window); this many in a row
    # stop the replica (last checkpoint intact).
    max_consecutive_nonfinite_steps: int = 3
    # The engine that samples rollouts (rollout.engine: native | vllm; rollout.vllm.*).
    rollout: RolloutSection = field(default_factory=RolloutSection)
    # Channel 2: an SDPOChannelConfig mapping (weight, context, loss, teacher, ema_rate);
    # null or weight 0 is off.
    sdpo: Any = None
    # Channel 3: a DPOChannelConfig mapping (weight, pairs, pairs_per_step per replica,
    # loss_type, beta, label_smoothing, reference, max_seq_len, heldout_fraction, ...); null or
    # weight 0 is off.
    dpo: Any = None


class DiLoCoRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.dist.device)
        self.diloco_cfg = DiLoCoConfig.coerce(cfg.diloco)
        self.replica_id = self.diloco_cfg.resolved_replica_id()
        self.num_replicas = self._resolve_num_replicas(cfg)
        # Each replica writes its own logs and checkpoints; ${output_dir} interpolations in the
        # config (e.g. the metric logger's log_dir) follow.
        cfg.output_dir = str(Path(cfg.output_dir) / f"replica_{self.replica_id}")
        self.step = 0  # inner optimiser steps this replica took
        self.epoch = 0
        self.batches_in_epoch = 0  # prompt batches of the current epoch already used
        self.accuracy_before: float | None = None  # held-out accuracy at step 0
        self.pairs_before: dict[str, float] = {}  # held-out pair metrics at step 0
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
        cfg = self.cfg
        # The three channels' sections (loss, sdpo, dpo), checked; a channel at weight 0 is
        # off and nothing below is built for it.
        self.channels = ComposerChannels.from_config(cfg, self.dist)
        self._check_batch_layout(cfg)
        if self.dist.is_main:
            remove_stale_staging(cfg.output_dir)
        barrier()
        self.tokenizer = config.instantiate(cfg.tokenizer)
        resume_path = resolve_resume_path(cfg.checkpoint.resume_from_checkpoint, cfg.output_dir)
        # A fresh run never writes beside another run's checkpoints (replace_existing deletes
        # them, after set-up has succeeded).
        replaced = checkpoints_a_fresh_run_replaces(
            cfg.checkpoint,
            cfg.output_dir,
            resuming=resume_path is not None or restarted_by_launcher(),
        )
        # A resumed checkpoint must come from this run's settings (not a variant's).
        check_checkpoint_section(cfg.checkpoint)
        self.identity = run_identity(cfg)
        if resume_path is not None:
            check_resume_identity(
                resume_path,
                self.identity,
                allow_changes=cfg.checkpoint.resume_with_changed_config,
            )
        initial = self._initial_checkpoint(cfg)
        self.model = self._setup_model(cfg, resume_path or initial)
        check_teacher_length(self.channels.sdpo, self.model.max_seq_len)
        # The reference is the starting policy, never a resumed one, and only exists for KL or
        # for DPO scoring pairs live.
        self.reference = (
            self._setup_reference(cfg, initial) if self.channels.builds_reference_model else None
        )
        self.ema_teacher = self._setup_ema_teacher(cfg, resume_path or initial)
        # The inner step's objective: forward/backward of every channel that is on.
        self.objective = ComposerObjective(
            self.model,
            self.channels,
            tokenizer=self.tokenizer,
            dist=self.dist,
            micro_batch_size=cfg.micro_batch_size,
            temperature=cfg.temperature,
            logprob_chunk_size=cfg.logprob_chunk_size,
            ema_teacher=self.ema_teacher,
            reference=self.reference,
        )
        self.optimizer = config.instantiate(cfg.optimizer, self.model.parameters())
        self.lr_scheduler = (
            config.instantiate(cfg.lr_scheduler, self.optimizer, num_training_steps=cfg.max_steps)
            if cfg.lr_scheduler is not None
            else None
        )
        self.guard = NonFiniteGuard(
            cfg.max_consecutive_nonfinite_steps, device=self.dist.device, verbose=self.dist.is_main
        )
        self.dataloader = self._setup_data(cfg)
        self.reward = config.instantiate(cfg.reward)
        self.eval_dataset = (
            config.instantiate(cfg.eval_dataset) if cfg.eval_dataset is not None else None
        )
        self.eval_reward = config.instantiate(cfg.eval_reward) if cfg.eval_reward else self.reward
        # Sampling randomness: its own stream per replica and rank, saved for exact resume.
        self.sampling_generator = torch.Generator(device=self.dist.device)
        self.sampling_generator.manual_seed(cfg.seed * 1_000_003 + self.data_shard)
        # The outer loop; it snapshots the current weights as the initial global weights.
        self.diloco = DiLoCoTrainer(
            self.model, self.optimizer, self.diloco_cfg, lr_scheduler=self.lr_scheduler
        )
        self.resumed = resume_path is not None
        state = self._restore(resume_path) if self.resumed else {}
        # Channel 3's pairs: this replica's shard of the training stream (resumed at its saved
        # position), the held-out pairs and the reference table.
        self.pairs = (
            PairChannel(
                self.channels.dpo,
                model=self.model,
                tokenizer=self.tokenizer,
                dist=self.dist,
                seed=cfg.seed,
                logprob_chunk_size=cfg.logprob_chunk_size,
                state=state,
                resumed=self.resumed,
                num_replicas=self.num_replicas,
                replica_id=self.replica_id,
            )
            if self.channels.dpo.enabled
            else None
        )
        # Last, once the config and inputs are validated: a start that fails writes no log
        # or config record into output_dir. Channel 3 alone samples nothing: no engine.
        self.engine = (
            build_rollout_engine(cfg, self.model, self.dist, step=self.step)
            if self.channels.needs_rollouts
            else None
        )
        self.metric_logger = self._setup_metric_logger(cfg)
        if self.dist.is_main:
            remove_checkpoints(replaced)

    def _check_batch_layout(self, cfg: DictConfig) -> None:
        """Reject step counts and batch sizes that do not divide evenly, naming the keys."""
        if cfg.num_prompts_per_generation % self.dist.world_size:
            raise ValueError(
                f"num_prompts_per_generation ({cfg.num_prompts_per_generation}) must be a "
                f"multiple of the number of ranks of a replica ({self.dist.world_size})"
            )
        rows = cfg.num_prompts_per_generation // self.dist.world_size * cfg.group_size
        if rows % cfg.steps_per_generation:
            raise ValueError(
                f"each rank's {rows} completions per generation (num_prompts_per_generation / "
                f"ranks * group_size) do not split into steps_per_generation="
                f"{cfg.steps_per_generation} equal optimiser steps"
            )
        if cfg.num_iterations < 1 or cfg.steps_per_generation < 1 or cfg.micro_batch_size < 1:
            raise ValueError(
                "num_iterations, steps_per_generation and micro_batch_size must be >= 1"
            )
        window = self.diloco_cfg.fragment_sync_every
        # Syncs fall between generation batches: no batch is trained across a weight reset, and
        # a checkpoint taken right after a sync is also at a data-position boundary.
        if window % self.steps_per_generation_total:
            raise ValueError(
                f"diloco.sync_every / diloco.num_fragments ({window}) must be a multiple of "
                f"steps_per_generation * num_iterations ({self.steps_per_generation_total}) so "
                "that syncs fall between generation batches"
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
    def steps_per_generation_total(self) -> int:
        """Optimiser steps taken on one generation batch."""
        return self.cfg.steps_per_generation * self.cfg.num_iterations

    @property
    def max_outer_steps(self) -> int:
        """Committed syncs (torchft manager steps) after which the run ends."""
        return self.cfg.max_steps // self.diloco_cfg.fragment_sync_every

    @property
    def data_shard(self) -> int:
        """This rank's shard of the dataset among every rank of every replica."""
        return self.replica_id * self.dist.world_size + self.dist.rank

    def _setup_metric_logger(self, cfg: DictConfig) -> Any:
        if not self.dist.is_main or cfg.logging.metric_logger is None:
            return None
        logger = config.instantiate(cfg.logging.metric_logger)
        logger.log_config(cfg)  # torchtune writes <output_dir>/torchtune_config.yaml
        print(f"resolved config: {cfg.output_dir}/torchtune_config.yaml", flush=True)
        return logger

    def _initial_checkpoint(self, cfg: DictConfig) -> str | None:
        return initial_checkpoint(cfg.warm_start, cfg.checkpoint.initial_checkpoint, self.dist)

    def _build_model(
        self, cfg: DictConfig, checkpoint: Any, dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        """The decoder, sharded under torchrun, with weights from ``checkpoint`` (or random),
        in ``dtype`` (default: the run's)."""
        return build_decoder(
            cfg.model,
            checkpoint=checkpoint,
            dtype=dtype or self.dtype,
            dist_info=self.dist,
            seed=cfg.seed,  # identical on every rank (and replica)
            activation_checkpointing=cfg.enable_activation_checkpointing,
            fsdp_cpu_offload=cfg.fsdp_cpu_offload,
            autocast=cfg.autocast,
        )

    def _setup_model(self, cfg: DictConfig, checkpoint: Any) -> torch.nn.Module:
        model = self._build_model(cfg, checkpoint)
        model.train()
        return model

    def _setup_ema_teacher(self, cfg: DictConfig, checkpoint: Any) -> EMATeacher | None:
        """Channel 2's EMA teacher (``sdpo.teacher: ema``) of this replica's weights, held in
        float32 so that small updates are not rounded away; None otherwise. A resumed run
        restores its average in ``_restore``."""
        if not self.channels.uses_ema_teacher:
            return None
        module = self._build_model(cfg, checkpoint, dtype=torch.float32)
        return EMATeacher(self.model, self.channels.sdpo.ema_rate, teacher=module)

    def _setup_reference(self, cfg: DictConfig, initial: str | None) -> torch.nn.Module:
        reference = self._build_model(cfg, initial)
        reference.eval()
        reference.requires_grad_(False)
        return reference

    def _setup_data(self, cfg: DictConfig) -> DataLoader:
        dataset = config.instantiate(cfg.dataset)
        prompts_per_rank = cfg.num_prompts_per_generation // self.dist.world_size
        num_shards = self.num_replicas * self.dist.world_size
        if len(dataset) < prompts_per_rank * num_shards:
            raise ValueError(
                f"dataset {cfg.dataset._component_} has {len(dataset)} samples, fewer than "
                f"num_prompts_per_generation={cfg.num_prompts_per_generation} for each of "
                f"{self.num_replicas} replicas"
            )
        # One shard per rank of every replica: replicas train on disjoint prompts.
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=num_shards,
            rank=self.data_shard,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        # Samples stay dicts: the rollout engine renders the prompts, the reward reads the rest.
        return DataLoader(
            dataset,
            batch_size=prompts_per_rank,
            sampler=self.sampler,
            drop_last=True,
            collate_fn=list,
        )

    def _restore(self, path: Any) -> dict[str, Any]:
        """Optimizer, LR schedule, RNGs, sampling generator, data position, non-finite guard,
        EMA teacher and this rank's DiLoCo state from ``path`` (the local weights were loaded
        from its ``model/``); returns the recipe state for channel 3's pairs."""
        state = load_training_state(
            path,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dist_info=self.dist,
        )
        self.step = state["step"]
        self.epoch = state["epoch"]
        self.batches_in_epoch = state["batches_in_epoch"]
        self.sampling_generator.set_state(state["sampling_generator"][self.dist.rank])
        self.guard.load_state_dict(state["nonfinite_guard"])
        self.accuracy_before = state.get("accuracy_before")
        self.pairs_before = state.get("pairs_before") or {}
        load_ema_teacher_state(
            self.ema_teacher,
            state,
            source=path,
            device=self.dist.device,
            cpu_offload=self.cfg.fsdp_cpu_offload,
        )
        self.diloco.load_outer_state_dict(state["diloco"][self.dist.rank])
        if self.dist.is_main:
            print(
                f"resumed from {path} at step {self.step}, outer step {self.diloco.outer_step}",
                flush=True,
            )
        return state

    # ----------------------------------------------------------------------------- training

    def train(self, stop: StopRequest) -> bool:
        """Trains to ``max_steps``; returns False if ``stop`` was signalled and ended the run
        early (after a committed sync every replica agreed on, with a checkpoint saved there)."""
        cfg = self.cfg
        if not self.resumed:
            before, self.pairs_before = self.evaluate()
            self.accuracy_before = before.accuracy if before is not None else None
        progress = tqdm(
            initial=self.diloco.outer_step,
            total=self.max_outer_steps,
            unit="sync",
            disable=not (self.dist.is_main and cfg.logging.progress_bar),
            dynamic_ncols=True,
        )
        prompt_batches = self._prompt_batches()
        window_start, window_tokens = time.perf_counter(), 0.0
        saved_outer_step = self.diloco.outer_step if self.resumed else None
        with self.diloco:
            self.diloco.vote_to_stop(lambda: stop.signalled)
            while self.diloco.outer_step < self.max_outer_steps:
                # 1. Rollout (channels 1 and 2): G completions per prompt, rewards, old (and
                # reference) log-probs. Channel 3 alone trains on pairs only.
                rollout, batch_metrics = None, {}
                if self.channels.needs_rollouts:
                    rollout = sample_rollouts(
                        self.model,
                        next(prompt_batches),
                        cfg,
                        tokenizer=self.tokenizer,
                        reward=self.reward,
                        generator=self.sampling_generator,
                        reference=self.reference if self.channels.kl_reference else None,
                        compute_old_logp=self.channels.needs_old_logp(self._on_policy()),
                        sync_ranks=self.dist.is_distributed,
                        engine=self.engine,
                        policy_version=None,  # the outer sync and healing change weights too
                    )
                    batch_metrics = rollout_metrics(rollout)
                # 2. Channel 1: group-relative advantages (after the KL penalty, kl_mode=reward).
                advantages = None
                if self.channels.policy_weight > 0:
                    advantages = group_advantages(
                        rollout, self.channels.loss, cfg.group_size, self.dist
                    )
                # 3. Channel 2: the teacher's contexts, once over the whole generation batch so
                # every row sees its group's siblings.
                teacher_batch = None
                if self.channels.sdpo.enabled:
                    teacher_batch = build_sdpo_teacher_batch(
                        rollout, tokenizer=self.tokenizer, cfg=self.channels.sdpo
                    )
                # 4. Inner optimiser steps on the generation batch: its slices, num_iterations
                # times. The optimizer step that ends a sync window also runs the sync.
                rows_per_step = (
                    len(rollout) // cfg.steps_per_generation if rollout is not None else 0
                )
                for iteration in range(cfg.num_iterations):
                    for index in range(cfg.steps_per_generation):
                        rows = slice(index * rows_per_step, (index + 1) * rows_per_step)
                        step_rows = rollout.select(rows) if rollout is not None else None
                        loss_metrics = self._optimizer_step(
                            step_rows,
                            advantages[rows] if advantages is not None else None,
                            select_teacher_rows(teacher_batch, rows)
                            if teacher_batch is not None
                            else None,
                            on_policy=self._on_policy(),
                        )
                        if step_rows is not None:
                            window_tokens += float(
                                (step_rows.prompt_lengths + step_rows.completion_lengths).sum()
                            )
                        self.step += 1
                        if self.step % cfg.logging.log_every_n_steps == 0:
                            elapsed = time.perf_counter() - window_start
                            window = torch.tensor([window_tokens], dtype=torch.float64)
                            total_tokens = float(all_reduce_sum(window.to(self.dist.device)))
                            self._log(
                                {
                                    **loss_metrics,
                                    **batch_metrics,
                                    "iteration": float(iteration),
                                    "lr": self.optimizer.param_groups[0]["lr"],
                                    "tokens_per_second": total_tokens / max(elapsed, 1e-9),
                                    **peak_memory_metrics(self.dist.device),
                                }
                            )
                            window_start, window_tokens = time.perf_counter(), 0.0
                # 5. The sync this batch ended with, if any (syncs fall between batches).
                synced = self._log_outer_steps(self.diloco.pop_outer_steps())
                if not any(outer.committed for outer in synced):
                    continue
                progress.update(self.diloco.outer_step - progress.n)
                progress.set_postfix(progress_postfix(batch_metrics, loss_metrics))
                outer_step = self.diloco.outer_step
                every_eval = cfg.eval_every_n_outer_steps
                if every_eval and outer_step % every_eval == 0:
                    self.evaluate()
                every = cfg.checkpoint.save_every_n_steps
                saved = None
                if every and (outer_step * self.diloco_cfg.fragment_sync_every) % every == 0:
                    saved = self.save_checkpoint()
                    saved_outer_step = outer_step
                if outer_step < self.max_outer_steps and self.diloco.stop_agreed():
                    progress.close()
                    print_stopped(self.step, saved or self.save_checkpoint(), self.dist)
                    return False
            progress.close()
            after = self.evaluate()
            if saved_outer_step != self.diloco.outer_step:  # the last sync was not saved yet
                self.save_checkpoint()
        self._print_before_after(after)
        return True

    def _print_before_after(self, after: tuple[Any, dict]) -> None:
        """The run's summary lines: held-out accuracy and held-out pair metrics, both of the
        global weights, against the step-0 values (kept in checkpoints: a resumed run prints
        the same lines)."""
        if not self.dist.is_main:
            return
        (after_result, after_pairs), before_pairs = after, self.pairs_before
        if self.accuracy_before is not None and after_result is not None:
            print(
                f"held-out accuracy (global weights): before {self.accuracy_before:.3f} -> "
                f"after {after_result.accuracy:.3f} ({after_result.num_samples} problems, "
                f"{self.step} inner steps, {self.diloco.outer_step} outer steps)",
                flush=True,
            )
        if before_pairs and after_pairs:
            print(
                f"held-out pairs (global weights): DPO accuracy before "
                f"{before_pairs['eval/dpo_accuracy']:.3f} -> after "
                f"{after_pairs['eval/dpo_accuracy']:.3f}, margin before "
                f"{before_pairs['eval/dpo_margin']:.4f} -> after "
                f"{after_pairs['eval/dpo_margin']:.4f} ({len(self.pairs.heldout)} pairs)",
                flush=True,
            )

    def _prompt_batches(self) -> Iterator[list[dict[str, Any]]]:
        """Endless prompt batches from the saved data position on, epoch after epoch."""
        while True:
            self.sampler.set_epoch(self.epoch)
            for index, batch in enumerate(self.dataloader):
                if index < self.batches_in_epoch:  # used before a resume
                    continue
                self.batches_in_epoch = index + 1
                yield batch
            self.epoch += 1
            self.batches_in_epoch = 0

    def _on_policy(self) -> bool:
        """One optimiser step per generation batch: the sampling policy is the current one."""
        return self.cfg.num_iterations == 1 and self.cfg.steps_per_generation == 1

    def _optimizer_step(
        self,
        rows: RolloutBatch | None,
        advantages: torch.Tensor | None,
        teacher_rows: Any,
        *,
        on_policy: bool,
    ) -> dict[str, float]:
        """Forward/backward of every channel that is on, clip, inner step (and, at the end of a
        sync window, the sync); returns step metrics. Arguments as composer_full's."""
        pair_batch = self.pairs.next_batch() if self.pairs is not None else None
        losses = self.objective.backward(
            rows, advantages, teacher_rows, pair_batch, on_policy=on_policy
        )
        # The norm is always computed (max_norm=inf does not clip): the guard checks it.
        max_norm = self.cfg.clip_grad_norm if self.cfg.clip_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=max_norm)
        applied = self.guard.check(self.step + 1, losses.loss, grad_norm)
        if not applied:
            # A skipped step keeps its slot in the sync window: with no gradients the inner
            # optimizer updates nothing, but its step() below still runs DiLoCo's hook.
            self.optimizer.zero_grad(set_to_none=True)
        # DiLoCoTrainer's hook runs a fragment sync inside this call at the end of a window.
        self.optimizer.step()
        if applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.ema_teacher is not None:
                self.ema_teacher.update()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            **losses.reduce(self.dist),
            "grad_norm": float(grad_norm),
            **self.guard.metrics(),
        }

    def _log_outer_steps(self, synced: list[OuterStepMetrics]) -> list[OuterStepMetrics]:
        """Logs each sync's metrics (bytes sent vs data-parallel, reduction factor, quorum
        size, pseudo-gradient norm) at the current inner step; returns them."""
        for outer in synced:
            self._log(outer.as_dict())
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
        params = dict(self.model.named_parameters())
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
        with self._global_weights():
            return self._evaluate_generation(), self._evaluate_pairs()

    def _evaluate_pairs(self) -> dict[str, float]:
        if self.pairs is None:
            return {}
        metrics = self.pairs.evaluate(self.model, self.reference)
        if metrics:
            self._log(metrics)
        if metrics and self.dist.is_main:
            print(
                f"[step {self.step}, outer step {self.diloco.outer_step}] held-out pairs: DPO "
                f"loss {metrics['eval/dpo_loss']:.4f}, margin {metrics['eval/dpo_margin']:.4f}, "
                f"accuracy {metrics['eval/dpo_accuracy']:.3f} over {len(self.pairs.heldout)} "
                "pairs",
                flush=True,
            )
        return metrics

    def _evaluate_generation(self) -> Any:
        if self.eval_dataset is None:
            return None
        result = evaluate_heldout(
            self.model,
            self.tokenizer,
            self.eval_dataset,
            self.eval_reward,
            dist_info=self.dist,
            batch_size=self.cfg.eval_batch_size,
            max_new_tokens=self.cfg.eval_max_new_tokens,
            enable_thinking=self.cfg.enable_thinking,
        )
        self._log(result.metrics())
        if self.dist.is_main:
            print(
                f"[step {self.step}, outer step {self.diloco.outer_step}] {result.summary()}",
                flush=True,
            )
        return result

    def save_checkpoint(self) -> Path | None:
        """Atomic run checkpoint (composer_tune/checkpointing/run_state.py) with every rank's
        DiLoCo state in the recipe state; taken right after a sync. Collective; returns its
        folder."""
        self.guard.check_parameters(self.model, self.step)  # never save poisoned weights
        path = save_run_checkpoint(
            output_dir=self.cfg.output_dir,
            step=self.step,
            model=self.model,
            model_config=self.model.config,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            recipe_state={
                "step": self.step,
                "epoch": self.epoch,
                "batches_in_epoch": self.batches_in_epoch,
                "sampling_generator": gather_generator_states(self.sampling_generator, self.dist),
                "nonfinite_guard": self.guard.state_dict(),
                "accuracy_before": self.accuracy_before,
                "pairs_before": self.pairs_before,
                # Channel 3's pair-stream position and reference table, channel 2's EMA teacher.
                **(self.pairs.state_dict() if self.pairs is not None else {}),
                **ema_teacher_state(self.ema_teacher, self.dist),
                "diloco": self._all_outer_states(),
            },
            dist_info=self.dist,
            tokenizer_dir=self.cfg.tokenizer.path,
            max_shard_size=self.cfg.checkpoint.max_shard_size,
            run_identity=self.identity,
            keep_last=self.cfg.checkpoint.keep_last,
        )
        if self.dist.is_main:
            print(f"saved checkpoint {path} at outer step {self.diloco.outer_step}", flush=True)
        return path

    def _all_outer_states(self) -> list[dict[str, Any]] | None:
        """Every rank's DiLoCo state on rank 0, by rank: under FSDP2 each rank holds the global
        weights and outer momentum of its own shards only."""
        state = self.diloco.outer_state_dict()
        if not self.dist.is_distributed:
            return [state]
        gathered: list[Any] | None = [None] * self.dist.world_size if self.dist.is_main else None
        torch_dist.gather_object(state, gathered, dst=0)
        return gathered

    def _log(self, metrics: dict[str, float]) -> None:
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.step)

    def cleanup(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.metric_logger is not None:
            self.metric_logger.close()
        teardown_distributed()


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
