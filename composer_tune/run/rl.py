"""The channel-agnostic parts of an RL recipe's run: :class:`RLRun`.

Every RL recipe (A1-A4, DiLoCo's inner loop) builds the same plumbing around its channels: the
tokenizer, the checkpoint to resume or start from, the policy, its optimizer, the prompts and
reward, the run's progress, the rollout engine and the metric log, and it samples, steps,
evaluates and saves the same way. That is :class:`RLRun`. What differs between the arms (which
channels are on, the models they need, a pair stream, an EMA teacher) stays in the recipe, which
builds its :class:`~composer_tune.channels.composer.ComposerObjective` beside the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from composer_tune import config
from composer_tune.agents import build_agent
from composer_tune.channels.composer import ComposerChannels, ComposerObjective, StepLosses
from composer_tune.channels.policy import sample_rollouts
from composer_tune.checkpointing.run_state import remove_checkpoints
from composer_tune.checkpointing.warm_start import initial_checkpoint
from composer_tune.distributed import DistInfo, teardown_distributed
from composer_tune.evaluation import EvalResult
from composer_tune.rollout.async_rollouts import (
    AsyncRollouts,
    check_rollout_section,
    uses_rollout_worker,
)
from composer_tune.rollout.engines import build_rollout_engine
from composer_tune.rollout.rollouts import RolloutBatch
from composer_tune.run.dynamic_sampling import DynamicSampling
from composer_tune.run.lengths import check_prompt_lengths
from composer_tune.run.loop import (
    LoopChores,
    MetricLog,
    PromptTask,
    build_guard,
    build_model,
    build_optimizer,
    build_sampling_generator,
    check_rl_batch_layout,
    clip_and_step,
    epoch_batches,
    evaluate_generation,
    restore_run,
    save_checkpoint,
    start_run,
)
from composer_tune.run.state import RunProgress
from composer_tune.run.task_sampler import TaskSampler, TaskSamplerSection


class RLRun:
    """An RL run's plumbing, built in dependency order (cheap checks first, then the weights).

    Args:
        cfg: the recipe config (:class:`~composer_tune.run.schema.RLRecipeConfig`).
        dist: this rank's place.
        channels: the recipe's channels (what its rollouts must carry).
        schema: the recipe's config dataclass (a resumed checkpoint that predates one of its
            keys matches at the key's default).
        replicas, replica_id: DiLoCo: every rank of every replica takes its own prompts and
            sampling stream.
        continuing: this process continues a run it has no checkpoint of (a restarted DiLoCo
            replica): its folder may hold checkpoints.

    Attributes:
        agent (None: single-turn rollouts), tokenizer, model (the policy, from the checkpoint
        to resume or ``initial``), optimizer,
        lr_scheduler, task (prompts, reward, held-out set; checked against the model's window
        at set-up), progress (the resumable state),
        initial (the starting checkpoint: a warm start's, ``checkpoint.initial_checkpoint`` or
        None), current (the checkpoint the policy was loaded from), resumed, identity,
        dynamic_sampling (:class:`DynamicSampling`, None when off); and, after
        :meth:`finish_setup`, engine (the colocated vLLM engine, or None), stream (the rollout
        worker's :class:`AsyncRollouts` with ``rollout.max_staleness >= 1`` or a server, else
        None) and metric_log.
    """

    def __init__(
        self,
        cfg: DictConfig,
        dist: DistInfo,
        channels: ComposerChannels,
        *,
        schema: type | None = None,
        replicas: int = 1,
        replica_id: int = 0,
        continuing: bool = False,
    ) -> None:
        self.cfg, self.dist, self.channels = cfg, dist, channels
        check_rl_batch_layout(cfg, dist)
        # Staleness and where generation runs (an unreachable server fails here).
        check_rollout_section(cfg.rollout, dist)
        # Agent episodes (an ``agent`` section: environments, tools, turn limits) or one turn.
        self.agent = build_agent(cfg.agent)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        if cfg.task_sampler is not None and uses_rollout_worker(cfg.rollout):
            raise ValueError(
                "task_sampler draws each batch from the pass rates of the batches before it; a "
                "rollout worker (rollout.max_staleness >= 1 or rollout.server.url) draws ahead "
                "of them, which is not built: set task_sampler=null or rollout.max_staleness=0"
            )
        self.dynamic_sampling = DynamicSampling.from_config(
            cfg, dist, policy_weight=channels.policy_weight, pad_id=self.tokenizer.pad_id
        )
        # Stale staging, the checkpoint to resume, the run's identity (refusing another run's).
        self._start = start_run(cfg, dist, schema=schema, continuing=continuing)
        self.identity = self._start.identity
        self.resumed = self._start.resume_path is not None
        # The task (prompts, rewards, held-out set) and whether it fits the model's window,
        # before a warm start trains or any weight is read.
        self.task = PromptTask.from_config(
            cfg, dist, agent=self.agent, replicas=replicas, replica_id=replica_id
        )
        check_prompt_lengths(
            cfg, self.tokenizer, self.task.dataset, self.task.eval_dataset, self.agent
        )
        self.initial = initial_checkpoint(cfg.warm_start, cfg.checkpoint.initial_checkpoint, dist)
        self.current = self._start.resume_path or self.initial
        self.model = build_model(cfg, dist, self.current)
        self.optimizer, self.lr_scheduler = build_optimizer(cfg, self.model)
        self.progress = RunProgress(
            guard=build_guard(cfg, dist),
            sampling_generator=build_sampling_generator(
                dist, cfg.seed, replica_id * dist.world_size + dist.rank
            ),
            task_sampler=None
            if cfg.task_sampler is None
            else TaskSampler(
                self.task.dataset,
                TaskSamplerSection(**cfg.task_sampler),
                batch_size=cfg.num_prompts_per_generation,
                dist=dist,
                seed=cfg.seed,
                stream=replica_id,
            ),
        )
        self.engine: Any = None
        self.stream: AsyncRollouts | None = None
        self.metric_log: MetricLog | None = None

    @property
    def on_policy(self) -> bool:
        """One optimiser step per generation batch: the sampling policy is the current one."""
        return self.cfg.num_iterations == 1 and self.cfg.steps_per_generation == 1

    def restore(self, objective: ComposerObjective, announce: bool = True) -> dict[str, Any]:
        """Optimizer, LR schedule, RNGs, the run's progress and ``objective``'s channel state
        (an EMA teacher) from the checkpoint being resumed (the weights were loaded from its
        ``model/`` by ``build_model``); returns its recipe state for the recipe's other parts
        ({} for a fresh run). Call it once every model is built: it restores the RNGs.
        ``announce``: print the ``resumed from`` line (a recipe with more to restore prints its
        own)."""
        path = self._start.resume_path
        if path is None:
            return {}
        state = restore_run(
            path, self.dist, self.model, self.optimizer, self.lr_scheduler, self.progress,
            announce=announce,
        )  # fmt: skip
        objective.load_state_dict(state, source=path, cpu_offload=self.cfg.fsdp_cpu_offload)
        return state

    @property
    def resume_path(self) -> Path | None:
        """The checkpoint being resumed (None: a fresh run)."""
        return self._start.resume_path

    def finish_setup(self) -> None:
        """Set-up's last acts, once the config and inputs are validated (a start that fails
        writes no log or config record into ``output_dir``): the rollout engine, from the
        policy's current weights (none when channel 3 alone samples nothing; the rollout
        worker's, started here, with ``rollout.max_staleness >= 1`` or a server), the metric
        log, and deleting the checkpoints ``replace_existing`` replaces."""
        if self.channels.needs_rollouts and uses_rollout_worker(self.cfg.rollout):
            self.stream = AsyncRollouts(
                self.cfg, model=self.model, progress=self.progress, loader=self.task.loader,
                sampler=self.task.sampler, checkpoint=self.current, dist_info=self.dist,
            )  # fmt: skip
            try:  # a worker that cannot sample stops the set-up
                self.stream.wait_until_ready()
            except BaseException:
                self.stream.close()
                raise
            self._say_staleness()
        elif self.channels.needs_rollouts:
            self.engine = build_rollout_engine(
                self.cfg, self.model, self.dist, step=self.progress.step
            )
        self.metric_log = MetricLog(self.cfg, self.dist, self.progress)
        if self.dist.is_main:
            remove_checkpoints(self._start.replaced)

    def chores(
        self, evaluate: Callable[[], Any], save: Callable[[], Path], **options: Any
    ) -> LoopChores:
        """The loop's chores (logging, evaluation, checkpoints, stop) for this run."""
        return LoopChores(
            self.cfg, self.dist, self.progress, log=self.metric_log.log, evaluate=evaluate,
            save_checkpoint=save, **options,
        )  # fmt: skip

    def prompt_batches(self) -> Iterator[list[dict[str, Any]]]:
        """This rank's prompts, one generation batch at a time, from the run's position on:
        drawn by the task sampler (a ``task_sampler`` section), else uniform shuffled epochs."""
        if self.progress.task_sampler is not None:
            return self.progress.task_sampler.batches()
        return epoch_batches(self.task.loader, self.task.sampler, self.progress)

    def rollout(
        self, samples: list[dict[str, Any]], reference: Any = None, *, push_always: bool = False
    ) -> RolloutBatch:
        """``group_size`` scored completions (agent episodes with an ``agent`` section) per prompt
        of ``samples`` with the log-probs the channels read (``reference``: a frozen model whose log-probs a KL term reads). A vLLM
        engine gets the policy's weights unless it holds this step's already; ``push_always``:
        weights change between steps too (DiLoCo's syncs), so push every time."""
        batch = sample_rollouts(
            self.model,
            samples,
            self.cfg,
            tokenizer=self.tokenizer,
            reward=self.task.reward,
            generator=self.progress.sampling_generator,
            reference=reference if self.channels.kl_reference else None,
            compute_old_logp=self.channels.needs_old_logp(self.on_policy),
            sync_ranks=self.dist.is_distributed,
            engine=self.engine,
            policy_version=None if push_always else self.progress.step,
            agent=self.agent,
        )
        if self.progress.task_sampler is not None:  # the drawn tasks' pass rates
            scored = ~torch.isnan(batch.rewards)
            batch.draw_metrics.update(self.progress.task_sampler.observe(batch.correct, scored))
        return batch

    def rollouts(
        self, reference: Any = None, *, push_always: bool = False
    ) -> Iterator[RolloutBatch]:
        """Every generation batch's rollouts in turn, from the run's data position on: sampled
        here by :meth:`rollout` (``max_staleness: 0``; with ``dynamic_sampling`` on, each is
        a training batch of the informative groups of one or more generation batches), or by
        the rollout worker ahead of training (:class:`AsyncRollouts`; the trainer then adds the
        old and ``reference`` log-probs with its current weights)."""
        if self.stream is None:  # the prompt batches never end
            generated = (
                self.rollout(samples, reference, push_always=push_always)
                for samples in self.prompt_batches()
            )
            if self.dynamic_sampling is not None:  # only informative groups, refilled
                generated = self.dynamic_sampling.batches(generated)
            yield from generated
            return
        settings = {
            "temperature": self.cfg.temperature,
            "chunk_size": self.cfg.logprob_chunk_size,
            "forward_batch_size": self.cfg.micro_batch_size,
            "shared_prefix": self.cfg.shared_prefix_forward,
        }
        while True:
            yield self.stream.next_batch(
                reference=reference if self.channels.kl_reference else None,
                compute_old_logp=self.channels.needs_old_logp(self.on_policy),
                logprob_settings=settings,
            )

    def _say_staleness(self) -> None:
        section, loss = self.cfg.rollout, self.channels.loss
        where = (
            f"the vLLM server at {section.server.url}" if section.server.url else "a rollout worker"
        )
        correction = (
            f", corrected by loss.sampling_correction={loss.sampling_correction} "
            f"(cap {loss.sampling_correction_cap})"
            if loss.sampling_correction is not None
            else ""
        )
        print(
            f"rollout.max_staleness={section.max_staleness}: {where} samples with weights at most "
            f"{section.max_staleness} optimiser steps old{correction}",
            flush=True,
        )

    def apply(
        self,
        losses: StepLosses,
        *,
        after_update: Callable[[], None] | None = None,
        step_when_skipped: bool = False,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Clip, guard and step on the gradients of ``losses``' backward (``after_update``:
        e.g. an EMA teacher's update); returns the step's metrics (collective) and the tokens
        each channel trained on."""
        grad_norm = clip_and_step(
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.progress.guard,
            step=self.progress.step + 1,
            loss=losses.loss,
            max_norm=self.cfg.clip_grad_norm,
            after_update=after_update,
            step_when_skipped=step_when_skipped,
        )
        metrics = {
            **losses.reduce(self.dist),
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            **self.progress.guard.metrics(),
        }
        if self.stream is not None:  # the worker samples from the new weights from now on
            self.stream.publish(self.progress.step + 1)
            metrics.update(self.stream.metrics(self.progress.step))
        return metrics, losses.tokens

    def evaluate_generation(self, where: str | None = None) -> EvalResult | None:
        """Greedy held-out accuracy of the policy (None without a held-out set), logged and
        printed at ``where`` (default: the current step)."""
        return evaluate_generation(
            self.cfg, self.dist, self.model, self.tokenizer, self.task.eval_dataset,
            self.task.eval_reward, self.metric_log,
            where=where or f"step {self.progress.step}", agent=self.agent,
        )  # fmt: skip

    def save_checkpoint(
        self, extra_state: Mapping[str, Any] | None = None, *, where: str = ""
    ) -> Path:
        """A run checkpoint of the current step with ``extra_state`` (the channels' own parts);
        collective."""
        return save_checkpoint(
            self.cfg, self.dist, self.model, self.optimizer, self.lr_scheduler, self.progress,
            self.identity, extra_state=extra_state, where=where,
        )  # fmt: skip

    def close(self) -> None:
        """Stops the engine or the rollout worker, closes the metric log, leaves the process
        group."""
        if self.engine is not None:
            self.engine.close()
        if self.stream is not None:
            self.stream.close()
        if self.metric_log is not None:
            self.metric_log.close()
        teardown_distributed()
