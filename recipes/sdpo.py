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

The recipe reads top to bottom: ``SDPORecipe.setup()`` builds each part in a ``_setup_*`` method,
``train()`` is the loop. Copy the file and edit it; shared building blocks live in composer_tune/.
"""

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import training
from tqdm import tqdm

from composer_tune import config
from composer_tune.channels.policy import (
    group_advantages,
    kl_in_reward,
    sample_rollouts,
    step_normalization,
)
from composer_tune.channels.sdpo import (
    SDPOChannelConfig,
    TeacherBatch,
    build_sdpo_teacher_batch,
    distilled_token_count,
    logprobs_with_sdpo,
    reduce_sdpo_metrics,
    select_teacher_rows,
)
from composer_tune.channels.sdpo.teacher import (
    check_teacher_length,
    ema_teacher_state,
    load_ema_teacher_state,
    sdpo_config_from,
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
from composer_tune.losses import (
    EMATeacher,
    PolicyLossConfig,
    needs_reference_model,
    policy_loss,
)
from composer_tune.models.build import build_decoder
from composer_tune.progress import progress_postfix
from composer_tune.rollout.engines import RolloutSection, build_rollout_engine
from composer_tune.rollout.rollouts import RolloutBatch, rollout_metrics
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest, print_stopped

# Metrics that measure the machine rather than the run: they differ between identical runs.
TIMING_METRICS = ("tokens_per_second", "peak_memory_gib", "peak_rss_gib")


@dataclass
class SDPOConfig(config.TrainingConfig):
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
    # The policy objective: a PolicyLossConfig mapping (objective, epsilon_low/high, beta,
    # kl_estimator, kl_mode, scale_rewards, mask_truncated_completions). max_completion_length
    # defaults to max_new_tokens.
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
    # Channel 2: weight (0 = off), teacher context (hints), divergence, teacher (current / ema).
    sdpo: SDPOChannelConfig = field(default_factory=SDPOChannelConfig)


class SDPORecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.dist.device)
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0  # prompt batches of the current epoch already used
        self.accuracy_before: float | None = None  # held-out accuracy at step 0
        # Per-rank RNG streams (torchtune offsets the seed by the rank); random init is seeded
        # identically on every rank in _build_model.
        training.set_seed(seed=cfg.seed)

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg = self.cfg
        self.loss_cfg = self._setup_loss_config(cfg)
        self.sdpo_cfg = sdpo_config_from(cfg, self.dist)
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
        check_teacher_length(self.sdpo_cfg, self.model.max_seq_len)
        # The reference is the starting policy, never a resumed one, and only exists with KL.
        self.reference = (
            self._setup_reference(cfg, initial) if needs_reference_model(self.loss_cfg) else None
        )
        self.ema_teacher = (
            self._setup_ema_teacher(cfg, initial)
            if self.sdpo_cfg.enabled and self.sdpo_cfg.teacher == "ema"
            else None
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
        if resume_path is not None:
            self._restore(resume_path)
        # Last, once the config and inputs are validated: a start that fails writes no log
        # or config record into output_dir.
        self.engine = build_rollout_engine(cfg, self.model, self.dist, step=self.step)
        self.metric_logger = self._setup_metric_logger(cfg)
        if self.dist.is_main:
            remove_checkpoints(replaced)

    def _setup_loss_config(self, cfg: DictConfig) -> PolicyLossConfig:
        section = OmegaConf.to_container(cfg.loss, resolve=True) if cfg.loss is not None else {}
        section.setdefault("max_completion_length", cfg.max_new_tokens)
        return PolicyLossConfig.from_mapping(section, source="loss")

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
            seed=cfg.seed,  # identical on every rank (and for the reference and EMA teacher)
            activation_checkpointing=cfg.enable_activation_checkpointing,
            fsdp_cpu_offload=cfg.fsdp_cpu_offload,
            autocast=cfg.autocast,
        )

    def _setup_model(self, cfg: DictConfig, checkpoint: Any) -> torch.nn.Module:
        model = self._build_model(cfg, checkpoint)
        model.train()
        return model

    def _setup_reference(self, cfg: DictConfig, initial: str | None) -> torch.nn.Module:
        reference = self._build_model(cfg, initial)
        reference.eval()
        reference.requires_grad_(False)
        return reference

    def _setup_ema_teacher(self, cfg: DictConfig, initial: str | None) -> EMATeacher:
        """An EMA of the policy, sharded like it, held in float32 (a bf16 average would lose
        updates below half an ulp). It starts as a copy of the policy; a resume restores it."""
        module = self._build_model(cfg, initial, dtype=torch.float32)
        return EMATeacher(self.model, rate=self.sdpo_cfg.ema_rate, teacher=module)

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

    def _restore(self, path: Any) -> None:
        """Optimizer, LR schedule, RNGs, sampling generator and data position from ``path``
        (the weights were loaded from its ``model/`` by ``_setup_model``)."""
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
        load_ema_teacher_state(
            self.ema_teacher,
            state,
            source=path,
            device=self.dist.device,
            cpu_offload=self.cfg.fsdp_cpu_offload,
        )
        if self.dist.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)

    # ----------------------------------------------------------------------------- training

    def train(self) -> bool:
        """Trains to ``max_steps``; returns False if a stop signal ended the run early (after
        saving a checkpoint at the end of the current generation batch)."""
        cfg = self.cfg
        if not self.resumed:
            before = self.evaluate()
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
                # 1. Rollout: G completions per prompt, rewards, old (and reference) log-probs.
                rollout = self._rollout(next(prompt_batches))
                batch_metrics = rollout_metrics(rollout)
                # 2. Group-relative advantages (after the KL penalty, in kl_mode=reward).
                advantages = (
                    group_advantages(rollout, self.loss_cfg, cfg.group_size, self.dist)
                    * cfg.advantage_sign
                )
                # 3. SDPO teacher contexts, once per generation so every row sees all its siblings.
                teacher_batch = (
                    build_sdpo_teacher_batch(rollout, tokenizer=self.tokenizer, cfg=self.sdpo_cfg)
                    if self.sdpo_cfg.enabled
                    else None
                )
                # 4. Optimiser steps on the generation batch: its slices, num_iterations times.
                rows_per_step = len(rollout) // cfg.steps_per_generation
                for iteration in range(cfg.num_iterations):
                    for start in range(0, len(rollout), rows_per_step):
                        if self.step >= cfg.max_steps:
                            break
                        rows = slice(start, start + rows_per_step)
                        step_rows = rollout.select(rows)
                        loss_metrics = self._optimizer_step(
                            step_rows,
                            advantages[rows],
                            select_teacher_rows(teacher_batch, rows)
                            if teacher_batch is not None
                            else None,
                            on_policy=self._on_policy(),
                        )
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
        if self.dist.is_main and self.accuracy_before is not None and after is not None:
            print(
                f"held-out accuracy: before {self.accuracy_before:.3f} -> after "
                f"{after.accuracy:.3f} ({after.num_samples} problems, {self.step} steps)",
                flush=True,
            )
        return True

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

    def _rollout(self, samples: list[dict[str, Any]]) -> RolloutBatch:
        return sample_rollouts(
            self.model,
            samples,
            self.cfg,
            tokenizer=self.tokenizer,
            reward=self.reward,
            generator=self.sampling_generator,
            reference=self.reference,
            compute_old_logp=self._needs_old_logp(),
            sync_ranks=self.dist.is_distributed,
            engine=self.engine,
            policy_version=self.step,
        )

    def _on_policy(self) -> bool:
        """One optimiser step per generation batch: the sampling policy is the current one."""
        return self.cfg.num_iterations == 1 and self.cfg.steps_per_generation == 1

    def _needs_old_logp(self) -> bool:
        """Off-policy steps, KL in the reward and SDPO's importance-ratio clipping read the
        sampling policy's log-probs; an on-policy step uses the current ones (no extra forward)."""
        loss_cfg = self.loss_cfg
        return (
            not self._on_policy()
            or kl_in_reward(loss_cfg)
            or (self.sdpo_cfg.enabled and self.sdpo_cfg.loss.is_clip is not None)
        )

    def _optimizer_step(
        self,
        rows: RolloutBatch,
        advantages: torch.Tensor,
        teacher_batch: TeacherBatch | None,
        *,
        on_policy: bool,
    ) -> dict[str, float]:
        """Forward/backward over micro-batches of ``rows``, clip, step; returns step metrics.

        ``teacher_batch`` (``rows``' SDPO teacher contexts) is None when channel 2 is off.
        """
        cfg, loss_cfg, sdpo_cfg = self.cfg, self.loss_cfg, self.sdpo_cfg
        micro_batches = rows.micro_batches(cfg.micro_batch_size)
        # The policy loss completes itself from the step's facts (objective by objective).
        normalization = step_normalization(rows, loss_cfg, self.dist, cfg.micro_batch_size)
        # SDPO: a token mean over the step's distilled tokens on all ranks, the same way.
        sdpo_normalizer = None
        if teacher_batch is not None:
            distilled = all_reduce_sum(distilled_token_count(teacher_batch).reshape(1))
            sdpo_normalizer = float(distilled.clamp(min=1)) / self.dist.world_size
        totals: dict[str, float] = {}
        sdpo_metrics: list[dict[str, float]] = []
        loss_total = sdpo_total = 0.0
        for index, micro in enumerate(micro_batches):
            start = index * cfg.micro_batch_size
            rows_here = slice(start, start + len(micro))
            # One student forward gives the policy's log-probs and the SDPO loss.
            logp, entropy, sdpo_loss, micro_sdpo = logprobs_with_sdpo(
                self.model,
                micro,
                tokenizer=self.tokenizer,
                cfg=sdpo_cfg,
                temperature=cfg.temperature,
                chunk_size=cfg.logprob_chunk_size,
                teacher_model=self.ema_teacher.module if self.ema_teacher is not None else None,
                normalizer=sdpo_normalizer,
                teacher_batch=select_teacher_rows(teacher_batch, rows_here)
                if teacher_batch is not None
                else None,
            )
            # One optimiser step per generation batch: old_logp is the current logp (TRL).
            old_logp = logp.detach() if on_policy else micro.old_logp
            loss, metrics = policy_loss(
                logp,
                old_logp,
                advantages[start : start + len(micro)],
                micro.completion_mask,
                loss_cfg,
                ref_logp=micro.ref_logp,
                truncated=micro.truncated,
                entropy=entropy,
                normalization=normalization,
                sampling_logp=micro.sampling_logp,
            )
            if sdpo_cfg.enabled:
                loss = loss + sdpo_loss
                sdpo_total += float(sdpo_loss.detach())
                sdpo_metrics.append(micro_sdpo)
            loss.backward()
            loss_total += float(loss.detach())
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value) / len(micro_batches)
        # The norm is always computed (max_norm=inf does not clip): the guard checks it.
        max_norm = cfg.clip_grad_norm if cfg.clip_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=max_norm)
        # A NaN/inf loss or norm skips the update (weights, optimizer, LR schedule, EMA untouched).
        if self.guard.check(self.step + 1, loss_total, grad_norm):
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.ema_teacher is not None:
                self.ema_teacher.update()
        self.optimizer.zero_grad(set_to_none=True)
        # Rank means of the loss (total and, with SDPO, its weighted SDPO part) and the
        # per-micro-batch-averaged metrics.
        if sdpo_cfg.enabled:
            totals["sdpo/weighted_loss"] = sdpo_total
        names = ["loss", *totals]
        values = torch.tensor([loss_total, *totals.values()], dtype=torch.float64)
        values = all_reduce_sum(values.to(self.dist.device)).cpu() / self.dist.world_size
        step_metrics = dict(zip(names, values.tolist(), strict=True))
        step_metrics["grad_norm"] = float(grad_norm)
        step_metrics.update(self.guard.metrics())
        step_metrics.update(reduce_sdpo_metrics(sdpo_metrics, self.dist.device))
        return step_metrics

    def evaluate(self) -> Any:
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
        recipe_state = {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "sampling_generator": gather_generator_states(self.sampling_generator, self.dist),
            "nonfinite_guard": self.guard.state_dict(),
            "accuracy_before": self.accuracy_before,
        }
        # The EMA teacher, gathered on rank 0 (collective), saved with the training state.
        recipe_state.update(ema_teacher_state(self.ema_teacher, self.dist))
        path = save_run_checkpoint(
            output_dir=self.cfg.output_dir,
            step=self.step,
            model=self.model,
            model_config=self.model.config,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            recipe_state=recipe_state,
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
