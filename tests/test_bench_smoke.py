"""The benchmark scripts run end to end at toy sizes and print their tables.

Timings at these sizes mean nothing; what is checked is that each script still drives both
frameworks through the same work (TRL's GRPOTrainer and recipes/grpo.py, transformers' and our
generate) and reports every column the README's tables are copied from.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_grpo_vs_trl_prints_both_frameworks_with_memory() -> None:
    # TRL is a peer for benchmarks only, installed by the `bench` extra, not by `dev`.
    pytest.importorskip("trl")
    out = _run(
        "bench_grpo_vs_trl.py",
        *("--prompts", "1", "--group-size", "2", "--max-new-tokens", "4"),
        *("--warmup", "0", "--repeats", "1"),
    )
    assert "prompt token ids identical (our renderer vs TRL's chat template): True" in out
    assert re.search(r"framework\s+median s/step\s+min s/step\s+peak mem MiB", out)
    rows = {
        match.group(1): [float(value) for value in match.group(2, 3, 4)]
        for match in re.finditer(r"^(composer-tune|trl)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", out, re.M)
    }
    assert set(rows) == {"composer-tune", "trl"}, out
    for median, fastest, peak in rows.values():
        assert median >= fastest > 0 and peak > 0
    assert re.search(r"speed-up \(trl median / composer-tune median\): [\d.]+x", out)
    assert "not equal:" in out


def test_generation_bench_prints_its_table() -> None:
    out = _run(
        "bench_generation.py",
        *("--batch-sizes", "2", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1"),
    )
    header = r"mode\s+batch\s+ours tok/s\s+HF tok/s\s+vLLM tok/s\s+HF/ours\s+vLLM/ours"
    assert re.search(header + r"\s+rows equal \(HF, vLLM\)", out), out
    # vLLM is installed by the README's set-up: its column is filled and it decodes greedily
    # exactly as ours does.
    assert "vllm=yes" in out
    assert re.search(r"^greedy\s+2\s+\d+\s+\d+\s+\d+\s+[\d.]+x\s+[\d.]+x\s+2/2, 2/2$", out, re.M), (
        out
    )
    assert re.search(r"^sample\s+2\s+\d+\s+\d+\s+\d+\s+[\d.]+x\s+[\d.]+x\s+-$", out, re.M), out


def test_rl_step_bench_prints_phases_per_variant() -> None:
    small = "warm_start=null num_prompts_per_generation=2 group_size=2 max_new_tokens=4"
    out = _run(
        "bench_rl_step.py",
        *("--config", "cpu_smoke", "--warmup", "0", "--repeats", "1"),
        *("--variant", small, "--variant", f"{small} autocast=bf16"),
    )
    assert re.search(r"variant\s+generation\s+reward\s+old log-prob pass\s+train forward", out)
    rows = re.findall(r"^(warm_start=null.*?)\s+((?:[\d.]+s\s+){6})([\d.]+)x$", out, re.M)
    assert [name.endswith("autocast=bf16") for name, _, _ in rows] == [False, True], out
    for _, seconds, _ in rows:
        generation, _, old_logp, forward, rest, total = (
            float(s.rstrip("s")) for s in seconds.split()
        )
        assert generation > 0 and forward > 0 and rest > 0 and old_logp == 0
        assert total >= generation + forward
    assert float(rows[0][2]) == 1.0


@pytest.mark.slow
def test_rl_step_bench_times_asynchronous_variants_in_blocks() -> None:
    small = "warm_start=null num_prompts_per_generation=2 group_size=2 max_new_tokens=4"
    out = _run(
        "bench_rl_step.py",
        *("--config", "cpu_smoke", "--warmup", "1", "--repeats", "2", "--rounds", "1"),
        *("--variant", f"{small} rollout.max_staleness=0"),
        *("--variant", f"{small} rollout.max_staleness=1"),
    )
    assert "loop mode: 1 rounds of 1 warm-up + 2 timed steps" in out, out
    rows = re.findall(
        r"^warm_start=null.*?max_staleness=(\d)\s+(trainer 1.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+"
        r"([\d.]+)x\s+(\S+)\s+([\d.]+)$",
        out,
        re.M,
    )
    assert [(row[0], row[1]) for row in rows] == [
        ("0", "trainer 1 (samples too)"),
        ("1", "trainer 1 + worker 1"),
    ], out
    (_, _, step_0, per_hour_0, speed_up_0, wait_0, stale_0), stale_row = rows
    # s/step is printed to 0.01 s, steps/hour from the unrounded time: equal within that rounding.
    assert float(step_0) > 0
    assert 3600 / (float(step_0) + 0.005) <= float(per_hour_0) <= 3600 / (float(step_0) - 0.005)
    assert float(speed_up_0) == 1.0 and wait_0 == "-" and float(stale_0) == 0
    # After the warm-up step every batch of the worker is exactly one step old.
    assert float(stale_row[6]) == 1.0 and float(stale_row[5]) >= 0


@pytest.mark.slow
def test_checkpoint_save_bench_prints_size_and_time() -> None:
    out = _run("bench_checkpoint_save.py", "--recipe", "grpo", "--config", "cpu_smoke")
    match = re.search(r"([\d.]+)M parameters, (\d+) MB per checkpoint, ([\d.]+)-([\d.]+) s", out)
    assert match, out
    assert float(match.group(1)) > 0 and int(match.group(2)) > 0
    assert 0 < float(match.group(3)) <= float(match.group(4))


def test_cpu_attention_bench_times_both_dtypes_for_every_pass_and_mask() -> None:
    out = _run("bench_cpu_attention.py", "--shape", "2", "2", "16", "16", "--repeats", "2")
    rows = re.findall(
        r"^\| (forward[^|]*) \| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M
    )
    assert [(name, mask) for name, mask, *_ in rows] == [
        ("forward, no grad", "causal"),
        ("forward, no grad", "boolean"),
        ("forward + backward", "causal"),
        ("forward + backward", "boolean"),
    ], out
    assert all(float(ratio) > 0 for *_, ratio in rows)


def test_muon_step_bench_times_both_optimizers() -> None:
    out = _run("bench_muon_step.py", "--tiny", "--layers", "2", "--vocab", "128", "--repeats", "1")
    adamw = re.search(r"^\| torch\.optim\.AdamW \| ([\d.]+) \|", out, re.M)
    muon = re.search(
        r"^\| composer_tune\.optim\.Muon \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+) \|", out, re.M
    )
    assert adamw and muon, out
    assert float(muon.group(2)) == pytest.approx(
        float(muon.group(1)) / float(adamw.group(1)), rel=0.02
    )
    assert "0.1M parameters (0.1M on Muon)" in out


def test_grpo_sweep_table_and_plot_cover_every_point(tmp_path: Path) -> None:
    from bench import bench_grpo_vs_trl as bench

    def point(tokens: int, group: int, trl_s: float, ours_s: float, **setup) -> dict:
        sides = {
            "trl": {"median_s": trl_s, "min_s": trl_s - 1, "peak_mib": 9000.0},
            "composer-tune": {"variant": "", "median_s": ours_s, "min_s": ours_s, "peak_mib": None},
        }
        base = {"model": "smollm2", "precision": "bf16", "prompts": 2, "device": "cpu"}
        return {
            "setup": {**base, "threads": 1, "max_new_tokens": tokens, "group_size": group, **setup},
            "sides": sides,
        }

    points = [point(24, 8, 60.0, 15.0), point(256, 8, 95.0, 40.0), point(24, 4, 20.0, 8.0)]
    points.append(point(120, 4, 30.0, 12.0, episodes=True))
    table = bench.sweep_table(points)
    rows = table.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| 24 tokens, group 8",
        "| 256 tokens, group 8",
        "| 24 tokens, group 4",
        "| episodes, group 4",
    ]
    assert rows[1].endswith("| 95.0 (94.0) | 9,000 | 40.0 (40.0) | - | **2.38x** |")
    bench.plot_sweep(points, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
