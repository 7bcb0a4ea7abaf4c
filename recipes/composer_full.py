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

The recipe reads top to bottom: ``ComposerFullRecipe.setup()`` builds each part in a
``_setup_*`` method, ``train()`` is the loop. Copy the file and edit it; shared building blocks
live in composer_tune/. The channels' config, their forward/backward per optimiser step, the
pair stream and the EMA teacher's checkpoint state come from composer_tune/channels/composer.py,
which recipes/diloco.py's inner loop uses too.
"""

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig
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

# Metrics that measure the machine rather than the run: they differ between identical runs.
TIMING_METRICS = ("tokens_per_second", "peak_memory_gib", "peak_rss_gib")


@dataclass
class ComposerFullConfig(config.TrainingConfig):
    dataset: Any = MISSING  # training prompts in the sample convention (prompt + answer)
    reward: Any = MISSING  # verifiable reward scoring the sampled completions
    eval_dataset: Any = None  # held-out prompts; null skips evaluation
    eval_reward: Any = None  # null: the training reward decides held-out correctness
    # The supervised run to start from; trained first if it has no checkpoint. Mutually
    # exclusive with checkpoint.initial_checkpoint.
    warm_start: WarmStartSection | None = None
    # Prompts per generation batch over all ranks (each rank takes an equal share).
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
    # Debug knob for negative controls: -1 flips every advantage (the run must then get worse).
    advantage_sign: float = 1.0
    # FSDP2 CPU offload of parameters, gradients and optimizer state (policy and reference).
    fsdp_cpu_offload: bool = False
    enable_thinking: bool = False
    eval_every_n_steps: int = 0  # 0: evaluate only before and after training
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 16
    # NaN/inf losses skip the step; this many in a row stop the run (last checkpoint intact).
    max_consecutive_nonfinite_steps: int = 3
    # The engine that samples rollouts (rollout.engine: native | vllm; rollout.vllm.*).
    rollout: RolloutSection = field(default_factory=RolloutSection)
    # Channel 2: an SDPOChannelConfig mapping (weight, context, loss, teacher, ema_rate);
    # null or weight 0 is off.
    sdpo: Any = None
    # Channel 3: a DPOChannelConfig mapping (weight, pairs, pairs_per_step, loss_type, beta,
    # label_smoothing, reference, max_seq_len, heldout_fraction, ...); null or weight 0 is off.
    dpo: Any = None


class ComposerFullRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.dist.device)
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0  # prompt batches of the current epoch already used
        self.accuracy_before: float | None = None  # held-out accuracy at step 0
        self.pairs_before: dict[str, float] = {}  # held-out pair metrics at step 0
        # The sampler splits the prompts; random init is seeded in _build_model.
        training.set_seed(seed=cfg.seed)

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg = self.cfg
        # The three channels' sections (loss, sdpo, dpo), checked; a channel at weight 0 is
        # off and nothing below is built for it.
        self.channels = ComposerChannels.from_config(cfg, self.dist)
        self._check_batch_layout(cfg)
        if self.dist.is_main:
            remove_stale_staging(cfg.output_dir)
        barrier()  # no rank looks for the latest checkpoint while rank 0 cleans up
        self.tokenizer = config.instantiate(cfg.tokenizer)
        resume_path = resolve_resume_path(cfg.checkpoint.resume_from_checkpoint, cfg.output_dir)
        # A fresh run never writes beside another run's checkpoints (replace_existing deletes
        # them, after set-up has succeeded).
        replaced = checkpoints_a_fresh_run_replaces(
            cfg.checkpoint, cfg.output_dir, resuming=resume_path is not None
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
        # Sampling randomness: its own stream per rank, saved in checkpoints for exact resume.
        self.sampling_generator = torch.Generator(device=self.dist.device)
        self.sampling_generator.manual_seed(cfg.seed * 1_000_003 + self.dist.rank)
        self.resumed = resume_path is not None
        state = self._restore(resume_path) if self.resumed else {}
        # Channel 3's pairs: the training stream (resumed at its saved position), the held-out
        # pairs and the reference table.
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
        """Reject batch sizes that do not divide evenly, naming the keys involved."""
        if cfg.num_prompts_per_generation % self.dist.world_size:
            raise ValueError(
                f"num_prompts_per_generation ({cfg.num_prompts_per_generation}) must be a "
                f"multiple of the number of ranks ({self.dist.world_size})"
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
        every = cfg.checkpoint.save_every_n_steps
        if every and every % self.steps_per_generation_total:
            raise ValueError(
                f"checkpoint.save_every_n_steps ({every}) must be a multiple of "
                f"steps_per_generation * num_iterations ({self.steps_per_generation_total}): "
                "checkpoints are taken between generation batches"
            )

    @property
    def steps_per_generation_total(self) -> int:
        """Optimiser steps taken on one generation batch."""
        return self.cfg.steps_per_generation * self.cfg.num_iterations

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
        """Channel 2's EMA teacher (``sdpo.teacher: ema``), held in float32 so that small
        updates are not rounded away; None otherwise. A resumed run restores its average in
        ``_restore``."""
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
        if len(dataset) < cfg.num_prompts_per_generation:
            raise ValueError(
                f"dataset {cfg.dataset._component_} has {len(dataset)} samples, fewer than "
                f"num_prompts_per_generation={cfg.num_prompts_per_generation}"
            )
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=self.dist.world_size,
            rank=self.dist.rank,
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
        """Optimizer, LR schedule, RNGs, sampling generator and data position from ``path``
        and the EMA teacher (the weights were loaded from its ``model/`` by ``_setup_model``);
        returns the recipe state for channel 3's pairs."""
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
        if self.dist.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)
        return state

    # ----------------------------------------------------------------------------- training

    def train(self) -> bool:
        """Trains to ``max_steps``; returns False if a stop signal ended the run early (after
        saving a checkpoint at the end of the current generation batch)."""
        cfg = self.cfg
        if not self.resumed:
            before, self.pairs_before = self.evaluate()
            self.accuracy_before = before.accuracy if before is not None else None
        progress = tqdm(
            initial=self.step,
            total=cfg.max_steps,
            disable=not (self.dist.is_main and cfg.logging.progress_bar),
            dynamic_ncols=True,
        )
        prompt_batches = self._prompt_batches()
        window_start, window_tokens = time.perf_counter(), 0.0
        with StopRequest(self.dist) as stop:
            while self.step < cfg.max_steps:
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
                        policy_version=self.step,
                    )
                    batch_metrics = rollout_metrics(rollout)
                # 2. Channel 1: group-relative advantages (after the KL penalty, in kl_mode=reward).
                advantages = None
                if self.channels.policy_weight > 0:
                    advantages = group_advantages(
                        rollout, self.channels.loss, cfg.group_size, self.dist
                    )
                    advantages = advantages * cfg.advantage_sign
                # 3. Channel 2: the teacher's contexts, once over the whole generation batch so
                # every row sees its group's siblings.
                teacher_batch = None
                if self.channels.sdpo.enabled:
                    teacher_batch = build_sdpo_teacher_batch(
                        rollout, tokenizer=self.tokenizer, cfg=self.channels.sdpo
                    )
                # 4. Optimiser steps on the generation batch: its slices, num_iterations times.
                rows_per_step = (
                    len(rollout) // cfg.steps_per_generation if rollout is not None else 0
                )
                for iteration in range(cfg.num_iterations):
                    for index in range(cfg.steps_per_generation):
                        if self.step >= cfg.max_steps:
                            break
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
                        progress.update(1)
                        progress.set_postfix(progress_postfix(batch_metrics, loss_metrics))
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
                                    # Rollout tokens trained on (0 with channel 3 alone).
                                    "tokens_per_second": total_tokens / max(elapsed, 1e-9),
                                    **peak_memory_metrics(self.dist.device),
                                }
                            )
                            window_start, window_tokens = time.perf_counter(), 0.0
                        if cfg.eval_every_n_steps and self.step % cfg.eval_every_n_steps == 0:
                            self.evaluate()
                every = cfg.checkpoint.save_every_n_steps
                saved = self.save_checkpoint() if every and self.step % every == 0 else None
                if self.step < cfg.max_steps and stop.requested():
                    progress.close()
                    print_stopped(self.step, saved or self.save_checkpoint(), self.dist)
                    return False
        progress.close()
        after = self.evaluate()
        every = cfg.checkpoint.save_every_n_steps
        if not (every and self.step % every == 0):  # the last step was not saved yet
            self.save_checkpoint()
        self._print_before_after(after)
        return True

    def _print_before_after(self, after: tuple[Any, dict]) -> None:
        """The run's summary lines: held-out accuracy and held-out pair metrics, against the
        step-0 values (kept in checkpoints, so a resumed run prints the same lines)."""
        if not self.dist.is_main:
            return
        (after_result, after_pairs), before_pairs = after, self.pairs_before
        if self.accuracy_before is not None and after_result is not None:
            print(
                f"held-out accuracy: before {self.accuracy_before:.3f} -> after "
                f"{after_result.accuracy:.3f} ({after_result.num_samples} problems, "
                f"{self.step} steps)",
                flush=True,
            )
        if before_pairs and after_pairs:
            print(
                f"held-out pairs: DPO accuracy before {before_pairs['eval/dpo_accuracy']:.3f} "
                f"-> after {after_pairs['eval/dpo_accuracy']:.3f}, margin before "
                f"{before_pairs['eval/dpo_margin']:.4f} -> after "
                f"{after_pairs['eval/dpo_margin']:.4f} ({len(self.pairs.heldout)} pairs)",
                flush=True,
            )

    def _prompt_batches(self):
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
        """Forward/backward of every channel that is on, clip, step; returns step metrics.

        ``rows`` are the step's rollouts (None with channel 3 alone), ``advantages`` their
        advantages (None without channel 1), ``teacher_rows`` their SDPO teacher batch (None
        without channel 2)."""
        pair_batch = self.pairs.next_batch() if self.pairs is not None else None
        losses = self.objective.backward(
            rows, advantages, teacher_rows, pair_batch, on_policy=on_policy
        )
        # The norm is always computed (max_norm=inf does not clip): the guard checks it.
        max_norm = self.cfg.clip_grad_norm if self.cfg.clip_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=max_norm)
        # A NaN/inf loss or norm skips the update (weights, optimizer, LR schedule, EMA teacher
        # untouched).
        if self.guard.check(self.step + 1, losses.loss, grad_norm):
            self.optimizer.step()
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

    def evaluate(self) -> tuple[Any, dict[str, float]]:
        """Held-out accuracy (None without an eval dataset) and held-out pair metrics ({}
        with channel 3 off)."""
        return self._evaluate_generation(), self._evaluate_pairs()

    def _evaluate_pairs(self) -> dict[str, float]:
        if self.pairs is None:
            return {}
        metrics = self.pairs.evaluate(self.model, self.reference)
        if metrics:
            self._log(metrics)
        if metrics and self.dist.is_main:
            print(
                f"[step {self.step}] held-out pairs: DPO loss {metrics['eval/dpo_loss']:.4f}, "
                f"margin {metrics['eval/dpo_margin']:.4f}, accuracy "
                f"{metrics['eval/dpo_accuracy']:.3f} over {len(self.pairs.heldout)} pairs",
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
            print(f"[step {self.step}] {result.summary()}", flush=True)
        return result

    def save_checkpoint(self) -> Path:
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
            },
            dist_info=self.dist,
            tokenizer_dir=self.cfg.tokenizer.path,
            max_shard_size=self.cfg.checkpoint.max_shard_size,
            run_identity=self.identity,
            keep_last=self.cfg.checkpoint.keep_last,
        )
        if self.dist.is_main:
            print(f"saved checkpoint {path}", flush=True)
        return path

    def _log(self, metrics: dict[str, float]) -> None:
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.step)

    def cleanup(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.metric_logger is not None:
            self.metric_logger.close()
        teardown_distributed()


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
