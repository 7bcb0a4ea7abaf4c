"""Hugging Face checkpoint I/O: logit parity with transformers' Qwen3 in both directions.

The peer implementation is ``transformers.Qwen3ForCausalLM``; every model is tiny, random and
float32. Weights use a large init and perturbed norm scales so that a wrong mapping or a wrong
op order shows up as an O(1) logit error, far above the 1e-4 tolerance (checked below).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchtune.modules import MultiHeadAttention, RotaryPositionalEmbeddings
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from composer_tune.checkpointing import (
    CheckpointError,
    decoder_from_hf_config,
    hf_to_decoder_state_dict,
    load_decoder_from_hf,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from composer_tune.checkpointing import hf_checkpoint as hf_io
from composer_tune.models import CausalDecoder, GroupedQueryAttention, decoder, qwen3_tiny

VOCAB = 300
TOL = 1e-4


def _perturb_norms(model: torch.nn.Module) -> None:
    """Norm scales start at 1; make them random so q/k/layer norms are not no-ops."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))


def _hf_model(tied: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen3ForCausalLM(config).eval()
    _perturb_norms(model)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


def _max_logit_diff(ours: CausalDecoder, hf: Qwen3ForCausalLM) -> float:
    tokens = _tokens()
    with torch.no_grad():
        return (ours.eval()(tokens) - hf(tokens).logits).abs().max().item()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Qwen3ForCausalLM, Path]:
    """A sharded HF checkpoint, shared by the tests of this module: do not modify it."""
    model = _hf_model(tied=request.param)
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, max_shard_size="60KB")  # several shards + index
    assert (path / "model.safetensors.index.json").exists()
    return model, path


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_single_file_to_ours(tied: bool, tmp_path: Path) -> None:
    hf = _hf_model(tied)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    ours = load_decoder_from_hf(tmp_path)
    assert ours.config.tie_word_embeddings == tied
    assert ours.config.rope_base == 5000.0 and ours.config.norm_eps == 1e-5
    assert _max_logit_diff(ours, hf) <= TOL


def test_hf_sharded_to_ours(hf_dir: tuple[Qwen3ForCausalLM, Path]) -> None:
    hf, path = hf_dir
    args, state_dict = load_hf_checkpoint(path)
    model = decoder_from_hf_config(path)
    assert model.config == args
    model.load_state_dict(state_dict, strict=True)
    assert _max_logit_diff(model, hf) <= TOL


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shard_bytes", [10**9, 40_000], ids=["single", "sharded"])
def test_ours_to_hf(tied: bool, shard_bytes: int, tmp_path: Path) -> None:
    torch.manual_seed(3)
    ours = qwen3_tiny(vocab_size=VOCAB, tie_word_embeddings=tied, initializer_range=0.15)
    _perturb_norms(ours)
    written = save_hf_checkpoint(
        ours.state_dict(), ours.config, tmp_path, max_shard_size_bytes=shard_bytes
    )
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert (len(shards) > 1) == (shard_bytes == 40_000)
    assert set(shards) <= set(written)
    stored = {k for shard in shards for k in load_file(shard)}
    assert ("lm_head.weight" in stored) == (not tied)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["torch_dtype"] == "float32"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(hf, Qwen3ForCausalLM)
    assert hf.config.tie_word_embeddings == tied
    # qwen3_tiny's rope_base (1e6) is not transformers' default, so it was really read.
    assert _max_logit_diff(ours, hf) <= TOL


def test_save_casts_dtype_and_keeps_source_files(tmp_path: Path) -> None:
    hf = _hf_model(tied=True)
    source = tmp_path / "source"
    hf.save_pretrained(source)
    (source / "tokenizer.json").write_text('{"dummy": true}')
    (source / "pytorch_model.bin").write_bytes(b"old weights, must not be copied")
    args, state_dict = load_hf_checkpoint(source)
    out = tmp_path / "out"
    source_config = json.loads((source / "config.json").read_text())
    save_hf_checkpoint(state_dict, source_config, out, dtype=torch.bfloat16, copy_files_from=source)
    assert (out / "tokenizer.json").read_text() == '{"dummy": true}'
    assert not (out / "pytorch_model.bin").exists()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["bos_token_id"] == 1
    reloaded_args, reloaded = load_hf_checkpoint(out)
    assert reloaded_args == args
    for key, tensor in state_dict.items():
        assert reloaded[key].dtype == torch.bfloat16
        assert torch.equal(reloaded[key], tensor.to(torch.bfloat16)), key


# ------------------------------------------------------------------ the parity check can fail


def _norm_after_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchtune's own MultiHeadAttention.forward applies q_norm/k_norm after RoPE.
    monkeypatch.setattr(GroupedQueryAttention, "forward", MultiHeadAttention.forward)


def _swap_gate_up(monkeypatch: pytest.MonkeyPatch) -> None:
    swapped = dict(hf_io._LAYER_KEYS)
    swapped["mlp.gate_proj.weight"], swapped["mlp.up_proj.weight"] = (
        swapped["mlp.up_proj.weight"],
        swapped["mlp.gate_proj.weight"],
    )
    monkeypatch.setattr(hf_io, "_LAYER_KEYS", swapped)


def _interleaved_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    # Llama-style RoPE (rotates adjacent pairs) instead of HF/Qwen's rotate-half.
    monkeypatch.setattr(
        decoder,
        "Qwen2RotaryPositionalEmbeddings",
        lambda dim, max_seq_len, base: RotaryPositionalEmbeddings(dim, max_seq_len, base),
    )


@pytest.mark.parametrize("mutation", [_norm_after_rope, _swap_gate_up, _interleaved_rope])
def test_parity_detects_wrong_model(
    mutation, hf_dir: tuple[Qwen3ForCausalLM, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf, path = hf_dir
    mutation(monkeypatch)
    assert _max_logit_diff(load_decoder_from_hf(path), hf) > 1000 * TOL


# ------------------------------------------------------------------ clear errors


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_checkpoint(tmp_path)


def test_missing_shard_is_named(hf_dir: tuple[Qwen3ForCausalLM, Path], tmp_path: Path) -> None:
    path = Path(shutil.copytree(hf_dir[1], tmp_path / "copy"))
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_hf_checkpoint(path)


def test_missing_weights_file(tmp_path: Path) -> None:
    _hf_model(tied=True).config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)


def _resave_single(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"), "layers.1.attn.k_norm.scale"),
        (
            lambda t: t.update({"model.layers.0.self_attn.rotary.weight": torch.zeros(2)}),
            "model.layers.0.self_attn.rotary.weight",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(3)}),
            r"norm.scale has shape \(3,\)",
        ),
        (
            lambda t: t.update({"lm_head.weight": torch.zeros(VOCAB, 64)}),
            "lm_head.weight differs",
        ),
    ],
    ids=["missing", "unexpected", "bad_shape", "untied_head_in_tied_config"],
)
def test_bad_weights_are_named(edit, match: str, tmp_path: Path) -> None:
    _hf_model(tied=True).save_pretrained(tmp_path)
    _resave_single(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gpt_neox"}, r"config\.json: model_type 'gpt_neox' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_config_is_named(change: dict, match: str, tmp_path: Path) -> None:
    _hf_model(tied=True).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    if change.get("hidden_size", 0) is None:
        del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(tmp_path)


def test_save_refuses_bad_input(tmp_path: Path) -> None:
    model = qwen3_tiny(vocab_size=VOCAB)
    state_dict = model.state_dict()
    with pytest.raises(CheckpointError, match="layers.0.mlp.w1.weight"):
        save_hf_checkpoint(
            {k: v for k, v in state_dict.items() if k != "layers.0.mlp.w1.weight"},
            model.config,
            tmp_path / "a",
        )
    mixed = {**state_dict, "norm.scale": state_dict["norm.scale"].half()}
    with pytest.raises(CheckpointError, match="one dtype"):
        save_hf_checkpoint(mixed, model.config, tmp_path / "b")
    save_hf_checkpoint(state_dict, model.config, tmp_path / "c")
    with pytest.raises(CheckpointError, match="already holds weights"):
        save_hf_checkpoint(state_dict, model.config, tmp_path / "c")


def test_hf_key_names_round_trip() -> None:
    """Every HF name maps to a distinct model name and back (no two HF keys collide)."""
    hf = _hf_model(tied=False)
    args = decoder_from_hf_config(hf.config.to_dict()).config
    ours = hf_to_decoder_state_dict(hf.state_dict(), args)
    assert len(ours) == len(hf.state_dict())
    back = hf_io.decoder_to_hf_state_dict(ours, args)
    assert back.keys() == hf.state_dict().keys()
