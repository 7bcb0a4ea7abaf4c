"""The pieces of a recipe's set-up and loop that are the same in every recipe.

A recipe file keeps its own ``setup()`` and ``train()`` readable top to bottom; these are the
calls they make for what is not theirs to decide:

* set-up: :func:`start_run` (stale staging, the checkpoint to resume, the run's identity, the
  checkpoints a fresh run replaces), :func:`build_model` (the policy, a frozen reference, an
  EMA teacher's module), :func:`build_optimizer`, :class:`MetricLog`, :class:`PromptTask` (the
  prompts, reward and held-out set of an RL run) and :func:`check_rl_batch_layout`;
* the loop: :func:`epoch_batches` (resumable epochs), :func:`clip_and_step` (clip, non-finite
  guard, optimiser and schedule step), :class:`LoopChores` (progress bar, token counts, the
  tokens/s window, logging and evaluation cadence, the end-of-batch save and stop, the end of
  the run), :func:`evaluate_generation`, :func:`save_checkpoint`, :func:`print_accuracy_summary`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import training
from tqdm import tqdm

from composer_tune import config
from composer_tune.checkpointing.run_identity import (
    check_resume_identity,
    identity_defaults,
    run_identity,
)
from composer_tune.checkpointing.run_state import (
    check_checkpoint_section,
    checkpoints_a_fresh_run_replaces,
    load_training_state,
    remove_stale_staging,
    resolve_resume_path,
    save_run_checkpoint,
)
from composer_tune.distributed import DistInfo, all_reduce_sum, barrier, peak_memory_metrics
from composer_tune.evaluation import EvalResult, evaluate_heldout
from composer_tune.guards import NonFiniteGuard
from composer_tune.models.build import build_decoder
from composer_tune.optim import optimizer_parameters
from composer_tune.progress import progress_postfix
from composer_tune.rewards.functions import RewardFunctions, build_reward
from composer_tune.run.state import RunProgress
from composer_tune.stop import StopRequest, print_stopped

if TYPE_CHECKING:
    from composer_tune.agents import AgentRuntime

# Metrics that measure the machine rather than the run: they differ between identical runs.
TIMING_METRICS = ("tokens_per_second", "peak_memory_gib", "peak_rss_gib")

# ----------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class RunStart:
    """What :func:`start_run` found: the checkpoint to resume (None: a fresh run), the run's
    identity, and the checkpoints a fresh run with ``replace_existing`` deletes once set-up has
    succeeded."""

    resume_path: Path | None
    identity: dict[str, Any]
    replaced: list[Path]


def start_run(
    cfg: DictConfig, dist: DistInfo, *, schema: type | None = None, continuing: bool = False
) -> RunStart:
    """The checks every recipe makes before it builds anything heavy: removes a crashed save's
    staging folder (rank 0, then every rank waits), resolves ``checkpoint.resume_from_checkpoint``,
    refuses a fresh run in a folder holding checkpoints (``continuing``: this process continues
    the run without a checkpoint to resume, e.g. a restarted DiLoCo replica), and refuses to resume
    a checkpoint written with other settings (a key its identity lacks is no change at the
    recipe ``schema``'s default)."""
    if dist.is_main:
        remove_stale_staging(cfg.output_dir)
    barrier()  # no rank looks for the latest checkpoint while rank 0 cleans up
    resume_path = resolve_resume_path(cfg.checkpoint.resume_from_checkpoint, cfg.output_dir)
    replaced = checkpoints_a_fresh_run_replaces(
        cfg.checkpoint, cfg.output_dir, resuming=resume_path is not None or continuing
    )
    check_checkpoint_section(cfg.checkpoint)
    identity = run_identity(cfg)
    if resume_path is not None:
        check_resume_identity(
            resume_path,
            identity,
            allow_changes=cfg.checkpoint.resume_with_changed_config,
            defaults=identity_defaults(schema),
        )
    return RunStart(resume_path=resume_path, identity=identity, replaced=replaced)


def build_model(
    cfg: DictConfig,
    dist: DistInfo,
    checkpoint: Any,
    *,
    trainable: bool = True,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The decoder ``cfg.model`` describes, sharded under torchrun, with weights from
    ``checkpoint`` (None: random init from ``cfg.seed``, identical on every rank and replica),
    in ``dtype`` (default: the run's). ``trainable``: in train mode (the policy); otherwise in
    eval mode without gradients (a frozen reference)."""
    model = build_decoder(
        cfg.model,
        checkpoint=checkpoint,
        dtype=dtype or training.get_dtype(cfg.dtype, device=dist.device),
        dist_info=dist,
        seed=cfg.seed,
        activation_checkpointing=cfg.enable_activation_checkpointing,
        fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
        autocast=cfg.autocast,
    )
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def build_optimizer(cfg: DictConfig, model: nn.Module) -> tuple[Any, Any]:
    """``cfg.optimizer`` over the model's parameters (named, for an optimizer that splits them
    by name: :func:`composer_tune.optim.optimizer_parameters`) and ``cfg.lr_scheduler`` (or
    None) over ``cfg.max_steps`` steps."""
    optimizer = config.instantiate(cfg.optimizer, optimizer_parameters(cfg.optimizer, model))
    lr_scheduler = (
        config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=cfg.max_steps)
        if cfg.lr_scheduler is not None
        else None
    )
    return optimizer, lr_scheduler


def build_guard(cfg: DictConfig, dist: DistInfo) -> NonFiniteGuard:
    """The non-finite guard: NaN/inf steps are skipped, ``max_consecutive_nonfinite_steps`` in
    a row stop the run."""
    return NonFiniteGuard(
        cfg.max_consecutive_nonfinite_steps, device=dist.device, verbose=dist.is_main
    )


def build_sampling_generator(dist: DistInfo, seed: int, stream: int) -> torch.Generator:
    """Sampling randomness of one data stream (a rank, or a rank of a replica), saved in
    checkpoints for exact resume."""
    generator = torch.Generator(device=dist.device)
    generator.manual_seed(seed * 1_000_003 + stream)
    return generator


class MetricLog:
    """Rank 0's metric logger (``logging.metric_logger``; nothing is logged elsewhere or
    without one), logging at the run's current step."""

    def __init__(self, cfg: DictConfig, dist: DistInfo, progress: RunProgress) -> None:
        self.progress = progress
        self.logger = None
        if dist.is_main and cfg.logging.metric_logger is not None:
            # It writes the resolved config into output_dir: build it last in set-up, so that
            # a start that fails leaves no record.
            self.logger = config.instantiate(cfg.logging.metric_logger)
            self.logger.log_config(cfg)  # torchtune writes <output_dir>/torchtune_config.yaml
            print(f"resolved config: {cfg.output_dir}/torchtune_config.yaml", flush=True)

    def log(self, metrics: Mapping[str, float]) -> None:
        if self.logger is not None:
            self.logger.log_dict(dict(metrics), step=self.progress.step)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


@dataclass
class PromptTask:
    """An RL run's task: the training prompts (``loader``, ``sampler``), the reward, and the
    held-out set with its reward (``eval_dataset`` None: no evaluation)."""

    loader: DataLoader
    sampler: DistributedSampler
    reward: RewardFunctions
    eval_dataset: Any
    eval_reward: RewardFunctions

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @classmethod
    def from_config(
        cls,
        cfg: DictConfig,
        dist: DistInfo,
        *,
        agent: AgentRuntime | None = None,
        replicas: int = 1,
        replica_id: int = 0,
    ) -> PromptTask:
        """``cfg.dataset``'s prompts, ``num_prompts_per_generation / ranks`` per batch on each
        rank, shuffled per epoch from ``cfg.seed`` (with DiLoCo ``replicas``, every rank of
        every replica takes a disjoint shard); ``cfg.reward`` (``build_reward``: TRL reward
        functions, the project's rewards, or null for the ``agent``'s environment reward);
        ``cfg.eval_dataset`` scored by ``cfg.eval_reward`` (null: the training reward). Samples
        stay dicts: the rollout engine renders the prompts and the reward reads the rest. The
        rewards are checked against the datasets' columns here, before any rollout."""
        dataset = config.instantiate(cfg.dataset)
        prompts_per_rank = cfg.num_prompts_per_generation // dist.world_size
        shards = replicas * dist.world_size
        if len(dataset) < prompts_per_rank * shards:
            each = f" for each of {replicas} replicas" if replicas > 1 else ""
            raise ValueError(
                f"dataset {cfg.dataset._component_} has {len(dataset)} samples, fewer than "
                f"num_prompts_per_generation={cfg.num_prompts_per_generation}{each}"
            )
        sampler = DistributedSampler(
            dataset,
            num_replicas=shards,
            rank=replica_id * dist.world_size + dist.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        loader = DataLoader(
            dataset, batch_size=prompts_per_rank, sampler=sampler, drop_last=True, collate_fn=list
        )
        eval_dataset = config.instantiate(cfg.eval_dataset) if cfg.eval_dataset else None
        if eval_dataset is not None and len(eval_dataset) == 0:
            raise ValueError(f"eval_dataset {cfg.eval_dataset._component_} holds no samples")
        environment = {
            "environments": agent is not None and agent.factories is not None,
            "environment_reward": agent is not None and agent.environment_reward,
        }
        reward = build_reward(cfg.reward, where="reward")
        reward.check(dataset[0].keys(), **environment, where="reward")
        eval_reward = reward
        if cfg.eval_reward is not None:
            eval_reward = build_reward(cfg.eval_reward, where="eval_reward")
        if eval_dataset is not None:
            key = "eval_reward" if cfg.eval_reward is not None else "reward"
            eval_reward.check(eval_dataset[0].keys(), **environment, where=key)
        return cls(
            loader=loader,
            sampler=sampler,
            reward=reward,
            eval_dataset=eval_dataset,
            eval_reward=eval_reward,
        )


def steps_per_generation_batch(cfg: DictConfig) -> int:
    """Optimiser steps taken on one generation batch."""
    return cfg.steps_per_generation * cfg.num_iterations


def check_rl_batch_layout(cfg: DictConfig, dist: DistInfo) -> None:
    """Rejects batch sizes that do not divide evenly, naming the keys involved."""
    if cfg.num_prompts_per_generation % dist.world_size:
        raise ValueError(
            f"num_prompts_per_generation ({cfg.num_prompts_per_generation}) must be a "
            f"multiple of the number of ranks ({dist.world_size})"
        )
    rows = cfg.num_prompts_per_generation // dist.world_size * cfg.group_size
    if rows % cfg.steps_per_generation:
        raise ValueError(
            f"each rank's {rows} completions per generation (num_prompts_per_generation / "
            f"ranks * group_size) do not split into steps_per_generation="
            f"{cfg.steps_per_generation} equal optimiser steps"
        )
    if cfg.num_iterations < 1 or cfg.steps_per_generation < 1 or cfg.micro_batch_size < 1:
        raise ValueError("num_iterations, steps_per_generation and micro_batch_size must be >= 1")
    every, per_batch = cfg.checkpoint.save_every_n_steps, steps_per_generation_batch(cfg)
    if every and every % per_batch:
        raise ValueError(
            f"checkpoint.save_every_n_steps ({every}) must be a multiple of "
            f"steps_per_generation * num_iterations ({per_batch}): checkpoints are taken "
            "between generation batches"
        )


def restore_run(
    path: Path,
    dist: DistInfo,
    model: nn.Module,
    optimizer: Any,
    lr_scheduler: Any,
    progress: RunProgress,
    *,
    announce: bool = True,
) -> dict[str, Any]:
    """Optimizer, LR schedule, RNGs and ``progress`` from the run checkpoint ``path`` (the
    weights were loaded from its ``model/`` by :func:`build_model`); returns its recipe state
    for the recipe's other parts. ``announce``: print the ``resumed from`` line."""
    state = load_training_state(
        path, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_info=dist
    )
    progress.load_state_dict(state, dist)
    if announce and dist.is_main:
        print(f"resumed from {path} at step {progress.step}", flush=True)
    return state


# ----------------------------------------------------------------------------- the loop


def epoch_batches(
    loader: DataLoader, sampler: DistributedSampler, progress: RunProgress
) -> Iterator[Any]:
    """Endless batches from ``progress``'s data position on, epoch after epoch (the position
    advances as batches are taken, so a checkpoint resumes at the next one)."""
    while True:
        sampler.set_epoch(progress.epoch)
        for index, batch in enumerate(loader):
            if index < progress.batches_in_epoch:  # used before a resume
                continue
            progress.batches_in_epoch = index + 1
            yield batch
        progress.epoch += 1
        progress.batches_in_epoch = 0


def clip_and_step(
    model: nn.Module,
    optimizer: Any,
    lr_scheduler: Any,
    guard: NonFiniteGuard,
    *,
    step: int,
    loss: float,
    max_norm: float | None,
    after_update: Callable[[], None] | None = None,
    step_when_skipped: bool = False,
) -> float:
    """Clips the accumulated gradients to ``max_norm`` (None: no clipping, the norm is still
    computed for the guard) and, unless the loss or the norm is NaN/inf, steps the optimizer,
    the LR schedule and ``after_update`` (e.g. an EMA teacher); gradients are zeroed after.

    A skipped step leaves weights, optimizer, schedule and ``after_update`` untouched. With
    ``step_when_skipped`` the optimizer's ``step()`` still runs on zeroed gradients (DiLoCo's
    hook counts inner steps there, so a skipped step keeps its slot in the sync window).
    Returns the gradient norm before clipping.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm=max_norm if max_norm is not None else math.inf
    )
    applied = guard.check(step, loss, grad_norm)
    if not applied and step_when_skipped:
        optimizer.zero_grad(set_to_none=True)
    if applied or step_when_skipped:
        optimizer.step()
    if applied:
        if lr_scheduler is not None:
            lr_scheduler.step()
        if after_update is not None:
            after_update()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


class LoopChores:
    """The chores around a recipe's optimiser steps: the progress bar, the cumulative token
    counts, the tokens/s window and the metric log at ``logging.log_every_n_steps``, evaluation
    at ``eval_every_n_steps``, the checkpoint at ``checkpoint.save_every_n_steps`` and the
    graceful stop at the end of a batch, and the end of the run.

    Args:
        cfg: the recipe config.
        dist: this rank's place.
        progress: the run's progress (``step`` is advanced by :meth:`step_done`).
        log: logs a metric dict at the current step.
        evaluate: held-out evaluation at the current step; its result is what :meth:`finish`
            returns.
        save_checkpoint: saves a checkpoint of the current step (collective), returns its path.
        eval_every: steps between evaluations (None: ``cfg.eval_every_n_steps``; 0: none).
        bar_total, bar_initial, bar_unit: the progress bar's (default: optimiser steps, which
            :meth:`step_done` advances it by); a bar of another unit is the recipe's to advance.
    """

    def __init__(
        self,
        cfg: DictConfig,
        dist: DistInfo,
        progress: RunProgress,
        *,
        log: Callable[[Mapping[str, float]], None],
        evaluate: Callable[[], Any],
        save_checkpoint: Callable[[], Path],
        eval_every: int | None = None,
        bar_total: int | None = None,
        bar_initial: int | None = None,
        bar_unit: str = "it",
    ) -> None:
        self.cfg, self.dist, self.progress = cfg, dist, progress
        self.log, self.evaluate, self.save_checkpoint = log, evaluate, save_checkpoint
        self.eval_every = cfg.eval_every_n_steps if eval_every is None else eval_every
        self._bar_counts_steps = bar_total is None
        self.bar = tqdm(
            initial=progress.step if bar_initial is None else bar_initial,
            total=cfg.max_steps if bar_total is None else bar_total,
            unit=bar_unit,
            disable=not (dist.is_main and cfg.logging.progress_bar),
            dynamic_ncols=True,
        )
        self._window_start = time.perf_counter()
        self._window_tokens = 0.0
        # Tokens sampled since the last step; counted only by recipes that sample.
        self._generated = 0.0
        self._samples = False
        # (step, result) of the last periodic evaluation: the end of the run reuses it when it
        # was at the last step instead of evaluating the same weights again.
        self._evaluated: tuple[int, Any] | None = None

    def rollout_sampled(self, generated_tokens: float) -> None:
        """Counts the completion tokens this rank just sampled."""
        self._samples = True
        self._generated += generated_tokens

    def step_done(
        self,
        step_metrics: Mapping[str, float],
        batch_metrics: Mapping[str, float],
        *,
        tokens_processed: float,
        tokens_trained: Mapping[str, float],
        iteration: int | None = None,
        postfix: Mapping[str, str] | None = None,
    ) -> None:
        """After an optimiser step: advances ``progress.step``, adds this rank's token counts
        (``tokens_processed``: rows' tokens through the forward, for tokens/s;
        ``tokens_trained``: per channel, logged as ``tokens/trained/<channel>``; tokens sampled
        since the last step, ``tokens/generated``, for recipes that sample), logs at the
        cadence (``iteration``: the pass over the generation batch, when there are passes),
        evaluates at the cadence (collective). ``postfix``: the progress bar's (default: the
        metrics that move, ``progress_postfix``)."""
        progress = self.progress
        progress.step += 1
        self._window_tokens += tokens_processed
        counts = {f"trained/{name}": value for name, value in tokens_trained.items()}
        if self._samples:
            counts["generated"] = self._generated
        progress.count_tokens(counts, self.dist)
        self._generated = 0.0
        if self._bar_counts_steps:
            self.bar.update(1)
            self.bar.set_postfix(postfix or progress_postfix(batch_metrics, step_metrics))
        if progress.step % self.cfg.logging.log_every_n_steps == 0:
            elapsed = time.perf_counter() - self._window_start
            window = torch.tensor([self._window_tokens], dtype=torch.float64)
            total_tokens = float(all_reduce_sum(window.to(self.dist.device)))
            self.log(
                {
                    **step_metrics,
                    **batch_metrics,
                    **progress.token_metrics(),
                    **({"iteration": float(iteration)} if iteration is not None else {}),
                    "tokens_per_second": total_tokens / max(elapsed, 1e-9),
                    **peak_memory_metrics(self.dist.device),
                }
            )
            self._window_start, self._window_tokens = time.perf_counter(), 0.0
        elif (self.eval_every and progress.step % self.eval_every == 0) or (
            progress.step == self.cfg.max_steps
        ):
            # Evaluations and the last step always see the cumulative token counts, whatever
            # the logging cadence (accuracy against generated tokens reads them).
            self.log(progress.token_metrics())
        if self.eval_every and progress.step % self.eval_every == 0:
            self._evaluated = (progress.step, self.evaluate())

    def train_on(
        self,
        batch: Any,
        optimizer_step: Callable[[Any], tuple[Mapping[str, float], Mapping[str, float]]],
    ) -> None:
        """The optimiser steps on a generation batch (a ``GenerationBatch``): its
        ``steps_per_generation`` slices, ``num_iterations`` times, until ``max_steps``; after
        each, :meth:`step_done` with what ``optimizer_step(step data)`` returns (the step's
        metrics and the tokens each channel trained on)."""
        self.rollout_sampled(batch.generated_tokens)
        cfg = self.cfg
        for iteration, step in batch.optimizer_steps(cfg.steps_per_generation, cfg.num_iterations):
            if self.progress.step >= cfg.max_steps:
                break
            metrics, trained = optimizer_step(step)
            self.step_done(
                metrics,
                batch.metrics,
                iteration=iteration,
                tokens_processed=step.tokens_processed,
                tokens_trained=trained,
            )

    def save_if_due(self, due: bool | None = None) -> Path | None:
        """Saves a checkpoint when one is due (default: every
        ``checkpoint.save_every_n_steps``); returns its path, or None."""
        every = self.cfg.checkpoint.save_every_n_steps
        if due is None:
            due = bool(every) and self.progress.step % every == 0
        return self.save_checkpoint() if due else None

    def batch_done(self, stop: StopRequest) -> bool:
        """At the end of a generation batch (SFT: a step): the periodic checkpoint, then, if a
        stop was requested and the run is not finished, a checkpoint (unless one was just
        taken), one line, and True: the recipe returns."""
        saved = self.save_if_due()
        # Asked only before the last step (a collective: every rank agrees on the step).
        requested = self.progress.step < self.cfg.max_steps and stop.requested()
        return self.stop_if_requested(requested, saved)

    def stop_if_requested(self, requested: bool, saved: Path | None) -> bool:
        """If ``requested`` (a stop agreed on before the run's end): saves (unless ``saved`` is
        this step's checkpoint), prints the stop line, returns True."""
        if not requested:
            return False
        self.bar.close()
        print_stopped(self.progress.step, saved or self.save_checkpoint(), self.dist)
        return True

    def finish(self) -> Any:
        """The end of the run: the last evaluation (the periodic one's when it was at this
        step), and a checkpoint unless the periodic one already saved this step; returns the
        evaluation's result."""
        self.bar.close()
        if self._evaluated is not None and self._evaluated[0] == self.progress.step:
            after = self._evaluated[1]
        else:
            after = self.evaluate()
        every = self.cfg.checkpoint.save_every_n_steps
        if not (every and self.progress.step % every == 0):
            self.save_checkpoint()
        return after


def evaluate_generation(
    cfg: DictConfig,
    dist: DistInfo,
    model: nn.Module,
    tokenizer: Any,
    eval_dataset: Any,
    eval_reward: Any,
    metric_log: MetricLog,
    *,
    where: str,
    **options: Any,
) -> EvalResult | None:
    """Greedy held-out accuracy (None without ``eval_dataset``), logged and printed as
    ``[where] summary``, then the sampled one when ``cfg.eval_sampling`` asks for it (logged
    too); returns the greedy result. ``options`` go to ``evaluate_heldout``."""
    if eval_dataset is None:
        return None
    sampled = [config.EvalSampling(**cfg.eval_sampling)] if cfg.eval_sampling else []
    results = [
        evaluate_heldout(
            model,
            tokenizer,
            eval_dataset,
            eval_reward,
            dist_info=dist,
            batch_size=cfg.eval_batch_size,
            max_new_tokens=cfg.eval_max_new_tokens,
            enable_thinking=cfg.enable_thinking,
            sampling=sampling,
            group_by=cfg.get("eval_group_by"),
            **options,
        )
        for sampling in [None, *sampled]
    ]
    for result in results:
        metric_log.log(result.metrics())
        if dist.is_main:
            print(f"[{where}] {result.summary()}", flush=True)
    return results[0]


def save_checkpoint(
    cfg: DictConfig,
    dist: DistInfo,
    model: nn.Module,
    optimizer: Any,
    lr_scheduler: Any,
    progress: RunProgress,
    identity: Mapping[str, Any],
    *,
    extra_state: Mapping[str, Any] | None = None,
    where: str = "",
) -> Path:
    """An atomic run checkpoint of the current step (collective): the weights, optimizer and
    schedule, ``progress`` and ``extra_state`` (a channel's or the outer loop's); refuses to
    save non-finite weights. Returns its folder."""
    progress.guard.check_parameters(model, progress.step)  # never save poisoned weights
    path = save_run_checkpoint(
        output_dir=cfg.output_dir,
        step=progress.step,
        model=model,
        model_config=model.config,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        recipe_state={**progress.state_dict(dist), **(extra_state or {})},
        dist_info=dist,
        tokenizer_dir=cfg.tokenizer.path,
        max_shard_size=cfg.checkpoint.max_shard_size,
        run_identity=identity,
        keep_last=cfg.checkpoint.keep_last,
        save_only_model=cfg.checkpoint.save_only_model,
    )
    if dist.is_main:
        print(f"saved checkpoint {path}{where}", flush=True)
    return path


def print_accuracy_summary(
    progress: RunProgress, after: Any, dist: DistInfo, *, qualifier: str = "", detail: str = ""
) -> None:
    """The run's summary line on rank 0: held-out accuracy before (kept in checkpoints, so a
    resumed run prints the same line) and after training."""
    if not dist.is_main or progress.accuracy_before is None or after is None:
        return
    print(
        f"held-out accuracy{qualifier}: before {progress.accuracy_before:.3f} -> after "
        f"{after.accuracy:.3f} ({after.num_samples} problems, {detail or f'{progress.step} steps'})",
        flush=True,
    )
