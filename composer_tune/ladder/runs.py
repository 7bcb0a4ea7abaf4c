"""Running a ladder: every arm-seed planned as a ``tune run`` command, run in its own process
group with its console in ``run.log``, resumed from its checkpoint when an earlier attempt left
one, and recorded (every metric series of every process replica) for ``results.json``; the A0
SFT warm start the arms share. ``tools/ladder.py`` is the command over it."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from composer_tune.analysis.metrics_log import Metrics, read_metrics, series
from composer_tune.checkpointing.run_state import (
    MODEL_DIR,
    checkpoint_dir,
    checkpoint_step,
    latest_checkpoint,
)
from composer_tune.config import load_recipe_config
from composer_tune.ladder.arms import ACCURACY, ARMS, GENERATED, Arm

REPO_ROOT = Path(__file__).resolve().parents[2]
TUNE = str(Path(sys.executable).parent / "tune")
LOG_TAIL_CHARS = 4000
# Console lines echoed while a run goes (the rest is in its run.log).
PROGRESS_MARKERS = ("held-out accuracy", "Error", "error:")
SFT_RECIPE = "recipes/sft.py"
# The training-task keys every arm takes from the SFT config (each arm keeps its own data seed).
TASK_KEYS = ("operations", "min_digits", "max_digits")


# ------------------------------------------------------------------------------ command lines


def _override_value(value: Any) -> str:
    """A config value as a ``key=value`` override writes it (YAML flow syntax)."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(_override_value(item) for item in value) + "]"
    if value is None:
        return "null"
    return str(value)


def section_overrides(
    name: str, section: dict[str, Any], keys: Sequence[str] | None = None
) -> list[str]:
    """``name.key=value`` overrides that set a config section's (scalar or list) keys."""
    return [
        f"{name}.{key}={_override_value(value)}"
        for key, value in section.items()
        if keys is None or key in keys
    ]


def split_overrides(overrides: Sequence[str], arms: Sequence[str]) -> dict[str, list[str]]:
    """``--override`` values per arm: ``KEY=VALUE`` goes to every arm, ``ARM:KEY=VALUE`` to one.

    Raises:
        ValueError: naming an override without ``=`` or for an arm not in the ladder.
    """
    per_arm: dict[str, list[str]] = {arm: [] for arm in arms}
    for override in overrides:
        head, colon, rest = override.partition(":")
        targeted = bool(colon) and "=" not in head
        assignment = rest if targeted else override
        if "=" not in assignment or assignment.startswith("="):
            raise ValueError(f"--override {override!r}: expected KEY=VALUE or ARM:KEY=VALUE")
        if not targeted:
            for arm in arms:
                per_arm[arm].append(override)
        elif head in per_arm:
            per_arm[head].append(assignment)
        else:
            raise ValueError(
                f"--override {override!r}: arm {head!r} is not in this ladder ({', '.join(arms)})"
            )
    return per_arm


def warm_start_overrides(path: Path) -> list[str]:
    """How an arm starts from ``path``: an SFT output folder (its newest checkpoint's model), or
    a Hugging Face model folder. The arms never run their own warm start: the ladder names
    the weights (and trains its own SFT run whole, :func:`train_warm_start`).

    Raises:
        FileNotFoundError: naming ``path`` when it is neither.
    """
    checkpoint = latest_checkpoint(path)
    if checkpoint is not None:
        path = checkpoint / MODEL_DIR
    if (path / "config.json").is_file():
        return ["warm_start=null", f"checkpoint.initial_checkpoint={path}"]
    raise FileNotFoundError(
        f"--warm-start {path}: neither an SFT output folder with a complete checkpoint "
        "(checkpoints/step_*/) nor a Hugging Face model folder (config.json + weights)"
    )


@dataclass
class PlannedRun:
    """One arm at one seed: where it writes and the command that runs it."""

    arm: Arm
    seed: int
    run_dir: Path
    overrides: list[str]  # the recipe's key=value overrides, output_dir first
    config: str

    @property
    def key(self) -> str:
        return f"{self.arm.key}/seed{self.seed}"

    def command(self) -> list[str]:
        recipe = [TUNE, "run", self.arm.recipe, "--config", self.config, *self.overrides]
        if self.arm.replicas == 1:
            return recipe
        launcher = str(REPO_ROOT / "tools" / "launch_diloco.py")
        return [sys.executable, launcher, "--replicas", str(self.arm.replicas), "--", *recipe]

    def resolved_config(self) -> DictConfig:
        """The config the run's recipe will see, checked against the recipe's schema."""
        return load_recipe_config(REPO_ROOT / self.arm.recipe, self.config, self.overrides)

    @property
    def log_path(self) -> Path:
        """The run's console output (stdout and stderr)."""
        return self.run_dir / "run.log"

    def log_dirs(self) -> list[Path]:
        """The DiskLogger folder of each process replica (DiLoCo: replica_<i>/logs)."""
        if self.arm.replicas == 1:
            return [self.run_dir / "logs"]
        return [self.run_dir / f"replica_{i}" / "logs" for i in range(self.arm.replicas)]


def plan_runs(
    args: argparse.Namespace, warm_start: list[str], sft_cfg: Any | None
) -> list[PlannedRun]:
    """Every (arm, seed) run of the ladder, seed-major (a cut-short ladder has whole seeds).
    With an SFT config the arms take its held-out set and task; without one, their own.

    Raises:
        ValueError: naming a bad ``--override``.
    """
    per_arm = split_overrides(args.override, args.arms)
    shared = [
        f"max_steps={args.steps}",
        "logging.progress_bar=false",
        *warm_start,
    ]
    if sft_cfg is not None:
        shared += [
            *section_overrides("eval_dataset", _plain(sft_cfg.eval_dataset)),
            *section_overrides("dataset", _plain(sft_cfg.dataset), TASK_KEYS),
        ]
    runs = []
    for seed in args.seeds:
        for key in args.arms:
            arm = ARMS[key]
            run_dir = (args.out / "runs" / f"{key}_seed{seed}").resolve()
            if arm.replicas == 1:
                cadence = [f"eval_every_n_steps={args.eval_every}"]
            else:
                cadence = [
                    f"diloco.sync_every={args.diloco_sync_every}",
                    f"eval_every_n_outer_steps={args.eval_every // args.diloco_sync_every}",
                ]
            overrides = [
                f"output_dir={run_dir}",
                f"seed={seed}",
                *shared,
                *cadence,
                *per_arm[key],
                *arm.overrides,
            ]
            runs.append(PlannedRun(arm, seed, run_dir, overrides, args.config))
    return runs


def _plain(section: Any) -> dict[str, Any]:
    return OmegaConf.to_container(section, resolve=True)


def heldout_set(runs: Sequence[PlannedRun]) -> dict[str, Any]:
    """The ``eval_dataset`` section every arm resolves to (overrides applied and checked).

    Raises:
        ValueError: naming the arm whose held-out set differs from the first arm's, or (a
            ConfigError) an override an arm's recipe does not take.
    """
    first_arm_of: dict[str, PlannedRun] = {}
    for run in runs:
        first_arm_of.setdefault(run.arm.key, run)
    sections = {
        key: _plain(run.resolved_config().eval_dataset) for key, run in first_arm_of.items()
    }
    reference_key, reference = next(iter(sections.items()))
    for key, section in sections.items():
        if section != reference:
            raise ValueError(
                f"arm {key} would be evaluated on another held-out set than {reference_key}: "
                f"{section} vs {reference} (an --override changed eval_dataset for one arm?)"
            )
    return reference


# ------------------------------------------------------------------------------ running


def run_logged(
    command: Sequence[str], log_path: Path, *, env: dict[str, str], timeout: float | None
) -> tuple[int, float]:
    """Runs ``command`` (its own process group) with stdout+stderr into ``log_path``.

    Echoes progress lines (held-out accuracies, errors) indented. A run past ``timeout`` seconds
    gets SIGTERM, then SIGKILL after 30 s, on its whole group (DiLoCo's replicas included).

    Returns:
        (exit status, wall seconds); the status is negative for a signal, as subprocess has it.
    """
    start = time.perf_counter()
    with open(log_path, "a") as log:  # a resumed run's output follows its first attempt's
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def stop_on_timeout() -> None:
            timed_out.set()
            _stop_group(process)

        watchdog = threading.Timer(timeout, stop_on_timeout) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            for line in process.stdout:
                log.write(line)
                if any(marker in line for marker in PROGRESS_MARKERS):
                    print("    " + line.split("; e.g.")[0].rstrip()[:200], flush=True)
            status = process.wait()
        except BaseException:  # Ctrl-C: leave no replica behind
            _stop_group(process)
            raise
        finally:
            if watchdog:
                watchdog.cancel()
        if timed_out.is_set():
            log.write(f"\n[ladder] stopped: it ran past --run-timeout {timeout:.0f} s\n")
    return status, time.perf_counter() - start


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the run's process group, SIGKILL if its leader is still there 30 s later."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-chars:]


def collect_metrics(run: PlannedRun) -> list[dict[str, list[list[float]]]]:
    """Every metric series of every process replica: [{name: [[step, value], ...]}]."""
    collected = []
    for log_dir in run.log_dirs():
        metrics: Metrics = read_metrics(log_dir) if log_dir.is_dir() else {}
        names = sorted({name for values in metrics.values() for name in values})
        collected.append({name: [list(point) for point in series(metrics, name)] for name in names})
    return collected


def generated_tokens(replica_metrics: Sequence[dict[str, list]], until: float = math.inf) -> float:
    """Completion tokens sampled up to step ``until`` (default: the whole run): each replica's
    cumulative ``tokens/generated`` at its last logged step at or before it, summed over
    replicas; a replica that logged none by then sampled none."""
    total = 0.0
    for metrics in replica_metrics:
        logged = [value for step, value in metrics.get(GENERATED, []) if step <= until]
        total += logged[-1] if logged else 0.0
    return total


def resumable_step(previous: dict[str, Any] | None, run: PlannedRun) -> int | None:
    """The step of the checkpoint a failed earlier attempt of this very run (same command) left,
    from which it can resume; None when there is none (or for DiLoCo, whose replicas restart)."""
    if previous is None or previous.get("status") == "ok" or run.arm.replicas != 1:
        return None
    if previous.get("command") != run.command():
        return None
    checkpoint = latest_checkpoint(run.run_dir)
    return None if checkpoint is None else checkpoint_step(checkpoint)


def execute(
    run: PlannedRun,
    env: dict[str, str],
    timeout: float | None,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs one arm-seed and returns its results record (ok or failed). A failed earlier attempt
    of the same command that left a checkpoint (killed, out of memory, past --run-timeout) is
    resumed from it, its wall time counted in, and so is one whose ladder died with it (status
    running); any other earlier attempt is trained again from scratch."""
    step = resumable_step(previous, run)
    command = run.command()
    if step is not None:
        command = [*command, "checkpoint.resume_from_checkpoint=latest"]
        print(f"    resuming from its step-{step} checkpoint", flush=True)
        earlier_wall = attempt_wall_s(previous, run)
    else:
        if run.run_dir.exists():  # its logs and checkpoints would mix in
            shutil.rmtree(run.run_dir)
        run.run_dir.mkdir(parents=True)
    status, wall = run_logged(command, run.log_path, env=env, timeout=timeout)
    record = run_record(run, status, wall)
    if step is not None:
        record["wall_s"] += earlier_wall
        record["resumed_from_step"] = step
    return record


def running_record(run: PlannedRun, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The record a run has while it runs: what a ladder killed mid-run (a session's end, a
    reboot) leaves in results.json, from which the next ladder resumes the run's checkpoint
    instead of deleting it as unknown. Its ``wall_s``: the earlier attempts' it resumes."""
    resumes = resumable_step(previous, run) is not None
    return {
        "arm": run.arm.key,
        "seed": run.seed,
        "command": run.command(),
        "status": "running",
        "started": time.time(),
        "returncode": None,
        "wall_s": attempt_wall_s(previous, run) if resumes and previous else 0.0,
        "log": str(run.log_path),
        "metrics": [],
    }


def attempt_wall_s(previous: dict[str, Any], run: PlannedRun) -> float:
    """Wall seconds of an earlier attempt: as recorded, or for one whose ladder was killed
    with it (status running) from its start to its log's last write."""
    if previous.get("status") != "running":
        return previous["wall_s"]
    return previous["wall_s"] + max(0.0, run.log_path.stat().st_mtime - previous["started"])


def run_record(run: PlannedRun, status: int, wall_s: float) -> dict[str, Any]:
    """The results record of a finished run: its metrics from its logs, or why it failed."""
    record: dict[str, Any] = {
        "arm": run.arm.key,
        "seed": run.seed,
        "command": run.command(),
        "returncode": status,
        "wall_s": wall_s,
        "log": str(run.log_path),
        "metrics": [],
    }
    try:
        record["metrics"] = collect_metrics(run)
        record["generated_tokens"] = generated_tokens(record["metrics"])
    except (OSError, ValueError) as err:  # an unreadable log fails the run, not the ladder
        record["metrics_error"] = f"{type(err).__name__}: {err}"
    ok = status == 0 and "metrics_error" not in record
    record["status"] = "ok" if ok else "failed"
    if not ok:
        record["log_tail"] = _tail(run.log_path)
    return record


def write_json_atomic(path: Path, data: Any) -> None:
    """Writes ``data`` as JSON through a temporary file and a rename: never a half-written file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


def load_results(path: Path) -> dict[str, Any]:
    """An earlier ladder's results.json, or empty results when there is none."""
    if not path.is_file():
        return {"runs": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a ladder results file ({err})") from None


def should_skip(previous: dict[str, Any] | None, run: PlannedRun) -> bool:
    """Whether an earlier attempt already completed this very run (same command).

    Raises:
        ValueError: when a completed run was made with another command (other settings): mixing
            both in one table would compare unequal runs.
    """
    if previous is None or previous.get("status") != "ok":
        return False
    if previous.get("command") != run.command():
        raise ValueError(
            f"{run.key} in {run.run_dir.parent.parent} was completed with other settings:\n"
            f"  then: {' '.join(previous.get('command', []))}\n  now:  {' '.join(run.command())}\n"
            "use another --out for these settings"
        )
    return True


def train_warm_start(
    args: argparse.Namespace,
    path: Path,
    max_steps: int,
    results: dict[str, Any],
    env: dict[str, str],
) -> None:
    """Trains the A0 SFT warm start into ``path`` unless its final (``max_steps``) checkpoint
    is there already; a folder left by an interrupted attempt is trained again from scratch.

    Raises:
        RuntimeError: when the SFT run fails or does not end at ``max_steps`` (no arm can start
            without it).
    """
    final = checkpoint_dir(path, max_steps)
    if latest_checkpoint(path) == final:
        print(f"warm start: {path}", flush=True)
        return
    command = [TUNE, "run", SFT_RECIPE, "--config", args.sft_config, f"output_dir={path}"]
    command += ["logging.progress_bar=false", *args.sft_override]
    print(f"warm start: training A0 SFT into {path}", flush=True)
    if path.exists():  # an interrupted attempt
        shutil.rmtree(path)
    path.mkdir(parents=True)
    status, wall = run_logged(command, path / "run.log", env=env, timeout=args.run_timeout)
    record = {"path": str(path), "command": command, "wall_s": wall, "returncode": status}
    results["warm_start"] = record
    if status != 0:
        record["log_tail"] = _tail(path / "run.log")
        raise RuntimeError(f"the A0 SFT warm start failed (exit {status}); see {path / 'run.log'}")
    if latest_checkpoint(path) != final:
        raise RuntimeError(
            f"the A0 SFT warm start left no checkpoint at its max_steps={max_steps} ({final}); "
            f"see {path / 'run.log'}"
        )
    accuracy = series(read_metrics(path / "logs"), ACCURACY)
    record["heldout_accuracy"] = accuracy[-1][1] if accuracy else None
    print(f"warm start: trained in {wall:.0f} s", flush=True)
