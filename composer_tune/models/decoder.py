"""Decoder-only transformers of the Llama, Qwen2 and Qwen3 families on torchtune components.

The three families share one architecture (GQA attention with rotate-half RoPE, SwiGLU MLP,
RMSNorm, tied or untied embeddings) and differ in two switches: Qwen2 adds a bias to the q/k/v
projections, Qwen3 normalises each query and key head (RMSNorm) *before* RoPE. torchtune's
``MultiHeadAttention`` applies ``q_norm``/``k_norm`` after RoPE, so
:class:`GroupedQueryAttention` overrides ``forward`` and keeps the rest of torchtune's attention
API (KV cache, GQA, SDPA/flex dispatch). Llama 3.1's RoPE frequency scaling is supported.

Module names follow torchtune's conventions (``tok_embeddings``, ``layers.{i}.attn.q_proj``,
``layers.{i}.mlp.w1`` ...); :mod:`composer_tune.checkpointing` maps them to Hugging Face names.
RoPE uses the rotate-half layout of Hugging Face's checkpoints (torchtune's
``Qwen2RotaryPositionalEmbeddings``), so q/k projection weights load without permutation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.attention_utils import _MaskType
from torchtune.modules.kv_cache import KVCache

from composer_tune.models.hf_backend import LayerWidths

HeadFn = Callable[[torch.Tensor, Any], Any]

# Hugging Face ``model_type`` values this decoder implements.
FAMILIES = ("qwen3", "qwen2", "llama")


class FusedRMSNorm(RMSNorm):
    """torchtune's fp32 RMSNorm whose sampling forwards (no autograd) run PyTorch's fused
    kernel: given a bf16 ``scale`` with the fp32 input, ``F.rms_norm`` falls back to ~6
    elementwise kernels, which is most of a launch-bound decode step's excess over a compiled
    one on a GPU. The weight cast keeps the fp32 math. Training keeps torchtune's path, whose
    saved activations ``composer_tune.analysis.memory`` models and the GPU check measured."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.scale.dtype == torch.float32:
            return super().forward(x)
        return F.rms_norm(x.float(), self.normalized_shape, self.scale.float(), self.eps).to(
            x.dtype
        )


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class DecoderArgs:
    """Architecture of a decoder: its family and shape, the keyword arguments of
    :func:`decoder`.

    Kept as one object so builders, HF ``config.json`` conversion and checkpoint saving agree on
    a single description of the architecture. ``family`` is the Hugging Face ``model_type``:
    ``qwen3`` (q/k RMSNorm before RoPE), ``qwen2`` (q/k/v bias) or ``llama`` (neither).
    """

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    head_dim: int
    max_seq_len: int
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    family: str = "qwen3"
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"DecoderArgs.{field.name} must be a positive int, got {value!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"DecoderArgs.family must be one of {FAMILIES}, got {self.family!r}")
        if self.rope_scaling is not None and self.family != "llama":
            raise ValueError("DecoderArgs.rope_scaling (Llama 3.1 RoPE) needs family 'llama'")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"DecoderArgs.num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        # torchtune's MultiHeadAttention insists on this even though Qwen3's head_dim is free.
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"DecoderArgs.embed_dim ({self.embed_dim}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )

    def layer_widths(self) -> LayerWidths:
        """Widths of a layer's matrix multiplies."""
        return LayerWidths(
            self.embed_dim,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_dim,
        )

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
        return self.family == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Bias on the q/k/v projections (Qwen2)."""
        return self.family == "qwen2"


class Llama3ScaledRotaryEmbeddings(Qwen2RotaryPositionalEmbeddings):
    """Rotate-half RoPE with Llama 3.1's frequency scaling: long wavelengths are divided by
    ``factor``, short ones kept, and the band between interpolated smoothly."""

    def __init__(self, dim: int, max_seq_len: int, base: float, scaling: Llama3RopeScaling):
        self.scaling = scaling
        super().__init__(dim=dim, max_seq_len=max_seq_len, base=base)

    def rope_init(self) -> None:
        super().rope_init()
        s = self.scaling
        wavelen = 2 * math.pi / self.theta
        low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_freq_wavelen, self.theta / s.factor, self.theta)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        self.register_buffer("theta", torch.where(medium, smoothed, scaled), persistent=False)
        self.build_rope_cache(self.max_seq_len)


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query self-attention; optional per-head q/k RMSNorm is applied before RoPE (Qwen3).

    Same constructor and KV-cache API as torchtune's ``MultiHeadAttention`` (``setup_cache``,
    ``reset_cache``, ``kv_cache``, ``cache_enabled``); ``pos_embeddings`` is required, and
    ``q_norm``/``k_norm`` come as a pair or not at all.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.pos_embeddings is None:
            raise ValueError("GroupedQueryAttention requires `pos_embeddings`")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("GroupedQueryAttention takes both `q_norm` and `k_norm` or neither")

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        mask: _MaskType | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``x`` [b, s, d] to ``y`` (defaults to ``x``) and return [b, s, d].

        ``mask`` is a boolean ``[b, s, s_kv]`` (True = may attend) or a flex ``BlockMask``;
        without one the attention is causal. With the KV cache enabled, new keys/values are
        appended to the cache and ``mask`` (``[b, s, span]``) says which of the first ``span``
        cache slots each query sees; later slots are not read.
        ``input_pos`` ([s] or [b, s]) gives RoPE positions, e.g. right-shifted for left padding.
        """
        y = x if y is None else y
        b, s_x, _ = x.shape
        s_y = y.shape[1]

        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim)
        k = self.k_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)
        v = self.v_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)

        # Qwen3: normalise each head, then rotate (torchtune's MHA does the reverse).
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
        v = v.transpose(1, 2)

        grouped = self.num_heads != self.num_kv_heads
        if self.kv_cache is not None and self.cache_enabled:
            if not isinstance(mask, torch.Tensor):
                raise ValueError("a cached forward needs a boolean mask [b, s, span]")
            # The mask's width is the span of cache slots this forward reads (the sampler's
            # filled slots on a CPU, a fixed bucket in a captured CUDA graph): slots past it are
            # not read. The write and the read are on-device, so the step can be captured.
            k, v = write_kv_cache(self.kv_cache, k, v, span=mask.shape[-1])
            if grouped and s_x == 1:
                # One new token: its query heads sharing a key/value head become that head's
                # rows of queries, so attention reads the grouped cache as it is (expanding it
                # to every query head copied the whole cache once per layer and token; SDPA's
                # enable_gqa on a CPU is 6x slower at SmolLM2's decode shapes).
                folded = q.reshape(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, -1)
                out = nn.functional.scaled_dot_product_attention(
                    folded, k, v, attn_mask=mask[:, None, :, :]
                )
                return self.output_proj(out.reshape(b, s_x, -1))
            if grouped and q.device.type == "cpu":
                # A prefill chunk on a CPU: SDPA reads the grouped cache as it is. On CUDA a
                # masked GQA call may fall back to the math kernel, so there it is expanded.
                out = nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask[:, None, :, :], enable_gqa=True
                )
                return self.output_proj(out.transpose(1, 2).reshape(b, s_x, -1))

        if grouped:
            q_per_kv = self.num_heads // self.num_kv_heads
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)

        dtype = q.dtype
        upcast = attention_in_fp32(q.device, dtype)
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast("cpu", enabled=False) if upcast else contextlib.nullcontext():
            out = self._attention_call(
                q,
                k,
                v,
                mask=mask,
                dropout_p=self.attn_dropout if self.training else 0.0,
                # Causal only when nothing else says how to mask; a set-up but disabled cache
                # (torchtune's `disable_kv_cache`) must still give causal attention.
                is_causal=mask is None and self.is_causal,
            )
        out = out.to(dtype).transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(out)


def attention_in_fp32(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the full-sequence (uncached) attention of ``dtype`` inputs on ``device`` runs in
    fp32: bf16 on a CPU, where the bf16 flash-attention kernel's forward + backward takes 1.6x
    as long as an fp32 upcast's at SmolLM2's training shape (bench/bench_cpu_attention.py).
    No-grad forwards (old and reference log-probs) take the same path, slower there, so that
    their log-probs equal the training forward's."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16


def write_kv_cache(
    cache: KVCache, k: torch.Tensor, v: torch.Tensor, *, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``k``/``v`` ``[b, h, s, d]`` at the cache's write position and return its first
    ``span`` slots. torchtune's ``KVCache.update`` does the same but asserts the bound by
    reading the position back to the host (a sync per layer and token, and no CUDA graph
    capture); here the caller (the sampler) sized the cache, and ``span`` is checked against
    its length on the host."""
    if span > cache.k_cache.shape[2]:
        raise ValueError(f"mask spans {span} cache slots; the cache holds {cache.k_cache.shape[2]}")
    slots = cache.cache_pos[: k.shape[2]]
    cache.k_cache.index_copy_(2, slots, k.to(cache.k_cache.dtype))
    cache.v_cache.index_copy_(2, slots, v.to(cache.v_cache.dtype))
    cache.cache_pos.add_(k.shape[2])
    return cache.k_cache[:, :, :span], cache.v_cache[:, :, :span]


class CausalDecoder(TransformerDecoder):
    """torchtune ``TransformerDecoder`` that can hand the final hidden state to a custom head.

    ``forward(..., head_fn=fn)`` skips the output projection and returns
    ``fn(h_normed, self.output)``, where ``h_normed`` is the final-norm hidden state [b, s, d]
    and ``self.output`` the projection module (``nn.Linear`` or ``TiedLinear``). Loss code uses
    it to compute log-probs chunk by chunk inside ``forward`` -- where FSDP2 keeps the root
    parameters (embeddings, final norm, lm head) unsharded -- without ever materialising
    ``[b, s, vocab]`` float32 logits. ``config`` records the architecture for checkpoint saving.
    """

    # A cached forward reads only the first ``mask.shape[-1]`` cache slots (the sampler's
    # filled slots, or a CUDA graph's fixed span), instead of a mask over the whole cache.
    reads_cache_span = True

    def __init__(self, *, config: DecoderArgs, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config

    def decoder_layers(self) -> nn.ModuleList:
        """The transformer blocks, in order: FSDP2's and activation checkpointing's units."""
        return self.layers

    def init_buffers(self) -> None:
        """Rebuild the RoPE caches (non-persistent buffers) of a model built on the meta device
        and materialised (torchtune's ``rope_init`` convention)."""
        for module in self.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: _MaskType | None = None,
        input_pos: torch.Tensor | None = None,
        head_fn: HeadFn | None = None,
    ) -> Any:
        """Run the decoder on ``tokens`` [b, s].

        Without ``head_fn`` this matches ``TransformerDecoder.forward``: float32 logits
        [b, s, vocab] (or a list of chunks after ``set_num_output_chunks``), preceded by the
        hidden states listed in ``output_hidden_states``. With ``head_fn`` it returns
        ``head_fn(h_normed, self.output)`` and ignores ``output_hidden_states``.
        ``mask``/``input_pos`` are as in torchtune (required once KV caches are enabled).
        """
        self._validate_inputs(tokens.shape[1], mask=mask, input_pos=input_pos)
        h = self.tok_embeddings(tokens)
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.output_hidden_states:
                hidden.append(h)
            h = layer(h, mask=mask, input_pos=input_pos)
        if head_fn is not None:
            return head_fn(self.norm(h), self.output)
        output = self.unembed(h)
        return [*hidden, output] if hidden else output


def decoder_from_args(args: DecoderArgs, initializer_range: float = 0.02) -> CausalDecoder:
    """Build the decoder ``args`` describes, initialised like Hugging Face's models.

    Weights are normal with std ``initializer_range`` for linear and embedding weights, zeros
    for biases and ones for norms, so randomly initialised test models produce near-uniform
    next-token distributions. Build under ``torch.device("meta")`` to skip allocation; after
    ``to_empty`` call ``rope_init()`` on the rotary embedding module (torchtune's convention) to
    rebuild its non-persistent cache.
    """
    d, hd = args.embed_dim, args.head_dim
    # One rotary module shared by all layers, as in torchtune's own model builders.
    if args.rope_scaling is not None:
        rope = Llama3ScaledRotaryEmbeddings(hd, args.max_seq_len, args.rope_base, args.rope_scaling)
    else:
        rope = Qwen2RotaryPositionalEmbeddings(
            dim=hd, max_seq_len=args.max_seq_len, base=args.rope_base
        )
    layers = nn.ModuleList()
    for _ in range(args.num_layers):
        attn = GroupedQueryAttention(
            embed_dim=d,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=hd,
            q_proj=nn.Linear(d, args.num_heads * hd, bias=args.qkv_bias),
            k_proj=nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias),
            v_proj=nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias),
            output_proj=nn.Linear(args.num_heads * hd, d, bias=False),
            pos_embeddings=rope,
            q_norm=FusedRMSNorm(dim=hd, eps=args.norm_eps) if args.qk_norm else None,
            k_norm=FusedRMSNorm(dim=hd, eps=args.norm_eps) if args.qk_norm else None,
            max_seq_len=args.max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=nn.Linear(d, args.intermediate_dim, bias=False),
            down_proj=nn.Linear(args.intermediate_dim, d, bias=False),
            up_proj=nn.Linear(d, args.intermediate_dim, bias=False),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=FusedRMSNorm(dim=d, eps=args.norm_eps),
                mlp_norm=FusedRMSNorm(dim=d, eps=args.norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(args.vocab_size, d)
    output = (
        TiedLinear(tok_embeddings)
        if args.tie_word_embeddings
        else nn.Linear(d, args.vocab_size, bias=False)
    )
    model = CausalDecoder(
        config=args,
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=args.max_seq_len,
        num_heads=args.num_heads,
        head_dim=hd,
        norm=FusedRMSNorm(dim=d, eps=args.norm_eps),
        output=output,
    )
    _init_weights(model, initializer_range)
    return model


def qwen3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    head_dim: int,
    max_seq_len: int,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.02,
) -> CausalDecoder:
    """Build a Qwen3 decoder of any size (the component builder behind the Qwen3 presets)."""
    args = DecoderArgs(
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
        family="qwen3",
    )
    return decoder_from_args(args, initializer_range)


def _init_weights(model: nn.Module, std: float) -> None:
    """Hugging Face's initialisation: N(0, std) for matrices, zero biases; RMSNorm scales stay 1."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
