"""One command that turns a GPU into evidence: model parity, memory estimates, speed, a TRL peer.

    python tools/gpu_check.py                          # every part, on the GPU, into docs/gpu/
    python tools/gpu_check.py --part parity            # one part (each stays under ~9 minutes)
    python tools/gpu_check.py --part memory speed      # several
    python tools/gpu_check.py --device cpu --tiny      # dry run: every part at toy sizes

Each run writes ``<out-dir>/report.json`` and regenerates ``<out-dir>/report.md`` from it
(``--out-dir`` defaults to ``docs/gpu`` on CUDA at full size, to a new temporary folder for a
dry run, so that the committed report changes only on purpose). A
part's run replaces only that part's section of an existing report, so running the parts one by
one (one command each, as the GPU machine's 10-minute limit requires) ends in one complete
report. Every section records the machine, torch/CUDA versions, date and commit it ran on.

The parts, all in bf16 (``docs/gpu/README.md`` has the goals and how to run them):

- ``parity``: the project's model, built the recipes' way (``build_decoder`` on
  ``composer_tune.models.from_pretrained`` with the checkpoint's weights), against
  ``transformers`` on small random Llama (plain and Llama 3.1 RoPE), Qwen2 and Qwen3 configs on
  both backends (``model.backend`` native and transformers), and Mistral, Gemma 3 and Qwen3-MoE
  on the transformers backend, tied and untied, with norms and biases randomised as tests/test_model_families.py does; and on
  SmolLM2-135M with ``--smollm2-dir``. Both bf16 models are compared with transformers in fp32:
  ours passes when its max abs logit error is at most twice transformers' own bf16 error (plus
  1e-3), i.e. the decoder is as exact as transformers can be in bf16.
- ``memory``: one GRPO step of random Qwen3-0.6B/1.7B/4B/8B, activation checkpointing on and
  off, the model from ``build_decoder``: rollouts on the native KV-cache engine
  (``collect_rollouts`` makes the training batch; the rollout phase is measured on ``generate``
  as bench/measure_memory.py does), the log-prob forward with entropies, the policy loss,
  backward, clipping and AdamW, as ``recipes/grpo.py`` runs them for one on-policy micro-batch.
  Peak bytes allocated per phase (rollout, forward+backward, optimizer step; bench/
  measure_memory.py's method) against ``composer_tune.analysis.memory`` for the same config
  (``plan_from_config``, as tools/estimate_memory.py); goal: the step's peak within 10 %.
  ``build_decoder`` shards with FSDP2 only under torchrun with several ranks, so one GPU measures
  the unsharded model, which is what the estimator's ``world_size=1`` describes.
- ``speed``: forward+backward tokens/s and MFU of a Qwen3-8B layer stack with its 152k-vocabulary
  log-prob head (as many layers as the estimator says fit without activation checkpointing),
  with and without activation checkpointing and ``torch.compile`` (torchtune's per-layer
  ``compile_model``), and the same shape on the transformers backend (``Qwen3ForCausalLM``,
  eager and compiled per layer). MFU counts useful FLOPs (6 N per token for the N matmul parameters plus
  6 L s H d_head for causal attention; recomputation is not counted) against the bf16 dense peak
  (H100 SXM and H200 989 TFLOP/s, detected by name or ``--peak-tflops``); goal: >= 45 %.
- ``sampling``: tokens/s of the native engine (``rollout/generation.py``, its decode steps
  replayed as CUDA graphs) at 8 and 64 rows on Qwen3-8B (as many layers as fit half the card),
  128-token prompts, every row sampled to 128 tokens; beside it the same engine's eager loop, the
  engine on the transformers backend, ``transformers``' ``generate`` with its static cache (its
  decode step compiled and replayed as CUDA graphs) and vLLM where installed; each against the
  weight-read bound (rows x memory bandwidth / weight bytes per step). Goal: the native engine
  >= 1.0x ``transformers``' static-cache ``generate`` at both batch sizes. Also a correctness
  row, always judged on CUDA: greedy rows of the graph loop identical to the eager loop's on a
  small fp32 Qwen3.
- ``peer``: GRPO steps of composer-tune and TRL's ``GRPOTrainer`` alternating in one process, the
  method and code of bench/bench_grpo_vs_trl.py (imported), on its Qwen3-0.6B layer shape (4
  layers); goal: the recipe's median step, as it ships, no slower than TRL's (ratio >= 1).
- ``muon``: seconds per optimizer step of ``composer_tune.optim.Muon`` against fused AdamW on
  Qwen3-8B in bf16 (as many layers as fit, its 152k vocabulary), bench/bench_muon_step.py's code
  (imported); timed, no goal. Also a correctness row, always judged: Muon's step on one
  Qwen3-8B MLP matrix on the device equals ``torch.optim.Muon``'s (both bf16 Newton-Schulz).
- ``async``: steps per hour of ``recipes/grpo.py``'s own ``train()`` at ``rollout.max_staleness``
  0 (the trainer samples each batch itself) and 1 (a rollout worker process on the same device
  samples the next batch while the current one trains), in turn, on the peer part's model,
  fp32: bench/bench_rl_step.py's loop mode, imported; goal: staleness 1 faster than 0.

A part that cannot run (a package missing, an import that fails on this torch) is recorded as
skipped with the reason; any other error is recorded with its message and the remaining parts
still run. Goals are judged on CUDA at full size only; the CPU dry run (``--tiny``) reports its
numbers as INFO, except parity, which is always judged. Exit status: 0 when no part run now
FAILed or raised, 1 otherwise, 2 on a bad command line.

Sizes and time (one H100; each part must finish well inside a 10-minute command):
- parity: eight ~2M-parameter models plus SmolLM2: well under a minute.
- memory: 8 rows (2 prompts x 4) of 384 prompt + 128 sampled tokens, one micro-batch of 4096
  training tokens. The estimate for the largest case, 4B without checkpointing, is 53 GiB; the
  8B rows need ~76 GiB for AdamW (bf16 parameters, gradients, two states and the foreach
  temporary) and are skipped by name when the estimate plus the allocator margin does not fit
  (they run on an H200). Each case is a warm-up and a measured step with two 128-token
  rollouts: seconds each, a few minutes in all.
- speed: 4 x 2048 tokens per step; 25 layers fit an H100 by the estimate (all 36 an H200),
  with 10 % of the card held back for compiled kernels. A step is ~6 N x 8192 ~ 3e14 FLOP,
  under a second at 45 % MFU; three warm-up and five timed steps per variant; the two compiled
  variants spend about a minute each compiling one layer (the others reuse it). About 4-5
  minutes.
- sampling: the full 8B (16 GiB of bf16 weights), 128 new tokens at batch 8 and 64, each call
  twice: seconds per call at tens of milliseconds a step; ``transformers``' compilation of its
  decode step for each batch size a minute or two; vLLM's start and graph capture a minute or
  two. About 5-8 minutes.
- peer: 4 prompts x 8 completions of at most 64 tokens, 1 warm-up + 3 timed steps per framework,
  fp32 on both sides as the bench fixes it for random models, two composer-tune variants (the
  recipe as it ships, each group's prompt once, and with one row per completion): a minute or two.
- muon: 8 bytes per parameter (bf16 weights and gradients, then AdamW's two bf16 states or
  Muon's fp32 buffer: one optimizer at a time), all 36 layers on an H200 (~73 GB); Muon's
  Newton-Schulz is ~19 TFLOP per layer, about a second a step at full size: 2 warm-up and 5
  timed steps each, a minute or two with the model's random initialisation.
- async: 8 prompts x 8 completions of at most 128 tokens, 2 warm-up + 6 timed steps, 2 rounds
  of each setting, plus a worker start (~10-30 s) per staleness-1 block: about 3-5 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# First on the path even where PYTHONPATH puts gpu_wheels/site first: torchtune's wheel ships a broken
# top-level ``recipes`` package that would otherwise shadow this repository's.
sys.path.insert(0, str(REPO_ROOT))

try:
    import torch
except ImportError as import_error:  # the only hard requirement besides the standard library
    sys.exit(f"error: gpu_check needs torch ({import_error})")

PARTS = ("parity", "memory", "speed", "sampling", "peer", "muon", "async")
DEFAULT_OUT_DIR = REPO_ROOT / "docs" / "gpu"  # the committed report (CUDA, full sizes)
GIB = 2**30
MIB = 2**20
# Past this a part risks the GPU machine's 10-minute limit per command.
PART_SECONDS_WARN = 9 * 60
MEMORY_GOAL = 0.10  # |estimate / measured peak - 1|
MFU_GOAL = 0.45
PEER_GOAL = 1.0  # TRL median step / composer-tune median step
ASYNC_GOAL = 1.0  # seconds per step at rollout.max_staleness 0 / at 1 (one device)
SAMPLING_GOAL = 1.0  # native engine tokens/s / transformers' static-cache generate tokens/s
PEER_PHASES = ("generation", "train log-prob forward", "other")
# Dense bf16 peak per GPU, matched against the device name in this order (PCIe/NVL first).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
# Memory bandwidth per GPU in TB/s (the weight-read bound of sampling), matched as above.
PEAK_BANDWIDTH_TBS = (
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),
    ("H200", 4.8),
    ("A100", 2.0),
)
# Versions listed in the report header (importlib.metadata: nothing is imported for this).
PACKAGES = (
    "transformers",
    "torchtune",
    "torchao",
    "torchft",
    "trl",
    "datasets",
    "pyarrow",
    "omegaconf",
    "accelerate",
    "numpy",
)
# Imported once per run for the header: whether composer_tune works on this torch, DiLoCo
# (torchft) included, which no part needs.
IMPORT_CHECKS = ("composer_tune.models", "composer_tune.diloco", "recipes.grpo")
STATUS_ORDER = ("ERROR", "FAIL", "PASS", "INFO", "SKIPPED")


class MissingDependency(Exception):
    """A part needs a package (or an API) this machine lacks: the part is skipped, by name."""


def require(*modules: str) -> None:
    """Import ``modules`` or raise :class:`MissingDependency` naming the first that fails."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise MissingDependency(f"{name} is not importable here ({err})") from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every part reads from the command line."""

    device: torch.device
    tiny: bool
    smollm2_dir: Path | None
    peak_tflops: float | None
    peak_bandwidth_tbs: float | None = None

    @property
    def judged(self) -> bool:
        """Whether the memory, speed and peer goals apply (CUDA, full sizes)."""
        return self.device.type == "cuda" and not self.tiny

    def verdict(self, ok: bool) -> str:
        return ("PASS" if ok else "FAIL") if self.judged else "INFO"

    def device_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(self.device).total_memory / GIB


@dataclasses.dataclass
class PartResult:
    """A part's table: ``columns`` are ``(row key, header, format spec)``; each row carries a
    ``status`` (PASS, FAIL, INFO, SKIPPED or ERROR) and, where it has one, a ``note``."""

    columns: list[tuple[str, str, str]]
    rows: list[dict[str, Any]]
    notes: list[str] = dataclasses.field(default_factory=list)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error_row(row: dict[str, Any], err: Exception) -> dict[str, Any]:
    """``row`` marked ERROR with the exception's one-line reason (out of memory included)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return {**row, "status": "ERROR", "note": f"{type(err).__name__}: {message}"[:300]}


# ----------------------------------------------------------------------------- parity

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
                        rows.append(_error_row({"case": name, "backend": backend}, err))
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
                rows.append(_error_row({"case": name, "backend": backend}, err))
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


# ----------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    model: dict[str, Any]  # the config's model node
    label: str
    prompts: int
    group_size: int
    prompt_len: int
    completion_len: int


def memory_cases(tiny: bool) -> list[MemoryCase]:
    if tiny:
        tiny_model = {"_component_": "composer_tune.models.qwen3_tiny", "vocab_size": 512}
        return [MemoryCase(tiny_model, "qwen3_tiny", 2, 2, 24, 8)]
    return [
        MemoryCase({"_component_": f"composer_tune.models.{name}"}, name, 2, 4, 384, 128)
        for name in ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b")
    ]


def memory_config(case: MemoryCase, device: torch.device, checkpointing: bool) -> Any:
    """The recipe config (the keys ``recipes/grpo.py`` and the estimator read) of ``case``."""
    from omegaconf import OmegaConf

    rows = case.prompts * case.group_size
    return OmegaConf.create(
        {
            "model": {**case.model, "max_seq_len": case.prompt_len + case.completion_len},
            "device": device.type,
            "dtype": "bf16",
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-6},
            "enable_activation_checkpointing": checkpointing,
            "logprob_chunk_size": 1024,
            "num_prompts_per_generation": case.prompts,
            "group_size": case.group_size,
            "max_new_tokens": case.completion_len,
            "micro_batch_size": rows,  # one on-policy micro-batch, as TRL's default step
            "temperature": 1.0,
            "loss": {"objective": "grpo", "beta": 0.0},
        }
    )


class RandomPromptTokenizer:
    """The tokenizer interface ``collect_rollouts`` uses, with random prompt ids of a fixed length
    and no stop tokens, so every row samples exactly ``max_new_tokens`` (what the estimate
    assumes); a random model's ids would not decode into anything a real reward reads."""

    pad_id = 0
    stop_tokens: list[int] = []

    def __init__(self, vocab_size: int, prompt_len: int, seed: int) -> None:
        self.vocab_size, self.prompt_len = vocab_size, prompt_len
        self.generator = torch.Generator().manual_seed(seed)

    def tokenize_messages(self, messages: Any, **_: Any) -> tuple[list[int], list[bool]]:
        ids = torch.randint(1, self.vocab_size, (self.prompt_len,), generator=self.generator)
        return ids.tolist(), [True] * self.prompt_len

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, token_ids))


class RandomReward:
    """Seeded random scores: group advantages are then nonzero and the loss has a gradient."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, completions: Any, samples: Any) -> list[Any]:
        from composer_tune.rewards.base import RewardResult

        return [RewardResult(score=self.rng.random()) for _ in completions]


def measure_grpo_step(cfg: Any, case: MemoryCase, device: torch.device) -> dict[str, Any]:
    """Peak bytes of one GRPO step of ``cfg`` (rollout, forward+backward, optimizer step) after
    a warm-up step, in bench/measure_memory.py's format (``before_step``, ``peaks``)."""
    from bench import measure_memory
    from composer_tune import config
    from composer_tune.channels.policy import group_advantages, step_normalization
    from composer_tune.distributed import DistInfo
    from composer_tune.losses import PolicyLossConfig, policy_loss
    from composer_tune.models.build import build_decoder
    from composer_tune.rollout.rollouts import collect_rollouts, sequence_logprobs

    dist_info = DistInfo(world_size=1, rank=0, device=device)
    model = build_decoder(
        cfg.model,
        checkpoint=None,
        dtype=torch.bfloat16,
        dist_info=dist_info,
        seed=0,
        activation_checkpointing=cfg.enable_activation_checkpointing,
        fsdp_cpu_offload=False,
    ).train()
    optimizer = config.instantiate(cfg.optimizer, model.parameters())
    loss_cfg = PolicyLossConfig.from_mapping(
        {**cfg.loss, "max_completion_length": case.completion_len}, source="loss"
    )
    rows = case.prompts * case.group_size
    samples = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(case.prompts)]
    rollout = collect_rollouts(
        model,
        RandomPromptTokenizer(model.config.vocab_size, case.prompt_len, seed=0),
        samples,
        RandomReward(seed=0),
        group_size=case.group_size,
        max_new_tokens=case.completion_len,
        temperature=cfg.temperature,
        generator=torch.Generator(device=device).manual_seed(0),
        logprob_chunk_size=cfg.logprob_chunk_size,
        forward_batch_size=rows,
        compute_old_logp=False,  # one on-policy step: old log-probs are the detached current
    )
    advantages = group_advantages(rollout, loss_cfg, case.group_size, dist_info)

    def forward_backward() -> None:  # recipes/grpo.py's _optimizer_step for one micro-batch
        normalization = step_normalization(rollout, loss_cfg, dist_info, rows)
        logp, entropy = sequence_logprobs(
            model,
            rollout.tokens,
            rollout.input_pos,
            rollout.completion_mask,
            temperature=cfg.temperature,
            chunk_size=cfg.logprob_chunk_size,
            return_entropy=True,
        )
        loss, _ = policy_loss(
            logp,
            logp.detach(),
            advantages,
            rollout.completion_mask,
            loss_cfg,
            truncated=rollout.truncated,
            entropy=entropy,
            normalization=normalization,
            sampling_logp=rollout.sampling_logp,
        )
        loss.backward()

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward_backward()  # warm-up: the AdamW states exist from here on
    optimizer_step()
    inputs = [rollout.tokens, rollout.input_pos, rollout.completion_mask, rollout.sampling_logp]
    step = measure_memory.TrainingStep(model, optimizer, inputs, forward_backward, optimizer_step)
    measured = measure_memory.measure_step(
        model, optimizer, forward_backward, optimizer_step, inputs
    )
    rollout_peak = measure_memory.measure_rollout(step, rows, case.prompt_len, case.completion_len)[
        "peak"
    ]
    measured["peaks"][measure_memory.ROLLOUT_PHASE] = rollout_peak
    return measured


def run_memory(settings: Settings) -> PartResult:
    require("torchtune", "omegaconf")
    from bench import measure_memory
    from composer_tune.analysis import memory

    device_gib = settings.device_gib()
    rows = []
    for case in memory_cases(settings.tiny):
        for checkpointing in (True, False):
            cfg = memory_config(case, settings.device, checkpointing)
            row: dict[str, Any] = {
                "model": case.label,
                "ac": "on" if checkpointing else "off",
                "tokens": f"{case.prompts * case.group_size} x "
                f"{case.prompt_len}+{case.completion_len}",
            }
            try:
                plan = memory.plan_from_config(cfg, world_size=1, prompt_len=case.prompt_len)
                estimate = memory.estimate_memory(plan.args, plan.plan)
                if device_gib is not None:
                    fit = memory.fit_report(estimate, capacity_gib=device_gib)
                    if not fit.fits:
                        needed = fit.needed_bytes / GIB
                        rows.append(
                            {
                                **row,
                                "status": "SKIPPED",
                                "note": f"estimate {needed:.1f} GiB (with margins) > "
                                f"{device_gib:.1f} GiB on this GPU",
                            }
                        )
                        continue
                measured = measure_grpo_step(cfg, case, settings.device)
            except ImportError:
                raise
            except Exception as err:  # noqa: BLE001 - out of memory included: next case
                rows.append(_error_row(row, err))
                continue
            finally:
                _free_memory(settings.device)
            got = measure_memory.compare(estimate, measured)
            phases = ("rollout", "fb", "opt", "peak")
            row.update(
                {
                    f"{kind}_{phase}": got[f"{kind}_{phase}"] / MIB
                    for kind in ("est", "got")
                    for phase in phases
                }
            )
            row.update(
                {
                    "peak_ratio": got["est_peak"] / got["got_peak"],
                    "status": settings.verdict(abs(got["peak_error"]) <= MEMORY_GOAL),
                }
            )
            rows.append(row)
    how = (
        "torch.cuda.max_memory_allocated per phase"
        if settings.device.type == "cuda"
        else "CPU: torch.profiler allocation totals (bench/measure_memory.py)"
    )
    return PartResult(
        columns=[
            ("model", "model", ""),
            ("ac", "AC", ""),
            ("tokens", "rows x prompt+completion", ""),
            ("est_rollout", "rollout est MiB", ",.1f"),
            ("got_rollout", "rollout meas MiB", ",.1f"),
            ("est_fb", "fwd+bwd est MiB", ",.1f"),
            ("got_fb", "fwd+bwd meas MiB", ",.1f"),
            ("est_opt", "opt est MiB", ",.1f"),
            ("got_opt", "opt meas MiB", ",.1f"),
            ("est_peak", "peak est MiB", ",.1f"),
            ("got_peak", "peak meas MiB", ",.1f"),
            ("peak_ratio", "est / meas", ".3f"),
        ],
        rows=rows,
        notes=[
            f"Measured: {how}, of a GRPO step (objective grpo, beta 0, AdamW, clip 1.0) after "
            "a warm-up step; bf16 parameters, one process (build_decoder does not shard at world "
            "size 1).",
            f"Goal: the estimated peak within {MEMORY_GOAL:.0%} of the measured one (judged on "
            "CUDA at full size). The estimate of a row is, e.g., python tools/estimate_memory.py "
            "--model qwen3_4b --seq-len 512 --batch-size 8 --rollout-batch-size 8 "
            "--prompt-len 384 --completion-len 128 --activation-checkpointing",
        ],
    )


# ----------------------------------------------------------------------------- speed


def peak_tflops(settings: Settings) -> float | None:
    """The device's dense bf16 peak: ``--peak-tflops``, else from its name (None: unknown)."""
    if settings.peak_tflops is not None:
        return settings.peak_tflops
    if settings.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(settings.device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def _fitting_qwen3_8b(
    settings: Settings, max_seq_len: int, fits: Callable[[Any, float], bool]
) -> Any:
    """Qwen3-8B's shape with as many layers as ``fits(args, capacity_gib)`` allows on this
    device (all of them when its memory is unknown); a toy Qwen3 with ``--tiny``."""
    from composer_tune.models import DecoderArgs, qwen3_8b

    if settings.tiny:
        return DecoderArgs(
            vocab_size=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            embed_dim=64,
            intermediate_dim=128,
            head_dim=16,
            max_seq_len=max_seq_len,
        )
    with torch.device("meta"):
        full = qwen3_8b(max_seq_len=max_seq_len).config
    capacity = settings.device_gib()
    for layers in range(full.num_layers, 0, -1):
        args = dataclasses.replace(full, num_layers=layers)
        if capacity is None or fits(args, capacity):
            return args
    raise RuntimeError(f"not even one Qwen3-8B layer fits {capacity:.1f} GiB")


def speed_shape(settings: Settings, batch: int, seq_len: int) -> Any:
    """Qwen3-8B's layer shape with as many layers as fit this GPU (estimated without activation
    checkpointing, gradients but no optimizer); a toy shape with ``--tiny``."""
    from composer_tune.analysis import memory

    plan = memory.MemoryPlan(
        micro_batch_size=batch,
        seq_len=seq_len,
        activation_checkpointing=False,
        optimizer_states=0,
        optimizer_impl="fused",
    )

    def fits(args: Any, capacity: float) -> bool:
        # 10 % of the card held back beyond fit_report's margins: compiled kernels' workspaces.
        estimate = memory.estimate_memory(args, plan)
        return memory.fit_report(estimate, capacity_gib=0.9 * capacity).fits

    return _fitting_qwen3_8b(settings, seq_len, fits)


def _model_node(args: Any) -> Any:
    """A config ``model`` node building exactly ``args`` (a Qwen3 shape)."""
    from omegaconf import OmegaConf

    fields = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if f.name not in ("family", "rope_scaling")
    }
    return OmegaConf.create({"_component_": "composer_tune.models.qwen3", **fields})


def _transformers_node(args: Any) -> Any:
    """A config ``model`` node building ``args``' shape on the transformers backend
    (``Qwen3ForCausalLM``): a ``config.json`` in a temporary folder, random weights."""
    from omegaconf import OmegaConf

    from composer_tune.checkpointing.hf_checkpoint import CONFIG_NAME, hf_config_from_decoder_args

    directory = Path(tempfile.mkdtemp(prefix="gpu_check_shape_"))
    config = hf_config_from_decoder_args(args, torch.bfloat16)
    (directory / CONFIG_NAME).write_text(json.dumps(config))
    return OmegaConf.create(
        {
            "_component_": "composer_tune.models.from_pretrained",
            "path": str(directory),
            "max_seq_len": args.max_seq_len,
            "backend": "transformers",
        }
    )


def _build(
    args: Any, device: torch.device, checkpointing: bool, backend: str = "native"
) -> torch.nn.Module:
    from composer_tune.distributed import DistInfo
    from composer_tune.models.build import build_decoder

    node = _model_node(args) if backend == "native" else _transformers_node(args)
    return build_decoder(
        node,
        checkpoint=None,
        dtype=torch.bfloat16,
        dist_info=DistInfo(world_size=1, rank=0, device=device),
        seed=0,
        activation_checkpointing=checkpointing,
        fsdp_cpu_offload=False,
    )


def _time_forward_backward(
    args: Any,
    settings: Settings,
    checkpointing: bool,
    compiled: bool,
    batch: int,
    steps: int,
    backend: str = "native",
) -> float:
    """Median seconds of forward (chunked log-prob head) + backward over ``steps`` timed steps."""
    from torchtune import training

    from composer_tune.losses import logprob_head

    device = settings.device
    model = _build(args, device, checkpointing, backend).train()
    if compiled and backend == "native":
        training.compile_model(model, verbose=False)
    elif compiled:  # per decoder layer, as torchtune compiles its own
        for layer in model.decoder_layers():
            layer.compile()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, args.max_seq_len), generator=generator)
    tokens = tokens.to(device)
    head = logprob_head(torch.roll(tokens, -1, dims=1), chunk_size=1024)
    times = []
    for step in range(3 + steps):  # three warm-ups (compilation, autotuning, allocator)
        _synchronize(device)
        start = time.perf_counter()
        (-model(tokens, head_fn=head).mean()).backward()
        _synchronize(device)
        if step >= 3:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    del model
    return statistics.median(times)


def run_speed(settings: Settings) -> PartResult:
    require("torchtune", "omegaconf")
    from composer_tune.analysis import memory

    batch, seq_len, steps = (2, 64, 2) if settings.tiny else (4, 2048, 5)
    args = speed_shape(settings, batch, seq_len)
    peak = peak_tflops(settings)
    tokens = batch * seq_len
    attention = 6 * args.num_layers * seq_len * args.num_heads * args.head_dim
    flops = tokens * (6 * memory.count_matmul_params(args) + attention)
    backend = os.environ.get("TORCH_COMPILE_BACKEND", "inductor")
    rows: list[dict[str, Any]] = []
    best_mfu = None
    # The native decoder with and without activation checkpointing; transformers' Qwen3 (the
    # transformers backend) without, eager and compiled: the comparison that decides auto.
    variants = [("native", ac, compiled) for ac in (False, True) for compiled in (False, True)]
    variants += [("transformers", False, compiled) for compiled in (False, True)]
    for model_backend, checkpointing, compiled in variants:
        mode = f"compiled ({backend})" if compiled else "eager"
        ac = "on" if checkpointing else "off"
        row: dict[str, Any] = {
            "what": f"fwd+bwd, {args.num_layers} layers, AC {ac}, {mode}",
            "backend": model_backend,
            "shape": f"{batch} x {seq_len}",
        }
        try:
            seconds = _time_forward_backward(
                args, settings, checkpointing, compiled, batch, steps, model_backend
            )
        except ImportError:
            raise
        except Exception as err:  # noqa: BLE001 - e.g. a compile failure: next variant
            rows.append(_error_row(row, err))
            continue
        finally:
            _free_memory(settings.device)
        row.update(
            {
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "tflops": flops / seconds / 1e12,
            }
        )
        if peak is not None:
            row["mfu"] = row["tflops"] / peak
            best_mfu = max(best_mfu or 0.0, row["mfu"])
        row["status"] = "INFO"
        rows.append(row)
    if best_mfu is not None:
        rows.append(
            {
                "what": f"best MFU vs goal {MFU_GOAL:.0%}",
                "mfu": best_mfu,
                "status": settings.verdict(best_mfu >= MFU_GOAL),
            }
        )
    peak_text = f"{peak:g} TFLOP/s" if peak is not None else "unknown (no --peak-tflops)"
    return PartResult(
        columns=[
            ("what", "what", ""),
            ("backend", "model.backend", ""),
            ("shape", "batch x seq", ""),
            ("seconds", "s / step", ".3f"),
            ("tokens_per_s", "tokens/s", ",.0f"),
            ("tflops", "TFLOP/s", ".1f"),
            ("mfu", "MFU", ".1%"),
        ],
        rows=rows,
        notes=[
            f"Model: {args.num_layers} layers of dim {args.embed_dim}, {args.num_heads}/"
            f"{args.num_kv_heads} heads of {args.head_dim}, ffn {args.intermediate_dim}, vocab "
            f"{args.vocab_size} (at full size Qwen3-8B's shape, as many layers as fit), bf16, "
            f"chunked log-prob head; median of {steps} "
            "steps after 3 warm-ups. FLOPs per step: tokens x (6 N + 6 L s H d_head) "
            f"= {flops / 1e12:.1f} TFLOP (recomputation not counted); peak {peak_text}.",
            f"torch.compile: torchtune's per-layer compile_model, backend {backend} "
            "(TORCH_COMPILE_BACKEND).",
        ],
    )


# ----------------------------------------------------------------------------- sampling


def peak_bandwidth(settings: Settings) -> float | None:
    """The device's memory bandwidth in bytes/s: ``--peak-bandwidth`` (TB/s), else from its
    name (None: unknown)."""
    if settings.peak_bandwidth_tbs is not None:
        return settings.peak_bandwidth_tbs * 1e12
    if settings.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(settings.device)
    return next((tbs * 1e12 for key, tbs in PEAK_BANDWIDTH_TBS if key in name), None)


def sampling_shape(settings: Settings, max_seq_len: int, rows: int) -> Any:
    """Qwen3-8B with as many layers as fit the GPU with a KV cache for ``rows`` rows (a toy
    Qwen3 with ``--tiny``)."""
    from composer_tune.analysis import memory

    def fits(args: Any, capacity: float) -> bool:
        weights = 2 * memory.count_params(args)
        cache = 2 * 2 * args.num_layers * args.num_kv_heads * args.head_dim * max_seq_len * rows
        # Half the card: the model, its cache, the step's activations and logits, and the
        # peers' compiled graphs and memory pools.
        return weights + cache <= 0.5 * capacity * GIB

    return _fitting_qwen3_8b(settings, max_seq_len, fits)


def _timed(device: torch.device, run: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``run()`` (after one untimed warm-up call: compilation, graphs, allocator)
    and its result."""
    run()
    _synchronize(device)
    start = time.perf_counter()
    result = run()
    _synchronize(device)
    return time.perf_counter() - start, result


def _native_sampling(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new: int,
    device: torch.device,
    cuda_graphs: bool,
    greedy: bool = False,
) -> tuple[float, Any]:
    from composer_tune.rollout.generation import generate

    sampler = torch.Generator(device=device).manual_seed(0)
    return _timed(
        device,
        lambda: generate(
            model,
            prompts,
            max_new_tokens=new,
            pad_id=0,
            greedy=greedy,
            generator=sampler,
            cuda_graphs=cuda_graphs,
        ),
    )


def _transformers_static_sampling(
    model: torch.nn.Module, prompts: list[list[int]], new: int, device: torch.device
) -> float:
    """Seconds of ``transformers``' ``generate`` with its static cache (on CUDA its decode step
    is compiled and replayed as CUDA graphs), every row to ``new`` tokens, temperature 1."""
    input_ids = torch.tensor(prompts, device=device)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": new,
        "min_new_tokens": new,
        "cache_implementation": "static",
        "pad_token_id": 0,
        "eos_token_id": None,
    }
    with torch.inference_mode():
        seconds, _ = _timed(device, lambda: model.generate(**kwargs))
    return seconds


def _measure_vllm(
    config: Any,
    prompts: dict[int, list[list[int]]],
    new: int,
    measure: Callable[[str, int, Callable[[], float]], None],
) -> None:
    """vLLM (random weights: ``load_format="dummy"``, CUDA graphs on) sampling the same rows,
    one engine for every batch; a SKIPPED row where vLLM is not installed."""
    from composer_tune.checkpointing.hf_checkpoint import CONFIG_NAME

    try:
        require("vllm")
    except MissingDependency:
        measure("vLLM", max(prompts), functools.partial(require, "vllm"))  # its SKIPPED row
        return
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="gpu_check_vllm_") as config_dir:
        (Path(config_dir) / CONFIG_NAME).write_text(json.dumps(config.to_dict()))
        llm = LLM(
            model=config_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=len(next(iter(prompts.values()))[0]) + new,
            gpu_memory_utilization=0.5,
            seed=0,
        )
    params = SamplingParams(temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True)
    for rows, batch in prompts.items():
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in batch]
        measure(
            "vLLM",
            rows,
            lambda requests=requests: _timed(
                torch.device("cuda"), lambda: llm.generate(requests, params, use_tqdm=False)
            )[0],
        )


def _greedy_rows_identical(settings: Settings) -> dict[str, Any]:
    """Greedy rows of the CUDA-graph loop against the eager loop on a small fp32 Qwen3 whose
    wide initialisation keeps the argmax away from ties (float rounding may not flip it)."""
    from composer_tune.models import qwen3_tiny

    row: dict[str, Any] = {"what": "greedy rows, CUDA graphs vs eager loop", "rows": 16}
    if settings.device.type != "cuda":
        return {**row, "status": "SKIPPED", "note": "CUDA graphs need a GPU"}
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=1024, num_layers=4, initializer_range=0.5, max_seq_len=512)
    model = model.to(settings.device).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, 1024, (int(length),), generator=generator).tolist()
        for length in torch.randint(8, 65, (16,), generator=generator)
    ]
    _, eager = _native_sampling(model, prompts, 300, settings.device, False, greedy=True)
    _, graphed = _native_sampling(model, prompts, 300, settings.device, True, greedy=True)
    same = sum(a == b for a, b in zip(eager.completions, graphed.completions, strict=True))
    return {
        **row,
        "identical": f"{same}/16",
        "status": "PASS" if same == 16 else "FAIL",
        "note": "fp32, 8-64 prompt tokens, 300 new tokens: spans of 1 and 2 graph buckets",
    }


def _measure_native(
    args: Any,
    settings: Settings,
    prompts: dict[int, list[list[int]]],
    new: int,
    measure: Callable[[str, int, Callable[[], float]], None],
    name: str,
    graphs: bool,
    backend: str = "native",
) -> None:
    """The native engine on ``backend``'s model at each batch of ``prompts`` (with graphs on
    the native model also its eager loop, the engine as it was before them)."""
    model = _build(args, settings.device, checkpointing=False, backend=backend)
    for rows, batch in prompts.items():
        measure(
            name,
            rows,
            lambda batch=batch: _native_sampling(model, batch, new, settings.device, graphs)[0],
        )
        if graphs and backend == "native":
            measure(
                "native engine, eager loop",
                rows,
                lambda batch=batch: _native_sampling(model, batch, new, settings.device, False)[0],
            )


def _measure_transformers(
    config: Any,
    settings: Settings,
    prompts: dict[int, list[list[int]]],
    new: int,
    measure: Callable[[str, int, Callable[[], float]], None],
) -> None:
    from transformers import AutoModelForCausalLM

    with settings.device:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    for rows, batch in prompts.items():
        measure(
            "transformers generate, static cache",
            rows,
            lambda batch=batch: _transformers_static_sampling(model, batch, new, settings.device),
        )


def run_sampling(settings: Settings) -> PartResult:
    require("transformers", "torchtune", "omegaconf")
    from transformers import Qwen3Config

    from composer_tune.analysis import memory
    from composer_tune.checkpointing.hf_checkpoint import hf_config_from_decoder_args

    device = settings.device
    prompt_len, new = (16, 16) if settings.tiny else (128, 128)
    batches = (2, 8) if settings.tiny else (8, 64)
    args = sampling_shape(settings, prompt_len + new, max(batches))
    bandwidth = peak_bandwidth(settings)
    # Bytes a decode step must read: every matmul weight (the embedding is looked up, not read).
    weight_bytes = 2 * memory.count_matmul_params(args)
    generator = torch.Generator().manual_seed(0)
    prompts = {
        rows: torch.randint(1, args.vocab_size, (rows, prompt_len), generator=generator).tolist()
        for rows in batches
    }
    graphs = device.type == "cuda"
    rows_out: list[dict[str, Any]] = []
    rates: dict[tuple[str, int], float] = {}

    def measure(name: str, rows: int, seconds_of: Callable[[], float]) -> None:
        row: dict[str, Any] = {"what": name, "rows": rows}
        try:
            seconds = seconds_of()
        except (ImportError, MissingDependency) as err:
            rows_out.append({**row, "status": "SKIPPED", "note": str(err)[:200]})
            return
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: the next peer
            rows_out.append(_error_row(row, err))
            return
        finally:
            _free_memory(device)
        rate = rows * new / seconds
        rates[(name, rows)] = rate
        row.update(seconds=seconds, tokens_per_s=rate, ms_per_step=1e3 * seconds / new)
        if bandwidth is not None:
            row["of_bound"] = rate / (rows * bandwidth / weight_bytes)
        rows_out.append({**row, "status": "INFO"})

    native_name = "native engine, CUDA graphs" if graphs else "native engine (no graphs off CUDA)"
    # One model on the device at a time; each is freed when its function returns.
    _measure_native(args, settings, prompts, new, measure, native_name, graphs)
    _measure_native(
        args,
        settings,
        {max(batches): prompts[max(batches)]},
        new,
        measure,
        "native engine on the transformers backend",
        graphs,
        backend="transformers",
    )
    config = Qwen3Config(**hf_config_from_decoder_args(args, torch.bfloat16))
    _measure_transformers(config, settings, prompts, new, measure)
    if device.type == "cuda":
        _measure_vllm(config, prompts, new, measure)
    for rows in batches:
        ours, theirs = (
            rates.get((native_name, rows)),
            rates.get(("transformers generate, static cache", rows)),
        )
        if ours is not None and theirs is not None:
            rows_out.append(
                {
                    "what": f"native engine / transformers static cache, goal >= {SAMPLING_GOAL:g}",
                    "rows": rows,
                    "ratio": ours / theirs,
                    "status": settings.verdict(ours / theirs >= SAMPLING_GOAL),
                }
            )
    rows_out.append(_greedy_rows_identical(settings))
    bound_text = f"{bandwidth / 1e12:g} TB/s" if bandwidth else "unknown (no --peak-bandwidth)"
    return PartResult(
        columns=[
            ("what", "what", ""),
            ("rows", "rows", "d"),
            ("seconds", "s", ".3f"),
            ("ms_per_step", "ms / token step", ".2f"),
            ("tokens_per_s", "tokens/s", ",.0f"),
            ("of_bound", "of weight-read bound", ".1%"),
            ("ratio", "ratio", ".2f"),
            ("identical", "identical", ""),
        ],
        rows=rows_out,
        notes=[
            f"Model: {args.num_layers} layers of Qwen3-8B's shape (at full size as many as "
            f"fit half the card with the cache; a toy Qwen3 with --tiny), random weights, bf16; "
            f"{prompt_len}-token prompts, every row sampled to {new} new tokens at temperature "
            "1 (no stop token); each figure is the second of two identical calls (the first "
            "compiles, captures and warms up).",
            f"Weight-read bound: rows x bandwidth / bytes of the matmul weights "
            f"({weight_bytes / GIB:.2f} GiB) per token step; bandwidth {bound_text}.",
            "transformers: generate(cache_implementation='static'), which on CUDA compiles the "
            "decode step and replays it as CUDA graphs. vLLM: load_format='dummy' (random "
            "weights), CUDA graphs on, where installed.",
        ],
    )


# ----------------------------------------------------------------------------- peer


def run_peer(settings: Settings) -> PartResult:
    require("torchtune", "trl", "datasets")
    from bench import bench_grpo_vs_trl as bench

    if settings.tiny:
        sizes = ["--model", "tiny", "--prompts", "2", "--group-size", "4"]
        sizes += ["--max-new-tokens", "8", "--repeats", "1"]
    else:
        # Every row runs to 128 tokens (same work on both sides) and six timed steps: with
        # 64 tokens and three steps an H200 step took 0.4 s and the verdict was within noise.
        sizes = ["--model", "qwen3-0.6b-4l", "--prompts", "8", "--group-size", "8"]
        sizes += ["--max-new-tokens", "128", "--no-stop", "--warmup", "2", "--repeats", "6"]
    # The recipe as it ships (each group's prompt once), then with one row per completion.
    variants = ["shared_prefix_forward=true", "shared_prefix_forward=false"]
    argv = [*sizes, "--device", settings.device.type, "--skip-memory"]
    argv += [item for variant in variants for item in ("--variant", variant)]
    args = bench.parse_args(argv)
    result = bench.measure(args)
    sides = result["sides"]
    trl_seconds = sides["trl"]["median_s"]
    rows = []
    for name, side in sides.items():
        label = name if name == "trl" else f"{name}: {side['variant']}"
        rows.append(
            {
                "side": label,
                "step_s": side["median_s"],
                **{phase: side["phases"][phase] for phase in PEER_PHASES},
                "completion_tokens": side["completion_tokens"],
                "ratio": trl_seconds / side["median_s"] if name != "trl" else None,
                # The goal is the recipe's step as it ships (the first variant).
                "status": settings.verdict(trl_seconds / side["median_s"] >= PEER_GOAL)
                if side.get("variant") == variants[0]
                else "INFO",
            }
        )
    setup = result["setup"]
    return PartResult(
        columns=[
            ("side", "side", ""),
            ("step_s", "median s / step", ".3f"),
            *((phase, f"{phase} s", ".3f") for phase in PEER_PHASES),
            ("completion_tokens", "mean completion tokens", ".1f"),
            ("ratio", "TRL / this side", ".2f"),
        ],
        rows=rows,
        notes=[
            f"bench/bench_grpo_vs_trl.py (imported): model {setup['model']} "
            f"({setup['params']:,} parameters), {setup['prompts']} prompts x "
            f"{setup['group_size']} completions, <= {setup['max_new_tokens']} new tokens, "
            f"{args.warmup} warm-up + {args.repeats} timed steps per side, alternating in one "
            "process, fp32 on both sides (the bench fixes it for its random models). Prompt "
            f"token ids identical between the two chat renderers: {setup['same_prompts']}.",
            f"Goal: TRL's median step / composer-tune's (the recipe as it ships, "
            f"{variants[0]}) >= {PEER_GOAL:g}.",
            *(
                f"not equal: {line}"
                for line in [*bench.NOT_EQUAL, *([bench.NO_STOP_NOT_EQUAL] if args.no_stop else [])]
            ),
        ],
    )


# ----------------------------------------------------------------------------- muon

MUON_BYTES_PER_PARAM = 8  # bf16 weights + gradients, then 4 bytes of optimizer state


def muon_layers(settings: Settings) -> int:
    """Qwen3-8B layers whose parameters, gradients and one optimizer's state fit 70 % of the
    card (the rest: Newton-Schulz temporaries, the allocator); all 36 when its size is unknown."""
    from composer_tune.analysis import memory

    def fits(args: Any, capacity: float) -> bool:
        return MUON_BYTES_PER_PARAM * memory.count_params(args) / GIB <= 0.7 * capacity

    return _fitting_qwen3_8b(settings, 4096, fits).num_layers


def _muon_equals_torch(settings: Settings) -> dict[str, Any]:
    """Two steps of composer_tune.optim.Muon and torch.optim.Muon on one matrix (Qwen3-8B's
    MLP shape; toy with --tiny) on the device, from the same weights and gradients."""
    from composer_tune.optim import Muon

    rows, cols = (192, 64) if settings.tiny else (12288, 4096)
    generator = torch.Generator(device=settings.device).manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator, device=settings.device)
    ours = torch.nn.Parameter(weight.clone())
    theirs = torch.nn.Parameter(weight.clone())
    ours_optimizer = Muon(
        [("mlp.w1.weight", ours)], lr=0.02, ns_dtype="bf16", adjust_lr_fn="original"
    )
    theirs_optimizer = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1)
    for _ in range(2):
        grad = torch.randn(rows, cols, generator=generator, device=settings.device)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        ours_optimizer.step()
        theirs_optimizer.step()
    difference = (ours - theirs).abs().max().item()
    moved = (ours - weight).abs().max().item()
    return {
        "optimizer": f"equal to torch.optim.Muon ({rows} x {cols}, 2 steps)",
        "max_abs_diff": difference,
        "status": "PASS" if difference <= 1e-6 and moved > 1e-3 else "FAIL",
    }


def run_muon(settings: Settings) -> PartResult:
    require("torchtune")
    from bench import bench_muon_step as bench

    if settings.tiny:
        sizes = ["--tiny", "--layers", "2", "--vocab", "128", "--repeats", "1"]
    else:
        sizes = ["--layers", str(muon_layers(settings)), "--vocab", "151936"]
        sizes += ["--dtype", "bf16", "--warmup", "2", "--repeats", "5"]
    args = bench.parse_args([*sizes, "--device", settings.device.type])
    result = bench.measure(args)
    setup = result["setup"]
    rows = [
        {"optimizer": "torch.optim.AdamW (fused on CUDA)", "step_s": result["adamw_s"]},
        {
            "optimizer": "composer_tune.optim.Muon",
            "step_s": result["muon_s"],
            "ratio": result["ratio"],
            "ns_tflops": result["ns_tflops"],
        },
    ]
    rows = [{**row, "status": "INFO"} for row in rows]
    rows.append(_muon_equals_torch(settings))
    return PartResult(
        columns=[
            ("optimizer", "optimizer", ""),
            ("step_s", "median s / step", ".4f"),
            ("ratio", "Muon / AdamW", ".2f"),
            ("ns_tflops", "Newton-Schulz TFLOP/s", ".1f"),
            ("max_abs_diff", "max abs diff", ".2e"),
        ],
        rows=rows,
        notes=[
            f"bench/bench_muon_step.py (imported): {setup['shape']} x {setup['layers']} layers, "
            f"vocabulary {setup['vocab']}, {setup['params'] / 1e9:.2f}B parameters "
            f"({setup['muon_params'] / 1e9:.2f}B on Muon), {setup['dtype']} weights, "
            f"Newton-Schulz in {setup['ns_dtype']} ({setup['ns_tflop_per_step']:.1f} TFLOP a "
            f"step); {setup['warmup']} warm-up + {setup['repeats']} timed steps each, AdamW "
            "first. One device: the FSDP2 exchange of whole matrices is not in these figures.",
        ],
    )


# ----------------------------------------------------------------------------- async


def run_async(settings: Settings) -> PartResult:
    require("torchtune")
    from bench import bench_grpo_vs_trl, bench_rl_step

    if settings.tiny:
        model, sizes = "tiny", ["num_prompts_per_generation=2", "group_size=4", "max_new_tokens=8"]
        timing = ["--warmup", "1", "--repeats", "2", "--rounds", "1"]
    else:  # the peer part's Qwen3-0.6B layer shape (a random model rarely stops early)
        model = "qwen3-0.6b-4l"
        sizes = ["num_prompts_per_generation=8", "group_size=8", "max_new_tokens=128"]
        timing = ["--warmup", "2", "--repeats", "6", "--rounds", "2"]
    common = [
        "warm_start=null", f"device={settings.device.type}", "dtype=fp32", "eval_dataset=null",
        "enable_thinking=false", "reward._component_=composer_tune.rewards.FormatReward",
        r"reward.pattern=\d*[13579]$", "micro_batch_size=64", *sizes,
        *(f"model.{k}={v}" for k, v in bench_grpo_vs_trl.RANDOM_MODELS[model].items()),
    ]  # fmt: skip
    variants = [" ".join([*common, f"rollout.max_staleness={k}"]) for k in (0, 1)]
    argv = ["--config", "cpu_smoke", "--threads", str(torch.get_num_threads()), *timing]
    args = bench_rl_step.parse_args([*argv, *(x for v in variants for x in ("--variant", v))])
    with tempfile.TemporaryDirectory() as tmp:
        results = bench_rl_step.measure_loops(args, Path(tmp))
    rows = []
    for staleness, result in enumerate(results):
        rows.append(
            {
                "max_staleness": staleness,
                "step_s": result["step_s"],
                "steps_per_hour": result["steps_per_hour"],
                "speed_up": result["speed_up"],
                "wait_s": result["wait_s"],
                "staleness": result["staleness"],
                "threads": result["threads"],
                "status": settings.verdict(result["speed_up"] > ASYNC_GOAL)
                if staleness
                else "INFO",
            }
        )
    return PartResult(
        columns=[
            ("max_staleness", "rollout.max_staleness", ""),
            ("step_s", "median s / step", ".3f"),
            ("steps_per_hour", "steps / hour", ".0f"),
            ("speed_up", "speed-up over 0", ".2f"),
            ("wait_s", "s a step waited for rollouts", ".3f"),
            ("staleness", "mean row staleness", ".2f"),
            ("threads", "CPU threads", ""),
        ],
        rows=rows,
        notes=[
            f"bench/bench_rl_step.py's loop mode (imported): recipes/grpo.py's train() on "
            f"random {model} ({', '.join(sizes)}), {args.warmup} warm-up + {args.repeats} timed "
            f"steps per block, {args.rounds} rounds, the two settings in turn; at staleness 1 "
            "the rollout worker (its own process, native engine) shares the device with the "
            "trainer and samples the next batch while the current one trains.",
            f"Goal: seconds per step at max_staleness 0 / at 1 > {ASYNC_GOAL:g}.",
        ],
    )


PART_FUNCTIONS: dict[str, Callable[[Settings], PartResult]] = {
    "parity": run_parity,
    "memory": run_memory,
    "speed": run_speed,
    "sampling": run_sampling,
    "peer": run_peer,
    "muon": run_muon,
    "async": run_async,
}


# ----------------------------------------------------------------------------- report


def _git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown (no git checkout)"


@functools.cache
def import_checks() -> dict[str, str]:
    """``ok`` or the import error of each of :data:`IMPORT_CHECKS`."""
    results = {}
    for name in IMPORT_CHECKS:
        try:
            importlib.import_module(name)
            results[name] = "ok"
        except Exception as err:  # noqa: BLE001 - any failure is the finding
            results[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return results


def environment(settings: Settings, commit: str | None) -> dict[str, Any]:
    """Where and when a part ran: device, versions, date, commit."""
    if settings.device.type == "cuda":
        props = torch.cuda.get_device_properties(settings.device)
        device = f"{props.name} ({props.total_memory / GIB:.1f} GiB)"
    else:
        device = (
            f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or _git_commit(),
        "tiny": settings.tiny,
        "packages": versions,
        "imports": import_checks(),
    }


def run_part(name: str, settings: Settings, commit: str | None) -> dict[str, Any]:
    """Run one part; never raises: a skip or an error becomes the section's status."""
    print(f"[gpu_check] {name} ...", flush=True)
    section: dict[str, Any] = {"environment": environment(settings, commit)}
    start = time.perf_counter()
    try:
        result = PART_FUNCTIONS[name](settings)
    except (MissingDependency, ImportError) as err:
        section.update(status="SKIPPED", reason=str(err))
    except Exception as err:  # noqa: BLE001 - the other parts still run
        section.update(
            status="ERROR", reason=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()
        )
    else:
        statuses = {row["status"] for row in result.rows}
        status = next((s for s in STATUS_ORDER if s in statuses), "SKIPPED")
        section.update(
            status="FAIL" if status == "ERROR" else status,
            columns=[list(column) for column in result.columns],
            rows=result.rows,
            notes=result.notes,
        )
    section["seconds"] = time.perf_counter() - start
    if section["seconds"] > PART_SECONDS_WARN:
        section.setdefault("notes", []).append(
            f"took {section['seconds']:.0f} s: over the {PART_SECONDS_WARN} s budget per part"
        )
    print(
        f"[gpu_check] {name}: {section['status']} in {section['seconds']:.1f} s"
        + (f" ({section['reason']})" if "reason" in section else ""),
        flush=True,
    )
    return section


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, spec) if spec else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def render_markdown(report: dict[str, Any]) -> str:
    """The Markdown report, generated from the JSON report alone."""
    parts = report["parts"]
    latest = max(parts.values(), key=lambda s: s["environment"]["date"], default=None)
    lines = ["# composer-tune GPU check", ""]
    lines.append("Written by `python tools/gpu_check.py`; see docs/gpu/README.md.")
    lines.append("")
    if latest is not None:
        env = latest["environment"]
        lines += ["| | |", "| --- | --- |"]
        for key in ("device", "torch", "cuda", "python", "date", "commit"):
            lines.append(f"| {key} | {env[key]} |")
        packages = ", ".join(f"{k} {v}" for k, v in env["packages"].items())
        lines.append(f"| packages | {packages} |")
        imports = ", ".join(f"{k}: {v}" for k, v in env["imports"].items())
        lines.append(f"| imports | {_cell(imports, '')} |")
        if env["tiny"]:
            lines.append("| sizes | **--tiny** (a dry run: toy sizes, goals not judged) |")
        lines.append("")
    lines += ["## Summary", "", "| part | status | seconds | ran on | reason |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for name in PARTS:
        section = parts.get(name)
        if section is None:
            lines.append(f"| {name} | not run yet | | | |")
            continue
        env = section["environment"]
        ran_on = f"{env['device']}, torch {env['torch']}, {env['commit']}, {env['date']}"
        reason = _cell(section.get("reason", ""), "")
        lines.append(
            f"| {name} | {section['status']} | {section['seconds']:.1f} | {ran_on} | {reason} |"
        )
    for name in PARTS:
        section = parts.get(name)
        if section is None:
            continue
        lines += ["", f"## {name}", "", f"Status: **{section['status']}**"]
        if "reason" in section:
            lines += ["", f"Reason: {section['reason']}"]
        if section.get("rows"):
            columns = [c for c in section["columns"] if any(c[0] in r for r in section["rows"])]
            lines += ["", "| " + " | ".join(c[1] for c in columns) + " | status | note |"]
            lines.append("| " + " | ".join("---" for _ in range(len(columns) + 2)) + " |")
            for row in section["rows"]:
                cells = [_cell(row.get(key), spec) for key, _, spec in columns]
                cells += [row["status"], _cell(row.get("note", ""), "")]
                lines.append("| " + " | ".join(cells) + " |")
        for note in section.get("notes", []):
            lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    staging.replace(path)


def update_report(out_dir: Path, sections: dict[str, dict[str, Any]], fresh: bool) -> Path:
    """Merge ``sections`` into ``out_dir/report.json`` and regenerate ``report.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    report: dict[str, Any] = {"parts": {}}
    if json_path.is_file() and not fresh:
        report = json.loads(json_path.read_text())
    report["parts"].update(sections)
    _write(json_path, json.dumps(report, indent=1) + "\n")
    _write(out_dir / "report.md", render_markdown(report))
    return out_dir / "report.md"


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Run one part per command on the GPU machine (10-minute limit): docs/gpu/README.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--part", nargs="+", choices=[*PARTS, "all"], default=["all"], help="parts to run"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (the dry run)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where the report goes (default: docs/gpu on CUDA at full size; a new temporary "
        "folder for a dry run, --device cpu or --tiny, so the committed report changes only "
        "on purpose)",
    )
    parser.add_argument("--fresh", action="store_true", help="start a new report, drop old parts")
    parser.add_argument("--smollm2-dir", type=Path, help="SmolLM2-135M HF checkpoint directory")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak for MFU")
    parser.add_argument(
        "--peak-bandwidth", type=float, help="memory bandwidth in TB/s for the sampling bound"
    )
    parser.add_argument(
        "--commit", help="commit to record (default: git describe; the GPU copy has no .git)"
    )
    parser.add_argument(
        "--compile-backend",
        help="torch.compile backend (sets TORCH_COMPILE_BACKEND; default inductor, with "
        "--tiny eager: graph capture only, as inductor's compiling takes minutes on 2 CPU cores)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but torch sees no CUDA device (torch "
            f"{torch.__version__}); the dry run is --device cpu --tiny",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too
    backend = ns.compile_backend or ("eager" if ns.tiny else None)
    if backend:
        os.environ["TORCH_COMPILE_BACKEND"] = backend
    settings = Settings(
        device=torch.device(ns.device),
        tiny=ns.tiny,
        smollm2_dir=ns.smollm2_dir,
        peak_tflops=ns.peak_tflops,
        peak_bandwidth_tbs=ns.peak_bandwidth,
    )
    out_dir = ns.out_dir
    if out_dir is None:
        judged = settings.device.type == "cuda" and not settings.tiny
        out_dir = DEFAULT_OUT_DIR if judged else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    names = PARTS if "all" in ns.part else tuple(p for p in PARTS if p in ns.part)
    sections: dict[str, dict[str, Any]] = {}
    for name in names:  # written after each part, so a command killed at its limit keeps them
        sections[name] = run_part(name, settings, ns.commit)
        path = update_report(out_dir, {name: sections[name]}, ns.fresh and len(sections) == 1)
    print(f"[gpu_check] report: {path} (and report.json beside it)")
    failed = [name for name, s in sections.items() if s["status"] in ("FAIL", "ERROR")]
    if failed:
        print(f"[gpu_check] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
