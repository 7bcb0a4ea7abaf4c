"""Asynchronous rollouts: batches generated ahead of training by a rollout worker beside the
trainer, with weights at most ``rollout.max_staleness`` optimiser steps old, on the worker's own
engine (native or vLLM) or on a vLLM server elsewhere.

``rollout.max_staleness: 0`` without a server never builds any of this: the trainer samples
each batch itself, as before. Otherwise :class:`AsyncRollouts` hands the recipe its batches:

* **The worker** is one process (``torch.multiprocessing``, spawned), with its own threads
  (``rollout.worker.threads``) or device, its own copy of the policy, tokenizer, reward and agent
  environments (multi-turn episodes run there), and the engine ``rollout.engine`` names. It
  takes requests (a batch of prompts, the oldest weights version it may sample with, a seed) in
  order and returns each batch's rows with the weights version that sampled them and the
  sampler's log-probs.
* **Weights** reach the worker through shared memory (:class:`SharedWeights`): after every
  optimiser step the trainer copies its weights into one shared buffer and bumps its version;
  the worker copies the newest version out before a batch (both under one lock, so neither ever
  sees half a step). No disk, no serialisation, and the trainer never waits for the worker to
  be ready to receive: a push is one memory copy. A process group would make both sides meet
  for every push; shared memory lets the worker take the newest weights when it needs them.
* **Staleness**: the batch the trainer will start at step ``t`` is requested with ``t - k`` as
  its oldest acceptable version (``k = max_staleness``), and issued as soon as the weights it
  needs can exist before the current batch's training ends, so with ``k >= 1`` the next batches
  are generated while the current one trains. A batch older than ``k`` when its turn comes (a
  server whose weights are pushed at an interval) is dropped and generated again.
* **The correction**: the trainer recomputes the rows' log-probs with its current weights where
  the channels need them (the proximal policy of decoupled PPO: AReaL, arXiv 2505.24298), and
  the loss reweights each token by the existing truncated or masked importance weight
  ``exp(old_logp - sampling_logp)`` (``loss.sampling_correction``; ``token_truncate`` when left
  null at ``k >= 1``): one correction covers both the sampler's numerics and the staleness.
* **Faults**: a worker that dies is replaced (``rollout.worker.max_restarts``) and every batch it
  held is requested again; a worker ignores SIGINT, so Ctrl-C reaches the trainer alone, which
  stops at the end of its batch as always. Checkpoints record the data position of the batches
  trained, so a resumed run generates the in-flight ones again: no finished step is lost.
* **A remote server** (``rollout.server.url``): :class:`ServerEngine` is the worker's engine
  then. Prompts go to the server's OpenAI-compatible ``/v1/completions`` as token ids, and the
  worker pushes the weights every ``push_every_n_steps`` over a torch.distributed process group
  (gloo on CPUs, NCCL on GPUs) that it opens with the server's vLLM workers through vLLM's
  ``/collective_rpc`` (its dev mode) and :class:`WeightReceiver`, the worker extension
  ``tools/serve_rollouts.py`` starts the server with (TRL's server mode and verl do the same
  with NCCL).

Single-process trainers only (under torchrun ``max_staleness`` must be 0, without a server).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf
from torch import nn

from composer_tune import config
from composer_tune.agents import build_agent
from composer_tune.channels.policy import sample_rollouts
from composer_tune.checkpointing.hf_checkpoint import checkpoint_tensors
from composer_tune.distributed import DistInfo
from composer_tune.rewards.functions import build_reward
from composer_tune.rollout.engine_config import RolloutEngineError
from composer_tune.rollout.engines import build_rollout_engine
from composer_tune.rollout.generation import GenerationOutput
from composer_tune.rollout.rollouts import RolloutBatch, batch_logprobs
from composer_tune.rollout.vllm_engine import refresh_tied_output_head
from composer_tune.run.loop import build_model, epoch_batches, steps_per_generation_batch
from composer_tune.run.state import RunProgress

# How often a waiting side looks again at the other (seconds): a dead worker or trainer is
# noticed this fast.
_POLL_S = 1.0
_WORKER_STOP_S = 5.0
# A worker whose server stopped answering exits with this status, and is replaced.
SERVER_LOST_EXIT_CODE = 3


def uses_rollout_worker(section: Any) -> bool:
    """Whether ``rollout`` asks for a rollout worker: staleness above 0 or a server."""
    return section.max_staleness > 0 or section.server.url is not None


def check_rollout_section(section: Any, dist_info: DistInfo) -> None:
    """Rejects ``rollout`` settings the worker cannot run, naming the key (ValueError)."""
    if section.max_staleness < 0:
        raise ValueError(f"rollout.max_staleness must be >= 0, got {section.max_staleness}")
    if not uses_rollout_worker(section):
        return
    if dist_info.is_distributed:
        raise ValueError(
            "rollout.max_staleness >= 1 and rollout.server run one rollout worker beside a "
            f"single-process trainer; this run has {dist_info.world_size} ranks (use "
            "max_staleness 0 without a server under torchrun)"
        )
    worker, server = section.worker, section.server
    if worker.threads is not None and worker.threads < 1:
        raise ValueError(f"rollout.worker.threads must be >= 1 or null, got {worker.threads}")
    if worker.max_restarts < 0:
        raise ValueError(f"rollout.worker.max_restarts must be >= 0, got {worker.max_restarts}")
    if server.url is None:
        return
    if server.weight_sync not in ("auto", "gloo", "nccl"):
        raise ValueError(
            f"rollout.server.weight_sync must be auto, gloo or nccl, got {server.weight_sync!r}"
        )
    if server.push_every_n_steps < 1 or server.push_every_n_steps > section.max_staleness + 1:
        raise ValueError(
            f"rollout.server.push_every_n_steps ({server.push_every_n_steps}) must be between 1 "
            f"and rollout.max_staleness + 1 ({section.max_staleness + 1}): a batch must be "
            "sampled by weights at most max_staleness steps old"
        )
    check_server(server.url, timeout_s=10.0)


# ----------------------------------------------------------------------------- weights


class SharedWeights:
    """The policy's weights in shared memory, one version (optimiser step) at a time.

    The trainer :meth:`publish`-es after each step; the worker :meth:`load_into` its own model
    before a batch. Both hold one lock while they copy, so a copy is never of half a step.
    """

    def __init__(self, model: nn.Module, context: Any) -> None:
        self.tensors = {
            name: value.detach().to("cpu", copy=True).share_memory_()
            for name, value in model.state_dict().items()
        }
        self._version = context.Value("q", -1, lock=False)
        self._changed = context.Condition()

    @property
    def version(self) -> int:
        return int(self._version.value)

    def publish(self, model: nn.Module, version: int, *, timeout: float | None = None) -> bool:
        """Copies ``model``'s weights in as ``version`` and wakes a waiting worker; False if the
        lock was not free within ``timeout`` (a worker killed while copying never frees it)."""
        if not self._changed.acquire(timeout=timeout):
            return False
        try:
            with torch.no_grad():
                for name, value in model.state_dict().items():
                    self.tensors[name].copy_(value.detach())
            self._version.value = version
            self._changed.notify_all()
        finally:
            self._changed.release()
        return True

    def load_into(
        self, model: nn.Module, min_version: int, *, holding: int, alive: Callable[[], bool]
    ) -> int:
        """Waits until the version is at least ``min_version``, copies the weights into
        ``model`` unless it holds that version already (``holding``), returns the version;
        returns -1 once ``alive()`` is False (the trainer is gone)."""
        with self._changed:
            while self._version.value < min_version:
                if not alive():
                    return -1
                self._changed.wait(timeout=_POLL_S)
            version = int(self._version.value)
            if version != holding:
                with torch.no_grad():
                    model.load_state_dict(self.tensors)
            return version


# ----------------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class RolloutRequest:
    """One generation batch: its prompts, the oldest weights version that may sample it, the
    seed of its sampling randomness."""

    id: int
    samples: list[dict[str, Any]]
    min_version: int
    seed: int


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds itself from: the resolved recipe config, the checkpoint its
    model starts from (its weights are then replaced by the trainer's), its device, threads,
    and the trainer's pid (a worker whose trainer is gone exits)."""

    config: dict[str, Any]
    checkpoint: str | None
    device: str
    threads: int
    trainer_pid: int


def _moved(rollout: RolloutBatch, device: torch.device | str) -> RolloutBatch:
    """``rollout`` with every tensor on ``device``."""
    tensors = {}
    for field in dataclasses.fields(rollout):
        value = getattr(rollout, field.name)
        if isinstance(value, torch.Tensor):
            tensors[field.name] = value.to(device)
    return dataclasses.replace(rollout, **tensors)


def _portable(error: BaseException) -> BaseException:
    """``error`` itself if it survives pickling (the trainer raises the worker's own error),
    else a RolloutEngineError quoting it."""
    try:
        pickle.dumps(error)
    except Exception:
        return RolloutEngineError(f"the rollout worker failed: {type(error).__name__}: {error}")
    return error


def _worker_engine(cfg: DictConfig, model: nn.Module, dist_info: DistInfo, version: int) -> Any:
    """The worker's engine: the remote server's, else what ``rollout.engine`` names (None:
    the native loop on the worker's own model)."""
    if cfg.rollout.server.url is not None:
        return ServerEngine(cfg.rollout.server, model, dist_info.device)
    return build_rollout_engine(cfg, model, dist_info, step=version)


def worker_main(spec: WorkerSpec, weights: SharedWeights, requests: Any, results: Any) -> None:
    """The rollout worker process: builds its model, tokenizer, reward, agent and engine, then
    answers requests in order until it gets None or the trainer is gone."""
    # Ctrl-C in a terminal signals the whole process group: the trainer decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)

    def trainer_alive() -> bool:
        return os.getppid() == spec.trainer_pid

    cfg = OmegaConf.create(spec.config)
    dist_info = DistInfo(world_size=1, rank=0, device=torch.device(spec.device))
    try:
        tokenizer = config.instantiate(cfg.tokenizer)
        agent = build_agent(cfg.agent)
        reward = build_reward(cfg.reward, where="reward")
        model = build_model(cfg, dist_info, spec.checkpoint, trainable=False)
        version = weights.load_into(model, weights.version, holding=-1, alive=trainer_alive)
        engine = _worker_engine(cfg, model, dist_info, version)
    except Exception as error:  # the trainer raises it: the run cannot sample
        results.put(("error", None, _portable(error)))
        return
    push_every = cfg.rollout.server.push_every_n_steps
    results.put(("ready",))
    try:
        while trainer_alive():
            try:
                request = requests.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if request is None:
                break
            try:
                version = weights.load_into(
                    model, request.min_version, holding=version, alive=trainer_alive
                )
                if version < 0:
                    break
                sampled_by = version
                if isinstance(engine, ServerEngine):
                    # Pushed every push_every steps, and whenever the request needs newer ones.
                    held = engine.weights_version
                    if held is not None and held >= request.min_version:
                        sampled_by = held if version - held < push_every else version
                start = time.perf_counter()
                generator = torch.Generator(device=dist_info.device)
                generator.manual_seed(request.seed)
                rollout = sample_rollouts(
                    model, request.samples, cfg, tokenizer=tokenizer, reward=reward,
                    generator=generator, reference=None, compute_old_logp=False,
                    sync_ranks=False, engine=engine, policy_version=sampled_by, agent=agent,
                )  # fmt: skip
                seconds = time.perf_counter() - start
                # Pickled here, tensors by value: a batch in the queue does not depend on
                # this process living on (shared-memory tensors would be lost with it).
                payload = pickle.dumps(_moved(rollout, "cpu"))
                results.put(("rollout", request.id, sampled_by, payload, seconds))
            except ServerLost as error:
                # The trainer replaces this worker; the new one waits for the server to return.
                print(f"rollout worker: {error}", file=sys.stderr, flush=True)
                os._exit(SERVER_LOST_EXIT_CODE)
            except Exception as error:
                results.put(("error", request.id, _portable(error)))
    finally:
        if engine is not None:
            engine.close()


class RolloutWorker:
    """The trainer's handle on one worker process (:func:`worker_main`), spawned by
    :meth:`start` with fresh queues (a killed process may leave a queue half-written)."""

    def __init__(self, spec: WorkerSpec, weights: SharedWeights, context: Any) -> None:
        self.spec, self.weights, self.context = spec, weights, context
        self.process: Any = None
        self.started_at = 0.0
        self.ready = False

    def start(self) -> None:
        self.requests = self.context.Queue()
        self.results = self.context.Queue()
        self.process = self.context.Process(
            target=worker_main,
            args=(self.spec, self.weights, self.requests, self.results),
            name="composer_tune_rollout_worker",
        )
        self.process.start()
        self.started_at, self.ready = time.monotonic(), False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def submit(self, request: RolloutRequest) -> None:
        self.requests.put(request)

    def receive(self, timeout: float) -> tuple[Any, ...] | None:
        """The worker's next message, or None (none yet, or one a dying worker left unread)."""
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None
        except (EOFError, OSError, pickle.UnpicklingError):
            return None

    def stop(self) -> None:
        """Asks the worker to finish, then kills it if it has not after a while."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=_WORKER_STOP_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        # Requests nobody will read must not hold this process's exit.
        self.requests.cancel_join_thread()
        self.process = None


# ----------------------------------------------------------------------------- the stream


@dataclass
class _DataCursor:
    """The data position :func:`epoch_batches` advances (RunProgress's two fields), kept apart
    from the run's so that batches drawn ahead do not count as trained."""

    epoch: int
    batches_in_epoch: int


@dataclass
class _InFlight:
    request: RolloutRequest
    position: tuple[int, int]  # the data position once this batch is trained


class AsyncRollouts:
    """The recipe's generation batches from a rollout worker, at most ``max_staleness`` steps
    behind the trainer (module docstring).

    Args:
        cfg: the recipe config.
        model: the trainer's policy (its weights are published after every step).
        progress: the run's progress (step and data position; the position advances as
            batches are handed over, not as they are requested).
        loader, sampler: the training prompts.
        checkpoint: what the worker's model starts from before the first weights arrive.
        dist_info: the trainer's place (single process).
    """

    def __init__(
        self,
        cfg: DictConfig,
        *,
        model: nn.Module,
        progress: RunProgress,
        loader: Any,
        sampler: Any,
        checkpoint: Any,
        dist_info: DistInfo,
    ) -> None:
        section = cfg.rollout
        self.cfg, self.model, self.progress = cfg, model, progress
        self.device = dist_info.device
        self.max_staleness = section.max_staleness
        self.steps_per_batch = steps_per_generation_batch(cfg)
        self.max_restarts = section.worker.max_restarts
        self.start_timeout_s = section.worker.start_timeout_s
        self._cursor = _DataCursor(progress.epoch, progress.batches_in_epoch)
        self._prompts = epoch_batches(loader, sampler, self._cursor)
        self._context = mp.get_context("spawn")
        self.version = progress.step  # of the weights last published
        self.weights = SharedWeights(model, self._context)
        self.weights.publish(model, self.version)
        spec = WorkerSpec(
            config=OmegaConf.to_container(cfg, resolve=True),
            checkpoint=str(checkpoint) if checkpoint is not None else None,
            device=section.worker.device or str(dist_info.device),
            threads=section.worker.threads or torch.get_num_threads(),
            trainer_pid=os.getpid(),
        )
        self.worker = RolloutWorker(spec, self.weights, self._context)
        atexit.register(self.close)
        self._in_flight: deque[_InFlight] = deque()
        self._done: dict[int, tuple[int, RolloutBatch, float]] = {}
        self._next_id = 0
        self._versions: torch.Tensor | None = None  # the batch in training's rows' versions
        self.restarts = 0
        self.dropped_rows = 0
        self.wait_seconds = 0.0
        self.generation_seconds = 0.0
        self.worker.start()

    # -- requests

    def _seed(self, position: tuple[int, int]) -> int:
        """The sampling seed of the batch at data ``position``: the same batch is sampled with
        the same randomness whoever generates it (again after a worker dies, or on resume)."""
        epoch, index = position
        return (self.cfg.seed * 1_000_003 + epoch) * 1_000_003 + index

    def _issue(self) -> None:
        """Requests every batch whose oldest acceptable weights can exist before the current
        batch's training ends (the next one with ``max_staleness >= 1``), up to ``max_steps``."""
        step, per_batch = self.progress.step, self.steps_per_batch
        while True:
            starts_at = step + len(self._in_flight) * per_batch
            min_version = starts_at - self.max_staleness
            if starts_at >= self.cfg.max_steps or min_version > step + per_batch - 1:
                return
            samples = next(self._prompts)
            position = (self._cursor.epoch, self._cursor.batches_in_epoch)
            self._submit(_InFlight(
                RolloutRequest(self._next_id, samples, max(min_version, 0), self._seed(position)),
                position,
            ))  # fmt: skip
            self._next_id += 1

    def _submit(self, flight: _InFlight, *, first: bool = False) -> None:
        if first:
            self._in_flight.appendleft(flight)
        else:
            self._in_flight.append(flight)
        self.worker.submit(flight.request)

    # -- results

    def _await(self, request_id: int) -> tuple[int, RolloutBatch, float]:
        """The worker's answer to ``request_id``, replacing a worker that died meanwhile."""
        while request_id not in self._done:
            self._take_message()
        return self._done.pop(request_id)

    def wait_until_ready(self) -> None:
        """Returns once the worker has built everything it samples with; raises its error if
        it could not."""
        while not self.worker.ready:
            self._take_message()

    def _take_message(self) -> None:
        """Takes the worker's next message (a finished batch, its readiness or its error),
        or, when none comes, replaces a dead worker and gives up on one that never starts."""
        message = self.worker.receive(timeout=_POLL_S)
        if message is None:
            if not self.worker.alive:
                self._replace_worker(f"exit code {self.worker.process.exitcode}")
            elif (
                not self.worker.ready
                and time.monotonic() - self.worker.started_at > self.start_timeout_s
            ):
                raise RolloutEngineError(
                    f"the rollout worker did not start within {self.start_timeout_s:.0f} s "
                    "(rollout.worker.start_timeout_s)"
                )
            return
        kind = message[0]
        if kind == "ready":
            self.worker.ready = True
        elif kind == "error":
            raise message[2]
        elif kind == "rollout":
            _, answered, version, payload, seconds = message
            self._done[answered] = (version, pickle.loads(payload), seconds)

    def _replace_worker(self, reason: str) -> None:
        """Starts a new worker in place of a dead one and requests its unanswered batches
        again, or raises once ``max_restarts`` are spent."""
        dead = self.worker.pid
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RolloutEngineError(
                f"the rollout worker (pid {dead}) died ({reason}) after {self.max_restarts} "
                "replacements (rollout.worker.max_restarts)"
            )
        self.worker.stop()
        # Fresh shared weights: the dead worker may have died holding the old buffer's lock.
        self.weights = SharedWeights(self.model, self._context)
        self.weights.publish(self.model, self.version)
        self.worker.weights = self.weights
        self.worker.start()
        again = [f for f in self._in_flight if f.request.id not in self._done]
        for flight in again:
            self.worker.submit(flight.request)
        print(
            f"rollout worker (pid {dead}) died ({reason}); started pid {self.worker.pid}, "
            f"which generates its {len(again)} unfinished batches again",
            flush=True,
        )

    def next_batch(
        self, *, reference: nn.Module | None, compute_old_logp: bool, logprob_settings: dict
    ) -> RolloutBatch:
        """The next generation batch's rows, sampled by weights at most ``max_staleness``
        steps old, on the trainer's device, with the trainer's old (``compute_old_logp``) and
        ``reference`` log-probs; the run's data position moves past it."""
        while True:
            self._issue()
            flight = self._in_flight[0]
            start = time.perf_counter()
            version, rollout, seconds = self._await(flight.request.id)
            self.wait_seconds = time.perf_counter() - start
            self._in_flight.popleft()
            if self.progress.step - version <= self.max_staleness:
                break
            # Sampled by weights pushed too long ago: generate it again.
            self.dropped_rows += len(rollout)
            stale = flight.request
            fresh = dataclasses.replace(
                stale, id=self._next_id, min_version=self.progress.step - self.max_staleness
            )
            self._next_id += 1
            self._submit(_InFlight(fresh, flight.position), first=True)
        self.generation_seconds = seconds
        self.progress.epoch, self.progress.batches_in_epoch = flight.position
        rollout = _moved(rollout, self.device)
        rollout.policy_version = torch.full((len(rollout),), version, device=rollout.tokens.device)
        if compute_old_logp:
            rollout.old_logp = batch_logprobs(self.model, rollout, **logprob_settings)
        if reference is not None:
            rollout.ref_logp = batch_logprobs(reference, rollout, **logprob_settings)
        self._versions = rollout.policy_version
        return rollout

    # -- the trainer's side of each step

    def publish(self, version: int) -> None:
        """The trainer's weights after optimiser step ``version``, for the worker (into a new
        worker's buffer if the worker died holding the lock of its own)."""
        self.version = version
        while not self.weights.publish(self.model, version, timeout=_POLL_S):
            if not self.worker.alive:
                self._replace_worker(f"exit code {self.worker.process.exitcode}")
                return

    def metrics(self, step: int) -> dict[str, float]:
        """This step's staleness (of the rows it trains on: ``step`` minus the version that
        sampled them), the seconds the trainer waited for their batch and the worker took to
        generate it, and the run's rows dropped as too stale and workers replaced so far."""
        metrics = {
            "async/wait_seconds": self.wait_seconds,
            "async/generation_seconds": self.generation_seconds,
            "async/dropped_stale_rows": float(self.dropped_rows),
            "async/worker_restarts": float(self.restarts),
        }
        if self._versions is not None:
            age = (step - self._versions).double()
            metrics["async/staleness_mean"] = float(age.mean())
            metrics["async/staleness_max"] = float(age.max())
        return metrics

    def close(self) -> None:
        """Stops the worker (idempotent); the stream no longer keeps the policy alive."""
        self.worker.stop()
        atexit.unregister(self.close)


# ----------------------------------------------------------------------------- remote server


class ServerLost(RolloutEngineError):
    """The rollout server stopped answering (connection refused, reset or timed out)."""


def wait_for_server(url: str, *, timeout_s: float) -> dict[str, Any]:
    """:func:`check_server` until the server answers or ``timeout_s`` pass (a server being
    restarted); raises ServerLost then."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check_server(url, timeout_s=10.0)
        except ValueError as error:
            if time.monotonic() > deadline:
                raise ServerLost(str(error)) from None
        time.sleep(_POLL_S)


def check_server(url: str, *, timeout_s: float) -> dict[str, Any]:
    """``GET <url>/v1/models`` of a vLLM server: its first model's card (``id``,
    ``max_model_len``). Raises ValueError, one line naming the server, when nothing answers
    there or the answer is not a vLLM model list."""
    base = url.rstrip("/")
    try:
        reply = httpx.get(f"{base}/v1/models", timeout=timeout_s)
        reply.raise_for_status()
        return reply.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"rollout.server.url: no vLLM server answers at {base} ({reason}); start one with "
            "tools/serve_rollouts.py"
        ) from None


def _process_group(backend: str, store: Any, rank: int, world_size: int, timeout_s: float) -> Any:
    """A torch.distributed process group of its own (outside the default group)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class ServerEngine:
    """A vLLM server elsewhere as the worker's engine (the interface of
    :class:`~composer_tune.rollout.vllm_engine.VLLMEngine`): ``generate`` through the server's
    ``/v1/completions`` (prompts as token ids, each sampled token's id and log-prob back), and
    ``sync_weights`` over a torch.distributed group with the server's vLLM workers
    (:class:`WeightReceiver`), opened at construction.

    The server must log-prob the distribution it samples from (``--logprobs-mode
    processed_logprobs``, as ``tools/serve_rollouts.py`` starts it). It takes no per-request
    seed here (a batch repeats each prompt ``group_size`` times, which one seed would make
    identical), so its samples are not reproducible.
    """

    def __init__(self, section: Any, model: nn.Module, device: torch.device) -> None:
        self.url = section.url.rstrip("/")
        self.timeout_s = section.timeout_s
        card = wait_for_server(self.url, timeout_s=self.timeout_s)
        self.model_name = card["id"]
        self.max_model_len = int(card.get("max_model_len") or model.max_seq_len)
        self.client = httpx.Client(timeout=self.timeout_s)
        info = self._rpc("composer_receiver_info")
        self.server_ranks = len(info)
        self.dtype = getattr(torch, info[0]["dtype"])
        self.tied = bool(info[0]["tied"])
        backend = section.weight_sync
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.group = self._open_group(backend, section.group_host)
        self.weights_version: int | None = None

    def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """Calls ``method`` on every vLLM worker of the server (vLLM's ``/collective_rpc``);
        returns each worker's result."""
        body = {"method": method, "kwargs": {k: json.dumps(v) for k, v in kwargs.items()}}
        try:
            reply = self.client.post(f"{self.url}/collective_rpc", json=body)
        except httpx.TransportError as error:
            raise ServerLost(f"the rollout server at {self.url} is gone ({error})") from error
        if reply.status_code == 404:
            raise RolloutEngineError(
                f"the server at {self.url} has no /collective_rpc: start it with "
                "tools/serve_rollouts.py (vLLM's dev mode and composer-tune's weight receiver)"
            )
        if reply.status_code != 200:
            raise RolloutEngineError(
                f"the server at {self.url} failed {method}: HTTP {reply.status_code} "
                f"{reply.text[:300]}"
            )
        return reply.json()["results"]

    def _rpc_beside(self, method: str, act: Callable[[], None], **kwargs: Any) -> None:
        """``method`` on the server's workers while this process does ``act`` (both sides of
        one collective: the call returns only when the workers' side is done)."""
        answer: dict[str, Any] = {}

        def call() -> None:
            try:
                answer["results"] = self._rpc(method, **kwargs)
            except BaseException as error:  # re-raised in the caller's thread
                answer["error"] = error

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        act()
        thread.join(timeout=self.timeout_s)
        if "error" in answer:
            raise answer["error"]
        if thread.is_alive():
            raise RolloutEngineError(f"{method} on the server at {self.url} did not return")

    def _open_group(self, backend: str, host: str | None) -> Any:
        """The weight group: this process (rank 0) and the server's workers (ranks 1..)."""
        parsed = urlparse(self.url)
        if host is None:  # the address this machine reaches the server from
            with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=10) as s:
                host = s.getsockname()[0]
        world_size = 1 + self.server_ranks
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )  # fmt: skip
        spec = {"host": host, "port": store.port, "world_size": world_size, "backend": backend,
                "timeout_s": self.timeout_s}  # fmt: skip
        opened: dict[str, Any] = {}

        def join() -> None:
            opened["group"] = _process_group(backend, store, 0, world_size, self.timeout_s)

        self._rpc_beside("composer_join_weight_group", join, spec=spec)
        self._store = store  # the workers' group reads it for as long as it lives
        return opened["group"]

    def sync_weights(self, model: nn.Module, version: int | None) -> bool:
        """Pushes ``model``'s weights to the server unless it holds ``version`` already."""
        if version is not None and version == self.weights_version:
            return False
        tensors = [
            (name, value.to(self.device, self.dtype).contiguous())
            for name, value in checkpoint_tensors(model, lambda value: value.detach())
        ]
        entries = [
            (name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors
        ]

        def send() -> None:
            try:
                for _, tensor in tensors:
                    _broadcast(self.group, tensor)
            except RuntimeError as error:  # gloo/NCCL: a peer left the group
                raise ServerLost(f"the weight push to {self.url} failed ({error})") from error

        self._rpc_beside(
            "composer_receive_weights", send, spec={"tensors": entries, "tied": self.tied}
        )
        self.weights_version = version
        return True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_tokens: Sequence[int] = (),
        generator: torch.Generator | None = None,
    ) -> GenerationOutput:
        """One completion per prompt, as the native engine returns it (the server's sampled
        ids, each one's log-prob, truncation at ``max_new_tokens`` without a stop token)."""
        del generator  # the server's randomness is its own (class docstring)
        body = {
            "model": self.model_name,
            "prompt": [list(prompt) for prompt in prompts],
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k if top_k is not None else -1,
            "top_p": top_p if top_p is not None else 1.0,
            "stop_token_ids": list(stop_tokens),
            "ignore_eos": True,  # only the tokenizer's stop tokens end a row, as natively
            "logprobs": 0,
            "return_token_ids": True,
        }
        try:
            reply = self.client.post(f"{self.url}/v1/completions", json=body)
            reply.raise_for_status()
            choices = sorted(reply.json()["choices"], key=lambda choice: choice["index"])
        except httpx.TransportError as error:
            raise ServerLost(f"the rollout server at {self.url} is gone ({error})") from error
        except (httpx.HTTPError, KeyError, ValueError) as error:
            raise RolloutEngineError(
                f"the rollout server at {self.url} failed a generation request: "
                f"{type(error).__name__}: {error}"
            ) from error
        stop = set(stop_tokens)
        completions = [list(choice["token_ids"]) for choice in choices]
        return GenerationOutput(
            completions=completions,
            completion_lengths=torch.tensor([len(ids) for ids in completions], dtype=torch.long),
            truncated=torch.tensor(
                [len(ids) == max_new_tokens and ids[-1] not in stop for ids in completions],
                dtype=torch.bool,
            ),
            logprobs=[
                torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
                for choice in choices
            ],
        )

    def sleep(self) -> None:
        """Nothing to release: the server's memory is its own."""

    def close(self) -> None:
        self.client.close()


class WeightReceiver:
    """vLLM worker extension (``--worker-extension-cls``) that joins a rollout worker's weight
    group and loads the weights it broadcasts; its methods run in each of the server's vLLM
    workers through ``/collective_rpc`` (JSON string arguments)."""

    def composer_receiver_info(self) -> dict[str, Any]:
        """The engine's weight dtype and whether its output head is tied to the embedding."""
        model_config = self.model_config
        return {
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "tied": bool(getattr(model_config.hf_config, "tie_word_embeddings", False)),
        }

    def composer_join_weight_group(self, spec: str) -> None:
        settings = json.loads(spec)
        store = dist.TCPStore(
            settings["host"], settings["port"], settings["world_size"], is_master=False,
            timeout=datetime.timedelta(seconds=settings["timeout_s"]),
        )  # fmt: skip
        self._composer_group = _process_group(
            settings["backend"], store, 1 + self.rank, settings["world_size"],
            settings["timeout_s"],
        )  # fmt: skip
        self._composer_device = self.device if settings["backend"] == "nccl" else "cpu"

    def composer_receive_weights(self, spec: str) -> None:
        settings = json.loads(spec)

        def received() -> Any:
            for name, dtype, shape in settings["tensors"]:
                tensor = torch.empty(
                    shape, dtype=getattr(torch, dtype), device=self._composer_device
                )
                _broadcast(self._composer_group, tensor)
                yield name, tensor

        self.reload_weights(weights_iterator=received())
        if settings["tied"]:
            refresh_tied_output_head(self)
