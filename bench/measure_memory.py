"""Measured peak memory of a Qwen3 training step vs ``composer_tune.analysis.memory``'s estimate.

Each configuration runs in a fresh process (two under ``torch.distributed.run`` for FSDP2):
build a random Qwen3, take one warm-up step (it creates the AdamW states), then measure a
second step -- forward with the chunked log-prob head, backward, gradient clipping, AdamW step --
and compare with the estimate for the same shape and settings.

How the peak is measured:
- CUDA: ``torch.cuda.max_memory_allocated`` over each phase (absolute: everything allocated).
- CPU: torch's CPU allocator is invisible to tracemalloc, so the step runs under
  ``torch.profiler`` with ``profile_memory=True``, whose memory events carry the running total
  of bytes allocated since profiling began; the peak of that total, plus the bytes alive before
  the step (parameters, buffers, optimizer states, inputs: counted tensor by tensor), is the
  CPU analogue of ``max_memory_allocated``. As a cross-check it also prints the growth of the
  resident set over the step (peak RSS reset through /proc/self/clear_refs, glibc made to
  return large blocks at once), which tracks the same quantity plus allocator noise.

    # CPU suite: fp32/bf16 x AC off/on x 1/2 ranks, plus a generate() rollout (~10 min, 2 cores)
    python bench/measure_memory.py
    python bench/measure_memory.py --nproc 1 --dtype fp32 --ac off      # one configuration
    # One 80 GB GPU: Qwen3-1.7B trains unsharded there (--nproc 8 on a node for FSDP2):
    python bench/measure_memory.py --device cuda --model qwen3_1_7b --nproc 1 --dtype bf16 \\
        --ac on --batch-size 4 --seq-len 4096 --chunk-size 1024 --peak-tflops 989

On CUDA it also prints the step time and MFU = 6 N tokens / time / peak FLOP/s (N: parameters
that take part in a matmul, see ``composer_tune.analysis.memory.count_matmul_params``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/measure_memory.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from composer_tune.analysis import memory  # noqa: E402
from composer_tune.models import DecoderArgs  # noqa: E402
from composer_tune.models.decoder import attention_in_fp32  # noqa: E402
from composer_tune.rollout.generation import DEFAULT_PREFILL_CHUNK  # noqa: E402

MIB = 2**20
# Default CPU shape: ~20M parameters, 2048 tokens: a few hundred MiB per configuration, so
# allocator and interpreter noise is small next to what is measured.
TINY_SHAPE = {
    "vocab_size": 8192,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "embed_dim": 512,
    "intermediate_dim": 1536,
    "head_dim": 64,
}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FB_PHASE, OPT_PHASE, ROLLOUT_PHASE = "forward+backward", "optimizer step", "rollout"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (shape from --tiny-* flags) or a composer_tune.models preset, e.g. qwen3_1_7b",
    )
    for key, value in TINY_SHAPE.items():
        parser.add_argument(f"--tiny-{key.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=1024, help="logprob_chunk_size")
    parser.add_argument(
        "--dtype", nargs="+", choices=sorted(TORCH_DTYPES), default=["fp32", "bf16"]
    )
    parser.add_argument("--ac", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--nproc", nargs="+", type=int, default=[1, 2], help="FSDP2 ranks")
    parser.add_argument(
        "--rollout-batch-size",
        type=int,
        default=16,
        help="also measure generate() on this many rows per rank (0: skip)",
    )
    parser.add_argument("--prompt-len", type=int, default=256, help="rollout prompt tokens")
    parser.add_argument("--completion-len", type=int, default=32, help="rollout new tokens")
    parser.add_argument("--peak-tflops", type=float, help="device peak (dense bf16) for MFU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: result file
    parser.add_argument("--worker-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--worker-ac", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_args(args: argparse.Namespace) -> DecoderArgs:
    """The shape under test: the tiny one from flags or a preset; ``max_seq_len`` covers the
    training sequence and the rollout (it only sizes the RoPE table)."""
    from composer_tune import models

    max_seq_len = max(args.seq_len, args.prompt_len + args.completion_len)
    if args.model == "tiny":
        shape = {key: getattr(args, f"tiny_{key}") for key in TINY_SHAPE}
        return DecoderArgs(**shape, max_seq_len=max_seq_len, tie_word_embeddings=False)
    builder = getattr(models, args.model, None)
    if builder is None or not args.model.startswith("qwen3_"):
        raise SystemExit(f"--model {args.model}: not a composer_tune.models Qwen3 preset")
    with torch.device("meta"):
        return builder(max_seq_len=max_seq_len).config


def plan_for(args: argparse.Namespace, dtype: str, ac: bool, world_size: int) -> memory.MemoryPlan:
    """The estimator's description of exactly what the worker runs."""
    return memory.MemoryPlan(
        world_size=world_size,
        micro_batch_size=args.batch_size,
        seq_len=args.seq_len,
        param_dtype=dtype,
        activation_checkpointing=ac,
        logprob_chunk_size=args.chunk_size,
        optimizer_impl="foreach" if args.device == "cuda" else "for-loop",  # AdamW's default
        rollout_batch_size=args.rollout_batch_size,
        prompt_len=args.prompt_len,
        completion_len=args.completion_len,
        prefill_chunk=DEFAULT_PREFILL_CHUNK,
        fp32_attention=attention_in_fp32(args.device, memory.torch_dtype(dtype)),
    )


# ----------------------------------------------------------------------------- worker


def _rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _live_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *extra) -> int:
    """Bytes of the distinct storages of parameters, buffers, optimizer states and ``extra``."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}

    def visit(tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for tensor in itertools.chain(model.parameters(), model.buffers(), extra):
        visit(tensor)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                visit(value)
    return sum(storages.values())


def _profiled_peaks(trace_path: Path) -> dict[str, int]:
    """Peak of the profiler's running CPU "Total Allocated" inside each phase's range."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    ranges = {
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name") in (FB_PHASE, OPT_PHASE, ROLLOUT_PHASE) and e.get("ph") == "X"
    }
    peaks = dict.fromkeys(ranges, 0)
    for e in events:
        if e.get("name") != "[memory]" or e["args"].get("Device Type") != 0:
            continue
        for name, (start, end) in ranges.items():
            if start <= e["ts"] <= end:
                peaks[name] = max(peaks[name], e["args"]["Total Allocated"])
    return peaks


def measure_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    forward_backward: Callable[[], None],
    optimizer_step: Callable[[], None],
    inputs: list[torch.Tensor],
) -> dict:
    """Peak bytes allocated during ``forward_backward()`` and during ``optimizer_step()``.

    Call it after a warm-up step, with gradients set to None, so that what is alive before the
    step is parameters, buffers, optimizer states and ``inputs``. Returns ``before_step`` (bytes
    alive before), ``peaks`` (absolute peak per phase), and ``step_seconds`` on CUDA or
    ``rss_growth`` on CPU (when /proc/self/clear_refs is writable).
    """
    device = next(model.parameters()).device
    result: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        result["before_step"] = torch.cuda.memory_allocated()
        peaks, seconds = {}, 0.0
        for name, phase in ((FB_PHASE, forward_backward), (OPT_PHASE, optimizer_step)):
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            phase()
            torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            peaks[name] = torch.cuda.max_memory_allocated()
        result["step_seconds"] = seconds
    else:
        result["before_step"] = _live_bytes(model, optimizer, *inputs)
        rss_before = _rss_bytes("VmRSS")
        rss_reset = _reset_peak_rss()
        with tempfile.TemporaryDirectory() as tmp:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with record_function(FB_PHASE):
                    forward_backward()
                with record_function(OPT_PHASE):
                    optimizer_step()
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            extra = _profiled_peaks(trace)
        peaks = {name: result["before_step"] + extra.get(name, 0) for name in (FB_PHASE, OPT_PHASE)}
        if rss_reset:
            result["rss_growth"] = _rss_bytes("VmHWM") - rss_before
    result["peaks"] = peaks
    return result


def measure_rollout(step: TrainingStep, rows: int, prompt_len: int, completion_len: int) -> dict:
    """Peak bytes allocated while ``generate`` samples ``completion_len`` tokens for ``rows``
    random prompts of ``prompt_len`` tokens (no stop tokens: every row runs to the cap), after
    the training step, as in an RL loop. Returns ``before`` and ``peak`` (absolute bytes)."""
    from composer_tune.rollout.generation import generate

    device = step.inputs[0].device
    vocab = step.model.tok_embeddings.num_embeddings
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (rows, prompt_len), generator=generator).tolist()
    sampler = torch.Generator(device=device).manual_seed(2)
    sync_ranks = torch.distributed.is_available() and torch.distributed.is_initialized()

    def rollout() -> None:
        generate(
            step.model,
            prompts,
            max_new_tokens=completion_len,
            pad_id=0,
            generator=sampler,
            sync_ranks=sync_ranks,
        )

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        rollout()
        torch.cuda.synchronize()
        return {"before": before, "peak": torch.cuda.max_memory_allocated()}
    before = _live_bytes(step.model, step.optimizer, *step.inputs)
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function(ROLLOUT_PHASE):
                rollout()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        extra = _profiled_peaks(trace).get(ROLLOUT_PHASE, 0)
    return {"before": before, "peak": before + extra}


@dataclass
class TrainingStep:
    """A warmed-up training step of a random Qwen3: call ``forward_backward`` then
    ``optimizer_step`` (what ``measure_step`` takes)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: list[torch.Tensor]
    forward_backward: Callable[[], None]
    optimizer_step: Callable[[], None]


def prepare_step(
    shape: DecoderArgs,
    *,
    dtype: torch.dtype,
    activation_checkpointing: bool,
    batch_size: int,
    seq_len: int,
    chunk_size: int,
    device: torch.device,
    sharded: bool = False,
    data_seed: int = 0,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
) -> TrainingStep:
    """Build the model (FSDP2-sharded when ``sharded``), the optimizer (``make_optimizer``;
    default AdamW) and a random batch the way the recipes do, and take one warm-up step so the
    optimizer states exist."""
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    from composer_tune.distributed import shard_decoder
    from composer_tune.losses import logprob_head
    from composer_tune.models import decoder_from_args

    torch.manual_seed(0)
    with training.set_default_dtype(dtype), device:
        model = decoder_from_args(shape)
    if activation_checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={TransformerSelfAttentionLayer}
        )
    if sharded:
        shard_decoder(model)
    if make_optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        optimizer = make_optimizer(model)
    generator = torch.Generator().manual_seed(data_seed)
    tokens = torch.randint(0, shape.vocab_size, (batch_size, seq_len), generator=generator)
    tokens = tokens.to(device)
    targets = torch.roll(tokens, -1, dims=1)

    def forward_backward() -> None:
        logprobs = model(tokens, head_fn=logprob_head(targets, chunk_size=chunk_size))
        (-logprobs.mean()).backward()

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward_backward()  # warm-up step: the optimizer's states exist from here on
    optimizer_step()
    return TrainingStep(model, optimizer, [tokens, targets], forward_backward, optimizer_step)


def run_worker(args: argparse.Namespace) -> None:
    """Measure one configuration's training step; rank 0 writes the result JSON."""
    from composer_tune.distributed import setup_distributed

    dist_info = setup_distributed(args.device)
    step = prepare_step(
        model_args(args),
        dtype=TORCH_DTYPES[args.worker_dtype],
        activation_checkpointing=args.worker_ac == "on",
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        chunk_size=args.chunk_size,
        device=dist_info.device,
        sharded=dist_info.is_distributed,
        data_seed=dist_info.rank,
    )
    result = measure_step(
        step.model, step.optimizer, step.forward_backward, step.optimizer_step, step.inputs
    )
    if args.rollout_batch_size:
        rollout = measure_rollout(
            step, args.rollout_batch_size, args.prompt_len, args.completion_len
        )
        result["peaks"][ROLLOUT_PHASE] = rollout["peak"]
    if dist_info.is_distributed:  # report the worst rank
        import torch.distributed as dist

        names = sorted(result["peaks"])
        values = torch.tensor(
            [result["peaks"][n] for n in names], dtype=torch.float64, device=dist_info.device
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        result["peaks"] = dict(zip(names, map(int, values.tolist()), strict=True))
        dist.destroy_process_group()
    if dist_info.is_main:
        args.worker.write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(args: argparse.Namespace, dtype: str, ac: bool, nproc: int) -> dict:
    """Run one configuration in fresh process(es) and return the worker's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        script = [str(Path(__file__).resolve())]
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]
            launcher += [str(nproc), "--master_addr", "127.0.0.1"]
            launcher += ["--master_port", str(_free_port())]
        else:
            launcher = [sys.executable]
        command = [*launcher, *script, *_forwarded_flags(args)]
        command += [
            "--worker",
            str(out),
            "--worker-dtype",
            dtype,
            "--worker-ac",
            "on" if ac else "off",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            # glibc: serve and return every block >= 64 KiB with mmap, so RSS follows frees.
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "MALLOC_TRIM_THRESHOLD_": "65536",
        }
        # One thread per process: on a shared or small machine, OpenMP spinning across
        # oversubscribed cores slows a step down by 10-40x (and memory does not depend on it).
        env.setdefault("OMP_NUM_THREADS", "1")
        subprocess.run(command, check=True, env=env)
        return json.loads(out.read_text())


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--model", args.model]
    flags += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    flags += ["--chunk-size", str(args.chunk_size)]
    flags += ["--rollout-batch-size", str(args.rollout_batch_size)]
    flags += ["--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)]
    for key in TINY_SHAPE:
        flags += [f"--tiny-{key.replace('_', '-')}", str(getattr(args, f"tiny_{key}"))]
    return flags


def compare(estimate: memory.MemoryEstimate, measured: dict) -> dict[str, float]:
    """Estimated vs measured peaks (bytes) per phase and overall, with relative errors."""
    fb_phases = (memory.FORWARD, *memory.BACKWARD_PHASES)
    est_fb = max(estimate.phase_bytes(p) for p in fb_phases)
    est_opt = estimate.phase_bytes(memory.OPTIMIZER_STEP)
    got_fb, got_opt = measured["peaks"][FB_PHASE], measured["peaks"][OPT_PHASE]
    est_peak, got_peak = max(est_fb, est_opt), max(got_fb, got_opt)
    # The step's growth over what was alive before it: the part that is not just a param count.
    before = measured["before_step"]
    rollout = {}
    if ROLLOUT_PHASE in measured["peaks"]:
        est_roll = estimate.phase_bytes(memory.ROLLOUT)
        got_roll = measured["peaks"][ROLLOUT_PHASE]
        rollout = {
            "est_rollout": est_roll,
            "got_rollout": got_roll,
            "rollout_error": est_roll / got_roll - 1,
            "rollout_growth_error": (est_roll - before) / max(got_roll - before, 1) - 1,
        }
    return {
        **rollout,
        "est_fb": est_fb,
        "got_fb": got_fb,
        "est_opt": est_opt,
        "got_opt": got_opt,
        "est_peak": est_peak,
        "got_peak": got_peak,
        "peak_error": est_peak / got_peak - 1,
        "growth_error": (est_peak - before) / max(got_peak - before, 1) - 1,
    }


def main() -> int:
    args = parse_args()
    if args.worker is not None:
        run_worker(args)
        return 0
    shape = model_args(args)
    print(
        f"device {args.device}, torch {torch.__version__}; model {args.model}: "
        f"{memory.count_params(shape) / 1e6:.1f}M params, {shape}"
    )
    print(f"batch {args.batch_size} x seq {args.seq_len} per rank, logprob chunk {args.chunk_size}")
    if args.rollout_batch_size:
        print(
            f"rollout: {args.rollout_batch_size} rows x ({args.prompt_len} prompt + "
            f"{args.completion_len} new tokens) per rank, after the step"
        )
    header = (
        f"{'ranks':>5} {'dtype':>5} {'AC':>3} | {'fwd+bwd est':>11} {'meas':>9} | "
        f"{'opt est':>9} {'meas':>9} | {'peak err':>8} {'growth err':>10}"
    )
    if args.rollout_batch_size:
        header += f" | {'rollout est':>11} {'meas':>7} {'err':>6}"
    if args.device == "cpu":
        header += f" | {'RSS growth':>10}"
    if args.device == "cuda":
        header += f" | {'step s':>7} {'MFU':>6}"
    print(f"(MiB per rank)\n{header}\n{'-' * len(header)}")
    rows = []
    for nproc, dtype, ac in itertools.product(args.nproc, args.dtype, args.ac):
        plan = plan_for(args, dtype, ac == "on", nproc)
        estimate = memory.estimate_memory(shape, plan)
        measured = measure(args, dtype, ac == "on", nproc)
        row = compare(estimate, measured)
        row.update(nproc=nproc, dtype=dtype, ac=ac, before_step=measured["before_step"])
        line = (
            f"{nproc:>5} {dtype:>5} {ac:>3} | {row['est_fb'] / MIB:>11.1f} "
            f"{row['got_fb'] / MIB:>9.1f} | {row['est_opt'] / MIB:>9.1f} "
            f"{row['got_opt'] / MIB:>9.1f} | {row['peak_error']:>+8.1%} "
            f"{row['growth_error']:>+10.1%}"
        )
        if "est_rollout" in row:
            line += (
                f" | {row['est_rollout'] / MIB:>11.1f} {row['got_rollout'] / MIB:>7.1f} "
                f"{row['rollout_error']:>+6.1%}"
            )
        if "rss_growth" in measured:
            row["rss_growth"] = measured["rss_growth"]
            line += f" | {measured['rss_growth'] / MIB:>10.1f}"
        if "step_seconds" in measured:
            tokens = args.batch_size * args.seq_len * nproc
            flops = 6 * memory.count_matmul_params(shape) * tokens
            row["step_seconds"] = measured["step_seconds"]
            mfu_text = "n/a"
            if args.peak_tflops:
                mfu = flops / measured["step_seconds"] / (args.peak_tflops * 1e12 * nproc)
                mfu_text = f"{mfu:.1%}"
            line += f" | {measured['step_seconds']:>7.3f} {mfu_text:>6}"
        print(line, flush=True)
        rows.append(row)
    worst = max(abs(r["peak_error"]) for r in rows)
    print(f"largest |peak error|: {worst:.1%}; growth error = error on (peak - memory before step)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
