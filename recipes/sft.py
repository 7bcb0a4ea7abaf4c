"""A0: supervised warm start (SFT) for Qwen3, single process or FSDP2 under torchrun.

    tune run recipes/sft.py --config cpu_smoke
    tune run --nproc_per_node 2 recipes/sft.py --config cpu_smoke
    tune run recipes/sft.py --config cpu_smoke checkpoint.resume_from_checkpoint=latest

Fine-tunes on chat-formatted examples with the loss on assistant tokens only, evaluates held-out
accuracy by greedy generation before and after training, and writes Hugging Face-format
checkpoints that ``transformers`` and vLLM load. Every RL arm of the ladder starts from its output.
Bad input (config, tokenizer, data, checkpoint files) fails before any weights are loaded; a NaN or
inf step is skipped (``max_consecutive_nonfinite_steps`` in a row stop the run); a killed run
resumes exactly from its newest complete checkpoint.

The recipe reads top to bottom: ``SFTRecipe.setup()`` builds each part in a ``_setup_*`` method,
``train()`` is the loop. Copy the file and edit it; shared building blocks live in composer_tune/.
"""

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import training
from tqdm import tqdm

from composer_tune import config
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
from composer_tune.distributed import (
    all_reduce_sum,
    barrier,
    setup_distributed,
    teardown_distributed,
)
from composer_tune.evaluation import evaluate_heldout
from composer_tune.guards import NonFiniteGuard
from composer_tune.losses.logprobs import IGNORE_INDEX, logprob_head
from composer_tune.models.build import build_decoder
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest, print_stopped


@dataclass
class SFTConfig(config.TrainingConfig):
    dataset: Any = MISSING  # training examples in the sample convention (prompt + target)
    eval_dataset: Any = None  # held-out examples; null skips evaluation
    eval_reward: Any = None  # verifiable reward that decides held-out correctness
    batch_size: int = 16
    # Batches per optimiser step (the RL recipes accumulate over micro_batch_size rows instead).
    gradient_accumulation_steps: int = 1
    # Qwen3's template: false pre-fills an empty <think></think> block in the generation prompt.
    enable_thinking: bool = False
    eval_every_n_steps: int = 0  # 0: evaluate only before and after training
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 16
    # A NaN/inf loss or gradient norm skips the optimizer step; this many in a row stop the run.
    max_consecutive_nonfinite_steps: int = 3


class SFTRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.dist.device)
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0  # batches of the current epoch already used
        self.accuracy_before: float | None = None  # held-out accuracy at step 0
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
        self.eval_reward = config.instantiate(cfg.eval_reward) if cfg.eval_reward else None
        if self.eval_dataset is not None and self.eval_reward is None:
            raise ValueError("eval_dataset is set but eval_reward is not: nothing to score with")
        if self.dist.is_main:
            remove_stale_staging(cfg.output_dir)
        barrier()  # every rank looks for the latest checkpoint after the clean-up
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
        checkpoint = resume_path or cfg.checkpoint.initial_checkpoint
        self.model = self._setup_model(cfg, checkpoint)
        self.optimizer = config.instantiate(cfg.optimizer, self.model.parameters())
        self.lr_scheduler = (
            config.instantiate(cfg.lr_scheduler, self.optimizer, num_training_steps=cfg.max_steps)
            if cfg.lr_scheduler is not None
            else None
        )
        self.guard = NonFiniteGuard(
            cfg.max_consecutive_nonfinite_steps, device=self.dist.device, verbose=self.dist.is_main
        )
        self.resumed = resume_path is not None
        if resume_path is not None:
            self._restore(resume_path)
        # Last, once the config and inputs are validated: a start that fails writes no log
        # or config record into output_dir.
        self.metric_logger = self._setup_metric_logger(cfg)
        if self.dist.is_main:
            remove_checkpoints(replaced)

    def _check_counts(self, cfg: DictConfig) -> None:
        """Reject counts that would crash, divide by zero or loop forever later, naming the key."""
        minimum = {
            "batch_size": 1,
            "gradient_accumulation_steps": 1,
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

    def _setup_metric_logger(self, cfg: DictConfig) -> Any:
        if not self.dist.is_main or cfg.logging.metric_logger is None:
            return None
        logger = config.instantiate(cfg.logging.metric_logger)
        logger.log_config(cfg)  # torchtune writes <output_dir>/torchtune_config.yaml
        print(f"resolved config: {cfg.output_dir}/torchtune_config.yaml", flush=True)
        return logger

    def _setup_model(self, cfg: DictConfig, checkpoint: Any) -> torch.nn.Module:
        """The decoder, sharded under torchrun, with weights from ``checkpoint`` (or random)."""
        return build_decoder(
            cfg.model,
            checkpoint=checkpoint,
            dtype=self.dtype,
            dist_info=self.dist,
            seed=cfg.seed,  # identical on every rank
            activation_checkpointing=cfg.enable_activation_checkpointing,
            fsdp_cpu_offload=False,
            autocast=cfg.autocast,
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

    def _restore(self, path: Any) -> None:
        """Optimizer, LR schedule, RNG, data position and guard counts from ``path`` (the
        weights were loaded from its ``model/`` by ``_setup_model``)."""
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
        self.guard.load_state_dict(state["nonfinite_guard"])
        self.accuracy_before = state.get("accuracy_before")
        if self.dist.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def _collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Chat-renders prompt + target; targets are next tokens on assistant spans only."""
        rows = [
            self.tokenizer.tokenize_messages(
                [*s["prompt"], {"role": "assistant", "content": s["target"]}],
                enable_thinking=self.cfg.enable_thinking,
            )
            for s in samples
        ]
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
        batches = self._batches()
        accumulated = 0
        tokens_seen = torch.zeros(1, dtype=torch.float64)
        step_start = time.perf_counter()
        self.model.train()
        with StopRequest(self.dist) as stop:
            while self.step < cfg.max_steps:
                loss, num_tokens = self._loss(next(batches))
                (loss / cfg.gradient_accumulation_steps).backward()
                tokens_seen += num_tokens
                accumulated += 1
                if accumulated < cfg.gradient_accumulation_steps:
                    continue
                accumulated = 0
                # The norm is always computed (max_norm=inf does not clip): the guard checks it.
                max_norm = cfg.clip_grad_norm if cfg.clip_grad_norm is not None else math.inf
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), max_norm=max_norm
                )
                # A NaN/inf loss or norm skips the update (weights, optimizer, LR schedule untouched).
                if self.guard.check(self.step + 1, loss, grad_norm):
                    self.optimizer.step()
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                # Each rank's loss is its share of the global token mean times world_size.
                global_loss = float(all_reduce_sum(loss.detach().clone())) / self.dist.world_size
                progress.update(1)
                progress.set_postfix(loss=f"{global_loss:.4f}")
                if self.step % cfg.logging.log_every_n_steps == 0:
                    elapsed = time.perf_counter() - step_start
                    total_tokens = float(all_reduce_sum(tokens_seen.clone()))
                    self._log(
                        {
                            "loss": global_loss,
                            "lr": self.optimizer.param_groups[0]["lr"],
                            "grad_norm": float(grad_norm),
                            "tokens_per_second": total_tokens / max(elapsed, 1e-9),
                            **self.guard.metrics(),
                            **self._peak_memory(),
                        }
                    )
                    tokens_seen.zero_()
                    step_start = time.perf_counter()
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

    def _batches(self):
        """Endless batches from the saved data position on, epoch after epoch."""
        while True:
            self.sampler.set_epoch(self.epoch)
            for index, batch in enumerate(self.dataloader):
                if index < self.batches_in_epoch:  # used before a resume
                    continue
                self.batches_in_epoch = index + 1
                yield batch
            self.epoch += 1
            self.batches_in_epoch = 0

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = batch["tokens"].to(self.dist.device)
        targets = batch["targets"].to(self.dist.device)
        logprobs = self.model(
            tokens, head_fn=logprob_head(targets, chunk_size=self.cfg.logprob_chunk_size)
        )
        mask = targets != IGNORE_INDEX
        num_tokens = mask.sum()
        # Token-mean over the global batch: sum here, normalise by all ranks' token count.
        global_tokens = all_reduce_sum(num_tokens.detach().clone().double()).clamp(min=1)
        loss = -(logprobs * mask).sum() / global_tokens * self.dist.world_size
        return loss, num_tokens.detach().cpu().double()

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
                "nonfinite_guard": self.guard.state_dict(),
                "accuracy_before": self.accuracy_before,
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

    def _peak_memory(self) -> dict[str, float]:
        if self.dist.device.type == "cuda":
            return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
        return {}

    def _log(self, metrics: dict[str, float]) -> None:
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.step)

    def cleanup(self) -> None:
        if self.metric_logger is not None:
            self.metric_logger.close()
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
