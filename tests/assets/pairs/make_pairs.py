#!/usr/bin/env python
"""Rebuild ``pairs.jsonl`` by running the channel-3 tools end to end on a real shared trace.

Channel 3 (trace-replay DPO) is composer-tune's own research addition, not part of Cursor's
published Composer recipe. This script exercises its whole data path, offline:

1. ``tools/ingest_traces.py`` on the real Claude Code session in ``tests/assets/traces/claude-code``
   (default redaction, ``--max-context-messages 4`` to keep the asset small);
2. ``tools/replay_traces.py`` against three scripted teachers served by
   ``tests/fake_openai_server.py`` on 127.0.0.1 (real HTTP, the real OpenAI client);
3. ``tools/build_pairs.py`` with both pair modes enabled.

The teachers' answers depend only on the step's position in the session (``SCENARIOS``), so some
steps get a consensus against the trace and some do not:

* ``consensus``: all three propose the same action, different from the trace's
  -> a ``consensus_over_trace`` pair;
* ``outlier``: two repeat the trace action, ``gamma`` proposes something else
  -> a ``trace_over_outlier`` pair (the session's two text-only steps fall here);
* ``agree``: all three repeat the trace action -> skipped (``consensus_not_against_trace``);
* ``split``: ``alpha`` repeats the trace action, ``beta`` and ``gamma`` propose two different
  actions -> skipped (``no_consensus``).

Usage (from anywhere)::

    python tests/assets/pairs/make_pairs.py [--out-dir DIR] [--keep-work WORK]

writes ``pairs.jsonl`` and ``pairs.jsonl.summary.json`` to DIR (default: this folder); with
``--keep-work`` the intermediate files stay in WORK (``steps.jsonl``, ``teachers.yaml``, the
response ``cache/``, ``replayed.jsonl`` and its report, ``rules.yaml``), so each tool can be rerun
by hand, e.g. the replay from the cache alone with ``--budget-usd 0`` and no API key. Tool-call
ids of teacher answers come from the fake server's request counter and the trace file's absolute
path is recorded in each pair's provenance, so two runs differ in those fields only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tests.fake_openai_server import FakeOpenAIServer, Reply  # noqa: E402

TRACE = (
    REPO
    / "tests/assets/traces/claude-code/claude-code-log-sample__fe869ecb-c176-478f-9734-7e4b8ef12cff.jsonl"
)
MAX_CONTEXT_MESSAGES = 4
TEACHERS = ("alpha", "beta", "gamma")
SCENARIOS = ("consensus", "outlier", "agree", "split")  # step i gets SCENARIOS[i % 4]
KEY_ENV = "MAKE_PAIRS_FAKE_API_KEY"
RULES = "modes: [consensus_over_trace, trace_over_outlier]\n"


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


# Alternatives proposed instead of the trace action: the first whose tool the trace action does
# not use, so they always disagree with it (different tool name scores 0).
ALTERNATIVES = (
    _call("Bash", command="uv run pytest -x -q"),
    _call("Read", file_path="pyproject.toml"),
    _call("Grep", pattern="def test_", path="test"),
)


def _context_key(messages: list[dict[str, Any]]) -> str:
    """Identifies a step by the tool-call ids of its context (unique within a session)."""
    ids = [message.get("tool_call_id") for message in messages]
    ids += [call.get("id") for message in messages for call in message.get("tool_calls") or []]
    return json.dumps([len(messages), ids])


def _run(args: list[str], env: dict[str, str]) -> None:
    subprocess.run([sys.executable, *args], cwd=REPO, env=env, check=True)


def _trace_reply(action: dict[str, Any]) -> Reply:
    calls = [_call(c["name"], **c["arguments"]) for c in action["tool_calls"]]
    return Reply(content=action["text"] or None, tool_calls=calls)


def _alternatives(action: dict[str, Any]) -> list[Reply]:
    used = {call["name"] for call in action["tool_calls"]}
    return [Reply(tool_calls=[alt]) for alt in ALTERNATIVES if alt["name"] not in used]


def make_responder(steps_path: Path):
    """The scripted teachers: answer per (step position, teacher) as in the module docstring."""
    from composer_tune.teachers.protocol import normalise_message

    by_context = {}
    with steps_path.open(encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            step = json.loads(line)
            key = _context_key([normalise_message(m) for m in step["context"]])
            if key in by_context:
                raise RuntimeError(f"two steps share the context key {key}")
            by_context[key] = (index, step["action"])

    def responder(body: dict[str, Any]) -> Reply:
        index, action = by_context[_context_key(body["messages"])]
        teacher = body["model"].removesuffix("-model")
        trace, (first, second, *_) = _trace_reply(action), _alternatives(action)
        scenario = SCENARIOS[index % len(SCENARIOS)]
        answers = {
            "consensus": {"alpha": first, "beta": first, "gamma": first},
            "agree": {"alpha": trace, "beta": trace, "gamma": trace},
            "outlier": {"alpha": trace, "beta": trace, "gamma": first},
            "split": {"alpha": trace, "beta": first, "gamma": second},
        }[scenario]
        return answers[teacher]

    return responder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument(
        "--keep-work",
        type=Path,
        default=None,
        help="keep the intermediate files (steps, teachers config, response cache, replayed "
        "steps, rules) in this folder instead of a temporary one",
    )
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(REPO), KEY_ENV: "sk-fake-make-pairs-000000000000"}
    with contextlib.ExitStack() as stack:
        if args.keep_work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        else:
            work = args.keep_work
            work.mkdir(parents=True, exist_ok=True)
        steps = work / "steps.jsonl"
        _run(
            ["tools/ingest_traces.py", str(TRACE), "--out", str(steps),
             "--max-context-messages", str(MAX_CONTEXT_MESSAGES)],
            env,
        )  # fmt: skip
        with FakeOpenAIServer(make_responder(steps)) as server:
            teachers = [
                {
                    "name": name,
                    "base_url": server.base_url,
                    "model": f"{name}-model",
                    "api_key_env": KEY_ENV,
                    "price_per_input_token": 0.0,
                    "price_per_output_token": 0.0,
                    "max_concurrency": 1,
                    "temperature": 0.0,
                    "max_tokens": 512,
                    "timeout_s": 30,
                }
                for name in TEACHERS
            ]
            (work / "teachers.yaml").write_text(json.dumps({"teachers": teachers}))
            _run(
                ["tools/replay_traces.py", "--steps", str(steps),
                 "--teachers", str(work / "teachers.yaml"), "--cache-dir", str(work / "cache"),
                 "--out", str(work / "replayed.jsonl"), "--budget-usd", "1"],
                env,
            )  # fmt: skip
        (work / "rules.yaml").write_text(RULES)
        _run(
            ["tools/build_pairs.py", "--replayed", str(work / "replayed.jsonl"),
             "--rules", str(work / "rules.yaml"), "--out", str(work / "pairs.jsonl")],
            env,
        )  # fmt: skip
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("pairs.jsonl", "pairs.jsonl.summary.json"):
            shutil.copyfile(work / name, args.out_dir / name)
    print(f"wrote {args.out_dir / 'pairs.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
