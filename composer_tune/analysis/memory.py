"""Per-GPU peak memory of a training run of a Llama-, Qwen2- or Qwen3-family decoder: an
analytic model, phase by phase.

A run's memory is a set of *components* (sharded parameters, optimizer states, saved
activations, the log-prob chunk's logits, the rollout KV cache, ...), each alive during some
*phases* of a step:

- ``forward``: the training forward, at its end (all activations saved);
- ``backward, head``: the log-prob head's backward (a chunk's logits recomputed, their
  gradient, the lm-head gradient), every activation still saved;
- ``backward, last layer`` / ``backward, first layer``: the backward of the last and the
  first decoder layer (with activation checkpointing: its recomputation);
- ``optimizer step``: parameters + gradients + states + the step's temporaries;
- ``rollout``: KV-cache sampling (only when a rollout is configured).

The estimated peak is the largest phase total. Layers in between need no phase of their own:
going backward, saved activations fall and gradients rise by a fixed amount per layer, so their
sum peaks at the last or the first layer. The saved-tensor formula of a layer (each family's:
Qwen3's q/k norms, Qwen2's q/k/v biases, Llama's neither) is derived from the kernels torch
uses (docs/memory.md walks through it) and is checked against autograd's saved tensors in
tests/test_memory_estimate.py; bench/measure_memory.py compares whole-step totals with measured
peaks. Figures are bytes *allocated* by torch tensors (what ``torch.cuda.max_memory_allocated``
reports); the CUDA context, NCCL buffers and allocator fragmentation are covered by the reserve
that :func:`fit_report` sets aside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from composer_tune.models import DecoderArgs
from composer_tune.models.decoder import attention_in_fp32

if TYPE_CHECKING:
    from composer_tune.channels.composer import ComposerChannels

GIB = 2**30

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

FORWARD = "forward"
BACKWARD_HEAD = "backward, head"
BACKWARD_LAST = "backward, last layer"
BACKWARD_FIRST = "backward, first layer"
OPTIMIZER_STEP = "optimizer step"
ROLLOUT = "rollout"
BACKWARD_PHASES = (BACKWARD_HEAD, BACKWARD_LAST, BACKWARD_FIRST)
TRAINING_PHASES = (FORWARD, *BACKWARD_PHASES, OPTIMIZER_STEP)
ALL_PHASES = (*TRAINING_PHASES, ROLLOUT)

OPTIMIZER_IMPLS = ("foreach", "for-loop", "fused")

# FSDP2 keeps the current layer's all-gathered parameters plus one prefetched layer (on GPUs
# the next all-gather overlaps compute; in backward FSDP2 prefetches explicitly).
FSDP_LAYERS_IN_FLIGHT = 2


def torch_dtype(name: str) -> torch.dtype:
    """The dtype named as in the configs (``bf16``, ``fp32``, ...)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype '{name}': expected one of {', '.join(sorted(DTYPES))}"
        ) from None


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named as in the configs (``bf16``, ``fp32``, ...)."""
    return torch_dtype(name).itemsize


# ----------------------------------------------------------------------------- parameters


def layer_param_shapes(args: DecoderArgs) -> list[tuple[int, ...]]:
    """Shapes of one decoder layer's parameters (torchtune module order)."""
    d, hd, f = args.embed_dim, args.head_dim, args.intermediate_dim
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    shapes = [(q, d), (kv, d), (kv, d)]  # q/k/v_proj
    if args.qkv_bias:
        shapes += [(q,), (kv,), (kv,)]
    shapes.append((d, q))  # output_proj
    if args.qk_norm:
        shapes += [(hd,), (hd,)]
    shapes += [(f, d), (d, f), (f, d), (d,), (d,)]  # w1 (gate), w2 (down), w3 (up), norms
    return shapes


def root_param_shapes(args: DecoderArgs) -> list[tuple[int, ...]]:
    """Shapes of the parameters outside the layers: embeddings, final norm, untied lm head."""
    shapes = [(args.vocab_size, args.embed_dim), (args.embed_dim,)]
    if not args.tie_word_embeddings:
        shapes.append((args.vocab_size, args.embed_dim))
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 is split in ``world_size`` padded chunks."""
    return math.ceil(shape[0] / world_size) * _numel(shape[1:])


def count_params(args: DecoderArgs) -> int:
    """Total parameter count (tied embeddings counted once)."""
    layer = sum(_numel(s) for s in layer_param_shapes(args))
    return args.num_layers * layer + sum(_numel(s) for s in root_param_shapes(args))


def count_matmul_params(args: DecoderArgs) -> int:
    """Parameters that take part in a matmul per token: all but the input embedding table
    (a lookup), with a tied table counted once as the lm head. The ``N`` of ``6 * N * tokens``."""
    embedding = 0 if args.tie_word_embeddings else args.vocab_size * args.embed_dim
    return count_params(args) - embedding


def sharded_matrix_numel(args: DecoderArgs, world_size: int) -> int:
    """Elements of the decoder layers' weight matrices one rank holds under FSDP2: Muon's."""
    layer = sum(shard_numel(s, world_size) for s in layer_param_shapes(args) if len(s) == 2)
    return args.num_layers * layer


def sharded_param_numel(args: DecoderArgs, world_size: int) -> int:
    """Elements of all parameters one rank holds under FSDP2 (padding included)."""
    layer = sum(shard_numel(s, world_size) for s in layer_param_shapes(args))
    root = sum(shard_numel(s, world_size) for s in root_param_shapes(args))
    return args.num_layers * layer + root


# ----------------------------------------------------------------------------- activations


def layer_saved_bytes_per_token(
    args: DecoderArgs, compute_bytes: int, *, fp32_attention: bool = False
) -> int:
    """Bytes autograd keeps per token for one decoder layer's backward (no checkpointing).

    - each of the two RMSNorms (torchtune computes in fp32) saves its fp32 input, fp32
      normalised output and fp32 rstd: ``8 D + 4``; its output cast back to the compute dtype
      is the input the next projections save: ``D * e``;
    - Qwen3's per-head q/k RMSNorms the same on ``H * hd`` and ``K * hd`` (plus an rstd per
      head); Qwen2's q/k/v biases save nothing more; RoPE saves only its cos/sin tables (per
      sequence, ignored);
    - SDPA (flash / memory-efficient, never an ``s x s`` matrix) saves q and k, v expanded from
      ``K`` to ``H`` heads for GQA, the output (also the output projection's input) in the
      compute dtype, and an fp32 logsumexp per head: ``4 H hd e + 4 H``; with
      ``fp32_attention`` (the native decoder on a CPU in bf16: ``models/decoder.py``) those four
      are fp32 and the output projection saves its own bf16 input: ``4 H hd 4 + 4 H + H hd e``;
    - SwiGLU saves the gate and up projections, silu(gate) and their product: ``4 F e``.
    """
    d, e = args.embed_dim, compute_bytes
    norms = 2 * (8 * d + 4) + 2 * d * e
    qk_norms = (args.num_heads + args.num_kv_heads) * (8 * args.head_dim + 4) if args.qk_norm else 0
    width = args.num_heads * args.head_dim
    attention = 4 * width * (4 if fp32_attention else e) + 4 * args.num_heads
    if fp32_attention:
        attention += width * e
    mlp = 4 * args.intermediate_dim * e
    return norms + qk_norms + attention + mlp


def layer_backward_transient_per_token(args: DecoderArgs, compute_bytes: int) -> int:
    """Extra bytes per token while one layer runs backward, beyond its saved tensors.

    The residual-stream gradient in and out (``2 D e``) plus half the attention width: the
    attention-input gradients appear while the MLP's saved tensors are already freed, so only
    part of them adds to the peak. Calibrated with the allocation profiler on CPU (docs/memory.md).
    """
    return 2 * args.embed_dim * compute_bytes + args.num_heads * args.head_dim * compute_bytes // 2


def head_saved_bytes_per_token(args: DecoderArgs, compute_bytes: int) -> int:
    """Saved tensors outside the layers per token: token ids kept by the embedding's backward
    (int64), the final RMSNorm (``8 D + 4``), its output that every log-prob chunk saves
    (``D e``) and the fp32 log-probs."""
    d = args.embed_dim
    return 8 + (8 * d + 4) + d * compute_bytes + 4


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class MemoryPlan:
    """What a run keeps in memory, per rank. Defaults: one rank, bf16, activation checkpointing.

    Attributes:
        world_size: FSDP2 ranks the model is sharded over (1: no FSDP, plain module).
        micro_batch_size: sequences per training forward on one rank.
        seq_len: tokens per training sequence (prompt + completion).
        param_dtype: dtype of the parameters the model computes with (and of activations).
        master_weights: keep fp32 sharded parameters and all-gather them in ``param_dtype``
            (FSDP2 ``MixedPrecisionPolicy``); without it the stored parameters are in
            ``param_dtype`` (torchtune's default).
        grad_dtype: dtype of the stored gradients; None: that of the stored parameters.
        optimizer_states: state tensors per parameter (AdamW: 2, SGD with momentum: 1).
        muon: the decoder layers' weight matrices step with ``composer_tune.optim.Muon``: one
            fp32 momentum buffer each instead of ``optimizer_states``, and Newton-Schulz
            temporaries in the step; the other parameters keep ``optimizer_states`` (AdamW's).
        optimizer_state_dtype: None: that of the stored parameters (``torch.optim.AdamW``
            allocates states with ``zeros_like(param)``).
        optimizer_impl: how ``torch.optim.AdamW`` runs its step: "foreach" (the default on
            GPUs) needs one temporary the size of all state shards (``_foreach_sqrt``),
            "for-loop" (CPU) two of the largest parameter, "fused" none.
        activation_checkpointing: each layer keeps only its input; backward recomputes one
            layer at a time.
        logprob_chunk_size: rows of the chunked log-prob head (``composer_tune.losses``).
        gradient_accumulation_steps: > 1 keeps gradients alive through later forwards.
        cpu_offload: FSDP2 ``CPUOffloadPolicy``: stored parameters, gradients and optimizer
            states live in host memory; the step runs on the CPU.
        reference_model: a frozen copy (``param_dtype``, sharded like the policy) for a KL term.
        ema_teacher: an EMA copy of the parameters (SDPO teacher), sharded like the policy.
        ema_dtype: None: ``param_dtype``.
        rollout_batch_size: sequences one rank samples at once; 0: no rollout phase.
        prompt_len: longest prompt of a rollout batch (tokens).
        completion_len: ``max_new_tokens`` of a rollout.
        prefill_chunk: prompt tokens per prefill forward (``composer_tune.rollout.generate``).
        rollout_engine: "native" (the KV-cache loop, its memory estimated component by
            component) or "vllm" (a colocated vLLM engine holding ``engine_gib``).
        engine_gib: the vLLM engine's reservation per GPU (``rollout.vllm.gpu_memory_utilization``
            times the GPU's memory: its weights, activations and KV cache).
        engine_sleeps: ``rollout.vllm.enable_sleep_mode``: the engine frees its reservation
            while the trainer steps, so it counts in the rollout phase only.
        fp32_attention: the native decoder runs its full-sequence attention in fp32 (on a CPU
            with a bf16 ``param_dtype``), so SDPA saves fp32 tensors for the backward.
    """

    world_size: int = 1
    micro_batch_size: int = 1
    seq_len: int = 2048
    param_dtype: str = "bf16"
    master_weights: bool = False
    grad_dtype: str | None = None
    optimizer_states: int = 2
    muon: bool = False
    optimizer_state_dtype: str | None = None
    optimizer_impl: str = "foreach"
    activation_checkpointing: bool = True
    logprob_chunk_size: int = 1024
    gradient_accumulation_steps: int = 1
    cpu_offload: bool = False
    reference_model: bool = False
    ema_teacher: bool = False
    ema_dtype: str | None = None
    rollout_batch_size: int = 0
    prompt_len: int = 0
    completion_len: int = 0
    prefill_chunk: int = 256
    rollout_engine: str = "native"
    engine_gib: float = 0.0
    engine_sleeps: bool = False
    fp32_attention: bool = False

    def __post_init__(self) -> None:
        positive = ("world_size", "micro_batch_size", "seq_len", "logprob_chunk_size")
        positive += ("gradient_accumulation_steps", "prefill_chunk")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryPlan.{name} must be a positive int, got {value!r}")
        for name in ("optimizer_states", "rollout_batch_size", "prompt_len", "completion_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryPlan.{name} must be an int >= 0, got {value!r}")
        for name in ("param_dtype", "grad_dtype", "optimizer_state_dtype", "ema_dtype"):
            value = getattr(self, name)
            if value is not None:
                dtype_bytes(value)
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"MemoryPlan.optimizer_impl must be one of {OPTIMIZER_IMPLS}, "
                f"got {self.optimizer_impl!r}"
            )
        if self.rollout_engine not in ("native", "vllm"):
            raise ValueError(
                f"MemoryPlan.rollout_engine must be 'native' or 'vllm', got {self.rollout_engine!r}"
            )
        if self.rollout_engine == "vllm" and not self.engine_gib > 0:
            raise ValueError(
                f"MemoryPlan: a vLLM engine needs engine_gib > 0, got {self.engine_gib}"
            )
        if self.rollout_batch_size and self.prompt_len + self.completion_len < 1:
            raise ValueError(
                "MemoryPlan: rollout_batch_size > 0 needs prompt_len + completion_len > 0"
            )

    @property
    def storage_dtype(self) -> str:
        """dtype of the stored (sharded) parameters."""
        return "fp32" if self.master_weights else self.param_dtype


@dataclass(frozen=True)
class Component:
    """One allocation class: per-rank bytes, where it lives and when it is alive."""

    name: str
    nbytes: int
    phases: tuple[str, ...]
    on_host: bool = False
    detail: str = ""


@dataclass
class MemoryEstimate:
    """Components plus the per-phase device totals; ``peak_bytes`` is the largest of those."""

    args: DecoderArgs
    plan: MemoryPlan
    components: list[Component] = field(default_factory=list)

    def phases(self) -> tuple[str, ...]:
        has_rollout = self.plan.rollout_batch_size or self.plan.rollout_engine == "vllm"
        return ALL_PHASES if has_rollout else TRAINING_PHASES

    def phase_bytes(self, phase: str) -> int:
        """Device bytes alive in ``phase``."""
        return sum(c.nbytes for c in self.components if phase in c.phases and not c.on_host)

    @property
    def peak_phase(self) -> str:
        return max(self.phases(), key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def host_bytes(self) -> int:
        """Host memory per rank for offloaded state (0 without ``cpu_offload``)."""
        return sum(c.nbytes for c in self.components if c.on_host)

    def component(self, name: str) -> Component:
        """The component called ``name`` (KeyError naming the known ones otherwise)."""
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component '{name}'; have: {[c.name for c in self.components]}")


# Component names (tests and the bench refer to them).
PARAMS = "parameters"
GRADS = "gradients"
OPTIMIZER = "optimizer states"
REFERENCE = "reference model"
EMA = "EMA teacher"
ROOT_GATHERED = "FSDP root params (gathered)"
LAYERS_GATHERED = "FSDP layers in flight"
LAYER_GRADS_GATHERED = "FSDP layer grads in flight"
ALLGATHER_KEPT = "FSDP all-gather buffer (kept)"
HEAD_GRAD = "lm-head grad (unsharded)"
EMBED_GRAD = "embedding grad (unsharded)"
ACTIVATIONS = "activations (all layers)"
ONE_LAYER = "activations (one layer)"
LAYER_TRANSIENT = "layer backward transient"
HEAD_SAVED = "embedding/norm/log-prob saved"
LOGPROB_FORWARD = "log-prob chunk (forward)"
LOGPROB_BACKWARD = "log-prob chunk (backward)"
OPTIMIZER_TEMP = "optimizer step temporary"
KV_CACHE = "rollout KV cache"
ROLLOUT_ATTENTION = "rollout attention (GQA expand, mask)"
ROLLOUT_LOGITS = "rollout logits + sampling"
ROLLOUT_PREFILL = "rollout prefill activations"
VLLM_ENGINE = "vLLM engine (weights, KV cache)"


def estimate_memory(args: DecoderArgs, plan: MemoryPlan) -> MemoryEstimate:
    """Per-rank memory components of training ``args``'s model as ``plan`` describes."""
    w = plan.world_size
    sharded = w > 1
    e = dtype_bytes(plan.param_dtype)
    stored = dtype_bytes(plan.storage_dtype)
    grad = dtype_bytes(plan.grad_dtype or plan.storage_dtype)
    state = dtype_bytes(plan.optimizer_state_dtype or plan.storage_dtype)
    offload = plan.cpu_offload
    tokens = plan.micro_batch_size * plan.seq_len
    vocab, dim = args.vocab_size, args.embed_dim
    local_numel = sharded_param_numel(args, w)
    layer_numel = sum(_numel(s) for s in layer_param_shapes(args))
    root_numel = sum(_numel(s) for s in root_param_shapes(args))
    training = TRAINING_PHASES
    everywhere = ALL_PHASES
    est = MemoryEstimate(args=args, plan=plan)
    add = est.components.append

    add(Component(PARAMS, local_numel * stored, everywhere, offload, f"{plan.storage_dtype}"))
    # Gradients are created layer by layer in backward. The input embedding's comes after the
    # first layer's backward, but counting it there matches the measured peaks (its backward
    # overlaps the end of that layer's) and errs on the safe side.
    grad_phases = (BACKWARD_FIRST, OPTIMIZER_STEP)
    if plan.gradient_accumulation_steps > 1:
        grad_phases = training
    add(Component(GRADS, local_numel * grad, grad_phases, offload))
    # Muon's matrices keep one fp32 momentum buffer; the rest (all, without Muon) AdamW's states.
    muon_numel = sharded_matrix_numel(args, w) if plan.muon else 0
    state_detail = f"{plan.optimizer_states} x {plan.optimizer_state_dtype or plan.storage_dtype}"
    if plan.muon:
        state_detail = f"matrices 1 x fp32 (Muon), the rest {state_detail}"
    add(
        Component(
            OPTIMIZER,
            plan.optimizer_states * (local_numel - muon_numel) * state + muon_numel * 4,
            everywhere,
            offload,
            state_detail,
        )
    )
    if plan.reference_model:
        add(Component(REFERENCE, local_numel * e, everywhere, offload, f"{plan.param_dtype}"))
    if plan.ema_teacher:
        ema_dtype = plan.ema_dtype or plan.param_dtype
        add(Component(EMA, local_numel * dtype_bytes(ema_dtype), everywhere, offload, ema_dtype))

    if sharded:
        gathered_phases = (FORWARD, *BACKWARD_PHASES, ROLLOUT)
        add(Component(ROOT_GATHERED, root_numel * e, gathered_phases))
        add(
            Component(
                LAYERS_GATHERED,
                FSDP_LAYERS_IN_FLIGHT * layer_numel * e,
                gathered_phases,
                detail=f"{FSDP_LAYERS_IN_FLIGHT} layers",
            )
        )
        # The last all-gather's output buffer outlives backward (measured on 2 CPU ranks).
        add(Component(ALLGATHER_KEPT, layer_numel * e, (OPTIMIZER_STEP,), detail="1 layer"))
        # Unsharded grads of the layer in backward + the reduce-scatter input they are copied to.
        add(
            Component(LAYER_GRADS_GATHERED, 2 * layer_numel * grad, (BACKWARD_LAST, BACKWARD_FIRST))
        )
    # The lm head's gradient is the first one backward makes; under FSDP it stays unsharded,
    # with the embedding's, until the root's reduce-scatter after the whole backward.
    head_grad_phases = BACKWARD_PHASES if sharded else (BACKWARD_HEAD, BACKWARD_LAST)
    add(Component(HEAD_GRAD, vocab * dim * grad, head_grad_phases))
    if sharded and not args.tie_word_embeddings:
        add(Component(EMBED_GRAD, vocab * dim * grad, (BACKWARD_FIRST,)))

    per_layer = layer_saved_bytes_per_token(args, e, fp32_attention=plan.fp32_attention) * tokens
    if plan.activation_checkpointing:
        all_layers = args.num_layers * dim * e * tokens  # each checkpointed layer's input
        detail = "layer inputs only"
        # Backward recomputes the layer it is in.
        one_layer_phases: tuple[str, ...] = (BACKWARD_LAST, BACKWARD_FIRST)
    else:
        all_layers = args.num_layers * per_layer
        detail = f"{args.num_layers} x {per_layer / GIB:.3f} GiB"
        one_layer_phases = (BACKWARD_FIRST,)  # part of "all layers" before that
    add(Component(ACTIVATIONS, all_layers, (FORWARD, BACKWARD_HEAD, BACKWARD_LAST), detail=detail))
    add(Component(ONE_LAYER, per_layer, one_layer_phases))
    transient = layer_backward_transient_per_token(args, e) * tokens
    add(Component(LAYER_TRANSIENT, transient, (BACKWARD_LAST, BACKWARD_FIRST)))
    head_saved = head_saved_bytes_per_token(args, e) * tokens
    add(Component(HEAD_SAVED, head_saved, (FORWARD, BACKWARD_HEAD)))

    # Chunked log-probs: forward holds a chunk's fp32 logits and logsumexp's exp buffer;
    # backward the recomputed logits and their gradient, plus the chunk's lm-head gradient.
    chunk = min(plan.logprob_chunk_size, tokens)
    logits = 2 * chunk * vocab * 4
    add(Component(LOGPROB_FORWARD, logits, (FORWARD,), detail=f"2 x {chunk} x {vocab} x fp32"))
    add(
        Component(
            LOGPROB_BACKWARD,
            logits + vocab * dim * grad,
            (BACKWARD_HEAD,),
            detail="+ the chunk's lm-head grad",
        )
    )

    adamw_shapes = layer_param_shapes(args) + root_param_shapes(args)
    if plan.muon:
        adamw_shapes = [s for s in layer_param_shapes(args) if len(s) != 2] + root_param_shapes(
            args
        )
    if plan.optimizer_impl == "foreach":
        step_temp = (local_numel - muon_numel) * state
    elif plan.optimizer_impl == "for-loop":
        largest = max(shard_numel(s, w) for s in adamw_shapes)
        step_temp = 2 * largest * state  # sqrt, then the division's result
    else:
        step_temp = 0
    detail = ""
    if plan.muon:  # Muon's matrices step first, then AdamW's: the larger of the two
        step_temp = max(step_temp, muon_step_temporary(args, w, e))
        detail = "AdamW's or Muon's largest matrix, the larger"
    add(Component(OPTIMIZER_TEMP, step_temp, (OPTIMIZER_STEP,), offload, detail))

    if plan.rollout_engine == "vllm":
        # vLLM reserves its share up front; asleep, it holds (almost) nothing while training.
        alive = (ROLLOUT,) if plan.engine_sleeps else ALL_PHASES
        detail = "gpu_memory_utilization x GPU" + ("; sleeps while training" * plan.engine_sleeps)
        add(Component(VLLM_ENGINE, int(plan.engine_gib * GIB), alive, detail=detail))
    elif plan.rollout_batch_size:
        _add_rollout(est, args, plan, e)
    return est


def muon_step_temporary(args: DecoderArgs, world_size: int, ns_bytes: int) -> int:
    """Bytes Muon's step (``composer_tune.optim``) holds at once beyond its state, at its
    largest ``m x n`` layer matrix (``m <= n``), in the Newton-Schulz dtype (``ns_bytes``:
    bf16 where the device multiplies it, for which a bf16 ``param_dtype`` stands): the update,
    the iteration's ``x`` and the next ``x``, two ``m x m`` Gram products; sharded, also the
    whole matrix its owner assembled from the round's blocks. Before that, the fp32 update of
    this rank's block and its cast."""
    shapes = [s for s in layer_param_shapes(args) if len(s) == 2]
    rows, cols = max(shapes, key=_numel)
    small = min(rows, cols)
    matrices = 3 if world_size == 1 else 4
    block = shard_numel((rows, cols), world_size)
    return max((4 + ns_bytes) * block, ns_bytes * (matrices * rows * cols + 2 * small * small))


def _add_rollout(est: MemoryEstimate, args: DecoderArgs, plan: MemoryPlan, e: int) -> None:
    """KV-cache sampling: caches for every layer, one layer's GQA-expanded keys/values and
    attention mask, the last position's logits and one prefill chunk's layer activations."""
    b = plan.rollout_batch_size
    length = plan.prompt_len + plan.completion_len
    kv_width = args.num_kv_heads * args.head_dim
    cache = args.num_layers * 2 * kv_width * length * b * e
    est.components.append(
        Component(KV_CACHE, cache, (ROLLOUT,), detail=f"{b} seqs x {length} tokens")
    )
    prefill = min(plan.prefill_chunk, max(plan.prompt_len, 1))
    expanded = 2 * b * args.num_heads * args.head_dim * length * e
    mask = b * prefill * length * e  # boolean mask turned into an additive bias
    est.components.append(Component(ROLLOUT_ATTENTION, expanded + mask, (ROLLOUT,)))
    # generate() projects only each row's last position (the decoder's head_fn), so every
    # forward yields [b, V] logits: compute dtype + fp32, then the sampler's fp32 softmax and
    # log-softmax and its float64 CDF.
    logits = b * args.vocab_size * (e + 4 + 4 + 4 + 8)
    est.components.append(Component(ROLLOUT_LOGITS, logits, (ROLLOUT,)))
    # No-grad prefill of one layer: the SwiGLU's three [b, chunk, F] tensors dominate.
    layer = b * prefill * (3 * args.intermediate_dim + 4 * args.embed_dim) * e
    est.components.append(Component(ROLLOUT_PREFILL, layer, (ROLLOUT,)))


# ----------------------------------------------------------------------------- reporting


@dataclass(frozen=True)
class FitReport:
    """How an estimate compares with a GPU's memory."""

    capacity_bytes: int
    reserve_bytes: int  # CUDA context, NCCL and cuBLAS workspaces
    fragmentation: float  # fraction added to the allocated peak for the caching allocator
    needed_bytes: int
    headroom_bytes: int

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


def fit_report(
    estimate: MemoryEstimate,
    *,
    capacity_gib: float = 79.2,
    reserve_gib: float = 3.0,
    fragmentation: float = 0.05,
) -> FitReport:
    """Needed = allocated peak x (1 + fragmentation) + reserve; headroom = capacity - needed.

    Default capacity: what an "80 GB" H100/A100 reports to torch (~79.2 GiB). The reserve covers
    memory that ``max_memory_allocated`` never sees (CUDA context ~0.5-1 GiB, NCCL buffers,
    cuBLAS workspaces); the fragmentation margin the caching allocator's rounding and splitting.
    """
    if not capacity_gib > 0 or reserve_gib < 0 or fragmentation < 0:
        raise ValueError(
            f"fit_report: need capacity_gib > 0, reserve_gib >= 0, fragmentation >= 0; got "
            f"{capacity_gib}, {reserve_gib}, {fragmentation}"
        )
    needed = int(estimate.peak_bytes * (1 + fragmentation) + reserve_gib * GIB)
    capacity = int(capacity_gib * GIB)
    return FitReport(
        capacity_bytes=capacity,
        reserve_bytes=int(reserve_gib * GIB),
        fragmentation=fragmentation,
        needed_bytes=needed,
        headroom_bytes=capacity - needed,
    )


_PHASE_LABELS = {
    FORWARD: "fwd",
    BACKWARD_HEAD: "bwdH",
    BACKWARD_LAST: "bwdL",
    BACKWARD_FIRST: "bwd1",
    OPTIMIZER_STEP: "opt",
    ROLLOUT: "roll",
}


def format_table(estimate: MemoryEstimate, fit: FitReport | None = None) -> str:
    """Components (GiB) with the phases they are alive in, per-phase totals and the peak."""
    phases = estimate.phases()
    short = {p: _PHASE_LABELS[p] for p in phases}
    lines = [f"{'component':<38}{'GiB':>9}  alive in ({', '.join(short.values())})  detail"]
    lines.append("-" * 96)
    for c in estimate.components:
        alive = " ".join(short[p] if p in c.phases else "." * len(short[p]) for p in phases)
        where = " [host]" if c.on_host else ""
        lines.append(f"{c.name + where:<38}{c.nbytes / GIB:>9.3f}  {alive}  {c.detail}")
    lines.append("-" * 96)
    for phase in phases:
        marker = "  <- peak" if phase == estimate.peak_phase else ""
        lines.append(f"{'total, ' + phase:<38}{estimate.phase_bytes(phase) / GIB:>9.3f}{marker}")
    if estimate.host_bytes:
        lines.append(f"{'host memory per rank (offloaded)':<38}{estimate.host_bytes / GIB:>9.3f}")
    if fit is not None:
        verdict = "FITS" if fit.fits else "DOES NOT FIT"
        lines.append(
            f"peak {estimate.peak_bytes / GIB:.2f} GiB x {1 + fit.fragmentation:.2f} "
            f"(fragmentation) + {fit.reserve_bytes / GIB:.1f} GiB reserve = "
            f"{fit.needed_bytes / GIB:.2f} GiB of {fit.capacity_bytes / GIB:.1f} GiB: {verdict}, "
            f"headroom {fit.headroom_bytes / GIB:+.2f} GiB "
            f"({fit.headroom_bytes / fit.capacity_bytes:+.0%})"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- from a config


@dataclass
class ConfigPlan:
    """A recipe config read as a memory plan: the model shape, the plan and where each plan
    value came from (a config key, a command-line flag or an assumed default)."""

    args: DecoderArgs
    plan: MemoryPlan
    sources: dict[str, str]

    def assumed(self) -> list[str]:
        """``field = value (why)`` for every value that no config key or flag gave."""
        return [
            f"{name} = {getattr(self.plan, name)!r} ({source})"
            for name, source in self.sources.items()
            if source.startswith("default")
        ]


# Config keys read for each plan value, first match wins: the SFT recipe's names, then those of
# the RL recipes (``num_prompts_per_generation`` counts prompts over all ranks). Which models an
# RL config builds is not read from keys here: :func:`recipe_channels` asks the recipes' own
# ComposerChannels.
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "param_dtype": ("dtype",),
    "micro_batch_size": ("micro_batch_size", "batch_size"),
    "seq_len": ("seq_len", "max_seq_len"),
    "activation_checkpointing": ("enable_activation_checkpointing",),
    "logprob_chunk_size": ("logprob_chunk_size",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "cpu_offload": ("fsdp_cpu_offload", "cpu_offload"),
    "prompt_len": ("max_prompt_length", "max_prompt_len"),
    "completion_len": ("max_completion_length", "max_new_tokens", "loss.max_completion_length"),
    "rollout_batch_size": ("rollout_batch_size",),
    "prompts_per_generation": ("num_prompts_per_generation",),
    "group_size": ("group_size", "num_generations"),
}

_ADAM_LIKE = ("torch.optim.AdamW", "torch.optim.Adam")
MUON = "composer_tune.optim.Muon"


def _select(cfg: DictConfig, name: str) -> tuple[Any, str | None]:
    """The first of ``CONFIG_KEYS[name]`` set in ``cfg`` (value, key), or (None, None)."""
    for key in CONFIG_KEYS[name]:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            return value, key
    return None, None


def _optimizer(cfg: DictConfig, device: str, offload: bool) -> tuple[int, str, str]:
    """(states per parameter, step implementation, where that came from); with Muon, those of
    the AdamW it keeps for the parameters that are not layer matrices."""
    component = OmegaConf.select(cfg, "optimizer._component_", default=None)
    if component == MUON:
        states, source = 2, f"optimizer {component}: AdamW's 2 states off the matrices"
    elif component == "torch.optim.SGD":
        states = 1 if OmegaConf.select(cfg, "optimizer.momentum", default=0) else 0
        source = "optimizer torch.optim.SGD"
    elif component in _ADAM_LIKE:
        states, source = 2, f"optimizer {component}"
    else:
        states, source = 2, f"default: AdamW-like, 2 states (optimizer {component!r} unknown)"
    if OmegaConf.select(cfg, "optimizer.fused", default=False):
        impl = "fused"
    elif device == "cpu" or offload or OmegaConf.select(cfg, "optimizer.foreach") is False:
        impl = "for-loop"  # torch's default off-GPU; with offload the step runs on the host
    else:
        impl = "foreach"
    return states, impl, source


def model_args_from_config(cfg: DictConfig) -> DecoderArgs:
    """Builds the config's ``model`` node on the meta device (no memory) and returns its shape."""
    from torchtune.config import instantiate

    if OmegaConf.select(cfg, "model") is None:
        raise ValueError("config has no 'model' node: cannot tell the model's shape")
    with torch.device("meta"):
        model = instantiate(cfg.model)
    args = getattr(model, "config", None)
    if not isinstance(args, DecoderArgs):
        family = getattr(args, "family", cfg.model.get("_component_"))
        raise ValueError(
            f"config 'model' node builds {family!r} on the transformers backend: the memory "
            "estimate models the native decoder only (Llama, Qwen2, Qwen3 with "
            "model.backend=native or auto); other families, mixtures of experts among them, "
            "are not modelled"
        )
    return args


def recipe_channels(cfg: DictConfig, world_size: int) -> ComposerChannels | None:
    """What the RL recipes make of ``cfg`` at ``world_size`` ranks: the same
    :meth:`ComposerChannels.from_config` they call at set-up, so the estimate and the run agree
    on the models built (policy, reference, EMA teacher) and on whether rollouts run. None for
    a config without a ``loss`` section (SFT's, or a bare model shape): no channels.

    A config the recipe would refuse at this world size is refused here too (ValueError). The
    one value it checks that a memory estimate need not have is channel 3's data source:
    ``dpo.pairs`` left null or ``???`` for the launch command to supply is taken as given.
    """
    from composer_tune.channels.composer import ComposerChannels
    from composer_tune.distributed import DistInfo

    if "loss" not in cfg:
        return None
    if "max_new_tokens" not in cfg:
        raise ValueError("an RL config (it has a 'loss' section) needs max_new_tokens")
    if cfg.get("dpo") is not None and (
        OmegaConf.is_missing(cfg.dpo, "pairs") or cfg.dpo.get("pairs") is None
    ):
        cfg = OmegaConf.merge(cfg, {"dpo": {"pairs": "<supplied at launch>"}})
    launch = DistInfo(world_size=world_size, rank=0, device=torch.device("cpu"))
    return ComposerChannels.from_config(cfg, launch)


def plan_from_config(
    cfg: DictConfig, *, world_size: int | None = None, gpu_gib: float = 79.2, **flags: Any
) -> ConfigPlan:
    """Reads a recipe config into a :class:`ConfigPlan`.

    Plan values come from, in order: ``flags`` (MemoryPlan field names; None means not given),
    the config keys in :data:`CONFIG_KEYS`, the recipe schema's defaults
    (:class:`composer_tune.config.TrainingConfig`), then documented fallbacks: one sequence per
    forward; a rollout of ``num_prompts_per_generation / world_size * group_size`` rows whose
    prompts fill the model's ``max_seq_len`` less the completion (no config states a prompt
    length); training sequences of prompt + completion (else ``max_seq_len``). A reference
    model, an EMA teacher and the rollout phase are there exactly when the recipe builds them
    (:func:`recipe_channels`; the ``reference_model`` and ``ema_teacher`` flags override it for
    what-if estimates). With ``rollout.engine: vllm`` the engine holds
    ``rollout.vllm.gpu_memory_utilization`` of ``gpu_gib`` (the GPU's memory).
    """
    from composer_tune.config import TrainingConfig
    from composer_tune.rollout.engines import VLLMSection
    from composer_tune.rollout.generation import DEFAULT_PREFILL_CHUNK

    args = model_args_from_config(cfg)
    schema_defaults = {f.name: f.default for f in dataclass_fields(TrainingConfig)}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(name: str, value: Any, source: str) -> None:
        values[name] = value
        sources[name] = source

    def read(name: str, fallback: Any = None, fallback_source: str = "") -> Any:
        """The flag, else the config key, else ``fallback``; None if none of them."""
        if flags.get(name) is not None:
            take(name, flags[name], "flag")
        else:
            value, key = _select(cfg, name) if name in CONFIG_KEYS else (None, None)
            if value is not None:
                take(name, value, f"config {key}")
            elif fallback is not None:
                take(name, fallback, fallback_source)
        return values.get(name)

    take("world_size", world_size or 1, "flag" if world_size else "default: 1 rank")
    channels = recipe_channels(cfg, values["world_size"])
    rollouts = channels is None or channels.needs_rollouts
    for name, schema_key in (
        ("param_dtype", "dtype"),
        ("activation_checkpointing", "enable_activation_checkpointing"),
        ("logprob_chunk_size", "logprob_chunk_size"),
    ):
        read(name, schema_defaults[schema_key], f"default of TrainingConfig.{schema_key}")
    read("gradient_accumulation_steps", 1, "default: 1 (an SFT key; RL recipes use micro-batches)")
    read("micro_batch_size", 1, "default: 1 sequence per forward")
    offload = read("cpu_offload", False, "default: no offload")
    read("master_weights", False, "default: parameters stored in param_dtype")
    read("grad_dtype")
    read("optimizer_state_dtype")
    read("ema_dtype")

    completion = read("completion_len")
    rows = read("rollout_batch_size")
    if rows is None:
        prompts, prompts_key = _select(cfg, "prompts_per_generation")
        group, group_key = _select(cfg, "group_size")
        if prompts is not None and group is not None:
            per_rank = math.ceil(prompts / values["world_size"]) * group
            take("rollout_batch_size", per_rank, f"{prompts_key} / world_size x {group_key}")
            rows = per_rank
    prompt = read("prompt_len")
    if rows and completion and prompt is None:
        prompt = args.max_seq_len - completion
        take("prompt_len", prompt, "default: model max_seq_len - completion")
    if not rollouts:
        take("rollout_batch_size", 0, "channels: channel 3 alone samples no rollouts")
    elif not (rows and (prompt or completion)):
        take("rollout_batch_size", 0, "default: no rollout (no rollout batch and lengths)")
    elif completion is None:
        take("completion_len", 0, "default: no completion length")
    read("seq_len")
    if "seq_len" not in values:
        if prompt is not None and completion is not None:
            take("seq_len", prompt + completion, "default: prompt + completion")
        else:
            take("seq_len", args.max_seq_len, "default: model max_seq_len")

    if channels is None:
        read("reference_model", False, "default: no channels (not an RL config)")
        read("ema_teacher", False, "default: no channels (not an RL config)")
    else:
        read("reference_model", channels.builds_reference_model, "channels.builds_reference_model")
        read("ema_teacher", channels.uses_ema_teacher, "channels.uses_ema_teacher")
    if values["ema_teacher"] and "ema_dtype" not in values:
        take("ema_dtype", "fp32", "the RL recipes hold the EMA teacher in float32")
    device = OmegaConf.select(cfg, "device", default=None) or schema_defaults["device"]
    states, impl, source = _optimizer(cfg, device, offload)
    take("optimizer_states", states, source)
    muon = OmegaConf.select(cfg, "optimizer._component_", default=None) == MUON
    take("muon", muon, "config optimizer._component_")
    take("optimizer_impl", impl, f"optimizer settings, device {device}")
    take("prefill_chunk", DEFAULT_PREFILL_CHUNK, "default: rollout.generation prefill chunk")
    # The model is the native decoder (model_args_from_config refuses others).
    if attention_in_fp32(device, torch_dtype(values["param_dtype"])):
        take("fp32_attention", True, "native decoder on a CPU in bf16: attention in fp32")
    engine = OmegaConf.select(cfg, "rollout.engine", default=None) if rollouts else None
    take("rollout_engine", engine or "native", "config rollout.engine" if engine else "default")
    if engine == "vllm":
        vllm = VLLMSection(**OmegaConf.to_container(cfg.rollout.get("vllm") or {}, resolve=True))
        share = f"{vllm.gpu_memory_utilization} x {gpu_gib} GiB"
        take("engine_gib", vllm.gpu_memory_utilization * gpu_gib, f"rollout.vllm: {share}")
        take("engine_sleeps", vllm.enable_sleep_mode, "config rollout.vllm.enable_sleep_mode")
    plan = MemoryPlan(**values)
    return ConfigPlan(args=args, plan=plan, sources=sources)
