"""Asynchronous rollouts (``rollout.max_staleness``, composer_tune/rollout/async_rollouts.py).

* ``max_staleness: 0`` is the synchronous step bit for bit: the recipe's loop over
  ``RLRun.rollouts`` gives the weights, metrics and checkpoint of the loop it replaced
  (``RLRun.rollout`` on ``epoch_batches``), and starts no worker.
* The stream's schedule, with the worker played in this process by :class:`ScriptedWorker`
  (so no process start): batches are sampled by weights at most ``k`` steps old and exactly
  ``k`` ahead once the pipeline runs, the data position advances only past batches handed to
  the trainer, a dead worker is replaced and its unanswered batches requested again, too many
  deaths are one error, and a batch older than ``k`` is dropped and generated again.
* End to end through ``tune run`` (slow): a worker killed with SIGKILL mid-run is replaced and
  the run finishes; Ctrl-C at ``max_staleness: 1`` saves the step it finished and ``latest``
  completes the run; an unreachable server is one ``error:`` line at set-up.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from composer_tune import config
from composer_tune.analysis.metrics_log import read_metrics
from composer_tune.channels.policy import sample_rollouts
from composer_tune.checkpointing.run_state import latest_checkpoint
from composer_tune.rollout import async_rollouts
from composer_tune.rollout.engine_config import RolloutEngineError
from composer_tune.run.loop import TIMING_METRICS, epoch_batches
from recipes.grpo import GRPOConfig, GRPORecipe
from tests.recipe_runs import REPO_ROOT, TUNE, checkout_env, run_recipe, run_tune
from tests.test_graceful_stop import COMMON  # random weights, small batches: fast steps


def _recipe(output_dir: Path, *overrides: str) -> GRPORecipe:
    cfg = config.load_config(
        "cpu_smoke",
        [*COMMON, f"output_dir={output_dir}", *overrides],
        recipe_file=REPO_ROOT / "recipes" / "grpo.py",
        schema=GRPOConfig,
    )
    recipe = GRPORecipe(cfg)
    recipe.setup()
    return recipe


def _checkpoint_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((latest_checkpoint(output_dir) / "model").glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def _logged(output_dir: Path) -> dict[int, dict[str, float]]:
    return {
        step: {k: v for k, v in values.items() if k not in TIMING_METRICS}
        for step, values in read_metrics(output_dir / "logs").items()
    }


# ----------------------------------------------------------------------------- staleness 0


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(tmp_path: Path) -> None:
    """The recipe at ``max_staleness: 0`` against the loop body it had before the stream
    existed (``run.rollout(next(epoch_batches(...)))``), from the same seed: the same loss and
    gradient norm at every step, the same final checkpoint, bit for bit."""
    steps = ("max_steps=3",)
    streamed = _recipe(tmp_path / "streamed", "rollout.max_staleness=0", *steps)
    assert streamed.run.stream is None  # no worker at staleness 0
    assert streamed.train()
    streamed.cleanup()

    before = _recipe(tmp_path / "before", *steps)
    run, progress = before.run, before.run.progress
    progress.record_before(before.evaluate())
    chores = run.chores(before.evaluate, before.save_checkpoint)
    prompts = epoch_batches(run.task.loader, run.task.sampler, progress)
    while progress.step < before.cfg.max_steps:
        rollout = run.rollout(next(prompts), before.objective.reference)
        batch = before.objective.prepare(rollout, advantage_sign=before.cfg.advantage_sign)
        chores.train_on(batch, before._optimizer_step)
    chores.finish()
    before.cleanup()

    logged, expected = _logged(tmp_path / "streamed"), _logged(tmp_path / "before")
    assert sorted(logged) == sorted(expected) and len(logged) >= 3
    for step, metrics in expected.items():
        assert logged[step] == metrics, step
    assert all("grad_norm" in logged[step] for step in (1, 2, 3))
    got, want = _checkpoint_weights(tmp_path / "streamed"), _checkpoint_weights(tmp_path / "before")
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


# ----------------------------------------------------------------------------- the schedule


class ScriptedWorker:
    """Plays the rollout worker in the test's process, with the trainer's own policy: a
    request is answered as soon as the published weights are new enough for it (as the real
    worker starts it), sampled by the policy as it is then, and reported with the version
    published then. ``die()`` makes it look dead until the stream starts it again."""

    run: Any = None  # the RLRun whose policy, tokenizer and reward it samples with
    instances: list[ScriptedWorker] = []

    def __init__(self, spec: Any, weights: Any, context: Any) -> None:
        self.weights = weights
        self.requests: list[Any] = []  # every request ever submitted, in order
        self.answers: list[tuple[Any, ...]] = []
        self.waiting: list[Any] = []
        self.starts = 0
        self.alive = False
        self.ready = True
        self.started_at = time.monotonic()
        self.process = SimpleNamespace(exitcode=-9)
        self.pid = 1000
        ScriptedWorker.instances.append(self)

    def start(self) -> None:
        self.starts += 1
        self.pid += 1
        self.alive = True
        self.waiting, self.answers = [], []

    def submit(self, request: Any) -> None:
        self.requests.append(request)
        self.waiting.append(request)
        self._answer_ready()

    def _answer_ready(self) -> None:
        while self.waiting and self.weights.version >= self.waiting[0].min_version:
            request = self.waiting.pop(0)
            run = ScriptedWorker.run
            rollout = sample_rollouts(
                run.model, request.samples, run.cfg, tokenizer=run.tokenizer,
                reward=run.task.reward, generator=torch.Generator().manual_seed(request.seed),
                reference=None, compute_old_logp=False, sync_ranks=False,
            )  # fmt: skip
            payload = pickle.dumps(rollout)  # as the worker sends it
            self.answers.append(("rollout", request.id, self.weights.version, payload, 0.0))

    def receive(self, timeout: float) -> tuple[Any, ...] | None:
        if not self.alive:
            return None
        self._answer_ready()
        assert self.answers, "the trainer awaits a batch no weights can sample yet"
        return self.answers.pop(0)

    def die(self) -> None:
        self.alive = False

    def stop(self) -> None:
        self.alive = False


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> type[ScriptedWorker]:
    monkeypatch.setattr(async_rollouts, "RolloutWorker", ScriptedWorker)
    ScriptedWorker.instances = []
    return ScriptedWorker


def _stream_recipe(tmp_path: Path, staleness: int, *overrides: str) -> GRPORecipe:
    recipe = _recipe(tmp_path, f"rollout.max_staleness={staleness}", *overrides)
    ScriptedWorker.run = recipe.run
    return recipe


def _train_batches(recipe: GRPORecipe, batches: int) -> list[dict[str, Any]]:
    """The recipe's loop for ``batches`` generation batches; per batch: the step it started
    at, the rows' weights versions, the requests submitted so far and the data position."""
    run = recipe.run
    rollouts = run.rollouts(recipe.objective.reference)
    chores = run.chores(lambda: None, recipe.save_checkpoint)
    seen = []
    for _ in range(batches):
        step = run.progress.step
        rollout = next(rollouts)
        seen.append({
            "step": step,
            "versions": set(rollout.policy_version.tolist()),
            "requested": len(ScriptedWorker.instances[0].requests),
            "position": run.progress.batches_in_epoch,
            "samples": rollout.samples[0],
        })  # fmt: skip
        batch = recipe.objective.prepare(rollout)
        chores.train_on(batch, recipe._optimizer_step)
    return seen


@pytest.mark.parametrize("staleness", [1, 2])
def test_batches_are_sampled_at_most_k_steps_behind_and_requested_k_ahead(
    tmp_path: Path, scripted: type[ScriptedWorker], staleness: int
) -> None:
    recipe = _stream_recipe(tmp_path, staleness, "max_steps=6")
    seen = _train_batches(recipe, 6)
    for index, batch in enumerate(seen):
        (version,) = batch["versions"]
        # Sampled while the batches before it trained: exactly k behind once the pipeline runs.
        assert batch["step"] - version == min(index, staleness), seen
        # Requested ahead: this batch and the k after it (none past max_steps).
        assert batch["requested"] == min(index + 1 + staleness, 6), seen
        # The run's data position counts the batches handed over, not those requested.
        assert batch["position"] == index + 1
    recipe.cleanup()
    logged = _logged(tmp_path)
    assert [logged[step]["async/staleness_max"] for step in range(1, 7)] == [
        float(min(step - 1, staleness)) for step in range(1, 7)
    ]


def test_a_resumed_stream_starts_at_the_first_batch_not_trained(
    tmp_path: Path, scripted: type[ScriptedWorker]
) -> None:
    """The data position a checkpoint would save after 2 batches (of 3 requested) makes a new
    stream hand over the uninterrupted stream's third batch next: batches in flight at a stop
    are generated again, none is skipped."""
    straight = _train_batches(_stream_recipe(tmp_path / "a", 1, "max_steps=4"), 3)
    ScriptedWorker.instances = []
    recipe = _stream_recipe(tmp_path / "b", 1, "max_steps=4")
    run = recipe.run
    run.stream.close()
    run.progress.step, run.progress.batches_in_epoch = straight[1]["step"] + 1, 2
    resumed = async_rollouts.AsyncRollouts(
        recipe.cfg, model=run.model, progress=run.progress, loader=run.task.loader,
        sampler=run.task.sampler, checkpoint=None, dist_info=recipe.dist,
    )  # fmt: skip
    settings = {"temperature": 1.0, "chunk_size": 64, "forward_batch_size": 8,
                "shared_prefix": True}  # fmt: skip
    rollout = resumed.next_batch(reference=None, compute_old_logp=False, logprob_settings=settings)
    assert rollout.samples[0] == straight[2]["samples"]
    assert run.progress.batches_in_epoch == 3


def test_a_dead_worker_is_replaced_and_its_batches_requested_again(
    tmp_path: Path, scripted: type[ScriptedWorker]
) -> None:
    recipe = _stream_recipe(tmp_path, 1, "max_steps=4", "rollout.worker.max_restarts=1")
    run, worker = recipe.run, ScriptedWorker.instances[0]
    _train_batches(recipe, 1)  # batch 2 is in flight now
    in_flight = [flight.request.id for flight in run.stream._in_flight]
    assert in_flight
    worker.die()
    _train_batches(recipe, 1)
    assert worker.starts == 2
    resubmitted = [r.id for r in worker.requests].count(in_flight[0])
    assert resubmitted == 2  # once to the dead worker, once to its replacement
    assert run.stream.metrics(run.progress.step)["async/worker_restarts"] == 1.0
    worker.die()  # past rollout.worker.max_restarts: one error naming the key
    with pytest.raises(RolloutEngineError, match=r"max_restarts"):
        _train_batches(recipe, 1)


def test_a_worker_dead_while_holding_the_weights_lock_does_not_block_the_trainer(
    tmp_path: Path, scripted: type[ScriptedWorker]
) -> None:
    """A worker killed mid-copy never releases the shared weights' lock: the trainer's next
    publish replaces it, with a fresh buffer holding the new weights."""
    recipe = _stream_recipe(tmp_path, 1, "max_steps=4")
    stream, worker = recipe.run.stream, ScriptedWorker.instances[0]
    stale = stream.weights
    # The "worker" (another thread: the lock is re-entrant) takes the lock and dies with it.
    taker = threading.Thread(target=stale._changed.acquire)
    taker.start()
    taker.join()
    worker.die()
    stream.publish(1)
    assert worker.starts == 2 and stream.restarts == 1
    assert stream.weights is not stale and stream.weights.version == 1
    assert worker.weights is stream.weights
    for name, value in recipe.run.model.state_dict().items():
        assert torch.equal(stream.weights.tensors[name], value), name


def test_a_batch_older_than_k_when_its_turn_comes_is_generated_again(
    tmp_path: Path, scripted: type[ScriptedWorker]
) -> None:
    """A server's weights pushed at an interval can leave a batch too old: it is dropped,
    counted, and generated again by weights in bounds."""
    recipe = _stream_recipe(tmp_path, 1, "max_steps=4")
    run = recipe.run
    _train_batches(recipe, 1)
    # The batch in flight claims weights from before the run: 2 steps behind at its turn.
    worker = ScriptedWorker.instances[0]
    kind, request_id, _, payload, seconds = worker.answers[0]
    worker.answers[0] = (kind, request_id, -1, payload, seconds)
    seen = _train_batches(recipe, 1)
    (version,) = seen[0]["versions"]
    assert seen[0]["step"] - version <= 1
    assert run.stream.dropped_rows == len(pickle.loads(payload))


def test_bad_rollout_settings_are_one_line_errors(tmp_path: Path) -> None:
    for index, (overrides, message) in enumerate((
        (["rollout.max_staleness=-1"], r"rollout.max_staleness must be >= 0"),
        (["rollout.max_staleness=1", "rollout.worker.threads=0"],
         r"rollout.worker.threads must be >= 1"),
        (["rollout.server.url=http://127.0.0.1:1", "rollout.server.push_every_n_steps=2"],
         r"push_every_n_steps \(2\) must be between 1 and rollout.max_staleness \+ 1 \(1\)"),
        (["rollout.max_staleness=1", "task_sampler.target_pass_rate=0.5"],
         r"task_sampler draws each batch .* set task_sampler=null or rollout.max_staleness=0"),
    )):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            _recipe(tmp_path / str(index), *overrides)


def test_an_unreachable_server_stops_the_run_at_setup_with_one_line(tmp_path: Path) -> None:
    result = run_tune(
        "recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={tmp_path / 'run'}",
        "rollout.server.url=http://127.0.0.1:1", timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in result.stderr.splitlines() if line.strip()][-1:]
    assert len(errors) == 1 and "http://127.0.0.1:1" in errors[0], result.stderr[-2000:]
    assert "rollout.server.url" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written


# ----------------------------------------------------------------------------- end to end


def _worker_pids(process: subprocess.Popen) -> list[int]:
    return [
        child.pid
        for child in psutil.Process(process.pid).children(recursive=True)
        if "composer_tune_rollout_worker" in " ".join(child.cmdline()) or _is_spawned(child)
    ]


def _is_spawned(child: psutil.Process) -> bool:
    try:
        return "multiprocessing.spawn" in " ".join(child.cmdline())
    except psutil.Error:
        return False


def _start(args: list[str], tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    env = {**checkout_env(), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    process = subprocess.Popen(
        [TUNE, "run", *args], cwd=REPO_ROOT, env=env, stdout=out.open("w"), stderr=err.open("w"),
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    return process, out, err


def _wait_for_step(process: subprocess.Popen, output_dir: Path, step: int, err: Path) -> None:
    deadline = time.monotonic() + 900
    marker = f"Step {step} |"
    while not any(marker in log.read_text() for log in (output_dir / "logs").glob("log_*.txt")):
        assert process.poll() is None, err.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{output_dir} never logged step {step}"
        time.sleep(0.05)


def _grpo(output_dir: Path, *overrides: str) -> list[str]:
    return ["recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={output_dir}", *COMMON,
            "rollout.max_staleness=1", *overrides]  # fmt: skip


@pytest.mark.slow
def test_a_killed_worker_is_replaced_without_stopping_training(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    process, out, err = _start(_grpo(output_dir, "max_steps=10"), tmp_path, "kill")
    _wait_for_step(process, output_dir, 2, err)
    (worker,) = _worker_pids(process)
    os.kill(worker, signal.SIGKILL)
    assert process.wait(timeout=900) == 0, err.read_text()[-3000:]
    stdout = out.read_text()
    assert re.search(rf"rollout worker \(pid {worker}\) died \(exit code -9\)", stdout), stdout
    logged = _logged(output_dir)
    assert [step for step in range(1, 11) if "loss" in logged.get(step, {})] == list(range(1, 11))
    assert logged[10]["async/worker_restarts"] == 1.0
    assert max(logged[step]["async/staleness_max"] for step in range(1, 11)) <= 1.0


@pytest.mark.slow
def test_sigint_at_staleness_one_keeps_every_finished_step_and_latest_finishes(
    tmp_path: Path,
) -> None:
    output_dir = tmp_path / "run"
    process, out, err = _start(_grpo(output_dir, "max_steps=10"), tmp_path, "stop")
    _wait_for_step(process, output_dir, 3, err)
    os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: trainer and worker alike
    assert process.wait(timeout=600) == 130, err.read_text()[-3000:]
    assert "Traceback" not in err.read_text()
    logged = _logged(output_dir)
    finished = max(step for step, values in logged.items() if "loss" in values)
    stopped_at = int(latest_checkpoint(output_dir).name.removeprefix("step_"))
    assert stopped_at == finished >= 3  # the checkpoint holds every step that was logged
    resumed = run_recipe(
        "grpo", "cpu_smoke", output_dir, *COMMON, "rollout.max_staleness=1", "max_steps=10",
        "checkpoint.resume_from_checkpoint=latest",
        f"logging.metric_logger.log_dir={tmp_path / 'resumed_logs'}",
    )  # fmt: skip
    assert f"at step {stopped_at}" in resumed.stdout
    resumed_steps = sorted(
        step for step, values in read_metrics(tmp_path / "resumed_logs").items() if "loss" in values
    )
    assert resumed_steps == list(range(stopped_at + 1, 11))
    assert int(latest_checkpoint(output_dir).name.removeprefix("step_")) == 10


@pytest.mark.slow
def test_a_trainer_killed_mid_step_leaves_no_worker_and_latest_finishes(tmp_path: Path) -> None:
    """kill -9 of the trainer at staleness 1: its orphaned worker exits by itself, and the
    periodic checkpoint resumes to the end of the run."""
    output_dir = tmp_path / "run"
    args = _grpo(output_dir, "max_steps=8", "checkpoint.save_every_n_steps=2")
    process, _, err = _start(args, tmp_path, "killed")
    _wait_for_step(process, output_dir, 5, err)
    (worker,) = _worker_pids(process)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    psutil.Process(worker).wait(timeout=120)  # gone without anyone stopping it
    saved = int(latest_checkpoint(output_dir).name.removeprefix("step_"))
    assert saved in (4, 6)
    resumed = run_recipe(
        "grpo", "cpu_smoke", output_dir, *COMMON, "rollout.max_staleness=1", "max_steps=8",
        "checkpoint.save_every_n_steps=2", "checkpoint.resume_from_checkpoint=latest",
        f"logging.metric_logger.log_dir={tmp_path / 'resumed_logs'}",
    )  # fmt: skip
    assert f"at step {saved}" in resumed.stdout
    steps = read_metrics(tmp_path / "resumed_logs")
    assert sorted(step for step, values in steps.items() if "loss" in values) == list(
        range(saved + 1, 9)
    )


@pytest.mark.slow
def test_a_worker_that_cannot_build_its_engine_stops_the_setup_with_its_error(
    tmp_path: Path,
) -> None:
    """The worker's own set-up error (here its vLLM engine's bad dtype) reaches the trainer at
    set-up, as the same error the trainer's own engine would raise, and no worker is left."""
    with pytest.raises(RolloutEngineError, match=r"rollout.vllm.dtype must be one of"):
        _recipe(
            tmp_path, "rollout.max_staleness=1", "rollout.engine=vllm", "rollout.vllm.dtype=fp64"
        )
    assert not [c for c in psutil.Process().children(recursive=True) if _is_spawned(c)]


class PidEnvironment:
    """A TRL environment that notes which process made it (in ``$PID_LOG``) and pays every
    other instance 1."""

    made = 0

    def __init__(self) -> None:
        PidEnvironment.made += 1
        self.pays = float(PidEnvironment.made % 2)
        with open(os.environ["PID_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")

    def reset(self, **sample: Any) -> str | None:
        return None

    def get_reward(self) -> float:
        return self.pays


@pytest.mark.slow
def test_agent_episodes_and_their_environments_run_in_the_worker(tmp_path: Path) -> None:
    """Multi-turn episodes at staleness 1: every episode's environment is made in the worker
    (the trainer makes one only, set-up's probe of the agent section), and the steps train."""
    output_dir, pids = tmp_path / "run", tmp_path / "pids.txt"
    args = [
        "recipes/grpo.py", "--config", "cpu_smoke_agent", f"output_dir={output_dir}",
        "agent.environment._component_=tests.test_async_rollouts.PidEnvironment",
        "rollout.max_staleness=1", "max_steps=3", "eval_dataset=null", "logging.progress_bar=false",
    ]  # fmt: skip
    env = {**checkout_env(), "PID_LOG": str(pids), "OMP_NUM_THREADS": "1"}
    with (tmp_path / "err").open("w") as err:
        process = subprocess.Popen(
            [TUNE, "run", *args], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        assert process.wait(timeout=900) == 0, (tmp_path / "err").read_text()[-3000:]
    made_by: dict[int, int] = {}
    for line in pids.read_text().split():
        made_by[int(line)] = made_by.get(int(line), 0) + 1
    assert made_by.pop(process.pid) == 1, made_by  # the trainer's set-up probe
    ((worker, made),) = made_by.items()  # one worker, never replaced
    assert made >= 1 + 3 * 2 * 4, made  # its own probe, then 3 batches of 2 prompts x 4
    logged = _logged(output_dir)
    for step in (1, 2, 3):
        assert logged[step]["episode/turns"] >= 1 and logged[step]["grad_norm"] > 0
    assert logged[3]["async/staleness_max"] == 1.0


# ----------------------------------------------------------------------------- a real server


def _server_checkpoint(directory: Path) -> Path:
    """cpu_smoke's toy Qwen3 from another seed than the trainer's, with its tokenizer: the
    server starts from weights the trainer does not have, so only a push makes them agree."""
    cfg = config.load_config(
        "cpu_smoke", ["warm_start=null", "seed=7", f"output_dir={directory}"],
        recipe_file=REPO_ROOT / "recipes" / "grpo.py", schema=GRPOConfig,
    )  # fmt: skip
    from composer_tune.checkpointing.hf_checkpoint import save_hf_checkpoint
    from composer_tune.distributed import DistInfo
    from composer_tune.run.loop import build_model

    model = build_model(cfg, DistInfo(1, 0, torch.device("cpu")), None, trainable=False)
    save_hf_checkpoint(
        model.state_dict(), model.config, directory, copy_files_from=REPO_ROOT / cfg.tokenizer.path
    )
    return directory


@pytest.mark.slow
def test_a_vllm_server_generates_from_pushed_weights_and_a_restarted_server_is_rejoined(
    tmp_path: Path,
) -> None:
    """vLLM's CPU server started as tools/serve_rollouts.py starts it: the first batch's
    sampler log-probs equal the trainer's (the gloo push replaced the server's other weights),
    later rows are at most 1 step stale; the server killed and started again mid-run costs a
    worker, which rejoins it, and the run finishes."""
    from composer_tune.teachers.local_server import LocalServerSettings, LocalTeacherServer

    settings = LocalServerSettings(
        model_dir=_server_checkpoint(tmp_path / "server_model"), served_model_name="policy",
        max_model_len=128, kv_cache_gib=1, chat_template=None, tool_call_parser=None,
        rollout_server=True, startup_timeout_s=600,
    )  # fmt: skip
    server = LocalTeacherServer(settings, log_path=tmp_path / "server.log")
    server.start()
    try:
        output_dir = tmp_path / "run"
        url = server.base_url.removesuffix("/v1")
        args = _grpo(output_dir, "max_steps=8", f"rollout.server.url={url}")
        process, out, err = _start(args, tmp_path, "server")
        _wait_for_step(process, output_dir, 3, err)
        server.kill()
        server.start()
        assert process.wait(timeout=1200) == 0, err.read_text()[-3000:]
    finally:
        server.stop()
    assert "died (exit code 3)" in out.read_text(), out.read_text()[-2000:]
    logged = _logged(output_dir)
    assert [step for step in range(1, 9) if "loss" in logged.get(step, {})] == list(range(1, 9))
    # Step 1: the server sampled with exactly the trainer's weights (a float32 engine).
    assert logged[1]["sampling/logp_diff_abs"] < 1e-4, logged[1]
    assert all(logged[step]["async/staleness_max"] <= 1 for step in range(1, 9))
    assert logged[8]["async/worker_restarts"] >= 1
