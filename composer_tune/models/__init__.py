"""The policy models: decoders of the Llama, Qwen2 and Qwen3 families built from torchtune
components (the native backend; torchtune 0.6.1 ships no Qwen3), Qwen3 presets, any other
``transformers`` causal LM behind the same interface (the transformers backend,
:mod:`composer_tune.models.hf_backend`), and :func:`from_pretrained`, which builds either from a
Hugging Face checkpoint directory."""

from composer_tune.models.decoder import (
    FAMILIES,
    CausalDecoder,
    DecoderArgs,
    GroupedQueryAttention,
    HeadFn,
    Llama3RopeScaling,
    decoder_from_args,
    qwen3,
)
from composer_tune.models.pretrained import from_pretrained
from composer_tune.models.qwen3_presets import (
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_14b,
    qwen3_32b,
    qwen3_tiny,
)

__all__ = [
    "FAMILIES",
    "CausalDecoder",
    "DecoderArgs",
    "GroupedQueryAttention",
    "HeadFn",
    "Llama3RopeScaling",
    "decoder_from_args",
    "from_pretrained",
    "qwen3",
    "qwen3_0_6b",
    "qwen3_14b",
    "qwen3_1_7b",
    "qwen3_32b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_tiny",
]
