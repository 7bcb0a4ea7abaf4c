"""GGUF import: the bundled SmolLM2 becomes a Hugging Face checkpoint; bad files leave nothing."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from composer_tune.checkpointing import gguf_import
from composer_tune.checkpointing.gguf_import import GGUFImportError, import_gguf, smollm2_gguf_path

REPO = Path(__file__).resolve().parents[1]


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_smollm2_checkpoint_is_a_chatml_llama(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    # The end of an assistant turn, not <|endoftext|>, stops generation.
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered.startswith("<|im_start|>system\n")


def test_smollm2_checkpoint_loads_in_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_truncated_gguf_is_rejected_and_leaves_nothing(tmp_path: Path) -> None:
    truncated = tmp_path / "in" / "model.gguf"
    truncated.parent.mkdir()
    with open(smollm2_gguf_path(), "rb") as src:
        truncated.write_bytes(src.read(4_000_000))
    out = tmp_path / "out" / "smollm2"
    with pytest.raises(GGUFImportError, match=r"model\.gguf: not a readable GGUF file"):
        import_gguf(truncated, out)
    assert not out.exists()


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("not a gguf file\n")
    with pytest.raises(GGUFImportError, match="GGUF magic"):
        import_gguf(bogus, tmp_path / "out")
    assert _leftovers(tmp_path) == ["model.gguf"]


def _write_tiny_gguf(path: Path, architecture: str, chat_template: str | None) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("architecture", "chat_template", "error"),
    [
        ("mamba", "{{ messages }}", r"tiny\.gguf: architecture 'mamba' is not supported"),
        ("gpt2", "{{ messages }}", r"tiny\.gguf: architecture 'gpt2' is not supported"),
        ("llama", None, r"tiny\.gguf: GGUF header has no 'tokenizer\.chat_template'"),
    ],
)
def test_unusable_header_is_rejected_before_loading(
    tmp_path: Path, architecture: str, chat_template: str | None, error: str
) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, architecture, chat_template)
    with pytest.raises(GGUFImportError, match=error):
        import_gguf(path, tmp_path / "out")
    assert _leftovers(tmp_path) == ["tiny.gguf"]


def test_failed_conversion_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_written(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_import, "_convert", half_written)
    with pytest.raises(RuntimeError, match="disk full"):
        import_gguf(smollm2_gguf_path(), tmp_path / "smollm2")
    assert _leftovers(tmp_path) == []


def test_force_replaces_an_existing_output_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def converted(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
        (out_dir / "config.json").write_text("{}")

    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "stale.txt").write_text("old import")
    monkeypatch.setattr(gguf_import, "_convert", converted)
    with pytest.raises(GGUFImportError, match="exists and is not empty"):
        import_gguf(smollm2_gguf_path(), out)
    assert _leftovers(out) == ["stale.txt"]
    import_gguf(smollm2_gguf_path(), out, force=True)
    assert _leftovers(out) == ["config.json"]
    assert _leftovers(tmp_path) == ["smollm2"]


def _import_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/import_gguf.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_help_and_errors(tmp_path: Path) -> None:
    usage = _import_tool("--help")
    assert usage.returncode == 0
    assert "--dtype {fp32,bf16}" in usage.stdout
    missing = _import_tool(str(tmp_path / "absent.gguf"), str(tmp_path / "out"))
    assert missing.returncode == 1
    assert "absent.gguf: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_cache_reuses_a_complete_import(tmp_path: Path, smollm2_dir: Path, monkeypatch) -> None:
    version_dir = tmp_path / smollm2_dir.name
    shutil.copytree(smollm2_dir, version_dir)
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a, **k: pytest.fail("re-imported"))
    assert gguf_import.smollm2_checkpoint(tmp_path) == version_dir
