"""The ladder: A1-A4 and DiLoCo from one A0 warm start, equal step budgets, several seeds.

    python tools/ladder.py                                   # the default (see the budget below)
    python tools/ladder.py --steps 40 --seeds 0 1 2 3 4 --eval-every 8 --out runs/ladder_40
    python tools/ladder.py --arms a1 a2 --override optimizer.lr=1e-5 --override a2:sdpo.weight=0.5
    python tools/ladder.py --warm-start outputs/sft_cpu_smoke --steps 4 --seeds 0 --eval-every 2 \
        --diloco-sync-every 2
    python tools/ladder.py --config smollm2 --sft-config none --out runs/ladder_smollm2
    python tools/ladder.py --combine runs/ladder_a1 runs/ladder_a2 --out runs/ladder_a1_a2

One A0 SFT run (``recipes/sft.py``, ``--sft-config``, by default ``cpu_smoke_hints``: the SFT
smoke run that also learnt to read SDPO's hints, which A2, A4 and DiLoCo need) is trained into
``<out>/warm_start`` (or ``--warm-start`` names an existing one: an SFT output folder or a
Hugging Face model folder). With ``--sft-config none`` there is no SFT run: A0 is the pretrained
checkpoint the arms' configs start from (``--config smollm2``: SmolLM2-135M-Instruct), and every
arm keeps its config's own task and held-out set (the ladder checks that they agree).
Every arm then starts from it with the same ``max_steps`` (``--steps``), the same seeds, the
warm start's held-out set and training-task distribution (the SFT config's ``eval_dataset``
section and its ``dataset`` operations/digits, passed to every arm), and a held-out evaluation
every ``--eval-every`` steps. The arms run their own ``cpu_smoke`` configs (``--config``),
sequentially, through the real ``tune run`` console script (DiLoCo: 2 replicas under
``tools/launch_diloco.py``, its ``diloco.sync_every`` set by ``--diloco-sync-every``), with
``OMP_NUM_THREADS=1`` unless ``--omp-threads`` says otherwise. ``--override KEY=VALUE`` goes to
every arm, ``--override ARM:KEY=VALUE`` to one (after the ladder's own overrides, so it wins).

The DiLoCo arm's inner loop is A4's composer loop (all three channels, recipes/diloco.py). Steps
are optimizer steps of one process; a DiLoCo replica takes that many inner steps, so DiLoCo
samples twice the rollouts of a single-process arm (the tokens column shows it).

The results folder holds ``runs/<arm>_seed<k>/`` (the run's console log ``run.log``, its
DiskLogger files, its final checkpoint), ``results.json`` (settings, every metric series of every
run, failures with their log tails; rewritten atomically after each run), ``results.md`` (the
table below), ``accuracy.png`` / ``reward.png`` (mean over seeds with a ±1 std band) and
``accuracy_vs_tokens.png`` (each run's accuracy against its generated tokens); where runs
logged per-channel gradients (``--override log_channel_gradients=true``), results.md adds each
channel's gradient norm before clipping and share of the step, and ``channel_gradients.png``
plots them per step. A failed
run is recorded and the ladder goes on; rerunning with the same ``--out`` skips every completed
run and retries failed ones, resuming from its last checkpoint one that left any (a run killed
out of memory or past --run-timeout loses only the steps since that checkpoint). Arms, or seeds of an arm, can also run as separate ladders side by
side (one ``--out`` each, e.g. one per core) and be combined into one table with ``--combine``
(the same arm's runs must share their command but for ``output_dir`` and ``seed``), as can a
peer's results (``PEER_ARMS``: tools/trl_sdpo_peer.py runs TRL's SDPOTrainer on the smollm2_trl
task).
The table, per arm: held-out accuracy at step 0, at the last evaluation at or before half-way,
and at the final step, as mean ± sample std over seeds, the standard error of the final
accuracy, wall time per run, generated tokens per run (see below) and the number of seeds.

Tokens: every RL recipe logs ``tokens/generated``, the completion tokens it has sampled since
step 0 over all its ranks (kept across a resume), at every logged step. A run's generated tokens
are its last logged value, summed over DiLoCo replicas (each counts its own ranks); an
evaluation's are the value at the last logged step at or before it (exact when the config's
``logging.log_every_n_steps`` divides the evaluation cadence, as in the cpu_smoke and smollm2
configs, which log every step). Prompt tokens, and the DPO pairs of A3/A4, are not in it.

Default budget (--steps 24 --seeds 0 1 2 --eval-every 4 --diloco-sync-every 4: 15 arm-runs),
measured with OMP_NUM_THREADS=1 on a 2-core machine shared with other jobs (load average about
4): one seed of the default, the five arms from an existing warm start (``--seeds 0
--warm-start ...``), took 272 s (A1 32 s, A2 47 s, A3 40 s, A4 45 s, DiLoCo 100 s); the A0 SFT
warm start took 4.3 min inside the ladder at that load (3.4 min at a lighter one; its config
says about 7 min on a heavily shared machine). So the default takes about 3 x 4.5 + 4.3 = 18 min
(about 21 min with the slowest warm start); --warm-start skips the warm start's share.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# First on the path, from any working directory: the schemas are read from this repository's
# `recipes` package, not from the broken one torchtune's wheel installs (the import hook of
# composer_tune/recipe_finder.py only answers in the repository root).
sys.path.insert(0, str(REPO_ROOT))

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from composer_tune.analysis.metrics_log import Metrics, read_metrics, series  # noqa: E402
from composer_tune.checkpointing.run_state import (  # noqa: E402
    MODEL_DIR,
    checkpoint_dir,
    checkpoint_step,
    latest_checkpoint,
)
from composer_tune.config import load_recipe_config  # noqa: E402

TUNE = str(Path(sys.executable).parent / "tune")
ACCURACY, REWARD, GENERATED = "eval/accuracy", "reward/mean", "tokens/generated"
# log_channel_gradients: each channel's gradient norm before clipping, its share of the step,
# and the step's norm before clipping.
CHANNEL_NORM, CHANNEL_SHARE, STEP_NORM = "grad_norm/", "grad_share/", "grad_norm"
# ... and each channel's logit gradient on the end-of-reply token (> 0: shortens replies).
EOS_PUSH, EOS_SHARE = "eos_push/", "eos_share/"
# Sampled training completions: mean length and the share cut off at max_new_tokens.
LENGTH, TRUNCATED = "completion_length/mean", "truncation_rate"
LOG_TAIL_CHARS = 4000
# Console lines echoed while a run goes (the rest is in its run.log).
PROGRESS_MARKERS = ("held-out accuracy", "Error", "error:")


@dataclass(frozen=True)
class Arm:
    """One rung of the ladder: a recipe run from the shared warm start."""

    key: str  # as --arms and --override ARM:... name it
    title: str
    recipe: str  # path from the repository root
    replicas: int = 1  # > 1: DiLoCo replicas under tools/launch_diloco.py
    # The arm's own key=value settings, after every --override (an ablation arm stays one).
    overrides: tuple[str, ...] = ()
    # An ablation arm: the A4 channel it leaves out (its contribution is A4 minus this arm).
    without: str | None = None


ARMS = {
    arm.key: arm
    for arm in (
        Arm("a1", "A1 GRPO", "recipes/grpo.py"),
        Arm("a2", "A2 SDPO", "recipes/sdpo.py"),
        Arm("a3", "A3 trace-replay DPO", "recipes/replay_dpo.py"),
        Arm("a4", "A4 composer_full", "recipes/composer_full.py"),
        # "A4 minus one channel": composer_full with that channel's weight at 0 (the same
        # recipe and settings as A4 otherwise). A4 minus SDPO is A1+3, minus DPO is A1+2.
        Arm(
            "a4_no_policy",
            "A4 minus GRPO (channels 2+3)",
            "recipes/composer_full.py",
            overrides=("loss.weight=0",),
            without="GRPO (channel 1)",
        ),
        Arm(
            "a4_no_sdpo",
            "A4 minus SDPO (A1+3)",
            "recipes/composer_full.py",
            overrides=("sdpo.weight=0",),
            without="SDPO (channel 2)",
        ),
        Arm(
            "a4_no_dpo",
            "A4 minus trace-replay DPO (A1+2)",
            "recipes/composer_full.py",
            overrides=("dpo.weight=0",),
            without="trace-replay DPO (channel 3)",
        ),
        Arm(
            "diloco",
            "DiLoCo (A4 loop, 2 replicas)",
            "recipes/diloco.py",
            replicas=2,
        ),
    )
}
# Peers the ladder does not run: a tool of their own runs one and writes a ladder results.json
# (one arm) that --combine joins with the ladder's, so a peer has a title and a place in the
# table and plots, but no `tune run` (and is no choice of --arms).
PEER_ARMS = {
    arm.key: arm
    for arm in (Arm("trl_sdpo", "TRL 1.16 SDPOTrainer (peer)", "tools/trl_sdpo_peer.py"),)
}
TITLED_ARMS = {**ARMS, **PEER_ARMS}  # every arm a results table can hold, in table order
DEFAULT_ARMS = ["a1", "a2", "a3", "a4", "diloco"]
ABLATION_ARMS = [key for key, arm in ARMS.items() if arm.without is not None]
SFT_RECIPE = "recipes/sft.py"
NO_SFT = "none"  # --sft-config value: no SFT run, the arms start from their configs' checkpoint
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


# ------------------------------------------------------------------------------ aggregation


def value_at(points: Sequence[Sequence[float]], step: int) -> float | None:
    """The value a series logged at ``step`` (the last one, if several), else None."""
    found = [value for at, value in points if at == step]
    return found[-1] if found else None


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for a single value)."""
    if not values:
        raise ValueError("mean_std of no values")
    std = statistics.stdev(values) if len(values) > 1 else None
    return statistics.fmean(values), std


def report_steps(steps: int, eval_every: int) -> list[int]:
    """The steps the table reports: 0, the last evaluation at or before steps/2, and the final."""
    mid = (steps // 2) // eval_every * eval_every
    return sorted({0, mid, steps})


def fmt_mean_std(values: Sequence[float], digits: int) -> str:
    """A table cell: "mean ± std", the mean alone for one value, "–" for none."""
    if not values:
        return "–"
    mean, std = mean_std(values)
    if std is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def ok_records(results: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    """An arm's completed runs, by seed (failed runs stay out of the table and plots)."""
    return sorted(
        (r for r in results["runs"].values() if r["arm"] == arm and r["status"] == "ok"),
        key=lambda r: r["seed"],
    )


def accuracy_series(record: dict[str, Any]) -> list[list[float]]:
    """Held-out accuracy of a run (DiLoCo: replica 0's, which evaluates the global weights)."""
    return record["metrics"][0].get(ACCURACY, []) if record["metrics"] else []


def accuracy_by_tokens(record: dict[str, Any]) -> list[list[float]]:
    """Held-out accuracy against the completion tokens generated before it: ``[[tokens, acc]]``
    (:func:`generated_tokens` up to the evaluation's step)."""
    return [
        [generated_tokens(record["metrics"], until=step), accuracy]
        for step, accuracy in accuracy_series(record)
    ]


def replica_mean_series(record: dict[str, Any], name: str) -> list[list[float]]:
    """A training metric per step, averaged over process replicas (each samples its own
    rollouts and takes its own steps)."""
    by_step: dict[int, list[float]] = {}
    for metrics in record["metrics"]:
        for step, value in metrics.get(name, []):
            by_step.setdefault(int(step), []).append(value)
    return [[step, statistics.fmean(values)] for step, values in sorted(by_step.items())]


def reward_series(record: dict[str, Any]) -> list[list[float]]:
    """Training reward per step, averaged over process replicas."""
    return replica_mean_series(record, REWARD)


def gradient_channels(records: Sequence[dict[str, Any]]) -> list[str]:
    """The loss channels whose gradients the runs logged (``log_channel_gradients``), sorted."""
    return sorted(
        {
            name.removeprefix(CHANNEL_NORM)
            for record in records
            for metrics in record["metrics"]
            for name in metrics
            if name.startswith(CHANNEL_NORM)
        }
    )


def finite_points(points: Sequence[Sequence[float]]) -> list[Sequence[float]]:
    """A series without its non-finite steps (a skipped optimiser step logs NaN)."""
    return [point for point in points if math.isfinite(point[1])]


def run_average(points: Sequence[Sequence[float]]) -> float | None:
    """The mean of a series over its finite steps; None when it logged no finite value."""
    finite = finite_points(points)
    return statistics.fmean(value for _, value in finite) if finite else None


def fmt_standard_error(values: Sequence[float], digits: int) -> str:
    """A table cell: the standard error of the mean (sample std / sqrt(n)); "–" below 2 values."""
    if len(values) < 2:
        return "–"
    return f"{statistics.stdev(values) / math.sqrt(len(values)):.{digits}f}"


def table_rows(results: dict[str, Any], arms: Sequence[str], steps: Sequence[int]) -> list[str]:
    """The markdown table: per arm, accuracy at ``steps`` (mean ± std), the standard error of
    the final accuracy, wall time, tokens, seeds."""
    header = (
        "| arm | "
        + " | ".join(f"held-out acc @ step {step}" for step in steps)
        + " | final acc std error | wall time / run (s) | generated tokens / run | seeds |"
    )
    rows = [header, "|" + " --- |" * (len(steps) + 5)]
    for key in arms:
        records = ok_records(results, key)
        cells = [TITLED_ARMS[key].title]
        at_step: list[float | None] = []
        for step in steps:
            at_step = [value_at(accuracy_series(r), step) for r in records]
            cells.append(fmt_mean_std([v for v in at_step if v is not None], 3))
        cells.append(fmt_standard_error([v for v in at_step if v is not None], 3))
        cells.append(fmt_mean_std([r["wall_s"] for r in records], 0))
        cells.append(fmt_mean_std([r["generated_tokens"] for r in records], 0))
        failed = sorted(
            r["seed"] for r in results["runs"].values() if r["arm"] == key and r["status"] != "ok"
        )
        seeds = str(len(records)) + (f" ({len(failed)} failed: {failed})" if failed else "")
        cells.append(seeds)
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def channel_gradient_rows(results: dict[str, Any], arms: Sequence[str]) -> list[str]:
    """The channel-gradient table (empty when no run logged them): per arm and channel, its
    gradient norm before clipping and its share of the step, each run averaged over its steps,
    then mean ± std over seeds; the step's own norm before clipping beside them."""
    rows: list[str] = []
    for key in arms:
        records = ok_records(results, key)
        channels = gradient_channels(records)
        if not channels:
            continue
        step_norms = [run_average(replica_mean_series(r, STEP_NORM)) for r in records]
        for channel in channels:
            cells = [TITLED_ARMS[key].title, channel]
            for prefix in (CHANNEL_NORM, CHANNEL_SHARE, EOS_PUSH, EOS_SHARE):
                averages = [run_average(replica_mean_series(r, prefix + channel)) for r in records]
                cells.append(fmt_mean_std([v for v in averages if v is not None], 3))
            cells.append(fmt_mean_std([v for v in step_norms if v is not None], 3))
            cells.append(str(len(records)))
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return []
    header = (
        "| arm | channel | gradient norm before clipping | share of the step "
        "| push on the end-of-reply logit | share of the logit gradient on the end of reply "
        "| step's gradient norm before clipping | seeds |"
    )
    return [header, "|" + " --- |" * 8, *rows]


def final_training_value(record: dict[str, Any], name: str, step: int) -> float | None:
    """A training metric at ``step`` (replicas averaged), None where the run did not log it."""
    return value_at(replica_mean_series(record, name), step)


def contribution_rows(results: dict[str, Any], arms: Sequence[str]) -> list[str]:
    """The A4 ablation table (empty without A4 and an "A4 minus one channel" arm): per arm
    (A1 and A4 beside the ablations), the final held-out accuracy, generated tokens, and the
    sampled completions' mean length and truncated share at the final step, each mean ± std over
    seeds; for an ablation arm, the channel it leaves out and that channel's contribution, A4's
    mean minus the arm's (what the channel adds to A4)."""
    ablations = [key for key in arms if ARMS.get(key) and ARMS[key].without is not None]
    if "a4" not in arms or not ablations or not ok_records(results, "a4"):
        return []
    final = results["settings"]["steps"]

    def figures(key: str) -> dict[str, list[float]]:
        records = ok_records(results, key)
        values = {
            "accuracy": [value_at(accuracy_series(r), final) for r in records],
            "tokens": [r["generated_tokens"] for r in records],
            "length": [final_training_value(r, LENGTH, final) for r in records],
            "truncated": [final_training_value(r, TRUNCATED, final) for r in records],
        }
        return {name: [v for v in found if v is not None] for name, found in values.items()}

    a4 = figures("a4")
    digits = {"accuracy": 3, "tokens": 0, "length": 1, "truncated": 2}
    rows = []
    for key in [k for k in ("a1", "a4") if k in arms] + ablations:
        own = figures(key)
        cells = [TITLED_ARMS[key].title, ARMS[key].without or "–"]
        for name, places in digits.items():
            cells.append(fmt_mean_std(own[name], places))
            if ARMS[key].without is None:
                cells.append("–")
            elif own[name] and a4[name]:
                change = statistics.fmean(a4[name]) - statistics.fmean(own[name])
                cells.append(f"{change:+.{places}f}")
            else:
                cells.append("–")
        cells.append(str(len(ok_records(results, key))))
        rows.append("| " + " | ".join(cells) + " |")
    header = (
        f"| arm | channel left out | held-out acc @ step {final} | its contribution "
        "| generated tokens / run | its contribution "
        f"| completion length @ step {final} | its contribution "
        f"| truncated @ step {final} | its contribution | seeds |"
    )
    return [header, "|" + " --- |" * 11, *rows]


def render_markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    steps = report_steps(settings["steps"], settings["eval_every"])
    lines = [
        "# Ladder results",
        "",
        f"Command: `{settings['command']}`",
        "",
        f"Warm start: `{results.get('warm_start', {}).get('path', '?')}`; every arm "
        f"{settings['steps']} optimizer steps (DiLoCo: inner steps per replica), seeds "
        f"{settings['seeds']}, held-out evaluation every {settings['eval_every']} steps on "
        f"{', '.join(f'{k}={v}' for k, v in settings['heldout'].items())} (held-out problems "
        "are distinct: num_samples counts them).",
        "",
        *table_rows(results, settings["arms"], steps),
        "",
        "Held-out accuracy: greedy, mean ± sample std over the seeds that finished; its standard "
        "error is the final step's sample std / sqrt(seeds). Wall time: the "
        "whole `tune run` (start-up and evaluations included). Generated tokens: completion tokens "
        "sampled, the runs' logged `tokens/generated` (summed over replicas); prompt tokens and "
        "DPO pairs not included.",
    ]
    lines += _section(
        "Channel gradients",
        channel_gradient_rows(results, settings["arms"]),
        "Logged with `log_channel_gradients=true`: each channel's gradient norm before the "
        "clip and its share `<g_c, g> / |g|^2` of the step (the shares sum to 1; clipping "
        "scales every channel alike). Each run's values averaged over its steps, then mean ± "
        "std over seeds; per step in channel_gradients.png. Where logged, each channel's "
        "push on the end-of-reply logit, `-sum dL_c/dz_eos` over the positions it scores "
        "(> 0: its step makes replies end sooner; < 0: later), and the share of its logit "
        "gradient's absolute mass on that token.",
    )
    lines += _section(
        "What each A4 channel adds",
        contribution_rows(results, settings["arms"]),
        "An ablation arm is A4 with one channel's weight at 0 and nothing else changed; a "
        "channel's contribution is A4's mean minus that arm's (what adding the channel to the "
        "other two gives). Completion length and truncated share: the sampled training "
        "completions of the final step (truncated: cut off at max_new_tokens). Per step in "
        "completion_length.png and truncation.png.",
    )
    failed = [r for r in results["runs"].values() if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed runs", ""]
        for record in sorted(failed, key=lambda r: (r["arm"], r["seed"])):
            lines.append(
                f"- {record['arm']} seed {record['seed']}: exit status {record['returncode']}"
                f"{'; ' + record['metrics_error'] if 'metrics_error' in record else ''} "
                f"(log: `{record['log']}`; tail in results.json)"
            )
    return "\n".join(lines) + "\n"


def _section(title: str, rows: list[str], note: str) -> list[str]:
    """A results.md section: its title, table and note; nothing for no rows."""
    return ["", f"## {title}", "", *rows, "", note] if rows else []


def band_series(
    per_seed: Sequence[Sequence[Sequence[float]]],
) -> tuple[list[int], list[float], list[float]]:
    """Steps every seed logged, with the mean and std (0 for one seed) over seeds."""
    if not per_seed:
        return [], [], []
    common = set.intersection(*({int(step) for step, _ in points} for points in per_seed))
    steps = sorted(common)
    means, stds = [], []
    for step in steps:
        mean, std = mean_std([value_at(points, step) for points in per_seed])
        means.append(mean)
        stds.append(std or 0.0)
    return steps, means, stds


def require_matplotlib() -> Any:
    """matplotlib's pyplot (Agg backend), or a clear error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "the ladder's plots need matplotlib: pip install -e '.[dev]' (or pass --no-plots)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict[str, Any], out: Path, plt: Any) -> list[Path]:
    """accuracy.png and reward.png: per arm, the mean over seeds with a ±1 std band;
    accuracy_vs_tokens.png: each run's held-out accuracy against its generated tokens;
    channel_gradients.png where runs logged per-channel gradients."""
    written = [_plot_accuracy_vs_tokens(results, out, plt)]
    gradients = _plot_channel_gradients(results, out, plt)
    if gradients is not None:
        written.append(gradients)
    for name, title, series_of, marker in (
        ("accuracy.png", "held-out accuracy", accuracy_series, "o"),  # a few evaluations
        ("reward.png", "training reward (reward/mean)", reward_series, None),  # every step
        (
            "completion_length.png",
            "mean sampled completion length (tokens)",
            lambda record: replica_mean_series(record, LENGTH),
            None,
        ),
        (
            "truncation.png",
            "sampled completions cut off at max_new_tokens",
            lambda record: replica_mean_series(record, TRUNCATED),
            None,
        ),
    ):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for key in results["settings"]["arms"]:
            records = ok_records(results, key)
            steps, means, stds = band_series([series_of(r) for r in records if series_of(r)])
            if not steps:
                continue
            (line,) = axes.plot(
                steps, means, marker=marker, label=f"{TITLED_ARMS[key].title} (n={len(records)})"
            )
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
        axes.set_xlabel("optimizer step")
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.set_ylabel(title)
        axes.set_title(f"{title}: mean over seeds, band ±1 std")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        written.append(out / name)
    return written


def _plot_channel_gradients(results: dict[str, Any], out: Path, plt: Any) -> Path | None:
    """Per arm and channel, its gradient norm before clipping and its share of the step at every
    step (mean over seeds, band ±1 std); None when no run logged them."""
    curves = []
    for key in results["settings"]["arms"]:
        records = ok_records(results, key)
        for channel in gradient_channels(records):
            curves.append((key, channel, records))
    if not curves:
        return None
    eos = any(
        name.startswith(EOS_PUSH)
        for _, _, records in curves
        for record in records
        for metrics in record["metrics"]
        for name in metrics
    )
    figure, panels = plt.subplots(1, 3 if eos else 2, figsize=(18 if eos else 12, 4.5))
    norm_axes, share_axes = panels[:2]
    prefixes = [CHANNEL_NORM, CHANNEL_SHARE, EOS_PUSH][: len(panels)]
    for key, channel, records in curves:
        label = f"{TITLED_ARMS[key].title}: {channel} (n={len(records)})"
        for axes, prefix in zip(panels, prefixes, strict=True):
            per_seed = [finite_points(replica_mean_series(r, prefix + channel)) for r in records]
            steps, means, stds = band_series([points for points in per_seed if points])
            if not steps:
                continue
            (line,) = axes.plot(steps, means, label=label)
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    norm_axes.set_ylabel("gradient norm before clipping")
    norm_axes.set_yscale("log")
    plain = plt.FuncFormatter(lambda value, _: f"{value:g}")
    norm_axes.yaxis.set_major_formatter(plain)
    norm_axes.yaxis.set_minor_formatter(plain)
    share_axes.set_ylabel("share of the step  <g_c, g> / |g|^2")
    share_axes.axhline(0.0, color="grey", linewidth=0.8)
    if eos:
        panels[2].set_ylabel("push on the end-of-reply logit  -sum dL_c/dz_eos")
        panels[2].axhline(0.0, color="grey", linewidth=0.8)
    for axes in panels:
        axes.set_xlabel("optimizer step")
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle("per-channel gradients: mean over seeds, band ±1 std")
    figure.tight_layout()
    path = out / "channel_gradients.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _plot_accuracy_vs_tokens(results: dict[str, Any], out: Path, plt: Any) -> Path:
    """One line per run (seeds of an arm share a colour): sample efficiency at equal tokens."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, key in enumerate(results["settings"]["arms"]):
        for number, record in enumerate(ok_records(results, key)):
            points = accuracy_by_tokens(record)
            if not points:
                continue
            label = f"{TITLED_ARMS[key].title} (n={len(ok_records(results, key))})"
            axes.plot(
                [tokens for tokens, _ in points],
                [accuracy for _, accuracy in points],
                marker="o",
                color=colours[index % len(colours)],
                alpha=0.7,
                label=label if number == 0 else None,
            )
    axes.set_xlabel("generated rollout tokens")
    axes.set_ylabel("held-out accuracy")
    axes.set_title("held-out accuracy at equal generated tokens (one line per seed)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / "accuracy_vs_tokens.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def settings_clash(reference: dict[str, Any], other: dict[str, Any]) -> str | None:
    """Why ``other``'s runs cannot share a table with ``reference``'s (two results files): the
    first differing ``settings`` key of "steps", "eval_every", "heldout", or "warm_start";
    None when they compare."""
    for key in ("steps", "eval_every", "heldout"):
        if other["settings"][key] != reference["settings"][key]:
            return key
    if other.get("warm_start", {}).get("path") != reference.get("warm_start", {}).get("path"):
        return "warm_start"
    return None


def arm_command(runs: dict[str, Any], arm: str) -> list[str] | None:
    """The command an arm's runs share: without the per-seed ``output_dir=`` and ``seed=`` of a
    recipe, or ``--seed`` and ``--out`` of a peer's tool."""
    for record in runs.values():
        if record["arm"] != arm:
            continue
        shared, args = [], iter(record["command"])
        for arg in args:
            if arg in ("--seed", "--out"):
                next(args, None)
            elif not arg.startswith(("output_dir=", "seed=")):
                shared.append(arg)
        return shared
    return None


def combine_results(parts: Sequence[dict[str, Any]], sources: Sequence[Path]) -> dict[str, Any]:
    """One results file from ladders with identical settings that ran different arms or
    different seeds of an arm (e.g. in parallel, one per core); the table counts each arm's
    seeds, and the combined ``seeds`` is their union.

    Raises:
        ValueError: naming the folder whose settings or warm start clash with the first's, that
            holds a run (arm and seed) already combined, or whose arm ran another command (another
            config or overrides) than the same arm in an earlier folder.
    """
    first = parts[0]
    combined: dict[str, Any] = {
        "settings": {**first["settings"], "arms": [], "command": []},
        "warm_start": first.get("warm_start", {}),
        "runs": {},
    }
    for part, source in zip(parts, sources, strict=True):
        if "settings" not in part:
            raise ValueError(f"{source}: no ladder results (results.json has no settings)")
        clash = settings_clash(first, part)
        if clash == "warm_start":
            raise ValueError(f"{source}: another warm start than {sources[0]}'s")
        if clash:
            raise ValueError(
                f"{source}: {clash} {part['settings'][clash]} differs from {sources[0]}'s "
                f"{first['settings'][clash]}: only ladders with equal settings combine"
            )
        overlap = set(part["runs"]) & set(combined["runs"])
        if overlap:
            raise ValueError(f"{source}: runs {sorted(overlap)} are in two of the ladders")
        for arm in part["settings"]["arms"]:
            earlier, this = arm_command(combined["runs"], arm), arm_command(part["runs"], arm)
            if earlier is not None and earlier != this:
                raise ValueError(
                    f"{source}: arm {arm} ran another command than in an earlier folder "
                    f"({shlex.join(this or [])} against "
                    f"{shlex.join(earlier)}): only runs of the same arm settings combine"
                )
        combined["settings"]["arms"] += part["settings"]["arms"]
        combined["settings"]["seeds"] = sorted(
            set(combined["settings"]["seeds"]) | set(part["settings"]["seeds"])
        )
        combined["settings"]["command"].append(part["settings"]["command"])
        combined["runs"].update(part["runs"])
    arms = combined["settings"]["arms"]
    combined["settings"]["arms"] = [key for key in TITLED_ARMS if key in arms]
    combined["settings"]["command"] = "` and `".join(combined["settings"]["command"])
    return combined


# ------------------------------------------------------------------------------ main


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("runs/ladder"), help="results folder")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=list(ARMS),
        default=DEFAULT_ARMS,
        help="arms to run; the A4 ablations (A4 minus one channel): " + " ".join(ABLATION_ARMS),
    )
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per arm-run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds per arm")
    parser.add_argument(
        "--eval-every", type=int, default=4, help="held-out evaluation every N steps"
    )
    parser.add_argument(
        "--diloco-sync-every",
        type=int,
        default=4,
        help="DiLoCo inner steps per sync (H); must divide --eval-every and --steps",
    )
    parser.add_argument("--config", default="cpu_smoke", help="config of every arm")
    parser.add_argument(
        "--warm-start",
        type=Path,
        help="reuse this A0 warm start (SFT output folder or HF model folder) instead of training",
    )
    parser.add_argument(
        "--sft-config",
        default="cpu_smoke_hints",
        help="config of the A0 SFT run (the default's model can read SDPO's hints); "
        f"'{NO_SFT}': A0 is the checkpoint the arms' configs start from (e.g. --config smollm2), "
        "and their own task and held-out set are used",
    )
    parser.add_argument(
        "--sft-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for the A0 SFT run (repeatable)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="[ARM:]KEY=VALUE",
        help="override for every arm, or for one with ARM: (repeatable; wins over the ladder's)",
    )
    parser.add_argument(
        "--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of every run (default 1)"
    )
    parser.add_argument(
        "--run-timeout", type=float, default=3600.0, help="seconds before a run is stopped"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="run nothing: write --out's table and plots from these ladders' results (the same "
        "settings, different arms, e.g. one ladder per core)",
    )
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be positive")
    if "diloco" in args.arms:
        h = args.diloco_sync_every
        if h < 1 or args.eval_every % h or args.steps % h:
            parser.error(
                f"--diloco-sync-every {h} must divide --eval-every ({args.eval_every}) and "
                f"--steps ({args.steps}): DiLoCo evaluates its global weights at syncs"
            )
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.arms)) != len(args.arms):
        parser.error("--seeds and --arms must not repeat")


def subprocess_env(omp_threads: int) -> dict[str, str]:
    """The runs' environment: this one, this repository first on PYTHONPATH (``tune run``
    appends the working directory to ``sys.path`` after site-packages, where an editable
    install of another checkout would win), OMP_NUM_THREADS pinned, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["OMP_NUM_THREADS"] = str(omp_threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


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


def save(results: dict[str, Any], out: Path, plt: Any | None) -> None:
    """results.json (atomically), results.md and the plots, from everything finished so far."""
    write_json_atomic(out / "results.json", results)
    (out / "results.md").write_text(render_markdown(results))
    if plt is not None:
        write_plots(results, out, plt)


def imported_checkout() -> Path:
    """The checkout this process imported ``composer_tune`` from. An editable install's ``.pth``
    imports it at interpreter start, before this file puts its repository first on the path, so
    another checkout's package (and its config schemas) can win."""
    import composer_tune

    return Path(composer_tune.__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    if imported_checkout() != REPO_ROOT:
        parser.error(
            f"composer_tune was imported from {imported_checkout()}, not from this checkout "
            f"({REPO_ROOT}), so configs would be checked against another version: run with "
            f"PYTHONPATH={REPO_ROOT}"
        )
    plt = None if args.no_plots else require_matplotlib()  # fail before the compute, not after
    if args.combine:
        try:
            parts = [load_results(folder / "results.json") for folder in args.combine]
            combined = combine_results(parts, args.combine)
        except ValueError as err:
            parser.error(str(err))
        args.out.mkdir(parents=True, exist_ok=True)
        save(combined, args.out, plt)
        print(f"results: {args.out / 'results.md'}", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    env = subprocess_env(args.omp_threads)
    # Everything that can be refused is checked before any compute: the warm start, the
    # overrides, equal held-out sets, and earlier runs in --out made with other settings.
    try:
        results = load_results(results_path)
        sft_cfg = None
        if args.sft_config != NO_SFT:
            sft_cfg = load_recipe_config(REPO_ROOT / SFT_RECIPE, args.sft_config, args.sft_override)
        if args.warm_start is not None:
            warm_start = args.warm_start.resolve()
            warm_start_args = warm_start_overrides(warm_start)
        elif sft_cfg is None:  # the arms' configs name their checkpoint
            warm_start, warm_start_args = None, []
        else:
            warm_start = (args.out / "warm_start").resolve()
            final = checkpoint_dir(warm_start, sft_cfg.max_steps) / MODEL_DIR  # once trained
            warm_start_args = ["warm_start=null", f"checkpoint.initial_checkpoint={final}"]
        runs = plan_runs(args, warm_start_args, sft_cfg)
        if warm_start is None:
            warm_start = runs[0].resolved_config().checkpoint.initial_checkpoint
        heldout = heldout_set(runs)
        pending = [run for run in runs if not should_skip(results["runs"].get(run.key), run)]
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    results["settings"] = {
        "command": shlex.join(
            ["python", "tools/ladder.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "arms": args.arms,
        "seeds": args.seeds,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "heldout": heldout,
    }
    results.setdefault("warm_start", {"path": str(warm_start)})
    if pending and args.warm_start is None and sft_cfg is not None:
        try:
            train_warm_start(args, warm_start, sft_cfg.max_steps, results, env)
        except RuntimeError as err:
            write_json_atomic(results_path, results)
            print(f"error: {err}", file=sys.stderr)
            return 1
    failures = 0
    for index, run in enumerate(runs, start=1):
        progress = f"[{index}/{len(runs)}] {run.key}"
        if run not in pending:
            print(f"{progress}: completed earlier, skipped", flush=True)
            continue
        print(f"{progress}: {run.arm.title} ...", flush=True)
        previous = results["runs"].get(run.key)
        results["runs"][run.key] = running_record(run, previous)
        write_json_atomic(results_path, results)
        record = execute(run, env, args.run_timeout, previous)
        results["runs"][run.key] = record
        save(results, args.out, plt)
        if record["status"] == "ok":
            accuracy = accuracy_series(record)
            change = f"{accuracy[0][1]:.3f} -> {accuracy[-1][1]:.3f}" if accuracy else "not logged"
            print(f"{progress}: done in {record['wall_s']:.0f} s, held-out accuracy {change}")
        else:
            failures += 1
            print(f"{progress}: FAILED (exit {record['returncode']}), log {record['log']}")
    save(results, args.out, plt)
    print(f"results: {args.out / 'results.md'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
