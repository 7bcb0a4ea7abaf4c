"""composer_tune.data.TaskDataset: a task's prompts from JSONL / JSON / Parquet / CSV files, a
folder of them, a ``save_to_disk`` folder or the Hugging Face cache, in TRL's standard and
conversational formats, with ``column_map``, a system prompt, the hash held-out split,
``num_samples`` and a shuffle seed; and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from composer_tune.data import TaskDataset
from composer_tune.data.task_dataset import TaskRow

CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": f"Count to {i}."}], "target_n": i, "tag": f"t{i}"}
    for i in range(20)
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_conversational_jsonl_passes_every_column_through(tmp_path: Path) -> None:
    data = TaskDataset(str(_jsonl(tmp_path / "train.jsonl", CONVERSATIONAL)))
    assert len(data) == 20
    row = data[3]
    assert isinstance(row, TaskRow) and row.prompt_text is None
    assert row == {
        "prompt": [{"role": "user", "content": "Count to 3."}],
        "target_n": 3,
        "tag": "t3",
    }


def test_standard_format_renders_as_a_user_message_and_keeps_its_text(tmp_path: Path) -> None:
    rows = [{"prompt": "Say hi.", "lang": "en"}, {"prompt": "Sag hallo.", "lang": "de"}]
    data = TaskDataset(str(_jsonl(tmp_path / "d.jsonl", rows)), system_prompt="Be brief.")
    assert data[1]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sag hallo."},
    ]
    assert data[1].prompt_text == "Sag hallo." and data[1]["lang"] == "de"
    # A row's own system message stays; none is added before it.
    own = [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}]
    data = TaskDataset(str(_jsonl(tmp_path / "s.jsonl", own)), system_prompt="Be brief.")
    assert data[0]["prompt"] == own[0]["prompt"]


def test_missing_message_keys_are_not_invented(tmp_path: Path) -> None:
    # Arrow gives every message every key any message has; the absent ones come back out.
    rows = [
        {
            "prompt": [
                {"role": "user", "content": "Call it."},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
                {"role": "tool", "name": "f", "content": "3"},
            ]
        }
    ]
    (row,) = TaskDataset(str(_jsonl(tmp_path / "d.jsonl", rows)))
    assert row["prompt"][0] == {"role": "user", "content": "Call it."}
    assert set(row["prompt"][2]) == {"role", "name", "content"}


@pytest.mark.parametrize("suffix", [".json", ".parquet", ".csv"])
def test_json_parquet_and_csv_files(tmp_path: Path, suffix: str) -> None:
    rows = [{"prompt": f"Question {i}?", "expected": str(i)} for i in range(5)]
    frame = datasets.Dataset.from_list(rows)
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        frame.to_parquet(str(path))
    else:
        frame.to_csv(str(path), index=False)
    data = TaskDataset(str(path))
    assert [row.prompt_text for row in data] == [f"Question {i}?" for i in range(5)]
    # CSV columns are typed by the reader (as TRL gets them): "0" reads as 0.
    assert [str(row["expected"]) for row in data] == [str(i) for i in range(5)]


def test_a_folder_of_files_and_a_save_to_disk_folder(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", CONVERSATIONAL[:7])
    _jsonl(folder / "b.jsonl", CONVERSATIONAL[7:])
    assert sorted(row["target_n"] for row in TaskDataset(str(folder))) == list(range(20))
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(CONVERSATIONAL[:15]),
            "test": datasets.Dataset.from_list(CONVERSATIONAL[15:]),
        }
    ).save_to_disk(str(saved))
    test_split = TaskDataset(str(saved), split="test")
    assert [row["target_n"] for row in test_split] == list(range(15, 20))
    assert len(TaskDataset(str(saved))) == 15  # several splits: "train" by default


def test_hub_dataset_name_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub dataset cached by an earlier ``load_dataset`` (laid out as ``datasets`` caches it:
    ``<namespace>___<name>/<config>/<version>/<hash>/``) loads by name with the hub unreachable."""
    from datasets.packaged_modules.json.json import Json

    source = _jsonl(tmp_path / "rows.jsonl", CONVERSATIONAL)
    build = tmp_path / "build"
    builder = Json(
        cache_dir=str(build),
        dataset_name="tiny_task",
        config_name="default",
        data_files={"train": str(source), "validation": str(source)},
        hash="0123abcd",
    )
    builder.download_and_prepare()
    cache = tmp_path / "hf_cache"
    target = cache / "tester___tiny_task" / "default" / "0.0.0"
    target.mkdir(parents=True)
    Path(builder.cache_dir).rename(target / "0123abcd")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    data = TaskDataset("tester/tiny_task", split="validation", num_samples=4)
    assert [row["tag"] for row in data] == ["t0", "t1", "t2", "t3"]
    with pytest.raises(ValueError, match=r"^dataset tester/tiny_task: no split 'test' \(it has"):
        TaskDataset("tester/tiny_task", split="test")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        TaskDataset("tester/other_task")


def test_column_map_renames_before_everything(tmp_path: Path) -> None:
    rows = [{"question": "Why?", "gold": "because"}]
    (row,) = TaskDataset(
        str(_jsonl(tmp_path / "d.jsonl", rows)), column_map={"question": "prompt", "gold": "hint"}
    )
    assert row.prompt_text == "Why?" and row["hint"] == "because" and "gold" not in row


def test_hash_split_is_disjoint_deterministic_and_order_free(tmp_path: Path) -> None:
    rows = [{"prompt": f"Problem {i}", "i": i} for i in range(400)]
    path = str(_jsonl(tmp_path / "d.jsonl", rows))
    train = {row["i"] for row in TaskDataset(path, heldout_fraction=0.25)}
    heldout = {row["i"] for row in TaskDataset(path, heldout_fraction=0.25, heldout=True)}
    assert train.isdisjoint(heldout) and len(train | heldout) == 400
    assert 60 < len(heldout) < 140  # about a quarter
    # Row order does not move a prompt across the split.
    reordered = str(_jsonl(tmp_path / "r.jsonl", rows[::-1]))
    assert {row["i"] for row in TaskDataset(reordered, heldout_fraction=0.25, heldout=True)} == (
        heldout
    )


def test_num_samples_and_shuffle_seed(tmp_path: Path) -> None:
    path = str(_jsonl(tmp_path / "d.jsonl", CONVERSATIONAL))
    assert [row["target_n"] for row in TaskDataset(path, num_samples=3)] == [0, 1, 2]
    first = [row["target_n"] for row in TaskDataset(path, shuffle_seed=1)]
    again = [row["target_n"] for row in TaskDataset(path, shuffle_seed=1)]
    other = [row["target_n"] for row in TaskDataset(path, shuffle_seed=2)]
    assert first == again and first != other and sorted(first) == list(range(20))
    assert [row["target_n"] for row in TaskDataset(path, shuffle_seed=1, num_samples=4)] == (
        first[:4]
    )


@pytest.mark.parametrize(
    ("rows", "kwargs", "expected"),
    [
        ([{"question": "Why?"}], {}, r"no 'prompt' column \(columns: \['question'\]\); rename one"),
        ([{"prompt": "a"}], {"column_map": {"q": "prompt"}}, r"column_map names columns it lacks"),
        (
            [{"prompt": "a", "q": "b"}],
            {"column_map": {"q": "prompt"}},
            r"column_map would overwrite existing columns \['prompt'\]",
        ),
        ([{"prompt": "a"}, {"other": 1}], {}, r"row 1 has no prompt$"),
        ([{"prompt": "a"}, {"prompt": "  "}], {}, r"row 1 has an empty prompt$"),
        ([{"prompt": 7}], {}, r"row 0 has a prompt of type int: expected a string"),
        (
            [{"prompt": [{"role": "narrator", "content": "x"}]}],
            {},
            r"row 0 has prompt\[0\] with role",
        ),
        ([{"prompt": [{"role": "user", "content": 3}]}], {}, r"prompt\[0\] whose content is int"),
        ([{"prompt": "a"}], {"num_samples": 5}, r"num_samples=5 but it has 1 rows"),
        ([{"prompt": "a"}], {"num_samples": 0}, r"num_samples must be >= 1"),
        ([{"prompt": "a"}], {"heldout": True}, r"heldout=true needs a heldout_fraction"),
        ([{"prompt": "a"}], {"heldout_fraction": 1.5}, r"heldout_fraction must be in \[0, 1\)"),
    ],
)
def test_bad_rows_and_settings_are_one_line_errors(
    tmp_path: Path, rows: list[dict], kwargs: dict, expected: str
) -> None:
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=expected) as info:
        TaskDataset(str(path), **kwargs)
    message = str(info.value)
    assert message.startswith(f"dataset {path}") and "\n" not in message


def test_unreadable_sources_are_one_line_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    text = tmp_path / "notes.txt"
    text.write_text("prompt")
    (tmp_path / "nothing").mkdir()
    cases = [
        (str(broken), ValueError, "cannot be read: JSON parse error"),
        (str(empty), ValueError, "the file is empty"),
        (str(text), ValueError, "unsupported file type '.txt'"),
        (str(tmp_path / "missing.jsonl"), FileNotFoundError, "no such file or folder"),
        (str(tmp_path / "nothing"), ValueError, "the folder holds no"),
    ]
    for source, error, expected in cases:
        with pytest.raises(error, match=expected) as info:
            TaskDataset(source)
        assert "\n" not in str(info.value)
