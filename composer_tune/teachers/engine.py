"""Teacher replay: ask several teacher models for the next action of every recorded agent step.

This is channel 3 of composer-tune's data, the project's OWN research addition (not part of
Cursor's published Composer recipe): agent traces are replayed by several teachers, and their
(dis)agreement with the action the agent actually took becomes DPO preference pairs
(``composer_tune.data.pairs``).

Guarantees of a run:

* every step is redacted (``StepRedactor.redact_step``) before anything is derived from it, so
  requests, cache entries, outputs and failure records only ever see redacted text;
* every (step, teacher) ends either as a result (fresh or cached) or as a line in the failures
  JSONL (reason: a non-retryable error, attempts exhausted, or ``budget_exhausted``);
* a response is written to the cache before it is used, and a cached request is never sent again,
  also not by two concurrent steps that happen to build the same request, so nothing is paid twice
  and an interrupted run resumes from the cache;
* spend budget: before each new request, if the USD already spent plus the estimated cost of the
  requests in flight plus this one would exceed the budget, no further request is issued for the
  rest of the run (cache hits are still served). The estimate of a request is its JSON length /
  CHARS_PER_TOKEN input tokens plus the teacher's mean output tokens so far (``max_tokens`` before
  the first answer), so the budget can be exceeded only by that estimate's error.

Caveat: if the model whose traces are replayed is itself one of the teachers, it tends to agree
with its own actions, which biases the disagreement signal (fewer, skewed pairs); exclude it at
pair-mining time (``exclude_teachers``) or leave it out of the teacher list.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any, TextIO

from composer_tune.data.traces.schema import Step
from composer_tune.teachers.cache import ResponseCache, cache_key
from composer_tune.teachers.client import TeacherCallError, TeacherClient
from composer_tune.teachers.config import RetryPolicy, TeacherConfig
from composer_tune.teachers.protocol import (
    CHARS_PER_TOKEN,
    Completion,
    ToolCatalog,
    build_request,
    canonical_json,
    parse_completion,
    session_key,
)
from composer_tune.teachers.redaction import StepRedactor
from composer_tune.teachers.report import ReplayReport, TeacherStats

BUDGET_EXHAUSTED = "budget_exhausted"


class SpendBudget:
    """Thread-safe USD budget: reservations for requests in flight, settled with actual costs."""

    def __init__(self, limit_usd: float | None) -> None:
        if limit_usd is not None and limit_usd < 0:
            raise ValueError(f"budget must be >= 0 USD, got {limit_usd}")
        self.limit_usd = limit_usd
        self.spent_usd = 0.0
        self.reserved_usd = 0.0
        self.stopped = False
        self._lock = threading.Lock()

    def try_reserve(self, estimate_usd: float) -> bool:
        """Reserve ``estimate_usd`` for a new request, or stop for good if it would not fit."""
        with self._lock:
            if self.stopped:
                return False
            if self.limit_usd is not None and (
                self.spent_usd + self.reserved_usd + estimate_usd > self.limit_usd
            ):
                self.stopped = True
                return False
            self.reserved_usd += estimate_usd
            return True

    def settle(self, estimate_usd: float, actual_usd: float) -> None:
        """Replace a reservation by the actual cost of the response it paid for."""
        with self._lock:
            self.reserved_usd -= estimate_usd
            self.spent_usd += actual_usd

    def release(self, estimate_usd: float) -> None:
        """Drop a reservation whose request was not billed (it failed)."""
        with self._lock:
            self.reserved_usd -= estimate_usd


@dataclass
class TeacherResult:
    """What one teacher produced for one step: a result dict for the output, or a failure."""

    step_index: int
    teacher: str
    record: dict[str, Any]
    failure: dict[str, Any] | None = None


@dataclass
class _PendingStep:
    step: Step
    tools: list[dict[str, Any]]
    results: dict[str, dict[str, Any]]


class ReplayEngine:
    """Replays steps through teachers with caching, retries, per-teacher concurrency and a budget.

    ``on_billed(teacher_name, step_index)`` is called after each newly paid response has been
    cached; an exception it raises aborts the run like an interruption would (tests use it).
    """

    def __init__(
        self,
        teachers: list[TeacherConfig],
        *,
        cache: ResponseCache,
        redactor: StepRedactor,
        budget_usd: float | None = None,
        retry: RetryPolicy | None = None,
        on_billed: Callable[[str, int], None] | None = None,
    ) -> None:
        if not teachers:
            raise ValueError("ReplayEngine needs at least one teacher")
        self.teachers = list(teachers)
        self.cache = cache
        self.redactor = redactor
        self.budget = SpendBudget(budget_usd)
        # Budget 0: answer from the cache only, never open a connection (no key needed).
        self.cache_only = budget_usd == 0
        self.retry = retry or RetryPolicy()
        self.on_billed = on_billed
        self.stats = {teacher.name: TeacherStats() for teacher in self.teachers}
        self._stats_lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self._inflight_lock = threading.Lock()
        self._clients: dict[str, TeacherClient] = {}
        self._ran = False
        # Redactors may learn as they go (e.g. user names from home paths): serialise access.
        self._redact_lock = threading.Lock()

    def _redact_step(self, step: Step) -> Step:
        with self._redact_lock:
            return self.redactor.redact_step(step)

    def _redact_text(self, text: str) -> str:
        with self._redact_lock:
            return self.redactor.redact_text(text)

    # ----------------------------------------------------------------------------- tool catalogs
    def tool_catalogs(self, steps: Iterable[Step]) -> dict[str, ToolCatalog]:
        """Per-session tool catalogs from the redacted steps (tools are sent to teachers too).

        Run over the whole input before ``replay``: it also lets a learning redactor (one that
        picks up user names from home paths) see every step first, so the redacted requests, and
        hence the cache keys, do not depend on which steps a run replays.
        """
        catalogs: dict[str, ToolCatalog] = {}
        for step in steps:
            redacted = self._redact_step(step)
            catalogs.setdefault(session_key(redacted), ToolCatalog()).observe_step(redacted)
        return catalogs

    # ------------------------------------------------------------------------------ one request
    def _estimate_usd(self, teacher: TeacherConfig, request_chars: int) -> float:
        stats = self.stats[teacher.name]
        with self._stats_lock:
            mean_output = stats.output_tokens / stats.billed if stats.billed else teacher.max_tokens
        return teacher.cost_usd(-(-request_chars // CHARS_PER_TOKEN), round(mean_output))

    def _claim(self, key: str) -> threading.Event | None:
        """None if this thread now owns ``key``; else the event of the thread that owns it."""
        with self._inflight_lock:
            event = self._inflight.get(key)
            if event is None:
                self._inflight[key] = threading.Event()
            return event

    def _release(self, key: str) -> None:
        with self._inflight_lock:
            self._inflight.pop(key).set()

    @staticmethod
    def _result(
        teacher: TeacherConfig, entry: dict[str, Any], completion: Completion, *, cached: bool
    ) -> dict[str, Any]:
        """The per-teacher output record of a successful answer (fresh or cached)."""
        return {
            "status": "ok",
            "model": teacher.model,
            "action": asdict(completion.action),
            "input_tokens": entry["input_tokens"],
            "output_tokens": entry["output_tokens"],
            "usage_estimated": entry["usage_estimated"],
            "cost_usd": entry["cost_usd"],
            "finish_reason": completion.finish_reason,
            "latency_s": entry["latency_s"],
            "cached": cached,
        }

    def _from_cache(self, teacher: TeacherConfig, request: dict[str, Any], key: str) -> dict | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        completion = parse_completion(entry["response"], request_chars=len(canonical_json(request)))
        with self._stats_lock:
            stats = self.stats[teacher.name]
            stats.cache_hits += 1
            stats.cached_cost_usd += entry["cost_usd"]
        return self._result(teacher, entry, completion, cached=True)

    def _failure(self, teacher: str, reason: str, kind: str, **extra: Any) -> dict:
        with self._stats_lock:
            self.stats[teacher].failures[kind] += 1
        return {
            "status": "failed",
            "reason": self._redact_text(reason),
            "kind": kind,
            **extra,
        }

    def _run_task(
        self, index: int, teacher: TeacherConfig, request: dict[str, Any]
    ) -> TeacherResult:
        key = cache_key(
            teacher=teacher.name, model=teacher.model, base_url=teacher.base_url, request=request
        )
        while True:
            cached = self._from_cache(teacher, request, key)
            if cached is not None:
                return TeacherResult(index, teacher.name, cached)
            owner = self._claim(key)
            if owner is None:
                break
            # Another step sent the identical request: wait for it instead of paying twice.
            owner.wait()
        try:
            # The owner may have finished between our cache miss and our claim.
            cached = self._from_cache(teacher, request, key)
            if cached is not None:
                return TeacherResult(index, teacher.name, cached)
            return self._request(index, teacher, request, key)
        finally:
            self._release(key)

    def _request(
        self, index: int, teacher: TeacherConfig, request: dict[str, Any], key: str
    ) -> TeacherResult:
        estimate = self._estimate_usd(teacher, len(canonical_json(request)))
        if self.cache_only:
            self.budget.stopped = True  # nothing more can be answered: rerun with a budget
            record = self._failure(
                teacher.name, "not in the cache (cache-only replay, budget 0)", BUDGET_EXHAUSTED
            )
            return TeacherResult(index, teacher.name, record, failure=record)
        if not self.budget.try_reserve(estimate):
            record = self._failure(teacher.name, "spend budget reached", BUDGET_EXHAUSTED)
            return TeacherResult(index, teacher.name, record, failure=record)
        with self._stats_lock:
            self.stats[teacher.name].requests += 1
        try:
            outcome = self._clients[teacher.name].complete(request)
        except TeacherCallError as error:
            self.budget.release(estimate)
            with self._stats_lock:
                stats = self.stats[teacher.name]
                stats.http_attempts += error.attempts
                stats.retried_errors.update(error.error_kinds)
            record = self._failure(teacher.name, error.reason, error.kind, attempts=error.attempts)
            return TeacherResult(index, teacher.name, record, failure=record)
        except BaseException:
            self.budget.release(estimate)
            raise
        completion = outcome.completion
        cost = teacher.cost_usd(completion.input_tokens, completion.output_tokens)
        entry = {
            "teacher": teacher.name,
            "model": teacher.model,
            "response": outcome.body,
            "input_tokens": completion.input_tokens,
            "output_tokens": completion.output_tokens,
            "usage_estimated": completion.usage_estimated,
            "cost_usd": cost,
            "latency_s": outcome.latency_s,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # Persist first: once paid for, the answer must survive whatever happens next.
        self.cache.put(key, entry)
        self.budget.settle(estimate, cost)
        with self._stats_lock:
            stats = self.stats[teacher.name]
            stats.http_attempts += outcome.attempts
            stats.retried_errors.update(outcome.error_kinds)
            stats.billed += 1
            stats.input_tokens += completion.input_tokens
            stats.output_tokens += completion.output_tokens
            stats.cost_usd += cost
            stats.latencies_s.append(outcome.latency_s)
        if self.on_billed is not None:
            self.on_billed(teacher.name, index)
        return TeacherResult(
            index, teacher.name, self._result(teacher, entry, completion, cached=False)
        )

    # ------------------------------------------------------------------------------------- run
    def replay(
        self,
        steps: Iterable[Step],
        *,
        out_path: str | Path,
        failures_path: str | Path,
        catalogs: Mapping[str, ToolCatalog] | None = None,
        limit: int | None = None,
        on_step_done: Callable[[], None] | None = None,
    ) -> ReplayReport:
        """Replay ``steps`` (the first ``limit``) and write one JSON line per step, in input order.

        ``catalogs`` (from ``tool_catalogs``) give each session's tool list; without them each
        step's tools are inferred from that step alone. The output is written to a temporary file
        and renamed at the end, so an interrupted run never leaves a partial output that looks
        complete; the failures JSONL is appended as failures happen.
        """
        out_path, failures_path = Path(out_path), Path(failures_path)
        temp_path = out_path.with_name(out_path.name + ".partial")
        if self._ran:
            raise RuntimeError("a ReplayEngine runs once (its stats and budget are per run)")
        self._ran = True
        executors: dict[str, ThreadPoolExecutor] = {}
        report = ReplayReport(teachers=self.stats, budget_usd=self.budget.limit_usd)
        # Bounds on memory: futures queued at once, and finished steps waiting for an earlier one.
        max_futures = 2 * sum(t.max_concurrency for t in self.teachers) + len(self.teachers)
        max_pending = 4 * max_futures
        futures: dict[Future, int] = {}
        pending: dict[int, _PendingStep] = {}
        next_to_write = 0
        completed = False
        try:
            for teacher in self.teachers:
                if not self.cache_only:  # a cache-only run needs no client and no API key
                    self._clients[teacher.name] = TeacherClient(teacher, self.retry)
                executors[teacher.name] = ThreadPoolExecutor(
                    max_workers=teacher.max_concurrency,
                    thread_name_prefix=f"teacher-{teacher.name}",
                )
            with (
                temp_path.open("w", encoding="utf-8") as out,
                failures_path.open("w", encoding="utf-8") as failures,
            ):

                def drain() -> None:
                    nonlocal next_to_write
                    done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                    for future in done:
                        del futures[future]
                        result: TeacherResult = future.result()  # re-raises aborts from workers
                        state = pending[result.step_index]
                        state.results[result.teacher] = result.record
                        if result.failure is not None:
                            self._write_failure(failures, state.step, result)
                    while next_to_write in pending and len(pending[next_to_write].results) == len(
                        self.teachers
                    ):
                        self._write_step(out, next_to_write, pending.pop(next_to_write))
                        next_to_write += 1
                        if on_step_done is not None:
                            on_step_done()

                for index, step in enumerate(islice(steps, limit)):
                    redacted = self._redact_step(step)
                    catalog = (catalogs or {}).get(session_key(redacted))
                    if catalog is None:
                        catalog = ToolCatalog()
                        catalog.observe_step(redacted)
                    tools = catalog.schemas()
                    pending[index] = _PendingStep(redacted, tools, {})
                    report.steps += 1
                    for teacher in self.teachers:
                        request = build_request(
                            redacted,
                            model=teacher.model,
                            temperature=teacher.temperature,
                            max_tokens=teacher.max_tokens,
                            tools=tools,
                            extra_body=teacher.extra_body,
                            system_prompt=teacher.system_prompt,
                            tool_choice=teacher.tool_choice,
                        )
                        future = executors[teacher.name].submit(
                            self._run_task, index, teacher, request
                        )
                        futures[future] = index
                    while futures and (len(futures) >= max_futures or len(pending) >= max_pending):
                        drain()
                while futures:
                    drain()
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp_path, out_path)
            completed = True
        finally:
            # On an abort, let in-flight requests finish (they are paid for and get cached) but
            # start nothing new.
            for executor in executors.values():
                executor.shutdown(wait=True, cancel_futures=True)
            for client in self._clients.values():
                client.close()
            if not completed:
                temp_path.unlink(missing_ok=True)
        report.stopped_by_budget = self.budget.stopped
        return report

    def _write_step(self, out: TextIO, index: int, state: _PendingStep) -> None:
        record = {
            "step_index": index,
            "step": state.step.to_dict(),
            "tools": state.tools,
            "teachers": {t.name: state.results[t.name] for t in self.teachers},
        }
        out.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _write_failure(self, failures: TextIO, step: Step, result: TeacherResult) -> None:
        record = {
            "step_index": result.step_index,
            "teacher": result.teacher,
            "provenance": asdict(step.provenance),
            **(result.failure or {}),
        }
        failures.write(json.dumps(record, ensure_ascii=False) + "\n")
        failures.flush()
