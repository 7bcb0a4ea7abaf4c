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

The parts live in ``composer_tune/gpu_check/`` (one module each, ``common`` and ``report``); this
file is the command.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
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

from composer_tune.gpu_check.common import PARTS, Settings  # noqa: E402
from composer_tune.gpu_check.report import run_part, update_report  # noqa: E402

DEFAULT_OUT_DIR = REPO_ROOT / "docs" / "gpu"  # the committed report (CUDA, full sizes)


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
