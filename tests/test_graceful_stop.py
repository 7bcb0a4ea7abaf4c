"""Ctrl-C keeps the work: SIGINT at a step of a real `tune run` saves a checkpoint at the end of
the current generation batch, prints one line (no traceback) and exits 130; `latest` then
finishes the run with the same metrics, weights and final summary as an uninterrupted one."""

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from composer_tune.analysis.metrics_log import parse_metric_lines
from composer_tune.checkpointing.run_state import latest_checkpoint
from composer_tune.distributed import DistInfo
from composer_tune.run.loop import TIMING_METRICS
from composer_tune.stop import STOPPED_EXIT_CODE, StopRequest
from tests.recipe_runs import REPO_ROOT, TUNE, checkout_env, run_recipe, run_tune

# Random weights and a reward random completions earn about half the time: fast steps.
COMMON = (
    "warm_start=null",
    "reward._component_=composer_tune.rewards.FormatReward",
    r"reward.pattern=\d*[13579]$",
    "num_prompts_per_generation=4",
    "group_size=4",
    "micro_batch_size=8",
    "max_new_tokens=6",
    "eval_dataset.num_samples=16",
    "eval_max_new_tokens=6",
    "optimizer.lr=1e-3",
    "max_steps=12",
    "checkpoint.save_every_n_steps=0",
    "logging.progress_bar=false",
)
SUMMARY = re.compile(r"^held-out accuracy: before .*$", re.MULTILINE)


def _metrics(log_dir: Path) -> dict[int, dict[str, float]]:
    (log_file,) = log_dir.glob("log_*.txt")
    logged = parse_metric_lines(log_file.read_text().splitlines(), source=str(log_file))
    return {
        step: {k: v for k, v in values.items() if k not in TIMING_METRICS}
        for step, values in logged.items()
    }


def _weights(output_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((latest_checkpoint(output_dir) / "model").glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def _interrupt_when_logged(
    tune_args: Sequence[str], log_dir: Path, step: int, tmp_path: Path
) -> tuple[int, str, str]:
    """Starts ``tune run <tune_args>`` in its own session (as a terminal's foreground job, with
    a terminal's SIGINT disposition: a shell's background job, e.g. CI, ignores SIGINT), sends
    SIGINT to the whole group once ``log_dir`` logs ``step``; returns (exit status, stdout,
    stderr)."""
    env = checkout_env()
    env["PYTHONUNBUFFERED"] = "1"
    out, err = tmp_path / "stop.out", tmp_path / "stop.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            [TUNE, "run", *tune_args],
            cwd=REPO_ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 900
        marker = f"Step {step} |"
        while not any(marker in log.read_text() for log in log_dir.glob("log_*.txt")):
            assert process.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{log_dir} never logged step {step}"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGINT)
        status = process.wait(timeout=600)
    return status, out.read_text(), err.read_text()


def _interrupt_after_step(
    output_dir: Path, step: int, tmp_path: Path, *launcher: str
) -> tuple[int, str, str]:
    """The grpo run of ``COMMON`` (``launcher``: torchrun flags of ``tune run``), interrupted
    once it logs ``step`` (see :func:`_interrupt_when_logged`)."""
    command = [*launcher, "recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={output_dir}"]
    return _interrupt_when_logged([*command, *COMMON], output_dir / "logs", step, tmp_path)


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_latest_finishes_the_run_exactly(tmp_path: Path) -> None:
    straight = run_recipe("grpo", "cpu_smoke", tmp_path / "straight", *COMMON)
    expected = _metrics(tmp_path / "straight" / "logs")

    stopped_dir = tmp_path / "stopped"
    status, stdout, stderr = _interrupt_after_step(stopped_dir, 3, tmp_path)
    assert status == STOPPED_EXIT_CODE, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    stopped_at = int(latest_checkpoint(stopped_dir).name.removeprefix("step_"))
    assert 3 <= stopped_at < 12
    assert f"stopped at step {stopped_at}; checkpoint {latest_checkpoint(stopped_dir)}" in stdout

    resumed = run_recipe(
        "grpo",
        "cpu_smoke",
        stopped_dir,
        *COMMON,
        "checkpoint.resume_from_checkpoint=latest",
        f"logging.metric_logger.log_dir={tmp_path / 'resumed_logs'}",
    )
    after_resume = _metrics(tmp_path / "resumed_logs")
    assert sorted(after_resume) == [step for step in sorted(expected) if step > stopped_at]
    for step, metrics in after_resume.items():
        assert metrics == expected[step], step
    # The resumed run prints the uninterrupted run's summary (the step-0 accuracy included).
    assert SUMMARY.findall(resumed.stdout) == SUMMARY.findall(straight.stdout) != []
    straight_weights, resumed_weights = _weights(straight.output_dir), _weights(stopped_dir)
    for name, value in straight_weights.items():
        assert torch.equal(value, resumed_weights[name]), name


@pytest.mark.slow
def test_sigint_under_torchrun_stops_every_rank_at_one_step(tmp_path: Path) -> None:
    """Ctrl-C reaches torchrun's agent and both workers; the ranks agree on the step (a
    collective), save one checkpoint, and `latest` finishes the run with the metrics and weights
    of an uninterrupted 2-process run. torchrun's agent re-raises the signal as SignalException:
    composer_tune/recipe_finder.py prints that as one line."""
    torchrun = ("--nproc_per_node", "2")
    straight = run_tune(
        *torchrun, "recipes/grpo.py", "--config", "cpu_smoke",
        f"output_dir={tmp_path / 'straight'}", *COMMON,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = _metrics(tmp_path / "straight" / "logs")

    stopped_dir = tmp_path / "stopped"
    status, stdout, stderr = _interrupt_after_step(stopped_dir, 3, tmp_path, *torchrun)
    assert status != 0
    assert "KeyboardInterrupt" not in stderr  # no worker died inside a step
    # No traceback: not from a worker, nor from torchrun's agent (one line instead).
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "torchrun: Process" in stderr and "its workers were told to stop" in stderr
    stopped_at = int(latest_checkpoint(stopped_dir).name.removeprefix("step_"))
    assert 3 <= stopped_at < 12
    assert stdout.count(f"stopped at step {stopped_at}; checkpoint") == 1  # rank 0 only
    resumed = run_tune(
        *torchrun, "recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={stopped_dir}",
        *COMMON, "checkpoint.resume_from_checkpoint=latest",
        f"logging.metric_logger.log_dir={tmp_path / 'resumed_logs'}",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped_at}" in resumed.stdout
    assert SUMMARY.findall(resumed.stdout) == SUMMARY.findall(straight.stdout) != []
    assert latest_checkpoint(stopped_dir).name == "step_0000012"
    after_resume = _metrics(tmp_path / "resumed_logs")
    assert sorted(after_resume) == [step for step in sorted(expected) if step > stopped_at]
    for step, metrics in after_resume.items():
        assert metrics == expected[step], step
    straight_weights, resumed_weights = _weights(tmp_path / "straight"), _weights(stopped_dir)
    for name, value in straight_weights.items():
        assert torch.equal(value, resumed_weights[name]), name


def test_stop_request_is_off_until_signalled_and_restores_handlers() -> None:
    one = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(one) as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the test process keeps running
        assert stop.requested() and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_sigint_while_the_warm_start_trains_keeps_its_checkpoint_and_prints_no_traceback(
    tmp_path: Path,
) -> None:
    """Ctrl-C while an RL recipe is still training its SFT warm start (set-up): the SFT run
    stops with a checkpoint (the next start resumes it) and the RL run ends with one line."""
    sft_dir, rl_dir = tmp_path / "sft", tmp_path / "grpo"
    status, stdout_text, stderr_text = _interrupt_when_logged(
        ["recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={rl_dir}"]
        + [f"warm_start.output_dir={sft_dir}", "logging.progress_bar=false"],
        sft_dir / "logs",
        50,  # the SFT run logs every 50 steps
        tmp_path,
    )
    assert status == STOPPED_EXIT_CODE, stderr_text[-3000:]
    assert "Traceback" not in stderr_text and "KeyboardInterrupt" not in stderr_text
    assert stderr_text.strip().splitlines()[-1] == (
        "interrupted during set-up; no training step was taken"
    )
    saved = latest_checkpoint(sft_dir)
    assert saved is not None and f"stopped at step {int(saved.name[5:])}" in stdout_text
    assert not rl_dir.exists()  # the RL run wrote nothing
