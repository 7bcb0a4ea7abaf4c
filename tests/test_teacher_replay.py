"""Teacher replay over real HTTP against tests/fake_openai_server.py.

What these tests prove: requests carry the (redacted) context and inferred tools; every
(step, teacher) ends as a result or a recorded failure; retries cover 429/5xx/timeouts/dropped
connections/malformed bodies without paying twice; the budget stops spending mid-run and keeps
what was paid; an aborted run resumes from the cache without re-billing; neither planted secrets
nor the API key reach the server's log, the cache or any output.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from composer_tune.data.traces.schema import Action, Provenance, Step, ToolCall
from composer_tune.teachers.cache import ResponseCache, cache_key
from composer_tune.teachers.client import TeacherCallError, TeacherClient, parse_retry_after
from composer_tune.teachers.config import (
    RetryPolicy,
    TeacherConfig,
    TeacherConfigError,
    load_teachers,
    parse_teachers,
)
from composer_tune.teachers.engine import ReplayEngine
from composer_tune.teachers.protocol import ToolCatalog, build_request, parse_completion
from composer_tune.teachers.redaction import load_redactor
from composer_tune.teachers.report import percentile
from tests.fake_openai_server import FakeOpenAIServer, Fault, Reply
from tests.recipe_runs import load_tool

API_KEY = "sk-fake-teacher-key-9f8e7d6c5b4a39281706"
KEY_ENV = "COMPOSER_TUNE_TEST_TEACHER_KEY"
FAST_RETRY = RetryPolicy(max_attempts=4, base_delay_s=0.001, max_delay_s=0.01)
REPO = Path(__file__).resolve().parents[1]


class LiteralRedactor:
    """Stand-in redactor replacing one literal, to test the engine's wiring on its own."""

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def redact_text(self, text: str) -> str:
        return text.replace(self.secret, "<REDACTED>")

    def redact_step(self, step: Step) -> Step:
        return Step.from_dict(json.loads(self.redact_text(json.dumps(step.to_dict()))))


NO_SECRET = LiteralRedactor("\x00never-present\x00")


def make_step(index: int, *, session: str = "s1", secret: str = "") -> Step:
    """A coding-agent step: user task, one read_file call and its result, then run_tests."""
    return Step(
        context=[
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"Task {index}: fix the failing test. {secret}".strip()},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": json.dumps({"path": f"src/mod{index}.py", "limit": 50}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": f"def f(): return {index}"},
        ],
        action=Action(
            text="Running the tests.",
            tool_calls=[ToolCall(name="run_tests", arguments={"path": "tests/"}, id="toolu_2")],
        ),
        observation=f"1 failed {secret}".strip(),
        provenance=Provenance(
            source_format="claude_code",
            file=f"/logs/{session}.jsonl",
            session_id=session,
            step_index=index,
        ),
    )


def responder(body: dict) -> Reply:
    """alpha and beta call run_tests; gamma answers in text. Usage is fixed per model."""
    if body["model"] == "gamma-model":
        return Reply(
            content="Please run the tests yourself.", prompt_tokens=80, completion_tokens=7
        )
    return Reply(
        content="",
        tool_calls=[{"name": "run_tests", "arguments": {"path": "tests/"}}],
        prompt_tokens=100,
        completion_tokens=10,
    )


def teacher(name: str, server: FakeOpenAIServer, **overrides) -> TeacherConfig:
    fields = {
        "name": name,
        "base_url": server.base_url,
        "model": f"{name}-model",
        "api_key_env": KEY_ENV,
        "price_per_input_token": 1e-6,
        "price_per_output_token": 2e-6,
        "max_concurrency": 2,
        "temperature": 0.0,
        "max_tokens": 64,
        "timeout_s": 5.0,
    }
    fields.update(overrides)
    return parse_teachers([fields])[0]


@pytest.fixture(autouse=True)
def api_key_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, API_KEY)


def run_replay(tmp_path, teachers, steps, *, redactor=NO_SECRET, **engine_kwargs):
    engine = ReplayEngine(
        teachers,
        cache=ResponseCache(tmp_path / "cache"),
        redactor=redactor,
        retry=engine_kwargs.pop("retry", FAST_RETRY),
        **engine_kwargs,
    )
    out = tmp_path / "replayed.jsonl"
    report = engine.replay(
        steps,
        out_path=out,
        failures_path=tmp_path / "failures.jsonl",
        catalogs=engine.tool_catalogs(steps),
    )
    return report, out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def all_written_text(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------- config


def test_teacher_config_errors_name_teacher_and_field(tmp_path):
    good = {
        "name": "alpha",
        "base_url": "http://localhost:1/v1",
        "model": "m",
        "api_key_env": "KEY",
        "price_per_input_token": 1e-6,
        "price_per_output_token": 2e-6,
        "max_concurrency": 2,
        "temperature": 0.2,
        "max_tokens": 16,
        "timeout_s": 10,
    }
    cases = [
        ({**good, "max_concurrency": 0}, "'max_concurrency' must be >= 1"),
        ({**good, "temperature": "hot"}, "'temperature' must be a number"),
        ({**good, "api_key": "sk-abc"}, "unknown field(s) ['api_key']"),
        ({**good, "api_key_env": "sk-abc-123"}, "NAME"),
        ({k: v for k, v in good.items() if k != "model"}, "missing field(s) ['model']"),
        ({**good, "base_url": "localhost:1"}, "'base_url' must start with"),
        ({**good, "system_prompt": ""}, "'system_prompt' must be a non-empty string"),
        ({**good, "tool_choice": "always"}, "'tool_choice' must be one of"),
    ]
    for raw, expected in cases:
        path = tmp_path / "teachers.yaml"
        path.write_text(json.dumps({"teachers": [good | {"name": "ok"}, raw]}))
        with pytest.raises(TeacherConfigError) as error:
            load_teachers(path)
        assert expected in str(error.value)
        assert str(path) in str(error.value) and "teacher #1 ('alpha')" in str(error.value)
    with pytest.raises(TeacherConfigError, match="duplicate teacher name 'alpha'"):
        parse_teachers([good, good])


def test_example_configs_are_valid():
    teachers = load_teachers(REPO / "configs" / "teachers_example.yaml")
    assert len(teachers) >= 2
    assert all(t.api_key_env and t.api_key_env.isupper() for t in teachers)
    local = load_teachers(REPO / "configs" / "teachers_local_smollm2.yaml")
    assert [t.tool_choice for t in local] == ["required", "required"]
    assert local[0].system_prompt is None and "cautious" in local[1].system_prompt


def test_request_system_prompt_merges_into_the_system_turn_and_tool_choice_needs_tools():
    step = make_step(0)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    common = {"model": "m", "temperature": 0, "max_tokens": 9, "extra_body": {}}
    request = build_request(
        step, tools=tools, system_prompt="Be careful.", tool_choice="required", **common
    )
    assert request["messages"][0] == {
        "role": "system",
        "content": "Be careful.\n\nYou are a coding agent.",
    }
    assert request["messages"][1:] == build_request(step, tools=tools, **common)["messages"][1:]
    assert request["tool_choice"] == "required"
    # A step without a system turn gets one; a request without tools gets no tool_choice.
    step.context = step.context[1:]
    request = build_request(
        step, tools=[], system_prompt="Be careful.", tool_choice="required", **common
    )
    assert request["messages"][0] == {"role": "system", "content": "Be careful."}
    assert "tool_choice" not in request and "tools" not in request


def test_missing_api_key_env_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    config = parse_teachers([{**_raw_teacher(), "api_key_env": KEY_ENV}])[0]
    with pytest.raises(TeacherConfigError, match=f"{KEY_ENV}.*not set"):
        config.api_key()


def _raw_teacher() -> dict:
    return {
        "name": "alpha",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "api_key_env": KEY_ENV,
        "price_per_input_token": 0,
        "price_per_output_token": 0,
        "max_concurrency": 1,
        "temperature": 0,
        "max_tokens": 8,
        "timeout_s": 1,
    }


# ------------------------------------------------------------------------------ protocol units


def test_tool_schemas_inferred_from_session_calls():
    steps = [make_step(0), make_step(1)]
    steps[1].action.tool_calls.append(ToolCall("read_file", {"path": "a.py"}))  # no "limit"
    catalog = ToolCatalog()
    for step in steps:
        catalog.observe_step(step)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in catalog.schemas()}
    assert tools == {
        "read_file": {
            "type": "object",
            "properties": {"limit": {"type": "integer"}, "path": {"type": "string"}},
            "required": ["path"],
        },
        "run_tests": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    }


def test_request_normalises_flat_tool_calls_and_drops_extra_keys():
    step = make_step(0)
    step.context[2] = {
        "role": "assistant",
        "content": None,
        "thinking": "private",
        "tool_calls": [{"id": "t1", "name": "read_file", "arguments": {"path": "x"}}],
    }
    request = build_request(
        step, model="m", temperature=0.5, max_tokens=9, tools=[], extra_body={"top_p": 0.9}
    )
    assert request["messages"][2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "t1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "x"}'},
            }
        ],
    }
    assert "tools" not in request and request["top_p"] == 0.9
    with pytest.raises(ValueError, match="override request fields \\['model'\\]"):
        build_request(
            step, model="m", temperature=0, max_tokens=1, tools=[], extra_body={"model": 1}
        )


def test_parse_completion_and_usage_estimate():
    body = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [{"function": {"name": "ls", "arguments": "not json"}}],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    parsed = parse_completion(body, request_chars=401)
    assert parsed.action.tool_calls[0].arguments == "not json"
    assert (parsed.input_tokens, parsed.output_tokens, parsed.usage_estimated) == (101, 2, True)


def test_retry_after_parsing_and_backoff_bounds():
    import httpx

    assert parse_retry_after(httpx.Headers({"retry-after": "2.5"})) == 2.5
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "40", "retry-after": "9"})) == 0.04
    assert parse_retry_after(httpx.Headers({"retry-after": "Thu, 01 Jan 1970 00:00:00 GMT"})) == 0
    assert parse_retry_after(httpx.Headers({"retry-after": "soon"})) is None
    config = parse_teachers([_raw_teacher()])[0]
    client = TeacherClient(
        config, RetryPolicy(base_delay_s=1.0, max_delay_s=3.0), rng=random.Random(0)
    )
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 3.0), (6, 3.0)]:
        delay = client.backoff_s(attempt, None)
        assert ceiling / 2 <= delay <= ceiling
    assert client.backoff_s(1, 500.0) == RetryPolicy().max_retry_after_s
    client.close()


def test_cache_key_and_corrupt_entry_is_a_miss(tmp_path):
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    key = cache_key(teacher="alpha", model="m", base_url="http://h/v1", request=request)
    reordered = dict(reversed(list(request.items())))
    assert key == cache_key(teacher="alpha", model="m", base_url="http://h/v1", request=reordered)
    for other in ({"teacher": "beta"}, {"model": "m2"}, {"base_url": "http://g/v1"}):
        fields = {"teacher": "alpha", "model": "m", "base_url": "http://h/v1", **other}
        assert cache_key(**fields, request=request) != key
    cache = ResponseCache(tmp_path)
    cache.put(key, {"response": {"x": 1}})
    assert cache.get(key) == {"response": {"x": 1}} and len(cache) == 1
    assert [p.name for p in (tmp_path / key[:2]).iterdir()] == [f"{key}.json"]  # no temp left
    (tmp_path / key[:2] / f"{key}.json").write_text('{"response": ')  # hand-truncated
    with pytest.warns(UserWarning, match="corrupt cache entry"):
        assert cache.get(key) is None


def test_percentile_matches_numpy():
    import numpy as np

    values = [random.Random(3).uniform(0, 5) for _ in range(37)]
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


# ---------------------------------------------------------------------------------- over HTTP


def test_client_honours_retry_after_and_scrubs_key():
    slept = []
    with FakeOpenAIServer(
        responder,
        fault_for=lambda body, attempt: (
            Fault("status", 429, retry_after=0.25) if attempt == 0 else None
        ),
        api_key=API_KEY,
    ) as server:
        client = TeacherClient(teacher("alpha", server), FAST_RETRY, sleep=slept.append)
        outcome = client.complete(
            {"model": "alpha-model", "messages": [{"role": "user", "content": "hi"}]}
        )
        client.close()
        assert slept == [0.25]
        assert (outcome.attempts, outcome.error_kinds) == (2, ["http_429"])
        assert outcome.completion.action.tool_calls[0].name == "run_tests"

    with FakeOpenAIServer(responder, api_key="sk-the-right-one") as server:
        client = TeacherClient(teacher("alpha", server), FAST_RETRY, sleep=slept.append)
        with pytest.raises(TeacherCallError) as error:
            client.complete(
                {"model": "alpha-model", "messages": [{"role": "user", "content": "x"}]}
            )
        client.close()
    # A 401 is not retried, and the echoed key is scrubbed from the reason.
    assert error.value.kind == "non_retryable" and error.value.attempts == 1
    assert "401" in error.value.reason and API_KEY not in error.value.reason


def test_end_to_end_three_teachers_then_rerun_costs_nothing(tmp_path):
    steps = [make_step(i) for i in range(4)] + [make_step(0)]  # a duplicate step: paid once
    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        teachers = [teacher(n, server) for n in ("alpha", "beta", "gamma")]
        report, out = run_replay(tmp_path, teachers, steps)
        first_output = out.read_text()
        billed_first = len(server.billed())
        report_again, _ = run_replay(tmp_path, teachers, steps)
        assert len(server.billed()) == billed_first  # nothing was requested again
        sent = [r.body for r in server.received]

    assert billed_first == 4 * 3 and len(sent) == 12
    assert report.total().cache_hits == 3 and report_again.total().cache_hits == 15
    assert report_again.total().requests == 0 and report_again.total().cost_usd == 0

    records = read_jsonl(out)
    assert [r["step_index"] for r in records] == list(range(5))
    for record in records:
        assert record["teachers"]["alpha"]["action"]["tool_calls"][0]["name"] == "run_tests"
        assert record["teachers"]["gamma"]["action"]["text"] == "Please run the tests yourself."
        assert all(result["cached"] for result in record["teachers"].values())
    first_records = [json.loads(line) for line in first_output.splitlines()]
    for before, after in zip(first_records, records, strict=True):
        for name in ("alpha", "beta", "gamma"):
            assert before["teachers"][name]["action"] == after["teachers"][name]["action"]

    # What the server received: the normalised context and the session's inferred tools.
    alpha_request = next(b for b in sent if b["model"] == "alpha-model" and "Task 2" in str(b))
    assert alpha_request["messages"][1]["content"] == "Task 2: fix the failing test."
    assert alpha_request["messages"][3] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "def f(): return 2",
    }
    assert sorted(t["function"]["name"] for t in alpha_request["tools"]) == [
        "read_file",
        "run_tests",
    ]
    assert alpha_request["max_tokens"] == 64 and alpha_request["temperature"] == 0.0

    totals = report.to_dict()["teachers"]
    expected_alpha_cost = 4 * (100 * 1e-6 + 10 * 2e-6)
    assert totals["alpha"]["cost_usd"] == pytest.approx(expected_alpha_cost)
    assert totals["gamma"]["input_tokens"] == 4 * 80 and totals["gamma"]["output_tokens"] == 4 * 7
    assert report.total().cost_usd == pytest.approx(2 * expected_alpha_cost + 4 * (80e-6 + 14e-6))
    assert (
        totals["beta"]["latency_p50_s"] > 0
        and totals["beta"]["latency_p95_s"] >= totals["beta"]["latency_p50_s"]
    )
    assert not (tmp_path / "failures.jsonl").read_text()


def test_identical_concurrent_requests_are_paid_once(tmp_path):
    steps = [make_step(0), make_step(0), make_step(0)]
    with FakeOpenAIServer(lambda body: replace(responder(body), delay_s=0.3)) as server:
        report, out = run_replay(tmp_path, [teacher("alpha", server, max_concurrency=3)], steps)
        assert len(server.received) == 1
    assert (report.total().billed, report.total().cache_hits) == (1, 2)
    assert len(read_jsonl(out)) == 3


def test_faults_are_retried_without_loss_or_double_payment(tmp_path):
    faults_by_task = {
        "Task 0:": [Fault("status", 429, retry_after=0.01), Fault("status", 500)],
        "Task 1:": [Fault("status", 503), Fault("malformed")],
        "Task 2:": [Fault("drop")],
        "Task 3:": [Fault("slow", delay_s=2.5)],
        "Task 4:": [Fault("status", 500)] * 10,  # never succeeds: recorded failure
        "Task 5:": [Fault("status", 400)],  # not retryable
    }

    def fault_for(body, attempt):
        user_text = body["messages"][1]["content"]
        for marker, faults in faults_by_task.items():
            if user_text.startswith(marker) and body["model"] == "alpha-model":
                return faults[attempt] if attempt < len(faults) else None
        return None

    steps = [make_step(i) for i in range(6)]
    with FakeOpenAIServer(responder, fault_for=fault_for, api_key=API_KEY) as server:
        teachers = [teacher("alpha", server, timeout_s=1.5), teacher("beta", server)]
        report, out = run_replay(tmp_path, teachers, steps)
        received, billed = list(server.received), server.billed()

    records = read_jsonl(out)
    failures = read_jsonl(tmp_path / "failures.jsonl")
    statuses = {
        (r["step_index"], name): res["status"]
        for r in records
        for name, res in r["teachers"].items()
    }
    assert len(statuses) == 12  # every (step, teacher) accounted for
    assert {key for key, status in statuses.items() if status == "failed"} == {
        (4, "alpha"),
        (5, "alpha"),
    }
    assert {(f["step_index"], f["teacher"], f["kind"]) for f in failures} == {
        (4, "alpha", "gave_up"),
        (5, "alpha", "non_retryable"),
    }
    assert "gave up after 4 attempts" in next(f["reason"] for f in failures if f["step_index"] == 4)
    # Paid exactly once per successful (step, teacher); nothing billed twice.
    signatures = [json.dumps(r.body, sort_keys=True) for r in billed]
    assert len(signatures) == len(set(signatures)) == 10
    alpha = report.teachers["alpha"]
    assert alpha.billed == 4 and alpha.http_attempts == len(
        [r for r in received if r.body["model"] == "alpha-model"]
    )
    assert alpha.retried_errors == {
        "http_429": 1,
        "http_500": 1 + 4,
        "http_503": 1,
        "malformed": 1,
        "connection": 1,
        "timeout": 1,
        "http_400": 1,
    }
    assert len(ResponseCache(tmp_path / "cache")) == 10


def test_budget_stops_spending_midrun_and_keeps_results(tmp_path):
    steps = [make_step(i) for i in range(6)]
    # Each answer costs exactly 10 output tokens * $0.001 = $0.01; the first estimate uses
    # max_tokens=10 output tokens, so it is exact too: 3 requests fit into $0.035, a 4th does not.
    priced = {"price_per_input_token": 0.0, "price_per_output_token": 1e-3, "max_tokens": 10}
    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        teachers = [teacher("alpha", server, max_concurrency=1, **priced)]
        report, out = run_replay(tmp_path, teachers, steps, budget_usd=0.035)
        assert len(server.billed()) == 3
        assert report.stopped_by_budget and report.total().cost_usd == pytest.approx(0.03)
        assert "STOPPED BY BUDGET" in report.format()
        records = read_jsonl(out)
        statuses = [r["teachers"]["alpha"]["status"] for r in records]
        assert statuses == ["ok"] * 3 + ["failed"] * 3
        assert [f["kind"] for f in read_jsonl(tmp_path / "failures.jsonl")] == [
            "budget_exhausted"
        ] * 3
        assert len(ResponseCache(tmp_path / "cache")) == 3

        # A zero budget replays from the cache only.
        report0, out = run_replay(tmp_path, teachers, steps, budget_usd=0.0)
        assert len(server.billed()) == 3 and report0.total().cache_hits == 3
        assert [r["teachers"]["alpha"]["status"] for r in read_jsonl(out)] == statuses

        report2, out = run_replay(tmp_path, teachers, steps, budget_usd=1.0)
        assert not report2.stopped_by_budget
        assert (report2.total().cache_hits, report2.total().billed) == (3, 3)
        assert len(server.billed()) == 6
        assert len({json.dumps(r.body, sort_keys=True) for r in server.billed()}) == 6


class Abort(Exception):
    pass


def test_interrupted_replay_resumes_from_cache_without_rebilling(tmp_path):
    steps = [make_step(i) for i in range(12)]
    billed_calls = []

    def abort_after_three(teacher_name: str, step_index: int) -> None:
        billed_calls.append((teacher_name, step_index))
        if len(billed_calls) == 3:
            raise Abort("simulated crash")

    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        teachers = [teacher("alpha", server), teacher("beta", server)]
        with pytest.raises(Abort):
            run_replay(tmp_path, teachers, steps, on_billed=abort_after_three)
        assert not (tmp_path / "replayed.jsonl").exists()  # no half output posing as complete
        paid_before = len(server.billed())
        assert 3 <= paid_before < 24
        assert len(ResponseCache(tmp_path / "cache")) == paid_before  # everything paid is kept

        report, out = run_replay(tmp_path, teachers, steps)
        signatures = [json.dumps(r.body, sort_keys=True) for r in server.billed()]
    assert len(signatures) == len(set(signatures)) == 24
    assert report.total().cache_hits == paid_before and report.total().billed == 24 - paid_before
    assert len(read_jsonl(out)) == 12


def test_redaction_is_applied_before_anything_leaves(tmp_path):
    """Engine wiring: whatever the redactor removes never reaches server, cache or outputs."""
    secret = "hunter2-literal-secret"
    steps = [make_step(i, secret=secret) for i in range(2)]
    steps[1].action.tool_calls[0].arguments["token"] = secret
    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        report, out = run_replay(
            tmp_path, [teacher("alpha", server)], steps, redactor=LiteralRedactor(secret)
        )
        bodies = "\n".join(r.body_text for r in server.received)
    assert "<REDACTED>" in bodies and secret not in bodies
    assert secret not in all_written_text(tmp_path)
    assert (
        read_jsonl(out)[1]["step"]["action"]["tool_calls"][0]["arguments"]["token"] == "<REDACTED>"
    )


def test_planted_secrets_never_leave_with_project_redactor(tmp_path):
    secrets = [
        "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd",
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    ]
    steps = [make_step(i, secret=secrets[i]) for i in range(3)]
    steps[0].context.append({"role": "user", "content": f"export GITHUB_TOKEN={secrets[2]}"})
    # Inside a JSON-string tool-call argument of the context, and an action argument.
    steps[2].context[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(
        {"path": "deploy.sh", "env": f"AWS_ACCESS_KEY_ID={secrets[1]}"}
    )
    steps[1].action.tool_calls[0].arguments["token"] = secrets[0]
    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        run_replay(tmp_path, [teacher("alpha", server)], steps, redactor=load_redactor())
        bodies = "\n".join(r.body_text for r in server.received)
    written = all_written_text(tmp_path)
    for secret in secrets:
        assert secret not in bodies and secret not in written


def test_api_key_never_written(tmp_path, capsys, caplog):
    steps = [make_step(i) for i in range(3)]
    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        wrong = teacher("wrongkey", server, api_key_env="COMPOSER_TUNE_TEST_WRONG_KEY")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("COMPOSER_TUNE_TEST_WRONG_KEY", "sk-wrong-key-that-server-echoes-123456")
            report, out = run_replay(tmp_path, [teacher("alpha", server), wrong], steps)
        auth_headers = {r.headers.get("Authorization") for r in server.received}
    assert f"Bearer {API_KEY}" in auth_headers  # the key did reach the server, in the header only
    print(report.format())
    written = all_written_text(tmp_path) + capsys.readouterr().out + caplog.text
    for key in (API_KEY, "sk-wrong-key-that-server-echoes-123456"):
        assert key not in written
    assert report.teachers["wrongkey"].failures == {"non_retryable": 3}


def test_replay_cli_end_to_end(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "replay_traces", REPO / "tools" / "replay_traces.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    steps_path = tmp_path / "steps.jsonl"
    steps_path.write_text("".join(json.dumps(make_step(i).to_dict()) + "\n" for i in range(3)))
    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        teachers_path = tmp_path / "teachers.yaml"
        teachers_path.write_text(json.dumps({"teachers": [asdict(teacher("alpha", server))]}))
        argv = [
            "--steps", str(steps_path),
            "--teachers", str(teachers_path),
            "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out.jsonl"),
            "--budget-usd", "1",
            "--limit", "2",
        ]  # fmt: skip
        assert cli.main(argv) == 0
        assert len(server.billed()) == 2
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert report["steps"] == 2 and report["total"]["billed"] == 2
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2


def test_cache_only_replay_needs_no_key_and_no_server(tmp_path, monkeypatch):
    """--budget-usd 0 answers from the cache: no API key variable, no connection; a step the
    cache lacks is a budget stop (exit 3) naming it, not a request."""
    cli = load_tool("replay_traces")
    steps_path = tmp_path / "steps.jsonl"
    steps_path.write_text("".join(json.dumps(make_step(i).to_dict()) + "\n" for i in range(3)))
    teachers_path = tmp_path / "teachers.yaml"

    def argv(budget: str, limit: int) -> list[str]:
        return [
            "--steps", str(steps_path), "--teachers", str(teachers_path),
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out.jsonl"),
            "--budget-usd", budget, "--limit", str(limit),
        ]  # fmt: skip

    with FakeOpenAIServer(responder, api_key=API_KEY) as server:
        teachers_path.write_text(json.dumps({"teachers": [asdict(teacher("alpha", server))]}))
        assert cli.main(argv("1", 2)) == 0  # pays for 2 steps, caches them
        paid = read_jsonl(tmp_path / "out.jsonl")
    monkeypatch.delenv(KEY_ENV)  # and the server is gone
    assert cli.main(argv("0", 2)) == 0
    assert read_jsonl(tmp_path / "out.jsonl") == [
        {**record, "teachers": {"alpha": {**record["teachers"]["alpha"], "cached": True}}}
        for record in paid
    ]
    assert cli.main(argv("0", 3)) == 3  # step 2 was never paid for
    (failure,) = read_jsonl(tmp_path / "out.jsonl.failures.jsonl")
    assert "not in the cache (cache-only replay, budget 0)" in json.dumps(failure)
