"""The ``parity`` part: the project's model, built the recipes' way, against ``transformers`` in
bf16 on small random models of each family (and SmolLM2), both compared with fp32."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from composer_tune.gpu_check.common import PartResult, Settings, error_row, require

PARITY_VOCAB = 1024
PARITY_TOKENS = (2, 96)  # batch, sequence: longer than the Llama 3.1 scaling's original window
PARITY_RELATIVE = 2.0  # ours may be off fp32 by at most this times transformers' own bf16 error
PARITY_FLOOR = 1e-3
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# transformers config class and the family's extra keys.
PARITY_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3_scaled": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 48}),  # head_dim != hidden / heads, as Qwen3 allows
    # The transformers backend only: a sliding window, hybrid windows, a mixture of experts.
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            # RoPE per layer type: transformers 5.17 (the GPU image's) refuses one flat dict.
            "rope_parameters": {
                kind: {"rope_type": "default", "rope_theta": 10000.0}
                for kind in ("sliding_attention", "full_attention")
            },
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    ),
}
NATIVE_PARITY = ("llama", "llama3_scaled", "qwen2", "qwen3")


def _perturb(model: torch.nn.Module) -> None:
    """Random norm scales and biases: left at 1 and 0 they would hide a mis-mapped one."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))


def _random_hf_checkpoint(family: str, tied: bool, directory: Path) -> None:
    import transformers

    class_name, extra = PARITY_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(
        vocab_size=PARITY_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        **{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **extra},
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    _perturb(model)
    model.save_pretrained(directory)


def build_ours(checkpoint: Path, device: torch.device, backend: str = "auto") -> torch.nn.Module:
    """The project's bf16 model of ``checkpoint`` on ``backend``, built as every recipe builds
    it."""
    from omegaconf import OmegaConf

    from composer_tune.distributed import DistInfo
    from composer_tune.models.build import build_decoder

    model_cfg = OmegaConf.create(
        {
            "_component_": "composer_tune.models.from_pretrained",
            "path": str(checkpoint),
            "backend": backend,
        }
    )
    return build_decoder(
        model_cfg,
        checkpoint=checkpoint,
        dtype=torch.bfloat16,
        dist_info=DistInfo(world_size=1, rank=0, device=device),
        seed=0,
        activation_checkpointing=False,
        fsdp_cpu_offload=False,
    ).eval()


def _parity_row(
    name: str, checkpoint: Path, tokens: torch.Tensor, device: torch.device, backend: str
) -> dict:
    from transformers import AutoModelForCausalLM

    tokens = tokens.to(device)
    logits = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
        with torch.no_grad():
            logits[label] = hf(tokens).logits.float()
        del hf
    ours = build_ours(checkpoint, device, backend)
    with torch.no_grad():
        logits["ours"] = ours(tokens).float()
    del ours
    reference = logits["fp32"]
    hf_error = (logits["bf16"] - reference).abs().max().item()
    ours_error = (logits["ours"] - reference).abs().max().item()
    tolerance = PARITY_RELATIVE * hf_error + PARITY_FLOOR
    return {
        "case": name,
        "backend": backend,
        "ours_vs_hf_bf16": (logits["ours"] - logits["bf16"]).abs().max().item(),
        "ours_vs_fp32": ours_error,
        "hf_bf16_vs_fp32": hf_error,
        "tolerance": tolerance,
        "logit_scale": reference.abs().max().item(),
        "status": "PASS" if ours_error <= tolerance else "FAIL",
    }


def _smollm2_tokens(directory: Path) -> torch.Tensor:
    """Real text through the checkpoint's own tokenizer (random ids if it has none)."""
    text = (
        "The quick brown fox jumps over the lazy dog. What is 17 + 25? "
        "Let me think step by step: 17 + 25 = 42."
    )
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(directory)(text)["input_ids"]
    except (OSError, ValueError):
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        ids = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    return torch.tensor([ids])


def run_parity(settings: Settings) -> PartResult:
    require("transformers", "torchtune")
    rows = []
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, PARITY_VOCAB, PARITY_TOKENS, generator=generator)
    with tempfile.TemporaryDirectory() as tmp:
        for family in PARITY_FAMILIES:
            # The native decoder's families on both backends; the others on transformers'.
            backends = ("native", "transformers") if family in NATIVE_PARITY else ("transformers",)
            for tied in (True, False):
                name = f"{family}, {'tied' if tied else 'untied'}"
                directory = Path(tmp) / f"{family}_{tied}"
                for backend in backends:
                    try:
                        if not directory.is_dir():
                            _random_hf_checkpoint(family, tied, directory)
                        rows.append(_parity_row(name, directory, tokens, settings.device, backend))
                    except ImportError:
                        raise  # a missing package skips the part, by name
                    except Exception as err:  # noqa: BLE001 - recorded, the other cases go on
                        rows.append(error_row({"case": name, "backend": backend}, err))
    name = "SmolLM2-135M (--smollm2-dir)"
    directory = settings.smollm2_dir
    if directory is None:
        rows.append({"case": name, "status": "SKIPPED", "note": "no --smollm2-dir given"})
    elif not (directory / "config.json").is_file():
        rows.append({"case": name, "status": "SKIPPED", "note": f"{directory}/config.json absent"})
    else:
        for backend in ("native", "transformers"):
            try:
                text = _smollm2_tokens(directory)
                rows.append(_parity_row(name, directory, text, settings.device, backend))
            except Exception as err:  # noqa: BLE001
                rows.append(error_row({"case": name, "backend": backend}, err))
    return PartResult(
        columns=[
            ("case", "case", ""),
            ("backend", "model.backend", ""),
            ("ours_vs_hf_bf16", "max abs diff, ours vs transformers (both bf16)", ".4g"),
            ("ours_vs_fp32", "ours bf16 vs transformers fp32", ".4g"),
            ("hf_bf16_vs_fp32", "transformers bf16 vs fp32", ".4g"),
            ("tolerance", "tolerance (on ours vs fp32)", ".4g"),
            ("logit_scale", "max abs logit", ".3g"),
        ],
        rows=rows,
        notes=[
            f"Logits of {PARITY_TOKENS[0]} x {PARITY_TOKENS[1]} random tokens (SmolLM2: text). "
            f"Tolerance = {PARITY_RELATIVE:g} x transformers' own bf16 error + {PARITY_FLOOR:g}: "
            "the project's bf16 decoder must be as close to the fp32 reference as transformers' "
            "bf16 model is (within a factor 2).",
        ],
    )
