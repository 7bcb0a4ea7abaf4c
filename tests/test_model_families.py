"""Llama, Qwen2 and Qwen3 from ``config.json``: logits equal transformers' in both directions.

For each family (and Llama 3.1 RoPE scaling), tied and untied, a tiny random transformers
model is loaded into the project's decoder (HF -> ours), and a tiny random project decoder is
saved and loaded by ``AutoModelForCausalLM`` (ours -> HF). Large inits and perturbed norms and
biases make any wrong mapping an O(1) logit error; the mutation tests below prove the check
catches a wrong norm order, a missing bias and a swapped projection.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchtune.modules import MultiHeadAttention
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from composer_tune.checkpointing import CheckpointError, load_decoder_from_hf, save_hf_checkpoint
from composer_tune.checkpointing.run_state import save_run_checkpoint
from composer_tune.distributed import DistInfo
from composer_tune.models import CausalDecoder, GroupedQueryAttention, from_pretrained
from composer_tune.models.pretrained import resolve_backend

VOCAB = 256
TOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "llama3_scaled": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
}
CASES = [(family, tied) for family in FAMILIES for tied in (True, False)]
IDS = [f"{family}-{'tied' if tied else 'untied'}" for family, tied in CASES]


def _perturb(model: torch.nn.Module) -> None:
    """Norm scales start at 1 and biases at 0: randomise them so neither is a no-op."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))


def _hf_model(family: str, tied: bool) -> torch.nn.Module:
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        **{"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, **extra},
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    return model


def _tokens() -> torch.Tensor:
    # Longer than original_max_position_embeddings, so Llama 3.1 scaling matters.
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def _max_diff(ours: CausalDecoder, hf: torch.nn.Module) -> float:
    tokens = _tokens()
    with torch.no_grad():
        return (ours.eval()(tokens) - hf.eval()(tokens).logits).abs().max().item()


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def hf_pair(request, tmp_path_factory) -> tuple[torch.nn.Module, Path, str, bool]:
    family, tied = request.param
    hf = _hf_model(family, tied)
    path = tmp_path_factory.mktemp(f"{family}_{tied}")
    hf.save_pretrained(path)
    return hf, path, family, tied


def test_hf_to_ours(hf_pair) -> None:
    hf, path, family, tied = hf_pair
    ours = load_decoder_from_hf(path)
    assert ours.config.family == hf.config.model_type
    assert ours.config.tie_word_embeddings == tied
    assert (ours.config.rope_scaling is not None) == (family == "llama3_scaled")
    assert _max_diff(ours, hf) <= TOL


def test_ours_to_hf(hf_pair, tmp_path: Path) -> None:
    _, path, family, tied = hf_pair
    torch.manual_seed(3)
    ours = from_pretrained(path)  # a fresh random model of the same architecture
    _perturb(ours)
    save_hf_checkpoint(ours.state_dict(), ours.config, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(hf).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    assert hf.config.tie_word_embeddings == tied
    assert _max_diff(ours, hf) <= TOL


def test_checkpoint_saved_after_a_training_step_loads_in_transformers(
    hf_pair, tmp_path: Path
) -> None:
    _, path, _, _ = hf_pair
    ours = load_decoder_from_hf(path)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    tokens = _tokens()
    logits = ours.train()(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert max((v - before[k]).abs().max().item() for k, v in ours.state_dict().items()) > 1e-3
    step_dir = save_run_checkpoint(
        output_dir=tmp_path,
        step=1,
        model=ours,
        model_config=json.loads((path / "config.json").read_text()),
        optimizer=optimizer,
        lr_scheduler=None,
        recipe_state={},
        dist_info=DistInfo(world_size=1, rank=0, device=torch.device("cpu")),
    )
    hf = AutoModelForCausalLM.from_pretrained(step_dir / "model", dtype=torch.float32)
    assert _max_diff(ours, hf) <= TOL


# ------------------------------------------------------------------ the parity check can fail


def _norm_after_rope(model: CausalDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchtune's own MultiHeadAttention.forward applies q_norm/k_norm after RoPE.
    monkeypatch.setattr(GroupedQueryAttention, "forward", MultiHeadAttention.forward)


def _drop_bias(model: CausalDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.no_grad():
        model.layers[0].attn.k_proj.bias.zero_()


def _swap_gate_up(model: CausalDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp = model.layers[1].mlp
    mlp.w1, mlp.w3 = mlp.w3, mlp.w1


@pytest.mark.parametrize(
    ("family", "mutation"),
    [("qwen3", _norm_after_rope), ("qwen2", _drop_bias), ("llama", _swap_gate_up)],
)
def test_parity_detects_a_wrong_model(family, mutation, monkeypatch, tmp_path: Path) -> None:
    hf = _hf_model(family, tied=False)
    hf.save_pretrained(tmp_path)
    ours = load_decoder_from_hf(tmp_path)
    assert _max_diff(ours, hf) <= TOL
    mutation(ours, monkeypatch)
    assert _max_diff(ours, hf) > 1000 * TOL


# ------------------------------------------------------------------ unsupported configs


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("llama", {"attention_bias": True}, "attention_bias=True is not supported for llama"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported for llama"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        (
            "qwen3",
            {"rope_parameters": LLAMA3_ROPE},
            "rope_type='llama3' is not supported for qwen3",
        ),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ("qwen2", {"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ],
)
def test_unsupported_option_is_named_before_weights_are_read(
    family: str, change: dict, match: str, tmp_path: Path
) -> None:
    _hf_model(family, tied=True).save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config_path.write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # never read
    with pytest.raises(CheckpointError, match=match) as error:
        from_pretrained(tmp_path, backend="native")
    assert str(config_path) in str(error.value)
    assert resolve_backend(config, "auto") == "transformers"  # what auto does with it
    with pytest.raises(CheckpointError, match=match):
        load_decoder_from_hf(tmp_path)


def test_from_pretrained_caps_the_rope_cache(hf_pair) -> None:
    _, path, _, _ = hf_pair
    model = from_pretrained(path, max_seq_len=48)
    assert model.config.max_seq_len == 48
    with pytest.raises(CheckpointError, match="not found"):
        from_pretrained(path / "nowhere")


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_computes_torchtunes_norm(input_dtype: torch.dtype) -> None:
    """The decoder's norms with bf16 weights (a GPU run): sampling forwards take the fused
    kernel's route (fp32 weight beside the fp32 input) and give torchtune's values; forwards
    that build a graph are torchtune's own."""
    from torchtune.modules import RMSNorm

    from composer_tune.models.decoder import FusedRMSNorm

    torch.manual_seed(0)
    norm = FusedRMSNorm(dim=64, eps=1e-6).to(torch.bfloat16)
    norm.scale.data.normal_()
    x = torch.randn(3, 5, 64, dtype=input_dtype)
    expected = RMSNorm.forward(norm, x)
    with torch.no_grad():
        sampled = norm(x)
    assert sampled.dtype == input_dtype
    torch.testing.assert_close(sampled, expected, rtol=0, atol=0)
    trained = norm(x.requires_grad_())
    assert trained.grad_fn is not None and torch.equal(trained, expected)
