"""composer_tune.optim.Muon: the step against torch.optim.Muon (matrices) + torch.optim.AdamW
(the rest) in one process and under FSDP2 on two gloo processes, for the native decoder and a
transformers mixture of experts (3-D expert stacks, a fused gate/up matrix, uneven shards);
exact resume; the parameter split by name; the one config override that selects it.

The reference (:class:`TorchReference`) gives ``torch.optim.Muon`` every 2-D matrix as its own
parameter (each expert's, each part of a fused matrix) and ``torch.optim.AdamW`` the
embeddings, output head and norms, chosen by name here, not by the module under test. The
Newton-Schulz iteration runs in bf16 on both sides (torch.optim.Muon always does), so equal
results mean the sharded step orthogonalised the very same whole matrices.
"""

from __future__ import annotations

import copy
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtune import training

from composer_tune.distributed import finish_process, setup_distributed, teardown_distributed
from composer_tune.models import qwen3_tiny
from composer_tune.optim import Muon, newton_schulz, split_parameters
from tests.recipe_runs import REPO_ROOT, run_torchrun

STEPS = 3
SETTINGS = {"lr": 0.02, "weight_decay": 0.1, "betas": (0.9, 0.99)}
ADAMW_NAMES = re.compile(r"embed|lm_head|(^|\.)output\.weight$")


def native_model(seed: int = 0) -> nn.Module:
    """The native Qwen3 decoder, untied, with rows that two ranks split unevenly (75 = 38 + 37)."""
    torch.manual_seed(seed)
    return qwen3_tiny(
        vocab_size=96, embed_dim=48, intermediate_dim=75, num_heads=3, num_kv_heads=1,
        head_dim=16, tie_word_embeddings=False, max_seq_len=32,
    )  # fmt: skip


def moe_model(seed: int = 0) -> nn.Module:
    """transformers' Qwen3-MoE: 3 experts (two ranks hold 2 and 1) in 3-D stacks, gate and up
    fused in one ``gate_up_proj``, a router matrix, untied head."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=3, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


MODELS: dict[str, Callable[..., nn.Module]] = {"native": native_model, "moe": moe_model}


def layers_of(model: nn.Module) -> nn.ModuleList:
    return model.layers if hasattr(model, "layers") else model.model.layers


def _matrix_pieces(tensor: torch.Tensor, parts: int) -> torch.Tensor:
    """A view of ``tensor``'s 2-D matrices: one per expert and fused part."""
    rows, cols = tensor.shape[-2:]
    return tensor.reshape(-1, parts, rows // parts, cols).flatten(0, 1)


class TorchReference:
    """torch.optim.Muon on every 2-D matrix as its own parameter, torch.optim.AdamW on the rest."""

    def __init__(self, model: nn.Module, adjust_lr_fn: str) -> None:
        self.pieces: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
        adamw = []
        for name, param in model.named_parameters():
            if param.ndim < 2 or ADAMW_NAMES.search(name):
                adamw.append(param)
                continue
            parts = 2 if name.endswith("gate_up_proj") else 1
            for index, piece in enumerate(_matrix_pieces(param.detach(), parts)):
                self.pieces.append((param, parts, index, piece.clone().requires_grad_()))
        lr, weight_decay = SETTINGS["lr"], SETTINGS["weight_decay"]
        self.muon = torch.optim.Muon(
            [leaf for *_, leaf in self.pieces],
            lr=lr,
            weight_decay=weight_decay,
            adjust_lr_fn=adjust_lr_fn,
        )
        self.adamw = torch.optim.AdamW(
            adamw, lr=lr, weight_decay=weight_decay, betas=SETTINGS["betas"]
        )

    def step(self) -> None:
        for param, parts, index, leaf in self.pieces:
            leaf.grad = _matrix_pieces(param.grad, parts)[index].clone()
        self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for param, parts, index, leaf in self.pieces:
                _matrix_pieces(param, parts)[index].copy_(leaf)


def make_muon(model: nn.Module, adjust_lr_fn: str) -> Muon:
    return Muon(model.named_parameters(), ns_dtype="bf16", adjust_lr_fn=adjust_lr_fn, **SETTINGS)


def set_gradients(model: nn.Module, step: int) -> None:
    """Seeded full gradients, the same on every rank; a sharded parameter gets its shard."""
    generator = torch.Generator().manual_seed(1000 + step)
    for param in model.parameters():
        full = torch.randn(param.shape, generator=generator)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements)
        param.grad = full


def train(model: nn.Module, optimizer: object, steps: range) -> None:
    for step in steps:
        set_gradients(model, step)
        optimizer.step()
        model.zero_grad(set_to_none=True)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_step_equals_torch_muon_and_adamw(model_name: str, adjust_lr_fn: str) -> None:
    model = MODELS[model_name]()
    reference_model = copy.deepcopy(model)
    initial = full_state(model)
    train(model, make_muon(model, adjust_lr_fn), range(STEPS))
    train(reference_model, TorchReference(reference_model, adjust_lr_fn), range(STEPS))
    assert max_difference(full_state(model), full_state(reference_model)) < 1e-6
    assert max_difference(full_state(model), initial) > 1e-2  # the steps moved the weights


def test_whole_stack_orthogonalisation_is_not_per_expert() -> None:
    """Negative control: the reference tells orthogonalising each expert's (and each fused
    part's) matrix from orthogonalising the stack as one matrix."""
    model = moe_model()
    reference_model = copy.deepcopy(model)
    train(model, Muon(model.named_parameters(), ns_dtype="bf16", fused_parts={}, **SETTINGS),
          range(1))  # fmt: skip
    train(reference_model, TorchReference(reference_model, "match_rms_adamw"), range(1))
    assert max_difference(full_state(model), full_state(reference_model)) > 1e-3


def test_newton_schulz_orthogonalises_each_matrix() -> None:
    generator = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 40, 24, generator=generator, dtype=torch.float64)
    result = newton_schulz(stack)
    # Keller Jordan's coefficients land the singular values in roughly (0.5, 1.5), not at 1.
    singular = torch.linalg.svdvals(result)
    assert singular.min() > 0.5 and singular.max() < 1.5
    # ... and the singular vectors are the input's: U S' V^T with S' near 1.
    u, _, vh = torch.linalg.svd(stack, full_matrices=False)
    assert (result - u @ vh).abs().max() < 0.4
    for index in range(3):  # a stack is its matrices one by one
        torch.testing.assert_close(result[index], newton_schulz(stack[index]))
    halves = newton_schulz(stack, parts=2)
    torch.testing.assert_close(halves[0, :20], newton_schulz(stack[0, :20]))


def test_split_by_name_and_shape() -> None:
    native = dict(split_parameters(native_model().named_parameters())[1])
    assert sorted(n for n in native if not n.endswith("scale")) == [
        "output.weight",
        "tok_embeddings.weight",
    ]
    muon, adamw = split_parameters(moe_model().named_parameters())
    muon_names = [name for name, _ in muon]
    assert "model.layers.0.mlp.experts.gate_up_proj" in muon_names  # a 3-D expert stack
    assert "model.layers.0.mlp.gate.weight" in muon_names  # the router is a hidden matrix
    assert "model.layers.0.self_attn.o_proj.weight" in muon_names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= {
        name for name, _ in adamw
    }
    assert all(param.ndim >= 2 for _, param in muon)


def test_resume_from_state_dict_equals_uninterrupted() -> None:
    model = native_model()
    uninterrupted = copy.deepcopy(model)
    train(uninterrupted, make_muon(uninterrupted, "match_rms_adamw"), range(STEPS))

    optimizer = make_muon(model, "match_rms_adamw")
    train(model, optimizer, range(1))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    state = saved["optimizer"]["state"]
    momentum = [s for s in state.values() if "momentum_buffer" in s]
    adamw = [s for s in state.values() if "exp_avg" in s]
    assert momentum and adamw and len(momentum) + len(adamw) == len(state)
    assert all(s["momentum_buffer"].dtype == torch.float32 and len(s) == 1 for s in momentum)

    resumed = native_model(seed=1)  # other weights: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = make_muon(resumed, "match_rms_adamw")
    resumed_optimizer.load_state_dict(saved["optimizer"])
    train(resumed, resumed_optimizer, range(1, STEPS))
    assert max_difference(full_state(resumed), full_state(uninterrupted)) == 0.0


def test_bad_arguments_are_named() -> None:
    model = native_model()
    with pytest.raises(TypeError, match="named_parameters"):
        Muon(model.parameters())
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(model.named_parameters(), ns_dtype="fp8")
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(model.named_parameters(), adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="fused parts"):
        Muon(model.named_parameters(), fused_parts={r"w1": 2})  # 75 rows


@pytest.mark.parametrize("recipe", ["sft", "grpo", "diloco"])
def test_one_override_selects_muon_in_a_recipe(recipe: str) -> None:
    """``optimizer._component_=composer_tune.optim.Muon`` on a config written for AdamW (its
    betas, weight_decay and, on GPU configs, fused) builds Muon through the recipes' builder."""
    from composer_tune.config import load_recipe_config
    from composer_tune.run.loop import build_optimizer

    cfg = load_recipe_config(
        REPO_ROOT / "recipes" / f"{recipe}.py",
        "qwen3_7b",
        ["optimizer._component_=composer_tune.optim.Muon", "optimizer.lr=2e-5"],
    )
    assert "betas" in cfg.optimizer and "fused" in cfg.optimizer
    cfg.optimizer.fused = None  # the GPU configs' fused AdamW kernel; this model is on a CPU
    optimizer, scheduler = build_optimizer(cfg, native_model())
    assert isinstance(optimizer, Muon)
    muon_group, adamw_group = optimizer.param_groups
    assert muon_group["muon"] and not adamw_group["muon"]
    assert scheduler.base_lrs == [2e-5, 2e-5]  # both parts follow the config's schedule
    assert adamw_group["betas"] == tuple(cfg.optimizer.betas)


# ----------------------------------------------------------------------------- FSDP2


def _shard(model: nn.Module) -> None:
    layers = {id(layer) for layer in layers_of(model)}
    training.shard_model(model, [lambda _name, module: id(module) in layers], cpu_offload=False)


def _fsdp_worker(out_path: str) -> None:
    """Per model: Muon on the FSDP2-sharded model against the reference in this process, and a
    run resumed after step 1 through the full optimizer state dict the recipes' checkpoints
    hold against the uninterrupted one. Rank 0 writes the differences."""
    info = setup_distributed("cpu")
    results = {}
    for name, build in MODELS.items():
        reference_model = build()
        train(reference_model, TorchReference(reference_model, "match_rms_adamw"), range(STEPS))

        model = build()
        _shard(model)
        optimizer = make_muon(model, "match_rms_adamw")
        train(model, optimizer, range(1))
        saved_model = full_state(model)
        # As a run checkpoint: rank 0 writes the full optimizer state, every rank reads it.
        checkpoint = Path(out_path).with_name(f"{name}_optimizer.pt")
        saved_optimizer = training.get_full_optimizer_state_dict(model, optimizer, info.is_main)
        if info.is_main:
            torch.save(saved_optimizer, checkpoint)
        dist.barrier()
        train(model, optimizer, range(1, STEPS))

        resumed = build(seed=1)  # other weights: the resumed run must take them from the checkpoint
        _shard(resumed)
        training.load_from_full_model_state_dict(resumed, saved_model, info.device, strict=True)
        resumed_optimizer = make_muon(resumed, "match_rms_adamw")
        training.load_from_full_optimizer_state_dict(
            resumed, resumed_optimizer, torch.load(checkpoint, weights_only=False), info.device
        )
        train(resumed, resumed_optimizer, range(1, STEPS))

        sharded = full_state(model)
        uneven = [
            tuple(p.to_local().shape) for p in model.parameters() if p.shape[0] % 2 and p.ndim >= 2
        ]
        results[name] = {
            "vs_reference": max_difference(sharded, full_state(reference_model)),
            "resumed_vs_uninterrupted": max_difference(full_state(resumed), sharded),
            "uneven_local_shapes": uneven,
        }
    if info.is_main:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    teardown_distributed()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("muon_fsdp") / "results.json"
    run_torchrun(Path(__file__).resolve(), str(out), timeout=420)
    return json.loads(out.read_text())


@pytest.mark.parametrize("model_name", list(MODELS))
def test_fsdp2_step_equals_single_process_torch_muon(fsdp_results: dict, model_name: str) -> None:
    result = fsdp_results[model_name]
    assert result["vs_reference"] < 1e-6
    assert result["uneven_local_shapes"]  # some matrices (or expert stacks) split unevenly


@pytest.mark.parametrize("model_name", list(MODELS))
def test_fsdp2_resume_equals_uninterrupted(fsdp_results: dict, model_name: str) -> None:
    assert fsdp_results[model_name]["resumed_vs_uninterrupted"] == 0.0


if __name__ == "__main__":
    finish_process(lambda: _fsdp_worker(sys.argv[1]))
