"""Published Qwen3 dense sizes (from each ``Qwen/Qwen3-*`` ``config.json``) and a tiny CPU model.

Every builder takes ``max_seq_len`` so short-context runs need not allocate the 40960-position
RoPE cache; the rest of the shape is fixed by the published checkpoint.
"""

from __future__ import annotations

from composer_tune.models.decoder import CausalDecoder, qwen3

_QWEN3_VOCAB = 151936
_QWEN3_MAX_POS = 40960  # max_position_embeddings in every Qwen3 dense config.json
_QWEN3_ROPE_BASE = 1_000_000.0
_QWEN3_HEAD_DIM = 128
_QWEN3_KV_HEADS = 8


def _published(
    *,
    num_layers: int,
    embed_dim: int,
    num_heads: int,
    intermediate_dim: int,
    tie_word_embeddings: bool,
    max_seq_len: int,
) -> CausalDecoder:
    return qwen3(
        vocab_size=_QWEN3_VOCAB,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_QWEN3_KV_HEADS,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        head_dim=_QWEN3_HEAD_DIM,
        max_seq_len=max_seq_len,
        rope_base=_QWEN3_ROPE_BASE,
        norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
    )


def qwen3_0_6b(max_seq_len: int = _QWEN3_MAX_POS) -> CausalDecoder:
    """Qwen3-0.6B: 28 layers, dim 1024, 16/8 heads, ffn 3072, tied embeddings."""
    return _published(
        num_layers=28,
        embed_dim=1024,
        num_heads=16,
        intermediate_dim=3072,
        tie_word_embeddings=True,
        max_seq_len=max_seq_len,
    )


def qwen3_1_7b(max_seq_len: int = _QWEN3_MAX_POS) -> CausalDecoder:
    """Qwen3-1.7B: 28 layers, dim 2048, 16/8 heads, ffn 6144, tied embeddings."""
    return _published(
        num_layers=28,
        embed_dim=2048,
        num_heads=16,
        intermediate_dim=6144,
        tie_word_embeddings=True,
        max_seq_len=max_seq_len,
    )


def qwen3_4b(max_seq_len: int = _QWEN3_MAX_POS) -> CausalDecoder:
    """Qwen3-4B: 36 layers, dim 2560, 32/8 heads, ffn 9728, tied embeddings."""
    return _published(
        num_layers=36,
        embed_dim=2560,
        num_heads=32,
        intermediate_dim=9728,
        tie_word_embeddings=True,
        max_seq_len=max_seq_len,
    )


def qwen3_8b(max_seq_len: int = _QWEN3_MAX_POS) -> CausalDecoder:
    """Qwen3-8B: 36 layers, dim 4096, 32/8 heads, ffn 12288, separate lm head."""
    return _published(
        num_layers=36,
        embed_dim=4096,
        num_heads=32,
        intermediate_dim=12288,
        tie_word_embeddings=False,
        max_seq_len=max_seq_len,
    )


def qwen3_14b(max_seq_len: int = _QWEN3_MAX_POS) -> CausalDecoder:
    """Qwen3-14B: 40 layers, dim 5120, 40/8 heads, ffn 17408, separate lm head."""
    return _published(
        num_layers=40,
        embed_dim=5120,
        num_heads=40,
        intermediate_dim=17408,
        tie_word_embeddings=False,
        max_seq_len=max_seq_len,
    )


def qwen3_32b(max_seq_len: int = _QWEN3_MAX_POS) -> CausalDecoder:
    """Qwen3-32B: 64 layers, dim 5120, 64/8 heads, ffn 25600, separate lm head."""
    return _published(
        num_layers=64,
        embed_dim=5120,
        num_heads=64,
        intermediate_dim=25600,
        tie_word_embeddings=False,
        max_seq_len=max_seq_len,
    )


def qwen3_tiny(
    vocab_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 64,
    intermediate_dim: int = 128,
    head_dim: int = 16,
    max_seq_len: int = 512,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.02,
) -> CausalDecoder:
    """A few-hundred-thousand-parameter Qwen3 for CPU tests and smoke runs.

    Keeps the real architecture (GQA, q/k norm, head_dim != embed_dim / num_heads is allowed);
    ``vocab_size`` should match the tokenizer the run uses; a larger ``initializer_range`` gives
    peakier random models (tests use it to make wrong wiring show up as large logit errors).
    """
    return qwen3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        rope_base=rope_base,
        norm_eps=norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )
