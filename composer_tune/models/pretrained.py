"""The ``model`` config component that builds whatever a Hugging Face checkpoint describes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from torch import nn

from composer_tune.models.decoder import FAMILIES, decoder_from_args

BACKENDS = ("auto", "native", "transformers")


def from_pretrained(
    path: str | os.PathLike[str],
    max_seq_len: int | None = None,
    backend: str = "auto",
    attn_implementation: str = "sdpa",
    router_aux_loss_coef: float | None = None,
    random_init: bool = False,
) -> nn.Module:
    """The model that ``path/config.json`` describes, randomly initialised: the recipe loads
    the weights from ``checkpoint.initial_checkpoint`` (point it at the same directory), after
    sharding, so a 32B model is never whole on one rank.

    Args:
        path: a Hugging Face checkpoint directory.
        max_seq_len: the run's context window, below the checkpoint's
            ``max_position_embeddings`` (short-context runs need not allocate 40k positions).
        backend: ``native`` (composer-tune's decoder: Llama, Qwen2, Qwen3), ``transformers``
            (any decoder-only ``AutoModelForCausalLM``, dense or mixture of experts), or
            ``auto``: native for the families it implements, transformers for the rest.
        attn_implementation: transformers backend: ``sdpa`` or ``eager`` (the shared-prefix
            forward and the sampler pass 4-D masks, which flash-attention kernels do not take).
        router_aux_loss_coef: transformers backend, mixture of experts: the load-balancing
            loss weight; None follows transformers (the config's ``router_aux_loss_coef`` when
            its ``output_router_logits`` is true, else no loss).
        random_init: the run may start from random weights although ``path`` holds some;
            otherwise a run that loads no checkpoint stops at set-up
            (:func:`composer_tune.models.build.check_weights_are_loaded` reads it).
    """
    # Imported here: composer_tune.checkpointing imports this package.
    from composer_tune.checkpointing.hf_checkpoint import (
        CONFIG_NAME,
        CheckpointError,
        decoder_args_from_hf_config,
        read_json,
    )

    if backend not in BACKENDS:
        raise ValueError(f"model.backend must be one of {list(BACKENDS)}, got {backend!r}")
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(
            f"model.path: {config_path} not found (a Hugging Face checkpoint directory; "
            "tools/import_gguf.py makes one from a GGUF file)"
        )
    config = read_json(config_path)
    if resolve_backend(config, backend) == "native":
        if router_aux_loss_coef:
            raise ValueError("model.router_aux_loss_coef applies to the transformers backend")
        args = decoder_args_from_hf_config(config, source=str(config_path))
        if max_seq_len is not None:
            args = dataclasses.replace(args, max_seq_len=max_seq_len)
        return decoder_from_args(args)
    return _transformers_model(Path(path), max_seq_len, attn_implementation, router_aux_loss_coef)


def resolve_backend(config: dict, backend: str) -> str:
    """``backend`` with ``auto`` decided for a checkpoint's ``config.json``: native where
    composer-tune's decoder implements the family and every option the config sets."""
    from composer_tune.checkpointing.hf_checkpoint import (
        CheckpointError,
        decoder_args_from_hf_config,
    )

    if backend != "auto":
        return backend
    if config.get("model_type") not in FAMILIES:
        return "transformers"
    try:
        decoder_args_from_hf_config(config)
    except CheckpointError:
        return "transformers"  # e.g. a sliding window or RoPE scaling the native one lacks
    return "native"


def _transformers_model(
    path: Path,
    max_seq_len: int | None,
    attn_implementation: str,
    router_aux_loss_coef: float | None,
) -> nn.Module:
    from transformers import AutoConfig

    from composer_tune.checkpointing.hf_checkpoint import CheckpointError
    from composer_tune.models.hf_backend import BackendError, build_hf_causal_lm

    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise CheckpointError(f"model.path: transformers cannot read {path}: {err}") from err
    window = getattr(hf_config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_seq_len is None:
        if window is None:
            raise CheckpointError(
                f"model.path: {path}/config.json names no context length "
                "(max_position_embeddings): set model.max_seq_len"
            )
        max_seq_len = int(window)
    elif window is not None and max_seq_len > int(window):
        raise ValueError(
            f"model.max_seq_len ({max_seq_len}) exceeds the checkpoint's "
            f"max_position_embeddings ({window})"
        )
    try:
        return build_hf_causal_lm(
            hf_config,
            max_seq_len=max_seq_len,
            attn_implementation=attn_implementation,
            router_aux_loss_coef=router_aux_loss_coef,
        )
    except BackendError as err:
        raise CheckpointError(f"model.path {path}: {err}") from err
