"""Checkpoints: Hugging Face-format directories of the Llama, Qwen2 and Qwen3 families in and
out (re-exported here), and beside them in this package the run checkpoints that resume a run
exactly (``run_state``), a run's identity (``run_identity``), GGUF import (``gguf_import``) and
the RL recipes' SFT warm start (``warm_start``)."""

from composer_tune.checkpointing.hf_checkpoint import (
    CheckpointError,
    decoder_args_from_hf_config,
    decoder_from_hf_config,
    decoder_to_hf_state_dict,
    hf_config_from_decoder_args,
    hf_to_decoder_state_dict,
    load_decoder_from_hf,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

__all__ = [
    "CheckpointError",
    "hf_config_from_decoder_args",
    "hf_to_decoder_state_dict",
    "load_hf_checkpoint",
    "load_decoder_from_hf",
    "decoder_args_from_hf_config",
    "decoder_from_hf_config",
    "decoder_to_hf_state_dict",
    "save_hf_checkpoint",
]
