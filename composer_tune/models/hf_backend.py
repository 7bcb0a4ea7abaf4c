"""Any ``transformers`` causal LM as a composer-tune policy: the ``transformers`` backend.

:class:`HFCausalLM` wraps a model that ``transformers.AutoModelForCausalLM`` builds (dense or
mixture-of-experts) behind the interface every recipe, channel and tool already uses with the
native decoder (:class:`~composer_tune.models.decoder.CausalDecoder`):

- ``forward(tokens, mask=..., input_pos=..., head_fn=...)``: with ``head_fn`` the final hidden
  states go to ``head_fn(hidden, output)`` (the chunked log-prob head: never a ``[B, T, V]``
  logits tensor); ``output`` maps hidden states to the model's own logits, logit soft-capping
  and scaling included. A boolean ``mask`` ``[b, s, s_kv]`` becomes the 4-D mask
  ``transformers`` takes as given, composed with each layer type's sliding window.
- the KV-cache calls the native sampler makes (``caches_are_setup`` and a
  :meth:`HFCausalLM.local_kv_cache` context in place of torchtune's), so it decodes through
  the model's own attention with a ``transformers`` cache whose every layer keeps all
  positions (the sampler's masks address cache slots).
- ``transformers``' parameter names: the wrapper's children are the ``transformers`` model's
  (``model``, ``lm_head``); ``save_pretrained``'s conversion writes the checkpoint names (a
  mixture of experts' fused tensors split per expert), by which vLLM is pushed too.
- ``decoder_layers()``: the units FSDP2 shards and activation checkpointing wraps.
- Mixture of experts: each training forward records the router logits; the load-balancing
  loss (the model family's own ``load_balancing_loss_func``) and the experts' load per layer
  are taken by :func:`router_loss` before each backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

# Attention implementations whose kernels take the arbitrary 4-D masks the shared-prefix
# forward and the sampler build (flash-attention kernels take padding masks only).
MASKABLE_ATTENTION = ("sdpa", "eager")
# Layer types the sampler's cache and masks handle: attention over all or a window of the
# earlier positions (not linear attention or state-space layers).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Config keys that say nothing about the architecture (compared when a checkpoint is loaded).
_NON_ARCHITECTURE_KEYS = frozenset(
    {
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "use_cache",
        "max_position_embeddings",
        "output_router_logits",
        "router_aux_loss_coef",
        "_name_or_path",
        "_attn_implementation_autoset",
        "attn_implementation",
        "_attn_implementation",
        "tie_word_embeddings",
    }
)


class BackendError(ValueError):
    """A model cannot run on the transformers backend; the message names the reason."""


# ----------------------------------------------------------------------------- architecture


class LayerWidths(NamedTuple):
    """A decoder layer's matrix widths: hidden size, query and key/value projection widths
    (heads x head dim) and the MLP's width per token."""

    hidden: int
    query: int
    key_value: int
    mlp: int


@dataclasses.dataclass(frozen=True)
class HFArchitecture:
    """What a ``transformers`` model is, for the code that reads ``model.config`` (saving,
    weight pushes, cost and length checks): its Hugging Face config dict, with the RoPE window
    the run uses as ``max_seq_len``."""

    hf_config: Mapping[str, Any]
    max_seq_len: int

    @property
    def family(self) -> str:
        return str(self.hf_config["model_type"])

    @property
    def vocab_size(self) -> int:
        return int(hf_config_object(self).get_text_config(decoder=True).vocab_size)

    @property
    def num_layers(self) -> int:
        return int(hf_config_object(self).get_text_config(decoder=True).num_hidden_layers)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf_config.get("tie_word_embeddings", False))

    def architecture_differences(self, stored: Mapping[str, Any]) -> list[str]:
        """The keys in which a checkpoint's ``config.json`` (``stored``, read by
        ``transformers`` so that defaults and legacy spellings compare equal) describes
        another model than this one: all but token ids, dtypes, versions and the context
        length."""
        from transformers import CONFIG_MAPPING

        theirs = _architecture_keys(CONFIG_MAPPING[stored["model_type"]].from_dict(stored))
        ours = _architecture_keys(self.hf_config)
        return sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))

    def layer_widths(self) -> LayerWidths:
        """Widths of a layer's matrix multiplies (experts counted by the ones a token uses)."""
        c = hf_config_object(self).get_text_config(decoder=True)  # its names: n_embd ...

        def value(name: str) -> int:
            return int(getattr(c, name, None) or 0)

        hidden, heads = value("hidden_size"), value("num_attention_heads")
        head_dim = value("head_dim") or hidden // heads
        kv_heads = value("num_key_value_heads") or heads
        mlp = value("intermediate_size") or 4 * hidden
        if value("num_experts_per_tok"):
            mlp = value("num_experts_per_tok") * (value("moe_intermediate_size") or mlp)
            mlp += value("shared_expert_intermediate_size")
        return LayerWidths(hidden, heads * head_dim, kv_heads * head_dim, mlp)


def _architecture_keys(config: Any) -> dict[str, Any]:
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: v for k, v in values.items() if k not in _NON_ARCHITECTURE_KEYS}


# ----------------------------------------------------------------------------- output head


class OutputHead(nn.Module):
    """Hidden states to the model's own logits: its ``lm_head`` and whatever its
    ``ForCausalLM.forward`` does to the result (Gemma's soft-capping, Granite's and Cohere's
    scaling, Falcon-H1's multiplier)."""

    def __init__(self, lm_head: nn.Module, hf_config: Any, base_model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "lm_head", lm_head)  # not a child: the wrapper owns it
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)
        scale = 1.0
        if getattr(hf_config, "logits_scaling", None):  # Granite: logits / logits_scaling
            scale /= float(hf_config.logits_scaling)
        if getattr(hf_config, "logit_scale", None):  # Cohere: logits * logit_scale
            scale *= float(hf_config.logit_scale)
        if getattr(base_model, "lm_head_multiplier", None):  # Falcon-H1
            scale *= float(base_model.lm_head_multiplier)
        self.scale = scale

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# ----------------------------------------------------------------------------- KV cache


@functools.cache
def _spanned_static_layer_class() -> type:
    """A cache layer that keeps every position in preallocated buffers (as ``transformers``'
    ``StaticLayer``, whose write position is a device counter) and hands attention only its
    first ``span`` slots, the width of the sampler's mask: the filled part of the cache on a
    CPU, a fixed bucket in a captured CUDA graph. Built on first use."""
    from transformers.cache_utils import StaticLayer

    class SpannedStaticLayer(StaticLayer):
        def __init__(self, max_cache_len: int, dtype: torch.dtype) -> None:
            super().__init__(max_cache_len=max_cache_len)
            self.cache_dtype = dtype
            self.span = max_cache_len

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any):
            # Under autocast RoPE leaves the keys in float32 and the values in bf16: both are
            # kept in the sampler's cache dtype (attention runs under the same autocast).
            keys, values = super().update(
                key_states.to(self.cache_dtype), value_states.to(self.cache_dtype), *args, **kwargs
            )
            return keys[:, :, : self.span], values[:, :, : self.span]

    return SpannedStaticLayer


@dataclasses.dataclass
class _CacheState:
    """One sampling call's cache: the ``transformers`` cache, its length, how many slots are
    written (a device counter, so that a decode step can be captured in a CUDA graph) and each
    slot's position id (for sliding windows, which count positions, not slots)."""

    cache: Any
    length: int
    written: Tensor  # long[1]
    positions: Tensor  # long[b, length]


# ----------------------------------------------------------------------------- the model


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind composer-tune's decoder interface (module docstring).

    Args:
        hf_model: the ``AutoModelForCausalLM`` instance (its children become this module's).
        max_seq_len: the run's context window (``model.max_seq_len``), at most the checkpoint's
            ``max_position_embeddings``.
        router_aux_loss_coef: weight of the router's load-balancing loss (mixture of experts);
            None takes ``transformers``' semantics: the config's ``router_aux_loss_coef`` when
            its ``output_router_logits`` is true, else 0.
    """

    # A cached forward reads only the first ``mask.shape[-1]`` cache slots (see the sampler).
    reads_cache_span = True

    def __init__(
        self, hf_model: nn.Module, *, max_seq_len: int, router_aux_loss_coef: float | None = None
    ) -> None:
        super().__init__()
        hf_config = hf_model.config
        attention = getattr(hf_config, "_attn_implementation", None) or "sdpa"
        if attention not in MASKABLE_ATTENTION:
            raise BackendError(
                f"attn_implementation {attention!r}: the transformers backend needs one that "
                f"takes 4-D masks ({', '.join(MASKABLE_ATTENTION)})"
            )
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        # Not children: their modules are registered above under the checkpoint's names.
        object.__setattr__(self, "hf_model", hf_model)
        object.__setattr__(self, "base_model", _base_model(hf_model))
        self.layer_types, self.sliding_windows = _layer_types(hf_config)
        self.attention = attention
        self.max_seq_len = max_seq_len
        self.config = HFArchitecture(_config_dict(hf_config), max_seq_len)
        object.__setattr__(
            self, "output", OutputHead(hf_model.get_output_embeddings(), hf_config, self.base_model)
        )
        self.moe = _MoERouting.for_model(hf_model, router_aux_loss_coef)
        self._cache: _CacheState | None = None
        # Loading with assign=True (as FSDP2's sharded load does) replaces each parameter:
        # tie the output projection to the embedding again, as the model was built.
        self.register_load_state_dict_post_hook(lambda module, _keys: module.hf_model.tie_weights())
        # transformers builds the embedding with padding_idx = config.pad_token_id, which gives
        # that token's input occurrences no gradient. Rollouts mask padding themselves, and the
        # pad id is often a real token (SmolLM2's is <|im_end|>, in every prompt): train it as
        # the native decoder does. Only the gradient changes; the forward is the same.
        embedding = hf_model.get_input_embeddings()
        if isinstance(embedding, nn.Embedding):
            embedding.padding_idx = None

    # -- structure ---------------------------------------------------------------------------

    def decoder_layers(self) -> nn.ModuleList:
        """The transformer blocks, in order: FSDP2's and activation checkpointing's units."""
        return _layer_list(self.base_model, self.hf_model.config)

    @property
    def tok_embeddings(self) -> nn.Embedding:
        return self.hf_model.get_input_embeddings()

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE frequencies, embedding scales) of a model
        built on the meta device: allocated on the current default device, then filled by
        ``transformers``' own initialisers, with every parameter marked initialised so that
        only the buffers are written."""
        for module in self.hf_model.modules():
            for name in module._non_persistent_buffers_set:
                buffer = module._buffers.get(name)
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)
        flagged = []
        for param in self.parameters():
            if not getattr(param, "_is_hf_initialized", False):
                param._is_hf_initialized = True
                flagged.append(param)
        try:
            for module in self.hf_model.modules():
                if module._non_persistent_buffers_set:
                    self.hf_model._init_weights(module)
        finally:
            for param in flagged:
                del param._is_hf_initialized

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self,
        tokens: Tensor,
        *,
        mask: Tensor | None = None,
        input_pos: Tensor | None = None,
        head_fn: Callable[[Tensor, nn.Module], Any] | None = None,
    ) -> Any:
        """Run the model on ``tokens`` ``[b, s]``: ``head_fn(hidden, self.output)`` with a
        ``head_fn``, else float32 logits ``[b, s, vocab]``. ``mask`` (bool ``[b, s, s_kv]``,
        True = may attend) and ``input_pos`` (``[b, s]`` or ``[s]``) as for the native
        decoder; without a mask attention is causal. Inside :meth:`local_kv_cache` the cache
        is appended to and ``mask`` spans the cache (``[b, s, cache_len]``)."""
        if input_pos is not None and input_pos.dim() == 1:
            input_pos = input_pos[None].expand(tokens.shape[0], -1)
        # No cache unless sampling: a training forward's cache would also be appended to when
        # activation checkpointing recomputes a layer in the backward.
        kwargs: dict[str, Any] = {
            "input_ids": tokens,
            "position_ids": input_pos,
            "use_cache": False,
        }
        if self._cache is not None:
            kwargs.update(self._cached_inputs(tokens, mask, input_pos))
        elif mask is not None:
            positions = input_pos if input_pos is not None else _arange_like(tokens)
            kwargs["attention_mask"] = self._layer_masks(mask, positions, positions)
        record_router = self.moe is not None and torch.is_grad_enabled()
        if record_router:
            kwargs["output_router_logits"] = True
        outputs = self.base_model(**kwargs)
        if record_router:
            self.moe.record(outputs.router_logits)
        hidden = outputs.last_hidden_state
        if head_fn is not None:
            return head_fn(hidden, self.output)
        return self.output(hidden).float()

    def _layer_masks(
        self, mask: Tensor, query_pos: Tensor, key_pos: Tensor
    ) -> Tensor | dict[str, Tensor]:
        """``mask`` ``[b, q, k]`` as ``transformers`` takes it: 4-D, each sliding layer type's
        window applied by position (keys further back than the window are hidden), one tensor
        when every layer attends alike, else a mask per layer type."""
        masks = {}
        for layer_type in set(self.layer_types):
            layer_mask = mask
            window = self.sliding_windows.get(layer_type)
            if window is not None:
                distance = query_pos[:, :, None] - key_pos[:, None, :]
                layer_mask = layer_mask & (distance < window)
            masks[layer_type] = self._attention_mask(layer_mask)
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks

    def _attention_mask(self, mask: Tensor) -> Tensor:
        """A boolean ``[b, q, k]`` mask in the form the attention kernel adds or selects."""
        mask = mask[:, None]
        if self.attention == "eager":
            dtype = self.output.lm_head.weight.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        return mask

    # -- KV cache (torchtune's API, for the native sampler) -----------------------------------

    def caches_are_setup(self) -> bool:
        return self._cache is not None

    def caches_are_enabled(self) -> bool:
        return self._cache is not None

    @contextlib.contextmanager
    def local_kv_cache(
        self,
        *,
        batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        decoder_max_seq_len: int,
    ) -> Iterator[None]:
        """A KV cache for one sampling call (torchtune's ``local_kv_cache`` contract): every
        layer keeps all ``decoder_max_seq_len`` positions, deleted on exit."""
        from transformers.cache_utils import Cache

        if self._cache is not None:
            raise ValueError("HFCausalLM: a KV cache is already set up")
        layer_class = _spanned_static_layer_class()
        cache = Cache(layers=[layer_class(decoder_max_seq_len, dtype) for _ in self.layer_types])
        self._cache = _CacheState(
            cache=cache,
            length=decoder_max_seq_len,
            written=torch.zeros(1, dtype=torch.long, device=device),
            positions=torch.zeros(
                (batch_size, decoder_max_seq_len), dtype=torch.long, device=device
            ),
        )
        try:
            yield
        finally:
            self._cache = None

    def _cached_inputs(
        self, tokens: Tensor, mask: Tensor | None, input_pos: Tensor | None
    ) -> dict[str, Any]:
        state = self._cache
        assert state is not None
        if mask is None or input_pos is None:
            raise ValueError("HFCausalLM: a cached forward needs mask and input_pos")
        # The mask's width is the span of slots this forward reads (see the layer class).
        span = mask.shape[-1]
        if span > state.length:
            raise ValueError(f"HFCausalLM: the KV cache holds {state.length} positions, not {span}")
        slots = state.written + torch.arange(tokens.shape[1], device=state.written.device)
        state.positions.index_copy_(1, slots, input_pos)
        state.written.add_(tokens.shape[1])
        for layer in state.cache.layers:
            layer.span = span
        return {
            "attention_mask": self._layer_masks(mask, input_pos, state.positions[:, :span]),
            "past_key_values": state.cache,
            "use_cache": True,
        }


def _arange_like(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)


def _base_model(hf_model: nn.Module) -> nn.Module:
    """The decoder stack inside a ``ForCausalLM`` (``model`` for nearly every family), which
    returns the final (normed) hidden states."""
    base = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    base = base if base is not None else getattr(hf_model, hf_model.base_model_prefix, None)
    if base is None or _layer_list(base, hf_model.config) is None:
        raise BackendError(
            f"{type(hf_model).__name__}: no decoder stack with a list of "
            f"{hf_model.config.num_hidden_layers} layers found; the transformers backend trains "
            "decoder-only causal LMs"
        )
    return base


def _layer_list(base: nn.Module, hf_config: Any) -> nn.ModuleList | None:
    """The decoder stack's list of transformer blocks (``layers`` in most families, ``h`` in
    GPT-2's): its child list as long as the config's layer count."""
    count = hf_config.get_text_config(decoder=True).num_hidden_layers
    for child in base.children():
        if isinstance(child, nn.ModuleList) and len(child) == count:
            return child
    return None


def _layer_types(hf_config: Any) -> tuple[list[str], dict[str, int]]:
    """Each layer's attention type and each sliding type's window, refusing layer types the
    sampler's cache cannot hold (linear attention, state-space and chunked layers)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text_config = hf_config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported or len(layer_types) != text_config.num_hidden_layers:
        raise BackendError(
            f"model_type {hf_config.model_type!r} has layer types {unsupported or layer_types}; "
            f"the transformers backend runs models whose layers are all "
            f"{' or '.join(SUPPORTED_LAYER_TYPES)}"
        )
    if isinstance(layer_kwargs, dict):  # transformers < 5.19: one dict for every layer
        layer_kwargs = [layer_kwargs] * len(layer_types)
    windows: dict[str, int] = {}
    for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True):
        if layer_type == "sliding_attention":
            window = int(kwargs["sliding_window"])
            if windows.setdefault(layer_type, window) != window:
                raise BackendError(f"model_type {hf_config.model_type!r}: several window sizes")
    return list(layer_types), windows


def _config_dict(hf_config: Any) -> dict[str, Any]:
    config = hf_config.to_dict()
    config["model_type"] = hf_config.model_type
    return config


# ----------------------------------------------------------------------------- experts


@dataclasses.dataclass
class _MoERouting:
    """A mixture-of-experts model's router bookkeeping: the router logits of the training
    forwards since they were last taken, the loss weight, and the family's loss function."""

    num_experts: int
    top_k: int
    coefficient: float
    loss_fn: Callable[..., Tensor] | None
    pending: list[tuple[Tensor, ...]] = dataclasses.field(default_factory=list)

    @classmethod
    def for_model(cls, hf_model: nn.Module, coefficient: float | None) -> _MoERouting | None:
        config = hf_model.config
        base = _base_model(hf_model)
        if "router_logits" not in (getattr(type(base), "_can_record_outputs", None) or {}):
            if coefficient:
                raise BackendError(
                    f"model.router_aux_loss_coef={coefficient}: {type(hf_model).__name__} "
                    "reports no router logits (not a mixture of experts transformers trains "
                    "with a load-balancing loss)"
                )
            return None
        num_experts = getattr(config, "num_experts", None) or getattr(
            config, "num_local_experts", None
        )
        top_k = getattr(config, "num_experts_per_tok", None)
        if not num_experts or not top_k:
            raise BackendError(
                f"{type(hf_model).__name__} reports router logits but its config names no "
                "num_experts / num_local_experts and num_experts_per_tok"
            )
        if coefficient is None:
            coefficient = (
                float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
                if getattr(config, "output_router_logits", False)
                else 0.0
            )
        if coefficient < 0 or not math.isfinite(coefficient):
            raise BackendError(f"model.router_aux_loss_coef must be >= 0, got {coefficient}")
        loss_fn = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)
        if coefficient > 0 and loss_fn is None:
            raise BackendError(
                f"model.router_aux_loss_coef={coefficient}: {type(hf_model).__module__} has no "
                "load_balancing_loss_func"
            )
        return cls(int(num_experts), int(top_k), float(coefficient), loss_fn)

    def record(self, router_logits: Any) -> None:
        if router_logits:
            self.pending.append(tuple(router_logits))

    def take(self) -> list[tuple[Tensor, ...]]:
        pending, self.pending = self.pending, []
        return pending


def router_loss(model: nn.Module, scale: float = 1.0) -> tuple[Tensor | None, dict[str, float]]:
    """The router's load-balancing loss of ``model``'s training forwards since the last call,
    to add to the loss before its backward: the coefficient times their mean loss, times
    ``scale`` (a forward's share of the optimiser step, e.g. ``1 / micro_batches``, as
    transformers' Trainer divides by its accumulation steps). Also the routing metrics: the
    unweighted loss (``moe/aux_loss``) and per layer the busiest expert's share of the routed
    tokens times the number of experts (``moe/load_max_over_mean/layer_<i>``; 1.0 is perfectly
    balanced). ``(None, {})`` for a model without experts or when no training forward ran."""
    routing = getattr(model, "moe", None)
    forwards = routing.take() if routing is not None else []
    if not forwards:
        return None, {}
    metrics: dict[str, float] = {}
    loads = torch.stack([_expert_load(layers, routing) for layers in forwards]).mean(dim=0)
    for layer, load in enumerate(loads.tolist()):
        metrics[f"moe/load_max_over_mean/layer_{layer}"] = load
    if routing.loss_fn is None:
        return None, metrics
    losses = [routing.loss_fn(layers, routing.num_experts, routing.top_k) for layers in forwards]
    aux = torch.stack([torch.as_tensor(loss) for loss in losses]).mean()
    metrics["moe/aux_loss"] = float(aux.detach())
    if routing.coefficient == 0:
        return None, metrics
    return routing.coefficient * scale * aux, metrics


def mean_metrics(per_call: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the calls that reported it (a step's micro-batches' metrics)."""
    sums: dict[str, list[float]] = {}
    for metrics in per_call:
        for key, value in metrics.items():
            sums.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in sums.items()}


def _expert_load(layers: tuple[Tensor, ...], routing: _MoERouting) -> Tensor:
    """Per layer: the busiest expert's share of the top-k assignments, times the experts."""
    with torch.no_grad():
        loads = []
        for logits in layers:
            chosen = logits.detach().float().topk(routing.top_k, dim=-1).indices.flatten()
            counts = torch.bincount(chosen, minlength=routing.num_experts).float()
            loads.append(counts.max() / counts.mean().clamp(min=1e-9))
        return torch.stack(loads).cpu()


# ----------------------------------------------------------------------------- building


def build_hf_causal_lm(
    hf_config: Any,
    *,
    max_seq_len: int,
    attn_implementation: str = "sdpa",
    router_aux_loss_coef: float | None = None,
) -> HFCausalLM:
    """A randomly initialised ``transformers`` model for ``hf_config`` (a ``PretrainedConfig``),
    wrapped; in the default dtype and device (``build_decoder`` calls it under the meta device,
    then loads the checkpoint's weights shard by shard)."""
    from transformers import AutoModelForCausalLM

    if attn_implementation not in MASKABLE_ATTENTION:
        raise BackendError(
            f"model.attn_implementation={attn_implementation!r}: the transformers backend needs "
            f"one that takes 4-D masks ({', '.join(MASKABLE_ATTENTION)}): the shared-prefix "
            "forward and the sampler mask by position"
        )
    try:
        try:
            hf_model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=attn_implementation, dtype=torch.get_default_dtype()
            )
        except ValueError as err:
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(err):
                raise
            log.warning(
                "%s has no SDPA attention in transformers: using eager", hf_config.model_type
            )
            hf_model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation="eager", dtype=torch.get_default_dtype()
            )
    except (ValueError, KeyError, ImportError) as err:
        raise BackendError(
            f"transformers cannot build a causal LM of model_type {hf_config.model_type!r}: {err}"
        ) from err
    return HFCausalLM(hf_model, max_seq_len=max_seq_len, router_aux_loss_coef=router_aux_loss_coef)


# ----------------------------------------------------------------------------- checkpoints


def hf_config_object(arch: HFArchitecture, **overrides: Any) -> Any:
    """``arch``'s Hugging Face config as a ``PretrainedConfig`` (with ``overrides``)."""
    from transformers import CONFIG_MAPPING

    values = {**arch.hf_config, **overrides}
    return CONFIG_MAPPING[arch.family].from_dict(values)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' own progress bars off ("Loading weights", "Writing model shards"): a
    recipe's log says what it loaded and saved in one line."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_transformers_weights(directory: str | Any) -> dict[str, Tensor]:
    """A checkpoint directory's weights under the module names of the model ``transformers``
    builds for it, in their stored dtype: ``transformers`` itself reads the files, so its
    conversions (a mixture of experts' per-expert tensors fused into one) and weight tying
    apply; tied names share one tensor."""
    from transformers import AutoModelForCausalLM

    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype="auto", local_files_only=True, device_map="cpu"
        )
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def save_transformers_checkpoint(
    state_dict: Mapping[str, Tensor],
    arch: HFArchitecture,
    out_dir: Any,
    *,
    dtype: torch.dtype,
    max_shard_size_bytes: int,
) -> None:
    """Write a full (gathered) state dict of a transformers-backend model with
    ``save_pretrained``: the checkpoint format ``transformers`` and vLLM read (tied weights
    stored once, fused experts written back per expert), ``config.json`` from ``arch``."""
    from transformers import AutoModelForCausalLM

    config = hf_config_object(arch)
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = {name: value.detach().to("cpu", dtype) for name, value in state_dict.items()}
    with _no_progress_bars():
        skeleton.save_pretrained(out_dir, state_dict=tensors, max_shard_size=max_shard_size_bytes)


def hf_named_weights(model: HFCausalLM, name: str, tensor: Tensor) -> dict[str, Tensor]:
    """One of the model's tensors under the checkpoint names ``transformers`` saves it by
    (a fused expert tensor becomes one tensor per expert), for a weight push by name."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model.hf_model, {name: tensor})
