"""The ``model`` config component that builds whatever a Hugging Face checkpoint describes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from composer_tune.models.decoder import CausalDecoder, decoder_from_args


def from_pretrained(path: str | os.PathLike[str], max_seq_len: int | None = None) -> CausalDecoder:
    """The decoder (Llama, Qwen2 or Qwen3) that ``path/config.json`` describes, randomly
    initialised: the recipe loads the weights from ``checkpoint.initial_checkpoint`` (point it at
    the same directory), after sharding, so a 32B model is never whole on one rank.

    ``max_seq_len`` caps the RoPE cache below the checkpoint's ``max_position_embeddings``
    (short-context runs need not allocate 40k positions).
    """
    # Imported here: composer_tune.checkpointing imports this package.
    from composer_tune.checkpointing.hf_checkpoint import (
        CONFIG_NAME,
        CheckpointError,
        decoder_args_from_hf_config,
        read_json,
    )

    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(
            f"model.path: {config_path} not found (a Hugging Face checkpoint directory; "
            "tools/import_gguf.py makes one from a GGUF file)"
        )
    args = decoder_args_from_hf_config(read_json(config_path), source=str(config_path))
    if max_seq_len is not None:
        args = dataclasses.replace(args, max_seq_len=max_seq_len)
    return decoder_from_args(args)
