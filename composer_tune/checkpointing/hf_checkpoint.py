"""Hugging Face-format checkpoints of the Llama, Qwen2 and Qwen3 families: read into
:mod:`composer_tune.models`, write back out, through one key map for all three.

The written directory (``config.json``, ``generation_config.json``, safetensors weights with a
``model.safetensors.index.json`` when sharded) loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM. Tied-embedding models store no
``lm_head.weight``, as Hugging Face does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from composer_tune.models.decoder import (
    FAMILIES,
    CausalDecoder,
    DecoderArgs,
    Llama3RopeScaling,
    decoder_from_args,
)
from composer_tune.models.hf_backend import (
    HFArchitecture,
    hf_named_weights,
    save_transformers_checkpoint,
)

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 1024**3

# Per-layer parameter names: Hugging Face suffix -> composer_tune (torchtune) suffix.
_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}
_GLOBAL_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TUNE_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_KEYS_INV = {tune: hf for hf, tune in _LAYER_KEYS.items()}
_GLOBAL_KEYS_INV = {tune: hf for hf, tune in _GLOBAL_KEYS.items()}

# Files written by save_hf_checkpoint itself, or weights in other formats: never copied from a source.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_OWN_FILES = {CONFIG_NAME, INDEX_NAME, "pytorch_model.bin.index.json"}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}
# Per family: config keys whose only supported value is the one given (absent = that value).
_FIXED_KEYS = {
    "qwen3": {"use_sliding_window": False, "attention_bias": False, "hidden_act": "silu"},
    "qwen2": {"use_sliding_window": False, "hidden_act": "silu"},
    "llama": {
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "pretraining_tp": 1,
    },
}


class CheckpointError(ValueError):
    """A Hugging Face checkpoint directory or state dict is unusable; the message names why."""


# ----------------------------------------------------------------------------- config.json


def decoder_args_from_hf_config(
    config: Mapping[str, Any], source: str = CONFIG_NAME
) -> DecoderArgs:
    """Translate a Hugging Face ``config.json`` dict (Llama, Qwen2 or Qwen3) into
    :class:`DecoderArgs`.

    Optional keys fall back to transformers' defaults. A ``model_type`` or an option this model
    does not implement (sliding windows, Llama attention/MLP bias, non-SiLU MLP, RoPE scaling
    other than Llama 3.1's) raises :class:`CheckpointError` naming ``source`` and the key,
    rather than loading into a silently different model.
    """
    family = config.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(
            f"{source}: model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})"
        )

    def required(key: str) -> Any:
        if key not in config:
            raise CheckpointError(f"{source}: missing required key {key!r}")
        return config[key]

    for key, supported in _FIXED_KEYS[family].items():
        if config.get(key, supported) not in (supported, None):
            raise CheckpointError(
                f"{source}: {key}={config[key]!r} is not supported for {family} "
                f"(only {supported!r})"
            )
    rope_base, rope_scaling = _rope(config, family, source)
    embed_dim = required("hidden_size")
    num_heads = required("num_attention_heads")
    try:
        return DecoderArgs(
            vocab_size=required("vocab_size"),
            num_layers=required("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            embed_dim=embed_dim,
            intermediate_dim=required("intermediate_size"),
            head_dim=config.get("head_dim") or embed_dim // num_heads,
            max_seq_len=config.get("max_position_embeddings", 32768),
            rope_base=rope_base,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            family=family,
            rope_scaling=rope_scaling,
        )
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from err


def _rope(
    config: Mapping[str, Any], family: str, source: str
) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE base and scaling from transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling``."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    if rope_type == "default":
        return base, None
    if rope_type != "llama3" or family != "llama":
        raise CheckpointError(
            f"{source}: {key}.rope_type={rope_type!r} is not supported for {family} "
            "(only 'default', and 'llama3' for llama)"
        )
    try:
        return base, Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise CheckpointError(f"{source}: {key} of rope_type 'llama3' lacks {err}") from None


def hf_config_from_decoder_args(
    args: DecoderArgs, dtype: torch.dtype, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict for ``args``: what transformers (4.5x and 5.x) and vLLM read.

    ``extra`` (e.g. the source checkpoint's config) supplies keys this model does not own, such
    as ``bos_token_id``/``eos_token_id``; shape keys always come from ``args``. RoPE is written
    both as ``rope_theta``/``rope_scaling`` (transformers 4.x, vLLM) and ``rope_parameters``
    (transformers 5.x).
    """
    config = dict(extra or {})
    for stale in ("torch_dtype", "dtype", "layer_types", "transformers_version"):
        config.pop(stale, None)
    rope_scaling = None
    if args.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)}
    config.update(
        architectures=[_ARCHITECTURES[args.family]],
        model_type=args.family,
        vocab_size=args.vocab_size,
        hidden_size=args.embed_dim,
        intermediate_size=args.intermediate_dim,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_base,
        rope_scaling=rope_scaling,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": args.rope_base,
            **(rope_scaling or {}),
        },
        tie_word_embeddings=args.tie_word_embeddings,
        hidden_act="silu",
        attention_dropout=0.0,
        torch_dtype=_DTYPE_NAMES[dtype],
        dtype=_DTYPE_NAMES[dtype],
        use_cache=True,
    )
    if args.family == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=args.num_layers
        )
        if args.family == "qwen3":
            config.update(attention_bias=False)
    config.setdefault("initializer_range", 0.02)
    config.setdefault("bos_token_id", None)
    config.setdefault("eos_token_id", None)
    return config


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: invalid JSON ({err})") from err


def _checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    return directory


def decoder_from_hf_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> CausalDecoder:
    """Build an (initialised, not loaded) decoder from a ``config.json`` dict or directory."""
    if isinstance(config, Mapping):
        return decoder_from_args(decoder_args_from_hf_config(config))
    path = _checkpoint_dir(config) / CONFIG_NAME
    return decoder_from_args(decoder_args_from_hf_config(read_json(path), source=str(path)))


# ----------------------------------------------------------------------------- state dicts


def _expected_shapes(args: DecoderArgs) -> dict[str, torch.Size]:
    """Parameter names and shapes of the model ``args`` describes (built on meta: no memory)."""
    with torch.device("meta"):
        model = decoder_from_args(args)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def _check_against_model(
    state_dict: Mapping[str, torch.Tensor], args: DecoderArgs, what: str
) -> None:
    """Raise naming every missing, unexpected or mis-shaped key of ``state_dict``."""
    expected = _expected_shapes(args)
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"{what} does not match the config: missing keys {missing}, unexpected keys {unexpected}"
        )
    for name, shape in expected.items():
        if state_dict[name].shape != shape:
            raise CheckpointError(
                f"{what}: {name} has shape {tuple(state_dict[name].shape)}, "
                f"config implies {tuple(shape)}"
            )


def hf_to_decoder_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], args: DecoderArgs
) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to :class:`CausalDecoder` names and check shapes.

    A tied checkpoint may still carry ``lm_head.weight``; it is dropped when it equals the
    embedding and rejected otherwise (the model could not represent it).
    """
    converted: dict[str, torch.Tensor] = {}
    for hf_key, tensor in hf_state_dict.items():
        layer = _HF_LAYER_RE.match(hf_key)
        if layer and layer.group(2) in _LAYER_KEYS:
            converted[f"layers.{layer.group(1)}.{_LAYER_KEYS[layer.group(2)]}"] = tensor
        elif hf_key in _GLOBAL_KEYS:
            converted[_GLOBAL_KEYS[hf_key]] = tensor
        else:
            raise CheckpointError(f"unexpected Hugging Face key {hf_key!r}")
    if args.tie_word_embeddings and "output.weight" in converted:
        lm_head = converted.pop("output.weight")
        embed = converted.get("tok_embeddings.weight")
        if embed is not None and not torch.equal(lm_head, embed):
            raise CheckpointError(
                "config says tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight"
            )
    _check_against_model(converted, args, "Hugging Face state dict")
    return converted


def decoder_to_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], args: DecoderArgs
) -> dict[str, torch.Tensor]:
    """Rename a :class:`CausalDecoder` state dict to Hugging Face names (inverse of the above)."""
    _check_against_model(state_dict, args, "model state dict")
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        layer = _TUNE_LAYER_RE.match(key)
        if layer:
            converted[f"model.layers.{layer.group(1)}.{_LAYER_KEYS_INV[layer.group(2)]}"] = tensor
        else:
            converted[_GLOBAL_KEYS_INV[key]] = tensor
    return converted


def checkpoint_tensors(
    model: nn.Module, materialize: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights as a Hugging Face checkpoint names them, each passed through
    ``materialize`` (e.g. an FSDP2 shard gathered and cast) only when its turn comes: the
    native decoder's renamed; a transformers-backend model's by transformers' own saving
    conversion (a fused expert tensor becomes one per expert), tied aliases left out."""
    if isinstance(model.config, DecoderArgs):
        for name, value in decoder_to_hf_state_dict(model.state_dict(), model.config).items():
            yield name, materialize(value)
        return
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    aliases -= {name for name, _ in model.named_parameters()}
    for name, value in model.state_dict().items():
        if name not in aliases:
            yield from hf_named_weights(model, name, materialize(value)).items()


# ----------------------------------------------------------------------------- load


def holds_weights(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds weight files (safetensors, PyTorch or GGUF), rather than only
    a ``config.json`` describing an architecture."""
    directory = Path(directory)
    return directory.is_dir() and any(
        path.name.endswith(_WEIGHT_SUFFIXES) for path in directory.iterdir()
    )


def _weight_files(directory: Path) -> dict[str, list[str] | None]:
    """Map each safetensors file to the keys the index assigns it (None: no index, take all)."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        files: dict[str, list[str] | None] = {}
        for key, filename in weight_map.items():
            files.setdefault(filename, []).append(key)
        return files
    if (directory / SINGLE_WEIGHTS_NAME).is_file():
        return {SINGLE_WEIGHTS_NAME: None}
    raise CheckpointError(f"{directory}: neither {SINGLE_WEIGHTS_NAME} nor {INDEX_NAME} found")


def load_hf_checkpoint(
    checkpoint_dir: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> tuple[DecoderArgs, dict[str, torch.Tensor]]:
    """Read a Hugging Face checkpoint directory: its architecture and its weights in our names.

    Handles a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
    ``dtype`` casts every tensor (None keeps the stored dtype). Build the model with
    ``decoder_from_args(args)`` and ``load_state_dict(state_dict)``, or use
    :func:`load_decoder_from_hf`.
    """
    directory = _checkpoint_dir(checkpoint_dir)
    config_path = directory / CONFIG_NAME
    args = decoder_args_from_hf_config(read_json(config_path), source=str(config_path))
    hf_state_dict: dict[str, torch.Tensor] = {}
    for filename, keys in _weight_files(directory).items():
        path = directory / filename
        if not path.is_file():
            raise CheckpointError(f"missing weight shard {path} (listed in {INDEX_NAME})")
        with safe_open(str(path), framework="pt") as shard:
            available = set(shard.keys())
            wanted = sorted(available) if keys is None else keys
            absent = sorted(set(wanted) - available)
            if absent:
                raise CheckpointError(f"{path}: keys {absent} listed in {INDEX_NAME} are absent")
            for key in wanted:
                tensor = shard.get_tensor(key)
                hf_state_dict[key] = tensor if dtype is None else tensor.to(dtype)
    return args, hf_to_decoder_state_dict(hf_state_dict, args)


def load_decoder_from_hf(
    checkpoint_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> CausalDecoder:
    """Build a :class:`CausalDecoder` and load a Hugging Face checkpoint into it."""
    args, state_dict = load_hf_checkpoint(checkpoint_dir, dtype=dtype)
    # Build without allocating, then adopt the loaded tensors instead of copying into them.
    with torch.device("meta"):
        model = decoder_from_args(args)
    model.load_state_dict(state_dict, strict=True, assign=True)
    for module in model.modules():
        if hasattr(module, "rope_init"):
            module.rope_init()  # the RoPE cache is a non-persistent buffer, still on meta
    return model


# ----------------------------------------------------------------------------- save


def _shard(tensors: Mapping[str, torch.Tensor], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Greedily pack keys, in order, into groups of at most ``max_bytes`` once stored at
    ``itemsize`` bytes per element (a bigger single tensor gets a group of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _storage_dtype(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> torch.dtype:
    """Check the tensors are full and of one supported dtype after the optional cast."""
    for key, tensor in state_dict.items():
        if isinstance(tensor, DTensor):
            raise CheckpointError(
                f"{key} is a sharded DTensor; gather a full state dict first "
                "(e.g. torchtune.training.gather_cpu_state_dict)"
            )
    dtypes = {dtype} if dtype is not None else {t.dtype for t in state_dict.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
        raise CheckpointError(
            f"state dict must hold one dtype among {sorted(_DTYPE_NAMES.values())}, "
            f"got {sorted(map(str, dtypes))}; pass dtype= to cast"
        )
    return next(iter(dtypes))


def _copy_non_weight_files(source: str | os.PathLike[str] | None, out: Path) -> list[Path]:
    """Copy ``source``'s tokenizer and other non-weight files (never its config or weights)."""
    if source is None:
        return []
    return [
        Path(shutil.copy2(path, out / path.name))
        for path in sorted(_checkpoint_dir(source).iterdir())
        if path.is_file() and not (path.name.endswith(_WEIGHT_SUFFIXES) or path.name in _OWN_FILES)
    ]


def _write_json(path: Path, payload: Any) -> Path:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def save_hf_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: DecoderArgs | HFArchitecture | Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    dtype: torch.dtype | None = None,
    copy_files_from: str | os.PathLike[str] | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write a model's state dict as a Hugging Face checkpoint.

    Args:
        state_dict: full (not sharded) tensors under the model's names, e.g.
            ``model.state_dict()``.
        config: the architecture: ``model.config``, i.e. :class:`DecoderArgs` (the native
            decoder, whose names are mapped to Hugging Face's) or :class:`HFArchitecture`
            (the transformers backend: written by ``save_pretrained``), or a Hugging Face
            ``config.json`` dict of a native family (whose non-shape keys are kept).
        out_dir: destination; created if needed, must not already hold weights.
        max_shard_size_bytes: split into ``model-0000i-of-0000n.safetensors`` plus an index
            when the weights exceed this.
        dtype: cast before writing (e.g. ``torch.bfloat16`` for serving); None keeps the dtype.
        copy_files_from: a Hugging Face directory whose tokenizer and other non-weight files
            (``tokenizer.json``, ``generation_config.json``, chat template ...) are copied, so
            the output is servable by vLLM as is.
        generation_config: written as ``generation_config.json`` (wins over a copied one).
            Without either, one holding the config's bos/eos token ids is written.

    Returns:
        The paths written.
    """
    if max_shard_size_bytes <= 0:
        raise ValueError(f"max_shard_size_bytes must be positive, got {max_shard_size_bytes}")
    if isinstance(config, HFArchitecture):
        hf_state_dict = dict(state_dict)
    else:
        args = config if isinstance(config, DecoderArgs) else decoder_args_from_hf_config(config)
        hf_state_dict = decoder_to_hf_state_dict(state_dict, args)
    stored_dtype = _storage_dtype(hf_state_dict, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))
    if stale or (out / INDEX_NAME).exists():
        raise CheckpointError(f"{out} already holds weights {stale}; choose an empty directory")

    if isinstance(config, HFArchitecture):
        save_transformers_checkpoint(
            hf_state_dict,
            config,
            out,
            dtype=stored_dtype,
            max_shard_size_bytes=max_shard_size_bytes,
        )
        _copy_non_weight_files(copy_files_from, out)
        if generation_config is not None:
            _write_json(out / GENERATION_CONFIG_NAME, dict(generation_config))
        return sorted(path for path in out.iterdir() if path.is_file())

    written = _copy_non_weight_files(copy_files_from, out)
    extra = None if isinstance(config, DecoderArgs) else config
    hf_config = hf_config_from_decoder_args(args, stored_dtype, extra)
    written.append(_write_json(out / CONFIG_NAME, hf_config))
    if generation_config is not None:
        written.append(_write_json(out / GENERATION_CONFIG_NAME, dict(generation_config)))
    elif not (out / GENERATION_CONFIG_NAME).exists():
        token_ids = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id")}
        written.append(_write_json(out / GENERATION_CONFIG_NAME, token_ids))

    shards = _shard(hf_state_dict, stored_dtype.itemsize, max_shard_size_bytes)
    names = (
        [SINGLE_WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, keys in zip(names, shards, strict=True):
        # One shard at a time keeps peak extra memory at one shard; clone() because
        # safetensors refuses tensors that share storage (views, tied copies).
        tensors = {
            k: hf_state_dict[k].detach().to("cpu", stored_dtype).clone().contiguous() for k in keys
        }
        # transformers refuses safetensors files without format metadata.
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        written.append(out / name)
    if len(shards) > 1:
        total = sum(t.numel() * stored_dtype.itemsize for t in hf_state_dict.values())
        weight_map = {key: name for name, keys in zip(names, shards, strict=True) for key in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        written.append(_write_json(out / INDEX_NAME, index))
    return written
