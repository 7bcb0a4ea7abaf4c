"""Typed config sections shared by the training recipes.

Each recipe declares its config as a dataclass that extends :class:`TrainingConfig` with its own
keys; ``composer_tune.config.parse(schema=...)`` rejects keys the dataclass does not declare.
Fields typed ``Any`` hold ``_component_`` nodes, checked against the callable they name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class CheckpointSection:
    # HF-format directory to start from; null starts from random initialisation (refused where
    # model.path holds weights, unless model.random_init: true).
    initial_checkpoint: str | None = None
    # Save an HF-format checkpoint (plus the training state for resume) every N steps; 0: only at the end.
    save_every_n_steps: int = 0
    # Path to a checkpoint folder written by this recipe, or "latest" for the newest in output_dir.
    resume_from_checkpoint: str | None = None
    # Resume although the checkpoint was written with other settings (keys outside
    # max_steps, logging, checkpoint and evaluation cadence); otherwise that is an error.
    resume_with_changed_config: bool = False
    # A run that does not resume refuses an output_dir holding checkpoints; true deletes them
    # (once set-up has succeeded) and starts over.
    replace_existing: bool = False
    # Largest safetensors shard written, in bytes.
    max_shard_size: int = 4_000_000_000
    # Keep only the newest N checkpoints (N >= 1); null keeps every one.
    keep_last: int | None = None
    # Leave the optimizer state out (Hugging Face's save_only_model): a third of the size of an
    # AdamW checkpoint, usable as a model or warm start but not resumable.
    save_only_model: bool = False


@dataclass(frozen=True)
class EvalSampling:
    """A sampled held-out evaluation (config ``eval_sampling``): ``samples_per_problem``
    completions (or episodes) per problem at ``temperature``, from a generator seeded by
    ``seed``."""

    samples_per_problem: int = 4
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples_per_problem < 1:
            raise ValueError(
                f"eval_sampling.samples_per_problem must be >= 1, got {self.samples_per_problem}"
            )
        if not self.temperature > 0:
            raise ValueError(f"eval_sampling.temperature must be > 0, got {self.temperature}")


@dataclass
class LoggingSection:
    log_every_n_steps: int = 1
    # A torchtune metric logger node, e.g. {_component_: torchtune.training.metric_logging.DiskLogger}.
    metric_logger: Any = None
    progress_bar: bool = True


@dataclass
class TrainingConfig:
    output_dir: str = MISSING
    seed: int = 0
    # "cpu" or "cuda"; under torchrun each rank takes its local device.
    device: str = "cpu"
    # "fp32" or "bf16" (bf16 only where the device supports it).
    dtype: str = "fp32"
    # null, "bf16" or "auto" (bf16 where the device multiplies it natively, else fp32): forwards
    # under torch.autocast with fp32 weights (models.build.enable_autocast).
    autocast: str | None = None
    model: Any = MISSING
    tokenizer: Any = MISSING
    optimizer: Any = MISSING
    lr_scheduler: Any = None
    max_steps: int = MISSING
    # Max global gradient norm; null disables clipping.
    clip_grad_norm: float | None = 1.0
    enable_activation_checkpointing: bool = False
    # Sequence chunk for log-prob computation: full [tokens, vocab] float32 logits never exist.
    logprob_chunk_size: int = 1024
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval_every_n_steps: int = 0  # 0: evaluate only before and after training
    # false: no evaluation before the first step (a ladder's arms that share the same starting
    # point measure it once; the run's summary line then has no "before").
    eval_at_start: bool = True
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 16
    # Also a sampled evaluation after each greedy one (logged as eval_sampled/*):
    # {samples_per_problem, temperature, seed}; null: greedy only.
    eval_sampling: EvalSampling | None = None
    # A dataset column (e.g. ``split``) whose values each get their own held-out accuracy
    # (eval/accuracy/<value>); null: one accuracy over the whole held-out set.
    eval_group_by: str | None = None
    # The chat template's enable_thinking (Qwen3's: false pre-fills an empty <think></think>
    # block in the generation prompt; templates without the switch refuse false).
    enable_thinking: bool = False
    # A NaN/inf loss or gradient norm skips the optimizer step; this many in a row stop the run
    # (the last checkpoint stays intact).
    max_consecutive_nonfinite_steps: int = 3
