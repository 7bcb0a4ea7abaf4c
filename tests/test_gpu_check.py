"""tools/gpu_check.py and tools/fetch_gpu_wheels.py, without a GPU.

The CPU dry run (``--device cpu --tiny``) must produce every section of the report with
numbers; a part that fails (a deliberately broken decoder) must read FAIL and make the exit
status non-zero, while the other parts' sections are kept; a part that raises is an ERROR and
the next part still runs; a missing package is a skip that names it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from composer_tune.gpu_check import parity
from composer_tune.gpu_check.common import PartResult, Settings
from composer_tune.gpu_check.muon import muon_layers
from composer_tune.gpu_check.report import PART_FUNCTIONS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.py"
PARTS = ("parity", "memory", "speed", "sampling", "peer", "muon", "async")


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return out, done


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # main() sets these for the process: restore them after the in-process runs.
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return _load(SCRIPT)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_dry_run_reports_every_part_with_numbers(dry_run) -> None:
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    parts = _report(out)["parts"]
    assert set(parts) == set(PARTS)
    for section in parts.values():
        env = section["environment"]
        assert env["device"].startswith("CPU") and env["torch"] == torch.__version__
        assert env["date"] and env["commit"] and env["tiny"] is True
        assert env["imports"]["composer_tune.models"] == "ok"
        assert 0 < section["seconds"] < 300

    parity = parts["parity"]
    assert parity["status"] == "PASS"
    cases = [row for row in parity["rows"] if not row["case"].startswith("SmolLM2")]
    # tied/untied x (4 native families x both backends + 3 on the transformers backend only)
    assert len(cases) == 22
    assert sum(row["backend"] == "native" for row in cases) == 8
    for row in cases:
        # bf16 is inexact, and ours is as exact as transformers' own bf16 model.
        assert 0 < row["ours_vs_fp32"] <= row["tolerance"], row
        assert row["status"] == "PASS"
    smollm2 = parity["rows"][-1]
    assert smollm2["status"] == "SKIPPED" and "--smollm2-dir" in smollm2["note"]

    memory = parts["memory"]
    assert memory["status"] == "INFO"  # goals are judged on CUDA at full size only
    assert {row["ac"] for row in memory["rows"]} == {"on", "off"}
    for row in memory["rows"]:
        for key in ("est_rollout", "got_rollout", "est_fb", "got_fb", "est_opt", "got_opt"):
            assert row[key] > 0, (key, row)
        assert 0.5 < row["peak_ratio"] < 2.0, row

    speed = parts["speed"]
    assert speed["status"] == "INFO"
    rates = {(row["what"], row["backend"]): row.get("tokens_per_s", 0) for row in speed["rows"]}
    # Native: AC off/on x eager/compiled; transformers: AC off, eager/compiled.
    assert len(rates) == 6, rates
    assert all(rate > 0 for rate in rates.values()), rates

    sampling = parts["sampling"]
    assert sampling["status"] == "INFO"
    rates = {(row["what"], row["rows"]): row.get("tokens_per_s") for row in sampling["rows"]}
    # Off CUDA: the native engine at 2 and 8 rows (and on the transformers backend at 8), and
    # transformers' static-cache generate; their ratio; the graphs' greedy check needs a GPU.
    for key in [
        ("transformers generate, static cache", 2),
        ("native engine on the transformers backend", 8),
    ]:
        assert rates[key] > 0, rates
    ratios = [row["ratio"] for row in sampling["rows"] if "ratio" in row]
    assert len(ratios) == 2 and all(ratio > 0 for ratio in ratios)
    greedy = sampling["rows"][-1]
    assert greedy["status"] == "SKIPPED" and "GPU" in greedy["note"]

    peer = parts["peer"]
    if importlib.util.find_spec("trl") is None:
        assert peer["status"] == "SKIPPED" and "trl" in peer["reason"]
    else:
        assert peer["status"] == "INFO"
        ratios = [row["ratio"] for row in peer["rows"] if row.get("ratio") is not None]
        assert len(ratios) == 2 and all(ratio > 0 for ratio in ratios)

    muon = parts["muon"]
    assert muon["status"] == "PASS"  # the equality row is judged everywhere; timings are INFO
    adamw_row, muon_row, equal_row = muon["rows"]
    assert adamw_row["step_s"] > 0 and muon_row["step_s"] > 0
    assert muon_row["ratio"] == pytest.approx(muon_row["step_s"] / adamw_row["step_s"])
    assert equal_row["status"] == "PASS" and equal_row["max_abs_diff"] <= 1e-6

    timed = parts["async"]
    assert timed["status"] == "INFO"
    synchronous, stale = timed["rows"]
    assert (synchronous["max_staleness"], stale["max_staleness"]) == (0, 1)
    assert synchronous["staleness"] == 0 and synchronous["wait_s"] is None
    # After its warm-up step every batch of the worker is exactly one step behind.
    assert stale["staleness"] == 1 and stale["wait_s"] >= 0 and "worker 1" in stale["threads"]
    assert synchronous["step_s"] > 0 and stale["speed_up"] > 0

    markdown = (out / "report.md").read_text()
    for name in PARTS:
        assert f"\n## {name}\n" in markdown
        assert f"| {name} | {parts[name]['status']} |" in markdown
    assert "| device | CPU" in markdown and "| commit |" in markdown


def test_a_failing_part_is_reported_fail_and_exits_nonzero(
    dry_run, gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    out, _ = dry_run
    shutil.copy(out / "report.json", tmp_path / "report.json")
    build_ours = parity.build_ours

    def broken(checkpoint: Path, device: torch.device, backend: str) -> torch.nn.Module:
        model = build_ours(checkpoint, device, backend)
        final_norm = model.norm.scale if backend == "native" else model.base_model.norm.weight
        with torch.no_grad():
            final_norm.mul_(1.5)  # a mis-loaded final norm
        return model

    monkeypatch.setattr(parity, "build_ours", broken)
    monkeypatch.setattr(parity, "PARITY_FAMILIES", {"qwen3": parity.PARITY_FAMILIES["qwen3"]})
    status = gpu_check.main(
        ["--device", "cpu", "--tiny", "--part", "parity", "--out-dir", str(tmp_path)]
    )

    assert status == 1
    parts = _report(tmp_path)["parts"]
    assert parts["parity"]["status"] == "FAIL"
    broken_rows = parts["parity"]["rows"][:2]
    assert [row["status"] for row in broken_rows] == ["FAIL", "FAIL"]
    assert all(row["ours_vs_fp32"] > row["tolerance"] for row in broken_rows)
    # The other parts' sections are kept, and the Markdown is regenerated from all of them.
    earlier = _report(out)["parts"]
    assert all(parts[name] == earlier[name] for name in PARTS if name != "parity")
    markdown = (tmp_path / "report.md").read_text()
    assert "| parity | FAIL |" in markdown and "\n## memory\n" in markdown


def test_a_raising_part_is_an_error_and_the_next_part_still_runs(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def raises(settings: object) -> None:
        raise RuntimeError("an API that differs on this torch")

    def passes(settings: object) -> object:
        return PartResult(columns=[("x", "x", "")], rows=[{"x": 1, "status": "PASS"}])

    monkeypatch.setitem(PART_FUNCTIONS, "memory", raises)
    monkeypatch.setitem(PART_FUNCTIONS, "speed", passes)
    status = gpu_check.main(
        ["--device", "cpu", "--part", "memory", "speed", "--out-dir", str(tmp_path)]
    )

    assert status == 1
    parts = _report(tmp_path)["parts"]
    assert parts["memory"]["status"] == "ERROR"
    assert "RuntimeError: an API that differs" in parts["memory"]["reason"]
    assert "Traceback" in parts["memory"]["traceback"]
    assert parts["speed"]["status"] == "PASS"
    assert "| parity | not run yet |" in (tmp_path / "report.md").read_text()


def test_a_missing_package_skips_the_part_by_name(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl now fails
    status = gpu_check.main(
        ["--device", "cpu", "--tiny", "--part", "peer", "--out-dir", str(tmp_path)]
    )

    assert status == 0
    peer = _report(tmp_path)["parts"]["peer"]
    assert peer["status"] == "SKIPPED" and peer["reason"].startswith("trl is not importable")


def test_a_dry_run_without_out_dir_leaves_the_committed_report_alone(
    gpu_check: ModuleType, capsys
) -> None:
    committed = {path: path.read_bytes() for path in (REPO / "docs" / "gpu").glob("report.*")}
    assert committed  # the report the full-size runs write
    assert gpu_check.main(["--device", "cpu", "--tiny", "--part", "sampling"]) == 0
    written = Path(capsys.readouterr().out.split("report: ")[-1].split()[0])
    try:
        assert written.parent != REPO / "docs" / "gpu" and written.is_file()
        assert "## sampling" in written.read_text()
        assert {path: path.read_bytes() for path in committed} == committed
    finally:
        shutil.rmtree(written.parent)


def test_muon_part_sizes_qwen3_8b_to_the_card(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights, gradients and one optimizer's state (8 bytes a parameter) within 70 % of the
    card: all 36 layers on an H200, fewer on an H100."""
    from composer_tune.analysis import memory
    from composer_tune.models import qwen3_8b

    with torch.device("meta"):
        full = qwen3_8b().config
    layers = {}
    for capacity in (79.2, 139.8):
        monkeypatch.setattr(Settings, "device_gib", lambda self, c=capacity: c)
        settings = Settings(torch.device("cpu"), False, None, None)
        layers[capacity] = muon_layers(settings)
        args = dataclasses.replace(full, num_layers=layers[capacity])
        assert 8 * memory.count_params(args) / 2**30 <= 0.7 * capacity
    assert layers[139.8] == 36 and 0 < layers[79.2] < 36
    more = dataclasses.replace(full, num_layers=layers[79.2] + 1)
    assert 8 * memory.count_params(more) / 2**30 > 0.7 * 79.2


def test_cuda_without_a_gpu_is_a_clear_error(gpu_check: ModuleType, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--part", "parity"]) == 2
    assert "--device cpu --tiny" in capsys.readouterr().err


def test_fetch_list_is_pinned_and_fetches_no_torch_vllm_or_cuda() -> None:
    fetch = _load(REPO / "tools" / "fetch_gpu_wheels.py")
    projects = [fetch.requirement_project(requirement) for requirement, _ in fetch.WHEELS]
    assert len(projects) == len(set(projects))
    assert all("==" in requirement for requirement, _ in fetch.WHEELS)
    assert not [p for p in projects if p == "torch" or p.startswith(("vllm", "nvidia", "triton"))]
    assert {"torchtune", "torchao", "torchft", "trl", "omegaconf"} <= set(projects)
    name = "opentelemetry_exporter_otlp_proto_http-1.45.2-py3-none-any.whl"
    assert fetch.wheel_project(name) == "opentelemetry-exporter-otlp-proto-http"


def test_fetch_size_check_names_the_largest_wheels(tmp_path: Path) -> None:
    fetch = _load(REPO / "tools" / "fetch_gpu_wheels.py")
    wheels = []
    for name, mib in (("big-1.0-py3-none-any.whl", 3), ("small-1.0-py3-none-any.whl", 1)):
        path = tmp_path / name
        path.write_bytes(b"\0" * (mib * fetch.MIB))
        wheels.append(path)
    assert fetch.check_size(wheels, tree_bytes=fetch.MIB, limit_mib=5) == 4 * fetch.MIB
    with pytest.raises(SystemExit, match=r"exceed the 4.5 MiB.*largest: big-1.0.*\(3.0 MiB\)"):
        fetch.check_size(wheels, tree_bytes=fetch.MIB, limit_mib=4.5)
