"""Channel 3 against a real OpenAI-compatible server: vLLM's server hosting SmolLM2 on 127.0.0.1.

Channel 3 (trace-replay DPO) is this project's own research addition, not part of Cursor's
published Composer recipe. These tests run its whole pipeline (ingest a committed real trace ->
replay with two teachers -> build pairs -> ``recipes/replay_dpo.py``) against the server that
``tools/serve_teacher.py`` starts, and inject faults into that real server: SIGKILL mid-replay,
more concurrent requests than it batches, prompts longer than its ``max_model_len``, 200 answers
with malformed or truncated bodies (``tests/fake_openai_server.py`` as a proxy in front of it),
and the spend budget. Every server process is checked to be gone after each stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from composer_tune.rollout.engines import vllm_available
from composer_tune.teachers.local_server import (
    TOOL_CALL_TEMPLATE,
    LocalServerError,
    LocalServerSettings,
    LocalTeacherServer,
)
from tests.fake_openai_server import FakeOpenAIServer, Fault
from tests.recipe_runs import REPO_ROOT, run_recipe
from tests.test_composer_full_recipe import MECHANICS, logged_metrics

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

TRACE = (
    REPO_ROOT
    / "tests/assets/traces/claude-code/claude-code-log-sample__fe869ecb-c176-478f-9734-7e4b8ef12cff.jsonl"
)
TEACHERS_CONFIG = REPO_ROOT / "configs" / "teachers_local_smollm2.yaml"
KEY_ENV = "LOCAL_TEACHER_TEST_KEY"
MAX_MODEL_LEN = 4096
SERVER_BATCH = 4  # --max-num-seqs: requests the server decodes together; the rest wait
# Of the session's first 12 steps, 7-10 have contexts longer than 4096 tokens (10 kB tool outputs).
REPLAYED_STEPS = 12
TOO_LONG_STEPS = (7, 8, 9, 10)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="module")
def server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTeacherServer]:
    settings = LocalServerSettings(
        model_dir=smollm2_dir,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=SERVER_BATCH,
        kv_cache_gib=1,
    )
    log = tmp_path_factory.mktemp("teacher_server") / "server.log"
    local = LocalTeacherServer(settings, log_path=log)
    local.start()
    yield local
    pids, segments = local.pids(), local.shared_memory()
    if not pids:  # killed by the last test, which checked what the kill left
        return
    local.stop()
    assert len(pids) >= 3, pids  # API server, engine core, worker
    assert _alive(pids) == [], f"server processes left behind: {_alive(pids)}"
    assert not [segment for segment in segments if segment.exists()]


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed real Claude Code session as Step JSONL (34 steps, 4 context messages)."""
    out = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    subprocess.run(
        [sys.executable, "tools/ingest_traces.py", str(TRACE), "--out", str(out),
         "--max-context-messages", "4"],
        cwd=REPO_ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return out


def teachers_file(path: Path, base_url: str, **changes: Any) -> Path:
    """The committed local-teacher config, pointed at ``base_url`` (other fields: ``changes``)."""
    config = yaml.safe_load(TEACHERS_CONFIG.read_text())
    for teacher in config["teachers"]:
        teacher.update(base_url=base_url, api_key_env=KEY_ENV, **changes)
    path.write_text(yaml.safe_dump(config))
    return path


def replay(
    work: Path, steps: Path, teachers: Path, *extra: str, budget: str = "1"
) -> subprocess.CompletedProcess:
    env = {**os.environ, KEY_ENV: "local-test-key"}
    return subprocess.run(
        [sys.executable, "tools/replay_traces.py", "--steps", str(steps),
         "--teachers", str(teachers), "--cache-dir", str(work / "cache"),
         "--out", str(work / "replayed.jsonl"), "--budget-usd", budget, *extra],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def results(work: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """(step index, teacher) -> that teacher's result, from the replay's output."""
    out = {}
    for line in (work / "replayed.jsonl").read_text().splitlines():
        record = json.loads(line)
        for name, result in record["teachers"].items():
            out[(record["step"]["provenance"]["step_index"], name)] = result
    return out


def body_key(body: dict[str, Any] | None) -> str:
    return json.dumps(body, sort_keys=True)


def teacher_of(body: dict[str, Any]) -> str:
    system = body["messages"][0]
    cautious = system["role"] == "system" and "cautious" in system["content"]
    return "smollm2-cautious" if cautious else "smollm2-direct"


@pytest.mark.slow
def test_replay_build_pairs_and_train_against_the_local_server(
    server: LocalTeacherServer, steps: Path, tmp_path: Path
) -> None:
    teachers = teachers_file(tmp_path / "teachers.yaml", server.base_url)
    done = replay(tmp_path, steps, teachers, "--limit", str(REPLAYED_STEPS))
    assert done.returncode == 0, done.stderr[-3000:]
    by_key = results(tmp_path)
    assert len(by_key) == 2 * REPLAYED_STEPS
    # Steps longer than the server's max_model_len are per-step failures with its reason.
    for (step, _), result in by_key.items():
        if step in TOO_LONG_STEPS:
            assert result["status"] == "failed" and result["kind"] == "non_retryable"
            assert f"maximum context length is {MAX_MODEL_LEN} tokens" in result["reason"]
    answered = {key: result for key, result in by_key.items() if key[0] not in TOO_LONG_STEPS}
    assert all(result["status"] == "ok" for result in answered.values())
    # Token counts are the server's usage, not estimates; tool_choice: required gives real calls.
    assert not any(result["usage_estimated"] for result in answered.values())
    calls = [result for result in answered.values() if result["action"]["tool_calls"]]
    assert len(calls) >= len(answered) // 2, answered
    tool_names = {call["name"] for r in calls for call in r["action"]["tool_calls"]}
    assert tool_names <= {"Bash", "Edit", "LS", "MultiEdit", "Read", "TodoWrite", "Write"}
    report = json.loads((tmp_path / "replayed.jsonl.report.json").read_text())
    for name in ("smollm2-direct", "smollm2-cautious"):
        stats = report["teachers"][name]
        ours = [r for (_, teacher), r in answered.items() if teacher == name]
        assert stats["input_tokens"] == sum(r["input_tokens"] for r in ours)
        assert stats["output_tokens"] == sum(r["output_tokens"] for r in ours) > 0
        assert stats["failures"] == len(TOO_LONG_STEPS) and stats["billed"] == len(ours)
    # The stored usage is what the server counts: re-ask one request directly and compare.
    record = json.loads((tmp_path / "replayed.jsonl").read_text().splitlines()[0])
    direct = record["teachers"]["smollm2-direct"]
    reply = httpx.post(
        server.base_url.removesuffix("/v1") + "/tokenize",
        json={"model": "smollm2", "messages": record["step"]["context"],
              "tools": record["tools"], "add_generation_prompt": True},
        timeout=60,
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.json()["count"] == direct["input_tokens"]

    rules = tmp_path / "rules.yaml"
    rules.write_text("modes: [consensus_over_trace, trace_over_outlier]\n")
    pairs = tmp_path / "pairs.jsonl"
    subprocess.run(
        [sys.executable, "tools/build_pairs.py", "--replayed", str(tmp_path / "replayed.jsonl"),
         "--rules", str(rules), "--out", str(pairs)],
        cwd=REPO_ROOT, check=True, capture_output=True,
    )  # fmt: skip
    summary = json.loads((tmp_path / "pairs.jsonl.summary.json").read_text())
    assert summary["steps"] == REPLAYED_STEPS
    assert summary["skipped_by_reason"]["too_few_teachers"] >= len(TOO_LONG_STEPS)
    assert summary["kept"] >= 4, summary

    run = run_recipe(
        "replay_dpo", "cpu_smoke", tmp_path / "dpo", *MECHANICS,
        f"dpo.pairs={pairs}", "dpo.pairs_per_step=2", "dpo.heldout_fraction=0.4", "max_steps=8",
    )  # fmt: skip
    logged = logged_metrics(run.output_dir)
    assert "held-out pairs: DPO accuracy before" in run.stdout and "margin before" in run.stdout
    assert "eval/dpo_margin" in logged[8] and "eval/dpo_accuracy" in logged[8]
    # The pairs train: the DPO loss on the training pairs falls from log 2.
    first, last = logged[1]["dpo/loss"], min(logged[step]["dpo/loss"] for step in (6, 7, 8))
    assert first == pytest.approx(0.6931, abs=0.01) and last < first - 0.05, (first, last)


@pytest.mark.slow
def test_more_concurrent_requests_than_the_server_batches_complete_once_each(
    server: LocalTeacherServer, steps: Path, tmp_path: Path
) -> None:
    limit = 5
    waiting_seen = []
    stop = threading.Event()

    def watch_server_queue() -> None:
        while not stop.is_set():
            try:
                metrics = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=5)
            except httpx.HTTPError:
                continue
            for line in metrics.text.splitlines():
                if line.startswith("vllm:num_requests_waiting{"):
                    waiting_seen.append(float(line.rsplit(" ", 1)[1]))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_server_queue, daemon=True)
    watcher.start()
    # 10 requests at once: the gateway (proxy) admits 6 and answers 429 to the rest; of the 6
    # the server decodes SERVER_BATCH together and queues the others.
    with FakeOpenAIServer(
        upstream=server.base_url, max_in_flight=SERVER_BATCH + 2, busy_retry_after_s=1.0
    ) as proxy:
        teachers = teachers_file(
            tmp_path / "teachers.yaml", proxy.base_url, max_concurrency=5, max_tokens=64
        )
        done = replay(tmp_path, steps, teachers, "--limit", str(limit), "--max-attempts", "60")
        stop.set()
        watcher.join(timeout=10)
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes = Counter(request.outcome for request in proxy.received)
        billed = Counter(body_key(request.body) for request in proxy.billed())
    assert outcomes["busy"] > 0, outcomes  # the gateway turned requests away ...
    assert max(waiting_seen, default=0) > 0, waiting_seen  # ... and the server queued some
    final = results(tmp_path)
    assert len(final) == 2 * limit and all(r["status"] == "ok" for r in final.values())
    # Retried with backoff, but each request answered (billed) exactly once.
    assert len(billed) == 2 * limit and set(billed.values()) == {1}
    report = json.loads((tmp_path / "replayed.jsonl.report.json").read_text())["total"]
    assert report["billed"] == 2 * limit and report["http_attempts"] > 2 * limit
    assert report["retried_errors"]["http_429"] == outcomes["busy"]


@pytest.mark.slow
def test_malformed_and_truncated_answers_are_recorded_and_retried(
    server: LocalTeacherServer, steps: Path, tmp_path: Path
) -> None:
    limit = 3

    def corrupt_first_answer(body: dict[str, Any], attempt: int) -> Fault | None:
        if attempt > 0:
            return None
        return Fault("malformed" if teacher_of(body) == "smollm2-direct" else "truncated")

    with FakeOpenAIServer(upstream=server.base_url, fault_for=corrupt_first_answer) as proxy:
        teachers = teachers_file(tmp_path / "teachers.yaml", proxy.base_url, max_tokens=64)
        done = replay(tmp_path, steps, teachers, "--limit", str(limit), "--base-delay-s", "0.1")
        outcomes = Counter(request.outcome for request in proxy.received)
    assert done.returncode == 0, done.stderr[-3000:]
    assert outcomes == {"malformed": limit, "truncated": limit, "ok": 2 * limit}, outcomes
    assert all(r["status"] == "ok" for r in results(tmp_path).values())
    report = json.loads((tmp_path / "replayed.jsonl.report.json").read_text())["teachers"]
    assert report["smollm2-direct"]["retried_errors"] == {"malformed": limit}
    # The body ends short of its Content-Length: the HTTP client reports a broken connection.
    assert report["smollm2-cautious"]["retried_errors"] == {"connection": limit}
    for stats in report.values():
        assert stats["http_attempts"] == 2 * limit and stats["billed"] == limit


@pytest.mark.slow
def test_budget_stops_spending_at_the_limit_and_a_larger_budget_finishes(
    server: LocalTeacherServer, steps: Path, tmp_path: Path
) -> None:
    limit = 4
    prices = {"price_per_input_token": 2.0e-6, "price_per_output_token": 1.0e-4}
    with FakeOpenAIServer(upstream=server.base_url) as proxy:
        teachers = teachers_file(
            tmp_path / "teachers.yaml", proxy.base_url, max_concurrency=1, max_tokens=64, **prices
        )
        budget = 0.04
        stopped = replay(tmp_path, steps, teachers, "--limit", str(limit), budget=str(budget))
        assert stopped.returncode == 3, stopped.stderr[-3000:]
        report = json.loads((tmp_path / "replayed.jsonl.report.json").read_text())
        first = results(tmp_path)
        paid = [r for r in first.values() if r["status"] == "ok"]
        assert paid and any(r.get("kind") == "budget_exhausted" for r in first.values())
        spent = sum(r["cost_usd"] for r in paid)
        assert report["total"]["cost_usd"] == pytest.approx(spent) and spent <= budget
        assert spent == pytest.approx(
            sum(r["input_tokens"] * 2.0e-6 + r["output_tokens"] * 1.0e-4 for r in paid)
        )
        billed_before = len(proxy.billed())
        assert billed_before == len(paid)
        finished = replay(tmp_path, steps, teachers, "--limit", str(limit), budget="1")
        assert finished.returncode == 0, finished.stderr[-3000:]
        assert len(proxy.billed()) - billed_before == 2 * limit - len(paid)
    assert all(r["status"] == "ok" for r in results(tmp_path).values())


def _serve_teacher(port: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``tools/serve_teacher.py`` as a user starts it, on ``port`` with the module server's
    batch and KV cache; returns the process once it printed its ready line, and that line."""
    command = [
        sys.executable, "tools/serve_teacher.py", "--port", str(port), "--log", str(log),
        "--max-num-seqs", str(SERVER_BATCH), "--kv-cache-gib", "1",
    ]  # fmt: skip
    server = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert server.stdout is not None
    lines = []
    for line in server.stdout:
        lines.append(line)
        if "ready at" in line or "error:" in line:
            break
    assert "ready at" in lines[-1], "".join(lines)
    return server, lines[-1]


# Last of the tests on the module's server: it kills that server, and the command restarts it.
@pytest.mark.slow
def test_server_killed_mid_replay_then_restarted_by_the_command_loses_and_repeats_nothing(
    server: LocalTeacherServer, steps: Path, tmp_path: Path
) -> None:
    """The module's server dies (SIGKILL) mid-replay; ``tools/serve_teacher.py`` (the command a
    user runs) serves again on the same port, the replay resumes and asks only what was lost,
    and Ctrl-C stops the command with every process it started gone."""
    limit = 3
    with FakeOpenAIServer(upstream=server.base_url) as proxy:
        # The proxy's address stays the same across the restart, so the cache keys do too.
        teachers = teachers_file(
            tmp_path / "teachers.yaml", proxy.base_url, max_concurrency=1, max_tokens=64
        )

        segments = server.shared_memory()
        assert segments  # vLLM's engine <-> API server queues

        def kill_after_two_answers() -> None:
            while len(proxy.billed()) < 2:
                time.sleep(0.05)
            server.kill()

        killer = threading.Thread(target=kill_after_two_answers, daemon=True)
        killer.start()
        first = replay(
            tmp_path, steps, teachers, "--limit", str(limit), "--max-attempts", "2",
            "--base-delay-s", "0.1",
        )  # fmt: skip
        killer.join(timeout=60)
        assert first.returncode == 0, first.stderr[-3000:]
        assert server.pids() == []
        assert not [segment for segment in segments if segment.exists()]  # RAM given back
        billed_first = {body_key(request.body) for request in proxy.billed()}
        after_first = results(tmp_path)
        ok_first = {key for key, result in after_first.items() if result["status"] == "ok"}
        failed_first = {key for key, result in after_first.items() if result["status"] != "ok"}
        assert len(ok_first) >= 2 and failed_first, after_first
        assert all(
            "connection" in result["reason"] or "HTTP 5" in result["reason"]
            for key, result in after_first.items()
            if key in failed_first
        )

        sent_before_restart = len(proxy.received)
        command, ready = _serve_teacher(server.port, tmp_path / "command.log")  # same port
        try:
            assert f"ready at {server.base_url} " in ready, ready
            models = httpx.get(f"{server.base_url}/models", timeout=30).json()
            assert [model["id"] for model in models["data"]] == ["smollm2"]
            children = psutil.Process(command.pid).children(recursive=True)
            started = [child.pid for child in children]
            assert len(started) >= 3  # API server, engine core, worker
            mapped = {
                m.path for child in children for m in child.memory_maps() if "/dev/shm/" in m.path
            }
            second = replay(tmp_path, steps, teachers, "--limit", str(limit))
            assert second.returncode == 0, second.stderr[-3000:]
            resent = [request.body for request in proxy.received[sent_before_restart:]]
            command.send_signal(signal.SIGINT)
            rest, _ = command.communicate(timeout=120)
        finally:
            if command.poll() is None:  # a failed check: stop its server too, then the command
                command.send_signal(signal.SIGINT)
                try:
                    command.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    command.kill()
    assert command.returncode == 0 and "teacher server stopped" in rest, rest
    assert _alive(started) == []
    assert mapped and not [path for path in mapped if Path(path).exists()]

    final = results(tmp_path)
    assert len(final) == 2 * limit and all(r["status"] == "ok" for r in final.values())
    # Nothing answered before the crash was asked again; everything that failed was.
    assert not billed_first & {body_key(body) for body in resent}
    assert len(resent) == len(failed_first)
    assert {key for key, result in final.items() if result["cached"]} >= ok_first


def test_a_server_that_cannot_start_names_the_cause(tmp_path: Path, smollm2_dir: Path) -> None:
    not_a_checkpoint = LocalTeacherServer(
        LocalServerSettings(model_dir=tmp_path), log_path=tmp_path / "log"
    )
    with pytest.raises(LocalServerError, match="not a checkpoint directory"):
        not_a_checkpoint.start()
    # A checkpoint vLLM rejects: the error quotes the server's log, and nothing is left running.
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in smollm2_dir.iterdir():
        if item.name != "model.safetensors":
            (broken / item.name).symlink_to(item)
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (broken / "config.json").unlink()
    (broken / "config.json").write_text(json.dumps(config))
    failing = LocalTeacherServer(
        LocalServerSettings(model_dir=broken, startup_timeout_s=240), log_path=tmp_path / "log2"
    )
    with pytest.raises(LocalServerError, match=r"exited with status \d+ before it was ready"):
        failing.start()
    assert failing.pids() == []


def test_tool_call_template_shows_the_trace_and_leaves_plain_chat_as_smollm2_renders_it(
    smollm2_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    template = TOOL_CALL_TEMPLATE.read_text()
    chat = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
    ]
    for messages in (chat, [{"role": "system", "content": "Be brief."}, *chat]):
        ours = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert ours == tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    call = {"id": "c1", "type": "function",
            "function": {"name": "Read", "arguments": '{"file_path": "setup.py"}'}}  # fmt: skip
    trace = [
        {"role": "user", "content": "Fix the build."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "from setuptools import setup"},
    ]
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
    ours = tokenizer.apply_chat_template(
        trace, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert '<tools>\n{"name": "Read", "parameters": {"type": "object"}}\n</tools>' in ours
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "Read", "arguments": '
        '{"file_path": "setup.py"}}\n</tool_call><|im_end|>' in ours
    )
    assert "<tool_response>\nfrom setuptools import setup\n</tool_response>" in ours
    assert ours.endswith("<|im_start|>assistant\n")
    # SmolLM2's own template drops the call: the reason the server gets this one.
    own = tokenizer.apply_chat_template(trace, tools=tools, tokenize=False)
    assert "setup.py" not in own and "Read" not in own


def test_the_api_key_reaches_the_server_through_its_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "inherited-key")
    settings = LocalServerSettings(model_dir=tmp_path, port=8011)
    keyed = LocalTeacherServer(settings, log_path=tmp_path / "log", api_key="secret-key")
    assert keyed._environment()["VLLM_API_KEY"] == "secret-key"
    assert "secret-key" not in " ".join(keyed.command())  # `ps` shows command lines
    # Without a key the server is open, whatever this shell happens to export.
    open_server = LocalTeacherServer(settings, log_path=tmp_path / "log")
    assert "VLLM_API_KEY" not in open_server._environment()
    assert open_server.base_url == "http://127.0.0.1:8011/v1"
