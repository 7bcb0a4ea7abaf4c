"""Building a recipe's decoder: random or from a checkpoint, activation checkpointing, FSDP2.

Every recipe builds its policy (and where it needs them a frozen reference and an EMA teacher)
the same way; :func:`build_decoder` is that one way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torchtune import training

from composer_tune import config
from composer_tune.checkpointing.hf_checkpoint import holds_weights
from composer_tune.checkpointing.run_state import (
    check_architecture,
    check_model_files,
    load_model_weights,
)
from composer_tune.distributed import DistInfo, shard_decoder


def build_decoder(
    model_cfg: Any,
    *,
    checkpoint: str | Path | None,
    dtype: torch.dtype,
    dist_info: DistInfo,
    seed: int,
    activation_checkpointing: bool,
    fsdp_cpu_offload: bool,
    autocast: str | None = None,
) -> nn.Module:
    """The decoder ``model_cfg`` describes, sharded with FSDP2 under torchrun.

    With a ``checkpoint`` (a ``model/`` folder of HF weights, or a run checkpoint) its files and
    architecture are checked first (a broken or mismatched checkpoint fails before any weight is
    read); the model is then built on the meta device, sharded, and loaded shard by shard, RoPE
    caches (not in the state dict) rebuilt first. Without one (refused where the model's
    ``path`` holds weights: :func:`check_weights_are_loaded`) it is randomly initialised on
    ``dist_info.device`` from ``seed`` on every rank: FSDP shards one model, so every rank must
    build the same one, whereas torchtune's ``set_seed`` offsets each rank's seed. The global RNG
    streams are left as they were. ``autocast`` (config key ``autocast``) runs forwards under
    :func:`enable_autocast`.
    """
    if checkpoint is None:
        check_weights_are_loaded(model_cfg)
        with torch.random.fork_rng(), training.set_default_dtype(dtype), dist_info.device:
            torch.manual_seed(seed)
            model = config.instantiate(model_cfg)
        _wrap(model, dist_info, activation_checkpointing, fsdp_cpu_offload)
        enable_autocast(model, autocast, dist_info.device)
        return model
    stored = check_model_files(checkpoint)
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = config.instantiate(model_cfg)
    check_architecture(model, stored, checkpoint)
    state_dict = load_model_weights(checkpoint, model)
    _wrap(model, dist_info, activation_checkpointing, fsdp_cpu_offload)
    with training.set_default_dtype(dtype), dist_info.device:
        model.init_buffers()  # RoPE caches and other non-persistent buffers: no weights
    training.load_from_full_model_state_dict(
        model, state_dict, dist_info.device, strict=True, cpu_offload=fsdp_cpu_offload
    )
    enable_autocast(model, autocast, dist_info.device)
    return model


def check_weights_are_loaded(model_cfg: Any) -> None:
    """Refuses to build ``model_cfg`` with random weights by accident, for a run that loads no
    checkpoint (no ``checkpoint.initial_checkpoint``, warm start or resumed checkpoint): where
    its ``path`` holds weights the user meant them, unless ``random_init: true`` says otherwise.
    A model without a ``path`` (a preset such as ``qwen3_tiny``) or whose ``path`` holds only a
    ``config.json`` has no weights to miss.

    Raises:
        ValueError: naming the keys that load the weights or allow random ones.
    """
    path = model_cfg.get("path")
    if path is None or model_cfg.get("random_init", False) or not holds_weights(path):
        return
    raise ValueError(
        f"model.path {path} holds weights, but the run loads none (checkpoint."
        "initial_checkpoint, warm_start and checkpoint.resume_from_checkpoint are unset) and "
        f"would train random ones: set checkpoint.initial_checkpoint={path} to start from "
        "them, or model.random_init=true to start from random weights"
    )


def load_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    device: str | torch.device = "cpu",
) -> nn.Module:
    """A Hugging Face checkpoint directory's model (either backend, see
    :func:`~composer_tune.models.from_pretrained`) with its weights, whole on one ``device``, in
    eval mode: what the tools that score or sample from a checkpoint load."""
    model_cfg = OmegaConf.create(
        {
            "_component_": "composer_tune.models.from_pretrained",
            "path": str(path),
            "backend": backend,
        }
    )
    model = build_decoder(
        model_cfg,
        checkpoint=path,
        dtype=dtype,
        dist_info=DistInfo(world_size=1, rank=0, device=torch.device(device)),
        seed=0,
        activation_checkpointing=False,
        fsdp_cpu_offload=False,
    )
    return model.eval()


AUTOCAST_DTYPES = {"bf16": torch.bfloat16}
AUTOCAST_CHOICES = ("auto", *AUTOCAST_DTYPES)


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 natively: a GPU, or a CPU with AVX512-BF16 (AMX CPUs
    have it too). Elsewhere (e.g. an AVX2-only CPU) torch emulates bf16 matmuls: a SmolLM2 GRPO
    step under bf16 autocast ran ~7x slower than in fp32 on an AMD EPYC with AVX2 only."""
    if torch.device(device).type == "cuda":
        return True
    return torch.cpu._is_avx512_bf16_supported()


def resolve_autocast(autocast: str | None, device: torch.device | str) -> str | None:
    """Config key ``autocast`` as run on ``device``: ``"auto"`` is ``"bf16"`` where the device
    multiplies bf16 natively (:func:`native_bf16`), else None (fp32); other values as given,
    checked."""
    if autocast is not None and autocast not in AUTOCAST_CHOICES:
        raise ValueError(
            f"autocast must be null or one of {list(AUTOCAST_CHOICES)}, got {autocast!r}"
        )
    if autocast == "auto":
        return "bf16" if native_bf16(device) else None
    return autocast


def enable_autocast(model: nn.Module, autocast: str | None, device: torch.device) -> None:
    """Run ``model``'s forward (training, log-probs and generation alike) under
    ``torch.autocast`` in ``autocast`` (``"bf16"``, or ``"auto"``: see :func:`resolve_autocast`),
    keeping its weights, gradients and optimizer state in their own dtype (fp32 master weights).
    None leaves the model as it is.

    Matmuls run in bf16: a GRPO step of SmolLM2-135M on a 2-core CPU with AVX512-BF16 ran 2.5x
    faster (``bench/bench_rl_step.py``; the numbers are in its config's header). Log-softmax over
    the vocabulary still runs in fp32 (``losses/logprobs.py``); KV caches are built in bf16.
    """
    autocast = resolve_autocast(autocast, device)
    if autocast is None:
        return
    dtype = AUTOCAST_DTYPES[autocast]
    model.forward = torch.autocast(device.type, dtype=dtype)(model.forward)
    model.autocast_dtype = dtype  # generation builds its KV caches in it


def _wrap(
    model: nn.Module, dist_info: DistInfo, activation_checkpointing: bool, fsdp_cpu_offload: bool
) -> None:
    if activation_checkpointing:
        layer_classes = {type(layer) for layer in model.decoder_layers()}
        training.set_activation_checkpointing(model, auto_wrap_policy=layer_classes)
    if dist_info.is_distributed:
        shard_decoder(model, cpu_offload=fsdp_cpu_offload)
