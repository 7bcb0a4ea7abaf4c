"""Preference pairs (trace-replay DPO, channel 3): the committed asset, rendering, truncation,
held-out split, collation and the reference log-prob cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer_tune.channels.dpo_reference import (
    completion_targets,
    compute_reference_logps,
    reference_cache_path,
)
from composer_tune.channels.replay_dpo import preference_loss
from composer_tune.data.preference import (
    PreferenceDataError,
    PreferenceDataset,
    collate_preference,
    heldout_bucket,
    load_pair_rows,
    pair_id,
)
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.losses.dpo import DPOLossConfig, dpo_loss
from composer_tune.models import qwen3_tiny

REPO = Path(__file__).resolve().parents[1]
PAIRS = REPO / "tests/assets/pairs/pairs.jsonl"
TOKENIZER_DIR = REPO / "tests/assets/tokenizer"


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def dataset(tokenizer: ChatTokenizer) -> PreferenceDataset:
    return PreferenceDataset(PAIRS, tokenizer, split="all")


def raw_rows() -> list[dict]:
    return [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------- the committed asset


def test_committed_pairs_load_with_datasets_and_cover_both_modes() -> None:
    import datasets

    rows = datasets.load_dataset("json", data_files=str(PAIRS), split="train")
    summary = json.loads((PAIRS.parent / "pairs.jsonl.summary.json").read_text())
    assert rows.num_rows == summary["kept"] == len(raw_rows())
    modes = {row["provenance"]["mode"] for row in rows}
    assert modes == {"consensus_over_trace", "trace_over_outlier"}
    assert summary["skipped"] > 0  # some steps had no usable disagreement
    assert any(not row["chosen"].get("tool_calls") for row in rows)  # a text-only answer


def _normalised(rows: list[dict]) -> list[dict]:
    """Drop the two fields that differ between runs (see make_pairs.py): teacher tool-call ids
    (the fake server's request counter) and the trace's absolute path."""
    text = json.dumps(rows, sort_keys=True)
    text = re.sub(r'"call_\d+_\d+"', '"call_N"', text)
    rows = json.loads(text)
    for row in rows:
        row["provenance"]["file"] = Path(row["provenance"]["file"]).name
    return rows


@pytest.mark.slow
def test_committed_pairs_are_what_make_pairs_produces_and_replay_needs_no_key(
    tmp_path: Path,
) -> None:
    """ingest -> replay against the fake server -> build_pairs, rerun from scratch; then the
    README's keyless try-out: the kept work folder's cache answers a --budget-usd 0 replay with
    no key variable set, and build_pairs gives the same pairs again."""
    work = tmp_path / "work"
    script = REPO / "tests/assets/pairs/make_pairs.py"
    subprocess.run(
        [sys.executable, str(script), "--out-dir", str(tmp_path), "--keep-work", str(work)],
        check=True,
        capture_output=True,
    )
    fresh = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert _normalised(fresh) == _normalised(raw_rows())
    committed_summary = (PAIRS.parent / "pairs.jsonl.summary.json").read_text()
    assert (tmp_path / "pairs.jsonl.summary.json").read_text() == committed_summary

    for name in ("steps.jsonl", "teachers.yaml", "cache", "replayed.jsonl", "rules.yaml"):
        assert (work / name).exists(), name
    env = {k: v for k, v in os.environ.items() if "API_KEY" not in k}
    env["PYTHONPATH"] = str(REPO)

    def tool(name: str, *args: Path | str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(REPO / "tools" / f"{name}.py"), *map(str, args)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip

    replay = tool(
        "replay_traces", "--steps", work / "steps.jsonl", "--teachers", work / "teachers.yaml",
        "--cache-dir", work / "cache", "--out", tmp_path / "again.jsonl", "--budget-usd", "0",
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr[-2000:]
    pairs = tool(
        "build_pairs", "--replayed", tmp_path / "again.jsonl", "--rules", work / "rules.yaml",
        "--out", tmp_path / "again_pairs.jsonl",
    )  # fmt: skip
    assert pairs.returncode == 0, pairs.stderr[-2000:]
    again = (tmp_path / "again_pairs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in again] == fresh


# ---------------------------------------------------------------------------------- rendering


def test_every_pair_renders_as_prompt_plus_one_assistant_turn(
    dataset: PreferenceDataset, tokenizer: ChatTokenizer
) -> None:
    rows = raw_rows()
    assert len(dataset) == len(rows) == dataset.stats["pairs"]
    for example, row in zip(dataset, rows, strict=True):
        tools = json.loads(row["tools_json"])
        prompt_text = tokenizer.render(
            row["prompt_messages"], tools=tools, add_generation_prompt=True
        )
        assert tokenizer.decode(example.prompt_ids, skip_special_tokens=False) == prompt_text
        assert example.prompt_ids == tokenizer.encode(prompt_text)
        for key, ids in (("chosen", example.chosen_ids), ("rejected", example.rejected_ids)):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert text.endswith("<|im_end|>") and text.count("<|im_end|>") == 1
            message = row[key]
            if message["content"]:
                assert message["content"] in text
            for call in message.get("tool_calls") or []:
                # Qwen3's tool-call format with the JSON-string arguments verbatim.
                function = call["function"]
                block = (
                    f'<tool_call>\n{{"name": "{function["name"]}", "arguments": '
                    f"{function['arguments']}}}\n</tool_call>"
                )
                assert block in text
            # Prompt + completion is exactly the full conversation's text up to <|im_end|>.
            full = tokenizer.render([*row["prompt_messages"], message], tools=tools)
            assert prompt_text + text == full.removesuffix("\n")
        assert example.chosen_ids != example.rejected_ids


def test_thinking_mode_moves_the_empty_think_block_into_the_prompt(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    rows = raw_rows()
    assert rows[0]["prompt_messages"][-1]["role"] == "user"
    path = write_rows(tmp_path / "first.jsonl", rows[:1])
    thinking = PreferenceDataset(path, tokenizer, split="all")[0]
    plain = PreferenceDataset(path, tokenizer, split="all", enable_thinking=False)[0]
    think_block = tokenizer.encode("<think>\n\n</think>\n\n")
    assert thinking.chosen_ids == think_block + plain.chosen_ids
    assert plain.prompt_ids == thinking.prompt_ids + think_block


def test_answer_not_separable_from_prompt_is_an_error(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """Without a user message in the context, Qwen3's template renders a final assistant turn
    without the empty <think> block that the non-thinking generation prompt ends with."""
    rows = raw_rows()
    index = next(i for i, row in enumerate(rows)
                 if all(m["role"] != "user" for m in row["prompt_messages"]))  # fmt: skip
    path = write_rows(tmp_path / "agentic.jsonl", rows[index : index + 1])
    PreferenceDataset(path, tokenizer, split="all")  # thinking mode: fine
    with pytest.raises(
        PreferenceDataError, match=r"agentic\.jsonl:1: 'chosen': the prompt does not"
    ):
        PreferenceDataset(path, tokenizer, split="all", enable_thinking=False)


def test_a_template_that_drops_tool_calls_is_refused(smollm2_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's template renders message content only: a tool-call action would train as an
    empty answer, and a pair of two tool calls as no preference at all."""
    smollm2 = ChatTokenizer.from_dir(smollm2_dir)
    rows = raw_rows()
    with_call = next(i for i, row in enumerate(rows) if row["chosen"].get("tool_calls"))
    path = write_rows(tmp_path / "tools.jsonl", rows[with_call : with_call + 1])
    with pytest.raises(
        PreferenceDataError, match=r"tools\.jsonl:1: 'chosen': the checkpoint's chat template drops"
    ):
        PreferenceDataset(path, smollm2, split="all")
    text_only = {
        **rows[with_call],
        "chosen": {"role": "assistant", "content": "ok", "tool_calls": []},
        "rejected": {"role": "assistant", "content": "ok"},
    }
    path = write_rows(tmp_path / "same.jsonl", [text_only])
    with pytest.raises(PreferenceDataError, match=r"same\.jsonl:1: .*render to the same tokens"):
        PreferenceDataset(path, smollm2, split="all")


def test_tokenizer_that_truncates_is_refused(tokenizer: ChatTokenizer) -> None:
    truncating = ChatTokenizer.from_dir(TOKENIZER_DIR, max_seq_len=64)
    with pytest.raises(ValueError, match="max_seq_len"):
        PreferenceDataset(PAIRS, truncating, split="all")


# --------------------------------------------------------------------------------- truncation


def test_truncation_keeps_prompt_end_and_drops_overlong_completions(
    dataset: PreferenceDataset, tokenizer: ChatTokenizer
) -> None:
    longest = sorted(max(len(e.chosen_ids), len(e.rejected_ids)) for e in dataset)
    limit = longest[len(longest) // 2] + 40  # some completions fit, the longest do not
    truncated = PreferenceDataset(PAIRS, tokenizer, split="all", max_seq_len=limit)
    kept = {e.pair_id: e for e in truncated}
    expect_dropped = sum(1 for e in dataset if max(len(e.chosen_ids), len(e.rejected_ids)) >= limit)
    assert 0 < expect_dropped < len(dataset)
    assert truncated.stats["dropped_completion_too_long"] == expect_dropped
    assert len(truncated) == len(dataset) - expect_dropped
    expect_truncated = 0
    for full in dataset:
        if full.pair_id not in kept:
            continue
        example = kept[full.pair_id]
        room = limit - max(len(full.chosen_ids), len(full.rejected_ids))
        assert example.chosen_ids == full.chosen_ids and example.rejected_ids == full.rejected_ids
        assert example.prompt_ids == full.prompt_ids[-room:]  # the END of the prompt is kept
        assert example.prompt_tokens_dropped == max(0, len(full.prompt_ids) - room)
        expect_truncated += len(full.prompt_ids) > room
        longer = max(len(example.chosen_ids), len(example.rejected_ids))
        assert len(example.prompt_ids) + longer <= limit
    assert truncated.stats["prompt_truncated"] == expect_truncated > 0


# ----------------------------------------------------------------------------- held-out split


def test_heldout_split_is_a_deterministic_partition_by_provenance_hash(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    fraction = 0.4
    train = PreferenceDataset(PAIRS, tokenizer, split="train", heldout_fraction=fraction)
    heldout = PreferenceDataset(PAIRS, tokenizer, split="heldout", heldout_fraction=fraction)
    train_ids, heldout_ids = {e.pair_id for e in train}, {e.pair_id for e in heldout}
    all_ids = {pair_id(row["provenance"]) for row in raw_rows()}
    assert train_ids and heldout_ids and not train_ids & heldout_ids
    assert train_ids | heldout_ids == all_ids
    # Independently: SHA-256 of the step identity, first 13 hex digits as a fraction.
    for row in raw_rows():
        provenance = row["provenance"]
        identity = {key: provenance[key] for key in
                    ("source_format", "session_id", "step_index", "record_ids", "is_sidechain")}  # fmt: skip
        identity["file_name"] = Path(provenance["file"]).name
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        assert pair_id(provenance) == digest[:16]
        assert (pair_id(provenance) in heldout_ids) == (int(digest[:13], 16) / 16**13 < fraction)

    # Reordered rows, another ingest path and other mining decisions: the same split.
    rows = raw_rows()[::-1]
    for row in rows:
        row["provenance"]["file"] = "/elsewhere/" + Path(row["provenance"]["file"]).name
        row["provenance"]["replay_step_index"] = 999 - row["provenance"]["replay_step_index"]
        row["provenance"]["mode"] = "other"
    moved = tmp_path / "moved.jsonl"
    moved.write_text("".join(json.dumps(row) + "\n" for row in rows))
    moved_heldout = PreferenceDataset(moved, tokenizer, split="heldout", heldout_fraction=fraction)
    assert {e.pair_id for e in moved_heldout} == heldout_ids


def test_split_by_session_keeps_a_session_on_one_side() -> None:
    rows = raw_rows()
    buckets = {heldout_bucket(row["provenance"], "session") for row in rows}
    assert len(buckets) == 1  # the asset is one session
    assert len({heldout_bucket(row["provenance"], "pair") for row in rows}) == len(rows)


# ---------------------------------------------------------------------------------- validation


def write_rows(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda row: row.pop("rejected"), r"missing field\(s\) \['rejected'\]"),
        (lambda row: row.update(tools_json="[{"), "'tools_json' is not valid JSON"),
        (lambda row: row.update(prompt_messages=[]), "'prompt_messages' must be a non-empty"),
        (lambda row: row["chosen"].update(role="user"), "'chosen' must be an assistant message"),
        (
            lambda row: row["rejected"]["tool_calls"][0]["function"].update(arguments={"a": 1}),
            r"'rejected.tool_calls\[0\].function.arguments' must be a JSON string",
        ),
        (
            lambda row: row.update(chosen=row["rejected"]),
            "'chosen' and 'rejected' are the same message",
        ),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path: Path, mutate, message: str) -> None:
    rows = raw_rows()[:3]
    bad = rows[1]
    assert bad["rejected"]["tool_calls"]  # the arguments case edits its first call
    mutate(bad)
    path = write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(PreferenceDataError, match=rf"bad\.jsonl:2: {message}"):
        load_pair_rows(path)


def test_invalid_json_and_duplicate_steps_are_named(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    rows = raw_rows()[:2]
    with pytest.raises(PreferenceDataError, match=r"broken\.jsonl:3: invalid JSON"):
        load_pair_rows(write_rows(tmp_path / "broken.jsonl", [*rows, "{not json"]))
    duplicate = write_rows(tmp_path / "dup.jsonl", [*rows, rows[0]])
    with pytest.raises(
        PreferenceDataError, match=r"dup\.jsonl:3: same trace step .* as \S*dup\.jsonl:1"
    ):
        PreferenceDataset(duplicate, tokenizer, split="all")


def test_rows_read_through_datasets_render_identically(tokenizer: ChatTokenizer) -> None:
    """Rows as ``datasets`` hands them out (its JSON loader may add None-valued keys to
    make row schemas agree) render to the same tokens as the raw JSON rows."""
    import datasets

    from composer_tune.data.preference import render_pair

    rows = datasets.load_dataset("json", data_files=str(PAIRS), split="train")
    for arrow_row, json_row in zip(rows, raw_rows(), strict=True):
        assert render_pair(arrow_row, tokenizer) == render_pair(json_row, tokenizer)


def test_missing_pairs_file_is_named(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pairs file not found: .*nope.jsonl"):
        PreferenceDataset(tmp_path / "nope.jsonl", tokenizer)


def test_directory_source_reads_every_jsonl(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    rows = raw_rows()
    write_rows(tmp_path / "a.jsonl", rows[:5])
    write_rows(tmp_path / "b.jsonl", rows[5:])
    from_dir = PreferenceDataset(tmp_path, tokenizer, split="all")
    assert [e.pair_id for e in from_dir] == [pair_id(row["provenance"]) for row in rows]


# ---------------------------------------------------------------------------------- batching


def test_collate_lays_out_chosen_then_rejected_with_aligned_targets(
    dataset: PreferenceDataset, tokenizer: ChatTokenizer
) -> None:
    examples = [dataset[i] for i in (0, 7, 3)]
    batch = collate_preference(examples, pad_id=tokenizer.pad_id)
    packed = batch.packed
    assert packed.tokens.shape[0] == 6 and batch.pair_ids == [e.pair_id for e in examples]
    targets = completion_targets(packed)
    rows = [(e.prompt_ids, e.chosen_ids) for e in examples]
    rows += [(e.prompt_ids, e.rejected_ids) for e in examples]
    for row, (prompt, completion) in enumerate(rows):
        tokens = packed.tokens[row]
        assert tokens[: len(prompt) + len(completion)].tolist() == prompt + completion
        assert (tokens[len(prompt) + len(completion) :] == tokenizer.pad_id).all()
        assert tokens[packed.completion_mask[row]].tolist() == completion
        # target t is predicted from position t - 1: the completion sits one column left.
        picked = targets[row][targets[row] != -100].tolist()
        assert picked == completion
        assert targets[row, len(prompt) - 1].item() == completion[0]
    chosen, rejected = batch.split(packed.completion_lengths)
    assert chosen.tolist() == [len(e.chosen_ids) for e in examples]
    assert rejected.tolist() == [len(e.rejected_ids) for e in examples]


# ----------------------------------------------------------------------- reference log-probs


def small_dataset(tokenizer: ChatTokenizer, tmp_path: Path, max_seq_len: int) -> PreferenceDataset:
    """Six pairs of both modes with completions under 160 tokens, truncated: a fast pass."""
    path = write_rows(tmp_path / "six.jsonl", [raw_rows()[i] for i in (1, 2, 3, 4, 10, 12)])
    return PreferenceDataset(path, tokenizer, split="all", max_seq_len=max_seq_len)


def test_reference_logps_match_per_row_full_softmax_and_are_cached(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=tokenizer.vocab_size, max_seq_len=256)
    data = small_dataset(tokenizer, tmp_path / "data", max_seq_len=200)
    cache_dir = tmp_path / "cache"
    assert len(data) == 6 and data.stats["prompt_truncated"] > 0
    table = compute_reference_logps(
        model, data, pad_id=tokenizer.pad_id, batch_size=3, cache_dir=cache_dir
    )
    for example in list(data)[:4]:
        for index, completion in enumerate((example.chosen_ids, example.rejected_ids)):
            tokens = torch.tensor([example.prompt_ids + completion])
            with torch.no_grad():
                log_softmax = torch.log_softmax(model(tokens).float(), dim=-1)[0]
            start = len(example.prompt_ids)
            expected = sum(log_softmax[start + i - 1, t].item() for i, t in enumerate(completion))
            assert table[example.cache_key][index] == pytest.approx(expected, abs=1e-3)

    files = list(cache_dir.iterdir())
    assert [f.name for f in files] == [reference_cache_path(cache_dir, _fp(files[0])).name]

    # A rerun is answered from the cache: the model is never called.
    def fail(*args, **kwargs):
        raise AssertionError("the reference model ran although every pair is cached")

    monkeypatch.setattr(model, "forward", fail)
    assert (
        compute_reference_logps(model, data, pad_id=tokenizer.pad_id, cache_dir=cache_dir) == table
    )
    monkeypatch.undo()

    # Other weights: another fingerprint, another file, other values.
    with torch.no_grad():
        model.norm.scale.mul_(2.0)
    changed = compute_reference_logps(model, data, pad_id=tokenizer.pad_id, cache_dir=cache_dir)
    assert len(list(cache_dir.iterdir())) == 2
    assert all(changed[key] != table[key] for key in table)

    batch = collate_preference(list(data)[:2], pad_id=tokenizer.pad_id, reference=table)
    first = list(data)[0]
    assert batch.reference_chosen_logps[0].item() == pytest.approx(table[first.cache_key][0])
    assert batch.reference_rejected_logps[0].item() == pytest.approx(table[first.cache_key][1])


def _fp(path: Path) -> str:
    return json.loads(path.read_text())["model_fingerprint"]


def test_cache_misses_when_tokens_change_and_reports_corruption(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=tokenizer.vocab_size, max_seq_len=256)
    short = small_dataset(tokenizer, tmp_path / "short", max_seq_len=170)
    longer = small_dataset(tokenizer, tmp_path / "longer", max_seq_len=200)
    cache_dir = tmp_path / "cache"
    compute_reference_logps(model, short, pad_id=tokenizer.pad_id, cache_dir=cache_dir)
    both = compute_reference_logps(model, longer, pad_id=tokenizer.pad_id, cache_dir=cache_dir)
    # Same pair ids, other truncation: other cache keys, so new values were computed.
    shared = {e.pair_id for e in short} & {e.pair_id for e in longer}
    assert shared and not {e.cache_key for e in short} & set(both)
    cache_file = next(cache_dir.iterdir())
    entries = json.loads(cache_file.read_text())["entries"]
    assert len(entries) == len(short) + len(longer)
    assert not list(cache_dir.glob("*.partial"))

    cache_file.write_text("{truncated")
    with pytest.raises(ValueError, match=f"{cache_file.name}: corrupt reference log-prob cache"):
        compute_reference_logps(model, short, pad_id=tokenizer.pad_id, cache_dir=cache_dir)
    with pytest.raises(KeyError, match="no reference log-probs"):
        collate_preference(list(short)[:1], pad_id=tokenizer.pad_id, reference={})


def test_preference_loss_with_cached_or_live_reference(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """The recipe-facing step: cached reference (collated) == live reference model == the
    same quantities assembled by hand, per pair, from unpadded rows. IPO, so the token counts
    must line up with the right rows too."""
    torch.manual_seed(0)
    reference = qwen3_tiny(vocab_size=tokenizer.vocab_size, max_seq_len=256)
    policy = qwen3_tiny(vocab_size=tokenizer.vocab_size, max_seq_len=256)
    data = list(small_dataset(tokenizer, tmp_path, max_seq_len=200))[:2]
    table = compute_reference_logps(reference, data, pad_id=tokenizer.pad_id)
    config = DPOLossConfig("ipo", beta=0.2)
    cached = preference_loss(
        policy, collate_preference(data, pad_id=tokenizer.pad_id, reference=table), config
    )
    batch = collate_preference(data, pad_id=tokenizer.pad_id)
    live = preference_loss(policy, batch, config, reference_model=reference)
    torch.testing.assert_close(cached.losses, live.losses, rtol=0, atol=1e-4)

    def row_logp(model, prompt: list[int], completion: list[int]) -> float:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).float()
        log_softmax = torch.log_softmax(logits, dim=-1)[0]
        return sum(log_softmax[len(prompt) + i - 1, t].item() for i, t in enumerate(completion))

    columns = [[], [], [], []]
    for e in data:
        columns[0].append(row_logp(policy, e.prompt_ids, e.chosen_ids))
        columns[1].append(row_logp(policy, e.prompt_ids, e.rejected_ids))
        columns[2].append(row_logp(reference, e.prompt_ids, e.chosen_ids))
        columns[3].append(row_logp(reference, e.prompt_ids, e.rejected_ids))
    by_hand = dpo_loss(
        *(torch.tensor(c, dtype=torch.float64) for c in columns),
        config,
        chosen_token_counts=torch.tensor([len(e.chosen_ids) for e in data]),
        rejected_token_counts=torch.tensor([len(e.rejected_ids) for e in data]),
    )
    torch.testing.assert_close(live.losses.double(), by_hand.losses, rtol=0, atol=1e-4)
    live.loss.backward()  # gradients reach the policy only
    assert policy.tok_embeddings.weight.grad is not None
    assert reference.tok_embeddings.weight.grad is None
    with pytest.raises(ValueError, match="no reference log-probs"):
        preference_loss(policy, batch, config)
