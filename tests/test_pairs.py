"""Preference-pair mining: agreement scores worked by hand, rule decisions on hand-built replays,
and the whole chain on a real Claude Code trace (ingest -> replay over HTTP -> pairs -> datasets).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_tune.data.pairs import (
    PairRules,
    PairRulesError,
    ReplayedFileError,
    action_agreement,
    load_pair_rules,
    mine_step,
    parse_pair_rules,
    read_replayed,
    text_similarity,
    value_similarity,
)
from composer_tune.data.traces import iter_steps
from composer_tune.data.traces.schema import Action, ToolCall
from tests.fake_openai_server import FakeOpenAIServer, Reply
from tests.recipe_runs import load_tool

REPO = Path(__file__).resolve().parents[1]
REAL_TRACE = REPO / "tests/assets/traces/claude-code/1af7fc5e-8455-4414-9ccd-011d40f70b2a.jsonl"
KEY_ENV = "COMPOSER_TUNE_TEST_PAIRS_KEY"


def call(name: str, **arguments) -> Action:
    return Action(tool_calls=[ToolCall(name=name, arguments=arguments)])


# ------------------------------------------------------------------------- agreement (by hand)


def test_text_similarity_is_token_jaccard():
    # {run, the, tests, now} vs {run, the, tests}: 3 shared of 4.
    assert text_similarity("Run the tests now", "run  the TESTS") == pytest.approx(3 / 4)
    # "pytest -q tests/unit": {pytest, -, q, tests, /, unit}; "pytest tests/unit": 4 of those.
    assert text_similarity("pytest -q tests/unit", "pytest tests/unit") == pytest.approx(4 / 6)
    assert text_similarity("", "  ") == 1.0 and text_similarity("a", "") == 0.0


def test_value_similarity_types():
    assert value_similarity(50, 50.0) == 1.0 and value_similarity(50, 20) == 0.0
    assert value_similarity(True, 1) == 0.0 and value_similarity(None, None) == 1.0
    assert value_similarity([1, 2, 3], [1, 2]) == pytest.approx(2 / 3)
    assert value_similarity({"a": 1, "b": "x y"}, {"a": 1, "b": "x", "c": 0}) == pytest.approx(
        (1 + 0.5 + 0) / 3
    )
    assert value_similarity("1", 1) == 0.0


def test_action_agreement_cases():
    read_a = call("read_file", path="src/a.py", limit=50)
    assert action_agreement(read_a, read_a) == 1.0
    # Same tool; path equal, limit differs: args = (1 + 0) / 2, score = 0.5 + 0.5 * 0.5.
    assert action_agreement(read_a, call("read_file", path="src/a.py", limit=20)) == 0.75
    assert action_agreement(read_a, call("write_file", path="src/a.py", limit=50)) == 0.0
    assert action_agreement(read_a, Action(text="I will read src/a.py")) == 0.0
    assert action_agreement(Action(text="Done."), Action(text="done .")) == 1.0
    # final_answer: text-only actions agree on their final answer, not their wording.
    so, answer_is = Action(text="So 21 - 2 = 19."), Action(text="The answer is 19")
    assert action_agreement(so, answer_is) < 0.4
    assert action_agreement(so, answer_is, "final_answer") == 1.0
    assert action_agreement(so, Action(text="21 - 2 = 18"), "final_answer") == 0.0
    assert action_agreement(Action(text="no idea"), Action(text="none"), "final_answer") == 0.0
    assert action_agreement(read_a, read_a, "final_answer") == 1.0  # tool calls as before
    # Call order does not matter; a missing call costs its share.
    two = Action(tool_calls=[ToolCall("ls", {"d": "x"}), ToolCall("cat", {"f": "y"})])
    swapped = Action(tool_calls=[ToolCall("cat", {"f": "y"}), ToolCall("ls", {"d": "x"})])
    assert action_agreement(two, swapped) == 1.0
    assert action_agreement(two, call("cat", f="y")) == 0.5
    # Unparsed (raw string) arguments against JSON ones: compared as text.
    raw = Action(tool_calls=[ToolCall("bash", '{"cmd": "ls -la"}')])
    assert action_agreement(raw, call("bash", cmd="ls -la")) == 1.0


# ----------------------------------------------------------------------------------- rules


def test_rules_validation_names_key_and_file(tmp_path):
    path = tmp_path / "rules.yaml"
    for text, expected in [
        ("min_teacher: 2", "unknown key(s) ['min_teacher']"),
        ("consensus_threshold: 1.5", "'consensus_threshold' must be a number in [0, 1]"),
        ("modes: [best_of]", "'modes' must be a non-empty list"),
        ("consensus_threshold: 0.3\ndisagreement_threshold: 0.5", "must not exceed"),
        ("min_teachers: 0", "'min_teachers' must be an integer >= 1"),
        ("text_match: exact", "'text_match' must be one of ['tokens', 'final_answer', 'verified']"),
    ]:
        path.write_text(text)
        with pytest.raises(PairRulesError, match=r".*") as error:
            load_pair_rules(path)
        assert expected in str(error.value) and str(path) in str(error.value)
    path.write_text(
        "modes: [trace_over_outlier]\nexclude_teachers: [self]\ntext_match: final_answer\n"
    )
    rules = load_pair_rules(path)
    assert rules.modes == ("trace_over_outlier",) and rules.exclude_teachers == ("self",)
    assert rules.text_match == "final_answer"
    assert parse_pair_rules(None) == PairRules()


# --------------------------------------------------------------------------- mining decisions


def action_dict(action: Action) -> dict:
    return {
        "text": action.text,
        "tool_calls": [
            {"name": c.name, "arguments": c.arguments, "id": c.id} for c in action.tool_calls
        ],
        "thinking": None,
    }


def replayed(trace: Action, answers: dict[str, Action | None]) -> dict:
    """A replayed-step record as tools/replay_traces.py writes it (None = failed teacher)."""
    return {
        "step_index": 0,
        "step": {
            "context": [{"role": "user", "content": "Fix the bug in src/a.py."}],
            "action": action_dict(trace),
            "observation": None,
            "provenance": {
                "source_format": "claude_code",
                "file": "/logs/s.jsonl",
                "session_id": "s",
                "step_index": 3,
                "tool_version": None,
                "record_ids": ["u1"],
                "is_sidechain": False,
            },
        },
        "tools": [],
        "teachers": {
            name: (
                {"status": "failed", "reason": "x"}
                if answer is None
                else {"status": "ok", "model": f"{name}-m", "action": action_dict(answer)}
            )
            for name, answer in answers.items()
        },
    }


BOTH_MODES = PairRules(modes=("consensus_over_trace", "trace_over_outlier"))
READ = call("read_file", path="src/a.py")
TEST = call("run_tests", path="tests/")


def test_consensus_against_trace_chooses_consensus():
    record = replayed(Action(text="Done, the bug is fixed."), {"a": READ, "b": READ, "c": READ})
    pair, mode = mine_step(record, BOTH_MODES)
    assert mode == "consensus_over_trace"
    assert pair["chosen"]["tool_calls"][0]["function"] == {
        "name": "read_file",
        "arguments": '{"path": "src/a.py"}',
    }
    assert pair["rejected"] == {"role": "assistant", "content": "Done, the bug is fixed."}
    assert pair["provenance"]["chosen_from"] == "teacher:a"
    assert pair["provenance"]["rejected_from"] == "trace"
    assert pair["scores"]["agreement_with_trace"] == {"a": 0.0, "b": 0.0, "c": 0.0}
    assert pair["prompt_messages"] == [{"role": "user", "content": "Fix the bug in src/a.py."}]


def test_consensus_representative_is_most_central_answer():
    near = call("edit", path="a.py", text="x = 1 + 2")
    # b's text shares tokens with both a's and c's; a and c share fewer with each other.
    answers = {
        "a": call("edit", path="a.py", text="x = 1"),
        "b": near,
        "c": call("edit", path="a.py", text="1 + 2"),
    }
    rules = PairRules(consensus_threshold=0.6, disagreement_threshold=0.3)
    pair, mode = mine_step(replayed(TEST, answers), rules)
    assert mode == "consensus_over_trace" and pair["provenance"]["chosen_from"] == "teacher:b"


def test_outlier_against_trace_and_mode_switch():
    record = replayed(READ, {"a": READ, "b": READ, "c": Action(text="Looks fine to me.")})
    pair, mode = mine_step(record, BOTH_MODES)
    assert mode == "trace_over_outlier"
    assert pair["chosen"]["tool_calls"][0]["function"]["name"] == "read_file"
    assert pair["rejected"] == {"role": "assistant", "content": "Looks fine to me."}
    assert pair["provenance"]["rejected_from"] == "teacher:c"
    assert mine_step(record, PairRules()) == (None, "mode_disabled")


@pytest.mark.parametrize(
    ("trace", "answers", "reason"),
    [
        (READ, {"a": READ, "b": READ}, "consensus_not_against_trace"),
        (READ, {"a": TEST, "b": Action(text="hm"), "c": READ}, "no_consensus"),
        (READ, {"a": TEST, "b": None, "c": Action(text=" ")}, "too_few_teachers"),
        (Action(), {"a": TEST, "b": TEST}, "empty_trace_action"),
        # Two outliers: not a single deviating teacher.
        (READ, {"a": READ, "b": TEST, "c": Action(text="no")}, "no_consensus"),
    ],
)
def test_skip_reasons(trace, answers, reason):
    assert mine_step(replayed(trace, answers), BOTH_MODES) == (None, reason)


def test_an_answer_cut_off_at_max_tokens_is_not_an_action():
    record = replayed(Action(text="Done."), {"a": READ, "b": READ})
    assert mine_step(record, BOTH_MODES)[1] == "consensus_over_trace"
    # A real server's answer to a long tool call: half the call as text, finish_reason length.
    record["teachers"]["b"]["action"] = action_dict(Action(text='<tool_call>\n{"name": "read'))
    record["teachers"]["b"]["finish_reason"] = "length"
    assert mine_step(record, BOTH_MODES) == (None, "too_few_teachers")


def test_excluding_the_trace_model_changes_the_decision():
    # "self" produced the trace and agrees with it; the independent teachers agree against it.
    record = replayed(READ, {"a": TEST, "b": TEST, "self": READ})
    assert mine_step(record, BOTH_MODES) == (None, "no_consensus")
    pair, mode = mine_step(record, PairRules(exclude_teachers=("self",)))
    assert mode == "consensus_over_trace" and pair["teachers"]["self"]["excluded"] is True


def test_bad_replayed_line_is_named(tmp_path):
    good = replayed(READ, {"a": READ, "b": READ})
    bad = replayed(READ, {"a": READ})
    del bad["teachers"]["a"]["action"]
    path = tmp_path / "replayed.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ReplayedFileError, match=f"{path}:3: teacher 'a': status 'ok' without"):
        list(read_replayed(path))


# ------------------------------------------------------------------- real trace, end to end


def test_real_trace_replay_to_pairs_to_datasets(tmp_path, monkeypatch):
    """Ingest a real Claude Code session, replay it with 3 scripted teachers over HTTP (with a
    redaction config naming the user found in its `ls` output), mine pairs, load with datasets."""
    steps = list(iter_steps(REAL_TRACE))
    assert len(steps) == 7 and "kaito" in json.dumps([s.to_dict() for s in steps])
    trace_by_length = {len(step.context): step.action for step in steps}
    assert len(trace_by_length) == 7  # context length identifies the step

    def as_reply(action: Action) -> Reply:
        calls = [{"name": c.name, "arguments": c.arguments} for c in action.tool_calls]
        return Reply(content=action.text, tool_calls=calls)

    bash_ls = call("Bash", command="ls -la")
    plan = {  # context length -> {model: proposed action}; None = echo the trace action
        2: {"alpha": bash_ls, "beta": bash_ls, "gamma": bash_ls},  # consensus against trace
        4: {"alpha": None, "beta": None, "gamma": None},  # agree with trace
        14: {"alpha": None, "beta": None, "gamma": Action(text="All done.")},  # one outlier
        20: {"alpha": None, "beta": None, "gamma": None},  # text step, all agree
    }

    def responder(body: dict) -> Reply:
        length, model = len(body["messages"]), body["model"].removesuffix("-model")
        proposal = plan.get(length, {}).get(model)
        if length not in plan:  # everyone proposes something different
            proposal = {"alpha": bash_ls, "beta": call("Read", file_path="x"), "gamma": None}[model]
            proposal = proposal or Action(text="I am not sure.")
        return as_reply(proposal or trace_by_length[length])

    steps_path = tmp_path / "steps.jsonl"
    steps_path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in steps))
    (tmp_path / "redact.yaml").write_text("home_users: [kaito]\n")
    (tmp_path / "rules.yaml").write_text("modes: [consensus_over_trace, trace_over_outlier]\n")
    monkeypatch.setenv(KEY_ENV, "sk-pairs-test-key-000000000000000000")
    with FakeOpenAIServer(responder) as server:
        teachers = [
            {
                "name": name,
                "base_url": server.base_url,
                "model": f"{name}-model",
                "api_key_env": KEY_ENV,
                "price_per_input_token": 1e-6,
                "price_per_output_token": 1e-6,
                "max_concurrency": 2,
                "temperature": 0,
                "max_tokens": 256,
                "timeout_s": 10,
            }
            for name in ("alpha", "beta", "gamma")
        ]
        (tmp_path / "teachers.yaml").write_text(json.dumps({"teachers": teachers}))
        replay_args = [
            "--steps", str(steps_path), "--teachers", str(tmp_path / "teachers.yaml"),
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "replayed.jsonl"),
            "--budget-usd", "1", "--redact-config", str(tmp_path / "redact.yaml"),
        ]  # fmt: skip
        assert load_tool("replay_traces").main(replay_args) == 0
        bodies = [r.body_text for r in server.received]
    assert len(bodies) == 21 and not any("kaito" in body for body in bodies)
    # Tools declared to teachers: every tool the session used.
    assert {t["function"]["name"] for t in json.loads(bodies[0])["tools"]} == {
        "TodoWrite", "Bash", "Glob", "Write"
    }  # fmt: skip

    pairs_path = tmp_path / "pairs.jsonl"
    pair_args = ["--replayed", str(tmp_path / "replayed.jsonl"), "--rules", str(tmp_path / "rules.yaml"), "--out", str(pairs_path)]  # fmt: skip
    assert load_tool("build_pairs").main(pair_args) == 0
    summary = json.loads((tmp_path / "pairs.jsonl.summary.json").read_text())
    assert summary["kept_by_mode"] == {"consensus_over_trace": 1, "trace_over_outlier": 1}
    assert summary["skipped_by_reason"] == {"consensus_not_against_trace": 2, "no_consensus": 3}
    assert "kaito" not in pairs_path.read_text()

    import datasets

    rows = datasets.load_dataset("json", data_files=str(pairs_path), split="train")
    assert rows.num_rows == 2
    by_mode = {row["provenance"]["mode"]: row for row in rows}
    consensus = by_mode["consensus_over_trace"]
    assert consensus["chosen"]["tool_calls"][0]["function"]["name"] == "Bash"
    assert consensus["rejected"]["tool_calls"][0]["function"]["name"] == "TodoWrite"
    assert len(consensus["prompt_messages"]) == 2
    outlier = by_mode["trace_over_outlier"]
    assert outlier["rejected"]["content"] == "All done."
    assert outlier["chosen"]["tool_calls"][0]["function"]["name"] == "TodoWrite"
    assert outlier["provenance"]["rejected_from"] == "teacher:gamma"
    assert len(outlier["prompt_messages"]) == 14
