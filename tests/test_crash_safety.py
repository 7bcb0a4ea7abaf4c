"""Crash safety: non-finite steps are skipped (and enough of them stop the run), and a run killed
while saving a checkpoint leaves the previous one intact and resumable.

The end-to-end tests drive ``recipes/sft.py`` through the real ``tune`` console script with two
test devices: ``tests/_nonfinite_model.py`` (a model whose training forward passes return NaN at
chosen steps) and ``run_state.PAUSE_IN_SAVE_ENV`` (a save that announces itself through a file and
waits at its most delicate point, so the SIGKILL lands inside the save every time, not by luck).
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from composer_tune.checkpointing import load_hf_checkpoint
from composer_tune.checkpointing.run_state import (
    PAUSE_IN_SAVE_ENV,
    TRAINING_STATE,
    checkpoints_root,
    latest_checkpoint,
    remove_stale_staging,
    resolve_resume_path,
    save_run_checkpoint,
)
from composer_tune.distributed import DistInfo
from composer_tune.guards import NonFiniteGuard, NonFiniteStepError
from composer_tune.models import qwen3_tiny
from tests.recipe_runs import REPO_ROOT, TUNE, checkout_env, run_recipe, run_tune

NAN, INF = math.nan, math.inf
SINGLE = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
# A short SFT run: small data (the default 50k problems take seconds to generate), tiny eval.
QUICK_SFT = (
    "batch_size=16",
    "dataset.num_samples=256",
    "eval_dataset.num_samples=4",
    "eval_max_new_tokens=2",
    "logging.log_every_n_steps=1",
    "logging.progress_bar=false",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last=null",  # every checkpoint stays: the tests list them
)


def _tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return qwen3_tiny(
        vocab_size=64, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=32,
        intermediate_dim=64, head_dim=16, max_seq_len=32,
    )  # fmt: skip


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    _, state_dict = load_hf_checkpoint(checkpoint / "model")
    return state_dict


def _training_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / TRAINING_STATE, map_location="cpu", weights_only=False)


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------- NonFiniteGuard


def test_guard_skips_nonfinite_loss_or_grad_norm_and_resets_on_a_good_step() -> None:
    guard = NonFiniteGuard(max_consecutive=3, verbose=False)
    steps = [  # (loss, grad norm, whether the update may be applied)
        (1.0, 2.0, True),
        (NAN, 1.0, False),
        (1.0, INF, False),
        (1.0, None, True),  # a good step ends the run of skipped ones
        (-INF, None, False),
    ]
    for step, (loss, grad_norm, expected) in enumerate(steps, start=1):
        assert guard.check(step, torch.tensor(loss), grad_norm) is expected, step
    assert (guard.skipped_total, guard.consecutive) == (3, 1)
    assert guard.metrics() == {"skipped_nonfinite_steps": 3.0}


def test_guard_stops_on_the_max_consecutive_skipped_step(capsys: pytest.CaptureFixture) -> None:
    guard = NonFiniteGuard(max_consecutive=2)
    assert guard.check(41, torch.tensor(NAN)) is False
    with pytest.raises(NonFiniteStepError, match="step 42: 2 consecutive non-finite steps"):
        guard.check(42, torch.tensor(INF))
    warnings = re.findall(r"warning: step (\d+): non-finite", capsys.readouterr().err)
    assert warnings == ["41", "42"]


def test_guard_counts_survive_a_resume() -> None:
    guard = NonFiniteGuard(max_consecutive=2, verbose=False)
    guard.check(1, torch.tensor(NAN))
    resumed = NonFiniteGuard(max_consecutive=2, verbose=False)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(NonFiniteStepError):  # the second in a row, counting the first run's
        resumed.check(2, torch.tensor(NAN))


def test_guard_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="max_consecutive must be >= 1, got 0"):
        NonFiniteGuard(max_consecutive=0)


def test_check_parameters_names_the_poisoned_weight() -> None:
    model = _tiny_model(seed=0)
    guard = NonFiniteGuard(max_consecutive=1)
    guard.check_parameters(model, step=5)  # finite: nothing happens
    with torch.no_grad():
        model.layers[0].mlp.w1.weight[3, 2] = INF
    with pytest.raises(NonFiniteStepError, match=r"step 5: 'layers\.0\.mlp\.w1\.weight'"):
        guard.check_parameters(model, step=5)


def _guard_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One gloo rank: rank 0 alone sees a NaN loss at step 1; both see finite ones at step 2."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    guard = NonFiniteGuard(max_consecutive=3, verbose=False)
    decisions = [
        guard.check(1, torch.tensor(NAN if rank == 0 else 1.0)),
        guard.check(2, torch.tensor(1.0)),
    ]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(decisions))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_guard_decision_is_the_same_on_every_rank(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(
        _guard_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [False, True], rank


@pytest.mark.slow
def test_sft_skips_isolated_nan_steps_and_stops_on_a_run_of_them(tmp_path: Path) -> None:
    # NaN at steps 3-4 (isolated: skipped, training goes on) and 7-8-9 (the third in a row
    # stops the run); checkpoints every 2 steps.
    result = run_tune(
        "recipes/sft.py",
        "--config",
        "cpu_smoke",
        f"output_dir={tmp_path}",
        *QUICK_SFT,
        "max_steps=10",
        "model._component_=tests._nonfinite_model.qwen3_tiny_nan_at",
        "model.nan_steps=[3,4,7,8,9]",
    )
    assert result.returncode != 0
    assert "NonFiniteStepError: step 9: 3 consecutive non-finite steps" in result.stderr
    warned = re.findall(r"warning: step (\d+): non-finite", result.stderr)
    assert warned == ["3", "4", "7", "8", "9"]
    (log_file,) = (tmp_path / "logs").glob("log_*.txt")
    skipped = re.findall(r"skipped_nonfinite_steps:([0-9.]+)", log_file.read_text())
    assert [float(v) for v in skipped] == [0, 0, 1, 2, 2, 2, 3, 4]

    # Nothing was written from the stopped step on; the last checkpoint is whole and finite.
    steps = sorted(p.name for p in checkpoints_root(tmp_path).iterdir())
    assert steps == ["step_0000002", "step_0000004", "step_0000006", "step_0000008"]
    last = latest_checkpoint(tmp_path)
    assert last is not None and last.name == "step_0000008"
    assert all(torch.isfinite(t).all() for t in _weights(last).values())
    assert _training_state(last)["recipe_state"]["nonfinite_guard"]["skipped_total"] == 4

    # A skipped step changes nothing: weights, optimizer moments and LR schedule after steps
    # 3-4 (and 7-8) equal those before them, while the good steps 5-6 did train.
    ckpt = {s: checkpoints_root(tmp_path) / f"step_{s:07d}" for s in (2, 4, 6, 8)}
    for before, after in ((2, 4), (6, 8)):
        _assert_same_tensors(_weights(ckpt[before]), _weights(ckpt[after]))
        state_before, state_after = _training_state(ckpt[before]), _training_state(ckpt[after])
        assert state_before["lr_scheduler"] == state_after["lr_scheduler"]
        for group_before, group_after in zip(
            state_before["optimizer"]["state"].values(),
            state_after["optimizer"]["state"].values(),
            strict=True,
        ):
            _assert_same_tensors(group_before, group_after)
    moved = _weights(ckpt[6])["tok_embeddings.weight"] - _weights(ckpt[4])["tok_embeddings.weight"]
    assert moved.abs().max() > 0


# ----------------------------------------------------------------------------- killed saves


def _kill_when_paused(process: subprocess.Popen, ready_file: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        assert process.poll() is None, "the run ended before reaching the paused save"
        assert time.monotonic() < deadline, "the save was not reached in time"
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_sft_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    common = (*QUICK_SFT, "max_steps=6")
    killed_dir, ready = tmp_path / "killed", tmp_path / "paused"
    env = checkout_env()
    env[PAUSE_IN_SAVE_ENV] = f"4:{ready}"  # hold the save of step 4 before it is renamed
    process = subprocess.Popen(
        [TUNE, "run", "recipes/sft.py", "--config", "cpu_smoke", f"output_dir={killed_dir}"]
        + list(common),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _kill_when_paused(process, ready)

    root = checkpoints_root(killed_dir)
    assert (root / ".partial-step_0000004" / TRAINING_STATE).is_file()  # killed mid-save
    previous = latest_checkpoint(killed_dir)
    assert previous == root / "step_0000002"
    assert _training_state(previous)["step"] == 2
    assert all(torch.isfinite(t).all() for t in _weights(previous).values())

    resumed = run_recipe(
        "sft", "cpu_smoke", killed_dir, *common, "checkpoint.resume_from_checkpoint=latest"
    )
    assert f"resumed from {previous} at step 2" in resumed.stdout
    assert sorted(p.name for p in root.iterdir()) == [
        "step_0000002",
        "step_0000004",
        "step_0000006",
    ]
    # Exact resume: optimizer, schedule and data position restored, so the result equals an
    # uninterrupted run's.
    straight = run_recipe("sft", "cpu_smoke", tmp_path / "straight", *common)
    final = "step_0000006"
    _assert_same_tensors(
        _weights(root / final), _weights(checkpoints_root(straight.output_dir) / final)
    )


RESAVE_SCRIPT = """
import sys, torch
from composer_tune.checkpointing.run_state import save_run_checkpoint
from composer_tune.distributed import DistInfo
from tests.test_crash_safety import _tiny_model
model = _tiny_model(seed=1)
save_run_checkpoint(
    output_dir=sys.argv[1], step=3, model=model, model_config=model.config, optimizer=None,
    lr_scheduler=None, recipe_state={"step": 3},
    dist_info=DistInfo(world_size=1, rank=0, device=torch.device("cpu")),
)
"""


@pytest.mark.slow
def test_resave_killed_between_renames_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    old = _tiny_model(seed=0)
    save_run_checkpoint(
        output_dir=tmp_path, step=3, model=old, model_config=old.config, optimizer=None,
        lr_scheduler=None, recipe_state={"step": 3}, dist_info=SINGLE,
    )  # fmt: skip
    # A second save of step 3 (other weights), killed after the old folder was moved aside and
    # before the new one took its place.
    ready = tmp_path / "paused"
    env = {**os.environ, PAUSE_IN_SAVE_ENV: f"3:{ready}"}
    process = subprocess.Popen(
        [sys.executable, "-c", RESAVE_SCRIPT, str(tmp_path)], cwd=REPO_ROOT, env=env
    )
    _kill_when_paused(process, ready, timeout=300)
    root = checkpoints_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [
        ".partial-step_0000003",
        ".replaced-step_0000003",
    ]
    assert latest_checkpoint(tmp_path) is None  # never a half-made folder

    # What a restarted run does first: the old checkpoint comes back, whole.
    assert remove_stale_staging(tmp_path) == [root / ".partial-step_0000003"]
    restored = latest_checkpoint(tmp_path)
    assert restored == root / "step_0000003"
    expected = {k: v.detach() for k, v in old.state_dict().items()}
    _assert_same_tensors(_weights(restored), expected)


def test_latest_ignores_incomplete_and_scratch_folders_which_cleanup_removes(
    tmp_path: Path,
) -> None:
    root = checkpoints_root(tmp_path)

    def folder(name: str, *files: str) -> Path:
        for file in files:
            (root / name / file).parent.mkdir(parents=True, exist_ok=True)
            (root / name / file).write_text("x")
        return root / name

    complete = folder("step_0000003", TRAINING_STATE, "model/config.json")
    folder("step_0000005", TRAINING_STATE)  # gutted: its model folder is gone
    folder(".partial-step_0000009", TRAINING_STATE, "model/config.json")
    folder(".deleting-step_0000001", TRAINING_STATE)
    folder(".replaced-step_0000003", TRAINING_STATE, "model/config.json")  # new one in place
    assert latest_checkpoint(tmp_path) == complete
    removed = remove_stale_staging(tmp_path)
    assert sorted(p.name for p in removed) == [
        ".deleting-step_0000001",
        ".partial-step_0000009",
        ".replaced-step_0000003",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["step_0000003", "step_0000005"]


def test_latest_with_nothing_to_resume_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert resolve_resume_path("latest", tmp_path) is None
    assert capsys.readouterr().out == (
        f"resume_from_checkpoint=latest: no complete checkpoint in {tmp_path}; "
        "starting from step 0\n"
    )
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    assert resolve_resume_path("latest", tmp_path) is None
    assert capsys.readouterr().out == ""
    assert resolve_resume_path(None, tmp_path) is None
    assert capsys.readouterr().out == ""


def test_keep_last_prunes_the_oldest_checkpoints(tmp_path: Path) -> None:
    model = _tiny_model(seed=0)
    for step in (1, 2, 3):
        save_run_checkpoint(
            output_dir=tmp_path, step=step, model=model, model_config=model.config,
            optimizer=None, lr_scheduler=None, recipe_state={"step": step}, dist_info=SINGLE,
            keep_last=2,
        )  # fmt: skip
    names = sorted(p.name for p in checkpoints_root(tmp_path).iterdir())
    assert names == ["step_0000002", "step_0000003"]


@pytest.mark.slow
def test_save_only_model_leaves_the_optimizer_out_and_refuses_to_resume(tmp_path: Path) -> None:
    common = (*QUICK_SFT, "max_steps=2")
    full = run_recipe("sft", "cpu_smoke", tmp_path / "full", *common)
    slim = run_recipe(
        "sft", "cpu_smoke", tmp_path / "slim", *common, "checkpoint.save_only_model=true"
    )
    full_ckpt, slim_ckpt = latest_checkpoint(full.output_dir), latest_checkpoint(slim.output_dir)
    assert _training_state(full_ckpt)["optimizer"]["state"]  # AdamW moments by default
    assert _training_state(slim_ckpt)["optimizer"] is None
    assert (slim_ckpt / TRAINING_STATE).stat().st_size < (
        full_ckpt / TRAINING_STATE
    ).stat().st_size / 10
    # The weights are the same as the full save's: the option changes what is kept, not training.
    _assert_same_tensors(_weights(slim_ckpt), _weights(full_ckpt))

    resumed = run_tune(
        "recipes/sft.py", "--config", "cpu_smoke", f"output_dir={slim.output_dir}",
        *QUICK_SFT, "max_steps=4", "checkpoint.resume_from_checkpoint=latest",
    )  # fmt: skip
    assert resumed.returncode != 0
    assert (
        f"{slim_ckpt} was saved with checkpoint.save_only_model=true and holds no optimizer state"
        in resumed.stderr
    )
