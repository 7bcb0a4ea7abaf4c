"""A scripted OpenAI-compatible ``/v1/chat/completions`` server for tests, over real HTTP.

``FakeOpenAIServer`` listens on 127.0.0.1 (a free port) in a background thread. Answers come from
a ``responder(body) -> Reply`` callable, so tests script tool calls, text and token usage
deterministically, or, with ``upstream=<base_url>``, from a real server the fake forwards each
request to (a fault-injecting proxy in front of e.g. a local vLLM server). Faults are injected per request by ``fault_for(body, attempt) -> Fault | None``,
where ``attempt`` counts earlier arrivals of the identical body (0 for the first), so a test can
say "fail this request twice, then answer" independently of thread scheduling.

Every request is recorded (``received``): headers, raw body, what the server did with it, and
whether it was *billed*, i.e. answered in full with a 200 completion. With ``max_in_flight`` the
fake answers 429 (``Retry-After``) to requests beyond that many at once, as a provider's gateway
does. A slow answer that outlives
the client's timeout is recorded as not billed (the fake's convention; real providers may charge
for abandoned requests, which a client cannot know).

Usage::

    with FakeOpenAIServer(responder, api_key="sk-test") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="sk-test")
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


@dataclass(frozen=True)
class Reply:
    """A scripted answer: text and/or tool calls ``{"name": str, "arguments": dict}``."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 100
    completion_tokens: int = 10
    include_usage: bool = True
    delay_s: float = 0.0  # think time before a normal (billed) answer


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    kind: ``status`` (HTTP ``status`` with an error body, ``retry_after`` seconds as header),
    ``slow`` (sleep ``delay_s`` before answering normally), ``malformed`` (200 with a broken JSON
    body), ``truncated`` (200 whose body stops halfway, short of its Content-Length, then the
    connection closes), ``drop`` (close the connection without answering). With an upstream, a
    ``malformed`` or ``truncated`` answer is made from the upstream's real answer: the upstream
    did the work (and would bill it), the client cannot use it.
    """

    kind: str
    status: int = 500
    retry_after: float | None = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("status", "slow", "malformed", "truncated", "drop"):
            raise ValueError(f"unknown fault kind {self.kind!r}")


@dataclass
class ReceivedRequest:
    """One request as the server saw it."""

    path: str
    headers: dict[str, str]
    body_text: str
    body: dict[str, Any] | None
    attempt: int
    outcome: str = "pending"  # "ok", "status_<code>", "busy", "slow", "malformed", "truncated",
    # "drop", "unauthorized", "upstream_<code>" (the upstream's non-200 answer, relayed)
    billed: bool = False


def completion_body(model: str, reply: Reply, serial: int) -> dict[str, Any]:
    """The chat.completion JSON for ``reply`` (arguments serialised as the API does)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{serial}_{i}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
            for i, call in enumerate(reply.tool_calls)
        ]
    body: dict[str, Any] = {
        "id": f"chatcmpl-{serial}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.tool_calls else "stop",
            }
        ],
    }
    if reply.include_usage:
        body["usage"] = {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        }
    return body


class FakeOpenAIServer:
    """Threaded fake chat-completions server; use as a context manager."""

    def __init__(
        self,
        responder: Callable[[dict[str, Any]], Reply] | None = None,
        *,
        upstream: str | None = None,
        fault_for: Callable[[dict[str, Any], int], Fault | None] | None = None,
        api_key: str | None = None,
        max_in_flight: int | None = None,
        busy_retry_after_s: float = 0.2,
    ) -> None:
        if (responder is None) == (upstream is None):
            raise ValueError("give exactly one of responder (scripted answers) and upstream")
        self.responder = responder
        self.upstream = upstream.rstrip("/") if upstream is not None else None
        self.fault_for = fault_for
        self.api_key = api_key
        self.max_in_flight = max_in_flight
        self.busy_retry_after_s = busy_retry_after_s
        self.received: list[ReceivedRequest] = []
        self._arrivals: dict[str, int] = {}
        self._in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        """The ``base_url`` an OpenAI client should use (ends in ``/v1``)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def billed(self) -> list[ReceivedRequest]:
        """Requests answered in full with a 200 completion."""
        with self._lock:
            return [request for request in self.received if request.billed]

    def _enter(self) -> bool:
        """Count a request in flight; False (and not counted) when ``max_in_flight`` is reached."""
        with self._lock:
            if self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                return False
            self._in_flight += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def answer(self, request: ReceivedRequest) -> tuple[int, bytes]:
        """The status and body of the normal answer: the responder's, or the upstream's."""
        assert request.body is not None
        if self.upstream is None:
            assert self.responder is not None
            reply = self.responder(request.body)
            time.sleep(reply.delay_s)
            body = completion_body(request.body["model"], reply, len(self.received))
            return 200, json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        try:
            reply = httpx.post(
                f"{self.upstream}/chat/completions",
                content=request.body_text.encode("utf-8"),
                headers=headers,
                timeout=None,
            )
        except httpx.HTTPError as error:  # the upstream died or is down: a gateway's 502
            message = {"error": {"message": f"upstream unreachable: {error!r}", "type": "proxy"}}
            return 502, json.dumps(message).encode()
        return reply.status_code, reply.content

    def _register(self, path: str, headers: dict[str, str], text: str) -> ReceivedRequest:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = None
        signature = json.dumps(body, sort_keys=True) if body is not None else text
        with self._lock:
            attempt = self._arrivals.get(signature, 0)
            self._arrivals[signature] = attempt + 1
            request = ReceivedRequest(path, headers, text, body, attempt)
            self.received.append(request)
        return request

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
                """Silence per-request logging on stderr."""

            def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)
                self.wfile.flush()

            def _error(self, status: int, message: str, headers: dict[str, str] | None = None):
                payload = json.dumps({"error": {"message": message, "type": "fake_error"}})
                self._send(status, payload.encode(), headers)

            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                length = int(self.headers.get("Content-Length", "0"))
                text = self.rfile.read(length).decode("utf-8")
                request = fake._register(self.path, dict(self.headers.items()), text)
                if self.path.rstrip("/") != "/v1/chat/completions" or request.body is None:
                    request.outcome = "status_404"
                    self._error(404, f"unknown path or bad body: {self.path}")
                    return
                if fake.api_key is not None and (
                    self.headers.get("Authorization") != f"Bearer {fake.api_key}"
                ):
                    request.outcome = "unauthorized"
                    # Like real providers, echo the presented key: clients must scrub it.
                    presented = self.headers.get("Authorization", "").removeprefix("Bearer ")
                    self._error(401, f"Incorrect API key provided: {presented}")
                    return
                if not fake._enter():
                    request.outcome = "busy"
                    retry_after = {"Retry-After": f"{fake.busy_retry_after_s:g}"}
                    self._error(429, "too many requests in flight", retry_after)
                    return
                try:
                    self._answer_counted(request)
                finally:
                    fake._leave()

            def _answer_counted(self, request: ReceivedRequest) -> None:
                assert request.body is not None
                fault = fake.fault_for(request.body, request.attempt) if fake.fault_for else None
                if fault is not None and fault.kind == "status":
                    request.outcome = f"status_{fault.status}"
                    headers = {}
                    if fault.retry_after is not None:
                        headers["Retry-After"] = f"{fault.retry_after:g}"
                    self._error(fault.status, "injected failure", headers)
                    return
                if fault is not None and fault.kind == "drop":
                    request.outcome = "drop"
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind == "slow":
                    # Meant to outlive the client's timeout: recorded as not billed either way.
                    request.outcome = "slow"
                    time.sleep(fault.delay_s)
                    self.close_connection = True
                    try:
                        self._send(*fake.answer(request))
                    except OSError:
                        pass  # the client has given up and closed the connection
                    return
                if fault is not None and fault.kind == "malformed":
                    if fake.upstream is not None:
                        fake.answer(request)  # the real server does the work
                    request.outcome = "malformed"
                    self._send(200, b'{"id": "chatcmpl-broken", "choices": [')
                    return
                status, payload = fake.answer(request)
                if fault is not None and fault.kind == "truncated":
                    request.outcome = "truncated"
                    self.close_connection = True
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                request.outcome = "ok" if status == 200 else f"upstream_{status}"
                request.billed = status == 200
                self._send(status, payload)

        return Handler
