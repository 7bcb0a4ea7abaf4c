"""A0: supervised warm start (SFT) for a Llama, Qwen2 or Qwen3 checkpoint (or a random init),
single process or FSDP2 under torchrun.

    tune run recipes/sft.py --config cpu_smoke
    tune run --nproc_per_node 2 recipes/sft.py --config cpu_smoke
    tune run recipes/sft.py --config cpu_smoke checkpoint.resume_from_checkpoint=latest

Fine-tunes on chat-formatted examples with the loss on assistant tokens only, evaluates held-out
accuracy by greedy generation before and after training, and writes Hugging Face-format
checkpoints that ``transformers`` and vLLM load. Every RL arm of the ladder starts from its output.
Bad input (config, tokenizer, data, checkpoint files) fails before any weights are loaded; a NaN or
inf step is skipped (``max_consecutive_nonfinite_steps`` in a row stop the run); a killed run
resumes exactly from its newest complete checkpoint.

The recipe reads top to bottom: ``SFTRecipe.setup()`` builds each part, ``train()`` is the loop.
The run's resumable state (``RunProgress``) and the loop's chores (logging, evaluation,
checkpoints, graceful stop: ``LoopChores``) are the RL recipes' too (composer_tune/run/). Copy
the file and edit it.
"""

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import training

from composer_tune import config
from composer_tune.checkpointing.run_state import remove_checkpoints
from composer_tune.distributed import all_reduce_sum, setup_distributed, teardown_distributed
from composer_tune.losses.logprobs import IGNORE_INDEX, logprob_head
from composer_tune.models.hf_backend import mean_metrics, router_loss
from composer_tune.rewards.functions import build_reward
from composer_tune.run.loop import (
    LoopChores,
    MetricLog,
    build_guard,
    build_model,
    build_optimizer,
    clip_and_step,
    epoch_batches,
    evaluate_generation,
    print_accuracy_summary,
    restore_run,
    save_checkpoint,
    start_run,
)
from composer_tune.run.state import RunProgress
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest


@dataclass
class SFTConfig(config.TrainingConfig):
    dataset: Any = MISSING  # training examples in the sample convention (prompt + target)
    eval_dataset: Any = None  # held-out examples; null skips evaluation
    # The reward that decides held-out correctness: as the RL recipes' ``reward`` (a project
    # reward's _component_, or TRL reward functions by dotted path).
    eval_reward: Any = None
    batch_size: int = 16
    # Batches per optimiser step (the RL recipes accumulate over micro_batch_size rows instead).
    gradient_accumulation_steps: int = 1
    # Each batch's rows, sorted by length, run as this many forward/backward passes, each padded
    # only to its own longest row: the same token-mean loss and gradient (up to float rounding)
    # with less compute spent on padding where lengths vary. 1: the batch as one pass, unsorted.
    length_grouped_micro_batches: int = 1


class SFTRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        # torchtune seeds each rank with seed + rank; the model's random init below re-seeds.
        training.set_seed(seed=cfg.seed)

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        cfg = self.cfg
        # Everything cheap to check comes first (counts, tokenizer, data, checkpoint files), so
        # bad input fails in seconds, naming the culprit, before any weights are loaded.
        self._check_counts(cfg)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.dataloader = self._setup_data(cfg)
        self.eval_dataset = self._build_dataset(cfg, "eval_dataset")
        self.eval_reward = build_reward(cfg.eval_reward) if cfg.eval_reward else None
        if self.eval_dataset is not None and self.eval_reward is None:
            raise ValueError("eval_dataset is set but eval_reward is not: nothing to score with")
        # Stale staging, the checkpoint to resume, the run's identity (refusing another run's).
        run = start_run(cfg, self.dist, schema=SFTConfig)
        self.identity, self.resumed = run.identity, run.resume_path is not None
        self.model = build_model(
            cfg, self.dist, run.resume_path or cfg.checkpoint.initial_checkpoint
        )
        self.optimizer, self.lr_scheduler = build_optimizer(cfg, self.model)
        self.progress = RunProgress(guard=build_guard(cfg, self.dist))
        if self.resumed:
            restore_run(
                run.resume_path, self.dist, self.model, self.optimizer, self.lr_scheduler,
                self.progress,
            )  # fmt: skip
        # Last, once the config and inputs are validated: a start that fails writes no log
        # or config record into output_dir.
        self.metric_log = MetricLog(cfg, self.dist, self.progress)
        if self.dist.is_main:
            remove_checkpoints(run.replaced)

    def _check_counts(self, cfg: DictConfig) -> None:
        """Reject counts that would crash, divide by zero or loop forever later, naming the key."""
        minimum = {
            "batch_size": 1,
            "gradient_accumulation_steps": 1,
            "length_grouped_micro_batches": 1,
            "eval_batch_size": 1,
            "eval_max_new_tokens": 1,
            "max_consecutive_nonfinite_steps": 1,
            "logging.log_every_n_steps": 1,
            "max_steps": 0,
            "eval_every_n_steps": 0,
        }
        for key, low in minimum.items():
            value = OmegaConf.select(cfg, key)
            if value < low:
                raise ValueError(f"config key {key} must be >= {low}, got {value}")
        # Every pass gets rows, so every rank runs as many (FSDP2's forwards are collectives).
        if cfg.length_grouped_micro_batches > cfg.batch_size:
            raise ValueError(
                f"config key length_grouped_micro_batches must be <= batch_size "
                f"({cfg.batch_size}), got {cfg.length_grouped_micro_batches}"
            )

    def _build_dataset(self, cfg: DictConfig, key: str) -> Any:
        """The dataset of config key ``key`` (None if unset); an empty one is an error naming it."""
        node = cfg[key]
        if node is None:
            return None
        dataset = config.instantiate(node)
        if len(dataset) == 0:
            arguments = {
                k: v for k, v in OmegaConf.to_container(node).items() if k != "_component_"
            }
            raise ValueError(f"config key {key}: {node._component_}({arguments}) has no samples")
        return dataset

    def _setup_data(self, cfg: DictConfig) -> DataLoader:
        dataset = self._build_dataset(cfg, "dataset")
        # With drop_last, fewer rows than one global batch would give empty epochs forever.
        if len(dataset) < cfg.batch_size * self.dist.world_size:
            raise ValueError(
                f"config key dataset: {len(dataset)} samples, fewer than one batch "
                f"(batch_size={cfg.batch_size} x {self.dist.world_size} ranks)"
            )
        sampler = DistributedSampler(
            dataset,
            num_replicas=self.dist.world_size,
            rank=self.dist.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        self.sampler = sampler
        return DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=self._collate,
        )

    def _collate(self, samples: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """Chat-renders prompt + target; targets are next tokens on assistant spans only. The
        rows come back as ``length_grouped_micro_batches`` padded micro-batches (shortest rows
        first when there are several)."""
        rows = [
            self.tokenizer.tokenize_messages(
                [*s["prompt"], {"role": "assistant", "content": s["target"]}],
                tools=s.get("tools"),
                enable_thinking=self.cfg.enable_thinking,
            )
            for s in samples
        ]
        groups = self.cfg.length_grouped_micro_batches
        if groups == 1:
            return [self._pad(rows)]
        by_length = sorted(rows, key=lambda row: len(row[0]))
        bounds = torch.linspace(0, len(rows), groups + 1).round().long().tolist()
        return [self._pad(by_length[start:end]) for start, end in itertools.pairwise(bounds)]

    def _pad(self, rows: list[tuple[list[int], list[bool]]]) -> dict[str, torch.Tensor]:
        """Token ids and next-token targets of ``rows``, right-padded to the longest."""
        width = max(len(ids) for ids, _ in rows)
        tokens = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, loss_mask) in enumerate(rows):
            ids_t = torch.tensor(ids, dtype=torch.long)
            tokens[row, : len(ids)] = ids_t
            # Position t predicts token t+1; train where that token is assistant-generated.
            keep = torch.tensor(loss_mask[1:], dtype=torch.bool)
            targets[row, : len(ids) - 1] = torch.where(keep, ids_t[1:], IGNORE_INDEX)
        return {"tokens": tokens, "targets": targets}

    # ----------------------------------------------------------------------------- training

    def train(self) -> bool:
        """Trains to ``max_steps``; returns False if a stop signal ended the run early (after
        saving a checkpoint at the end of the current SFT step)."""
        cfg, progress = self.cfg, self.progress
        if not self.resumed and cfg.eval_at_start:
            progress.record_before(self.evaluate())
        chores = LoopChores(
            cfg, self.dist, progress, log=self.metric_log.log, evaluate=self.evaluate,
            save_checkpoint=self.save_checkpoint,
        )  # fmt: skip
        batches = epoch_batches(self.dataloader, self.sampler, progress)
        self.model.train()
        with StopRequest(self.dist) as stop:
            while progress.step < cfg.max_steps:
                # Forward/backward over gradient_accumulation_steps batches.
                tokens = 0.0
                loss = torch.zeros((), dtype=torch.float64, device=self.dist.device)
                router_metrics = []
                for _ in range(cfg.gradient_accumulation_steps):
                    batch_loss, num_tokens, moe = self._backward(next(batches))
                    loss += batch_loss
                    router_metrics.extend(moe)
                    tokens += num_tokens
                grad_norm = clip_and_step(
                    self.model,
                    self.optimizer,
                    self.lr_scheduler,
                    progress.guard,
                    step=progress.step + 1,
                    loss=float(loss.detach()),
                    max_norm=cfg.clip_grad_norm,
                )
                # Each rank's loss is its share of the global token mean times world_size.
                global_loss = float(all_reduce_sum(loss.detach().clone())) / self.dist.world_size
                metrics = {
                    "loss": global_loss,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm,
                    **progress.guard.metrics(),
                    **mean_metrics(router_metrics),
                }
                chores.step_done(
                    metrics, {}, tokens_processed=tokens, tokens_trained={"sft": tokens},
                    postfix={"loss": f"{global_loss:.4f}"},
                )  # fmt: skip
                if chores.batch_done(stop):
                    return False
        print_accuracy_summary(progress, chores.finish(), self.dist)
        return True

    def _backward(
        self, micro_batches: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, float, list[dict[str, Any]]]:
        """Forward and backward of one batch, micro-batch by micro-batch. Returns its loss
        (this rank's share of the global token mean, divided by the accumulation steps), its
        target-token count and each pass's router metrics (mixtures of experts)."""
        cfg, device = self.cfg, self.dist.device
        targets = [mb["targets"].to(device) for mb in micro_batches]
        masks = [t != IGNORE_INDEX for t in targets]
        num_tokens = sum(mask.sum() for mask in masks)
        # Token-mean over the global batch: sum here, normalise by all ranks' token count.
        global_tokens = all_reduce_sum(num_tokens.detach().clone().double()).clamp(min=1)
        passes = len(micro_batches) * cfg.gradient_accumulation_steps
        loss = torch.zeros((), dtype=torch.float64, device=device)
        router_metrics = []
        for micro_batch, micro_targets, mask in zip(micro_batches, targets, masks, strict=True):
            logprobs = self.model(
                micro_batch["tokens"].to(device),
                head_fn=logprob_head(micro_targets, chunk_size=cfg.logprob_chunk_size),
            )
            micro_loss = -(logprobs * mask).sum() / global_tokens * self.dist.world_size
            micro_loss = micro_loss / cfg.gradient_accumulation_steps
            # A mixture of experts' load-balancing loss (None for other models), averaged
            # over the step's passes.
            aux, moe = router_loss(self.model, scale=1 / passes)
            (micro_loss if aux is None else micro_loss + aux).backward()
            loss += micro_loss.detach()
            router_metrics.append(moe)
        return loss, float(num_tokens), router_metrics

    def evaluate(self) -> Any:
        """Greedy held-out accuracy (None without an eval dataset)."""
        return evaluate_generation(
            self.cfg, self.dist, self.model, self.tokenizer, self.eval_dataset,
            self.eval_reward, self.metric_log, where=f"step {self.progress.step}",
        )  # fmt: skip

    def save_checkpoint(self) -> Path:
        return save_checkpoint(
            self.cfg, self.dist, self.model, self.optimizer, self.lr_scheduler, self.progress,
            self.identity,
        )  # fmt: skip

    def cleanup(self) -> None:
        self.metric_log.close()
        teardown_distributed()


@config.parse(schema=SFTConfig)
def recipe_main(cfg: DictConfig) -> None:
    """A0 supervised warm start."""
    with config.setup_errors_as_one_line():
        recipe = SFTRecipe(cfg)
        recipe.setup()
    finished = recipe.train()
    recipe.cleanup()
    if not finished:  # stopped by a signal, after saving a checkpoint
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(recipe_main())
