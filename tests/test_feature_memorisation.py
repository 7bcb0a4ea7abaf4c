"""Memorisation, measured (composer_tune/data/feature_memorisation.py, tools/probe_memorisation.py):
the reply's splice, the recall measure, unscored grades and counts.json, on a store the
generator makes from the small repository of tests/test_feature_tasks.py."""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from composer_tune.checkpointing import save_hf_checkpoint
from composer_tune.data import feature_memorisation
from composer_tune.data.chat_template import ChatTemplateError
from composer_tune.data.feature_generator import GenerationSettings
from composer_tune.data.feature_memorisation import (
    deletion_tasks,
    grade_reply,
    per_source,
    prefix_recall,
    probe_task,
    reply_replacement,
)
from composer_tune.data.feature_tasks import (
    COUNTS_FILE,
    Feature,
    FeatureTask,
    LineEdit,
    load_feature_tasks,
    read_source_file,
    removed_code,
)
from composer_tune.models import qwen3_tiny
from composer_tune.rewards.repository import HiddenTestsResult
from tests.recipe_runs import load_tool
from tests.test_feature_tasks import TINY, _make_feature_tasks, _write

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO = "tinylib-0.1"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generator's deletion tasks of the small repository: initials, wrap (functions),
    Counter (a class) and Counter.most_common (a method)."""
    root = tmp_path_factory.mktemp("tiny") / REPO
    _write(root, TINY)
    store = tmp_path_factory.mktemp("store")
    _make_feature_tasks(str(root), "--store", str(store), "--max-candidates", "8", "--workers", "1")
    return store


def _task(store: Path, qualname: str) -> FeatureTask:
    return next(task for task in load_feature_tasks(store) if task.feature.qualname == qualname)


def _deleted(store: Path, task: FeatureTask) -> str:
    return removed_code(task, read_source_file(store, task, task.deletion.file))


class Reciter:
    """A stand-in model that knows the source by heart: it replies with the deleted code (or
    ``reply``) and continues a file with its original text, one character a token."""

    def __init__(self, store: Path, task: FeatureTask, reply: str | None = None) -> None:
        self.original = read_source_file(store, task, task.deletion.file)
        self.answer = reply if reply is not None else f"```python\n{_deleted(store, task)}```"
        self.statement = task.statement

    def reply(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int) -> str:
        assert messages[-1] == {"role": "user", "content": self.statement}
        return self.answer

    def continuation(self, prefix: str, max_new_tokens: int) -> str:
        assert self.original.startswith(prefix)
        return self.original[len(prefix) :][:max_new_tokens]

    def count_tokens(self, text: str) -> int:
        return len(text)

    def first_tokens(self, text: str, count: int) -> str:
        return text[:count]


# --------------------------------------------------------------------------------------------
# The splice


@pytest.mark.parametrize("qualname", ["wrap", "Counter.most_common", "Counter"])
def test_the_deleted_code_spliced_back_passes_every_hidden_test(store: Path, qualname) -> None:
    task = _task(store, qualname)
    deleted = _deleted(store, task)
    assert reply_replacement(task, deleted) == deleted  # at its place, at its indentation
    passed, graded = grade_reply(store, task, deleted)
    assert passed is True and graded.passed == graded.total == len(task.hidden_tests)


def test_a_reply_of_pass_fails(store: Path) -> None:
    task = _task(store, "wrap")
    passed, graded = grade_reply(store, task, "pass")
    assert passed is False and graded.passed == 0 and graded.sandbox_failure is None


def test_a_reply_is_moved_to_the_deleted_lines_indentation() -> None:
    deletion = LineEdit("m.py", 5, 6, "        raise NotImplementedError\n", "")
    task = _fake_task("method", "Counter.most_common", deletion)
    assert reply_replacement(task, "return 1") == "        return 1\n"
    # A body at another depth; a multi-line string's less indented line stays as it is.
    body = '    text = """a\nb"""\n    return text\n'
    assert reply_replacement(task, body) == '        text = """a\nb"""\n        return text\n'
    # A whole definition (its class around it, its docstring): only the body is kept.
    whole = 'class Counter:\n    def most_common(self):\n        """Doc."""\n        return 2\n'
    assert reply_replacement(task, whole) == "        return 2\n"
    # A module's reply goes in as it is, at the top level.
    module = _fake_task("module", "pkg.mod", dataclasses.replace(deletion, replacement=""))
    assert reply_replacement(module, "    x = 1\n") == "x = 1\n"


def _fake_task(kind: str, qualname: str, deletion) -> FeatureTask:
    feature = Feature(kind, "m.py", qualname, "", "", 2)
    return FeatureTask("id", REPO, "0" * 64, "", ("m",), feature, deletion, (), ("t",), (), "s")


def test_a_whole_definition_in_a_fenced_reply_passes(store: Path) -> None:
    task = _task(store, "Counter.most_common")
    # The method alone, at the top level: its body moves from 4 spaces to the class's 8.
    body = textwrap.indent(textwrap.dedent(_deleted(store, task)), "    ")
    reply = f'Here it is:\n```python\ndef most_common(self):\n    """Sorted."""\n{body}```\nDone.'
    probe = probe_task(Reciter(store, task, reply), store, task)
    assert probe.passed is True, probe.feedback


# --------------------------------------------------------------------------------------------
# Recall


def test_prefix_recall_on_hand_computed_strings() -> None:
    reference = "def f(x):\n\n    return x + 1\n"  # normalised: "def f(x):\nreturn x + 1", 22
    assert prefix_recall("def f(x):\n        return   x + 1\n\nmore", reference) == 1.0
    assert prefix_recall("def f(x):\n    return x + 2\n", reference) == 21 / 22
    assert prefix_recall("def f(", reference) == 6 / 22
    assert prefix_recall("class A:\n", reference) == 0.0
    assert prefix_recall("", reference) == 0.0
    assert prefix_recall("anything", "\n  \n") == 1.0


def test_a_model_that_recites_the_source_recalls_it_and_passes(store: Path) -> None:
    task = _task(store, "wrap")
    assert len(_deleted(store, task)) > 256  # the recall compares the first 256 "tokens"
    probe = probe_task(Reciter(store, task), store, task, max_recall_tokens=256)
    assert (probe.passed, probe.recall) == (True, 1.0), probe.feedback
    assert probe.hidden_passed == probe.hidden_total == 1
    summary = per_source([probe])[0]
    assert (summary.tasks, summary.pass_rate, summary.recall, summary.unscored) == (1, 1.0, 1.0, 0)


def test_a_model_that_continues_otherwise_recalls_less(store: Path) -> None:
    task = _task(store, "initials")

    class Paraphraser(Reciter):
        def continuation(self, prefix: str, max_new_tokens: int) -> str:
            return "    letters = [w[0] for w in name.split()]\n"

    reference = 'letters = [word[0] for word in _words(name)]\nreturn "".join(letters).upper()'
    assert feature_memorisation.normalised(_deleted(store, task)) == reference
    recall = probe_task(Paraphraser(store, task, "pass"), store, task).recall
    assert recall == len("letters = [w") / len(reference)


# --------------------------------------------------------------------------------------------
# What is not measured


def test_bug_tasks_are_skipped(store: Path) -> None:
    task = _task(store, "wrap")
    bug = dataclasses.replace(task, feature=dataclasses.replace(task.feature, kind="bug"))
    assert deletion_tasks([bug, task]) == [task]
    with pytest.raises(ValueError, match="bug task"):
        probe_task(Reciter(store, task), store, bug)


def test_a_grade_the_sandbox_could_not_run_is_unscored(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_sandbox(tree: Path, *, node_ids: Sequence[str], **_) -> HiddenTestsResult:
        failure = "the sandbox could not run the grader (could not start: ENOMEM)"
        return HiddenTestsResult(0, len(node_ids), {}, failure, [], failure)

    task = _task(store, "initials")
    monkeypatch.setattr(feature_memorisation, "grade_repository", no_sandbox)
    unscored = probe_task(Reciter(store, task), store, task)
    assert unscored.passed is None and "ENOMEM" in unscored.feedback
    scored = dataclasses.replace(unscored, passed=True)
    (alone,) = per_source([unscored])
    assert (alone.pass_rate, alone.unscored) == (None, 1)
    (mixed,) = per_source([scored, unscored])  # 1 of 1 scored passes, not 1 of 2
    assert (mixed.tasks, mixed.pass_rate, mixed.unscored) == (2, 1.0, 1)


# --------------------------------------------------------------------------------------------
# The tool and counts.json


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random toy Qwen3 with the test tokenizer: its replies fail, its recall is about 0."""
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=1024, max_seq_len=2048)
    directory = tmp_path_factory.mktemp("toy-qwen3")
    save_hf_checkpoint(
        model.state_dict(), model.config, directory,
        copy_files_from=REPO_ROOT / "tests" / "assets" / "tokenizer",
    )  # fmt: skip
    return directory


def test_a_chat_template_without_a_thinking_switch_is_read_at_its_default(
    smollm2_dir: Path,
) -> None:
    # SmolLM2's template has no enable_thinking: asking it for False is an error, so the probe
    # leaves the switch at the template's default unless --no-thinking says otherwise.
    model = feature_memorisation.CheckpointModel(smollm2_dir, threads=1)
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    assert isinstance(model.reply(messages, 2), str)
    model.enable_thinking = False
    with pytest.raises(ChatTemplateError, match="no 'enable_thinking' switch"):
        model.reply(messages, 2)


def test_write_counts_adds_only_the_memorisation_key(
    store: Path, checkpoint: Path, tmp_path: Path, capsys
) -> None:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    before = json.loads((copy / COUNTS_FILE).read_text())
    tool = load_tool("probe_memorisation")
    out = tmp_path / "memo.json"
    argv = [str(checkpoint), "--store", str(copy), "--per-source", "1", "--threads", "1"]
    assert tool.main([*argv, "--write-counts", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{REPO}  " in printed and "0 bug tasks skipped" in printed
    text = (copy / COUNTS_FILE).read_text()
    after = json.loads(text)
    assert text == json.dumps(after, indent=2) + "\n" and not list(copy.glob("*.partial"))
    memorisation = after[REPO].pop("memorisation")
    assert after == before  # every other key as it was
    assert memorisation == {
        "model": checkpoint.name,
        "date": datetime.date.today().isoformat(),
        "tasks": 1,
        "pass_rate": 0.0,
        "recall": memorisation["recall"],
        "unscored": 0,
    }
    report = json.loads(out.read_text())
    assert report["sources"][0]["recall"] == memorisation["recall"] < 0.5
    assert [probe["passed"] for probe in report["tasks"]] == [False]


def test_the_memorisation_key_leaves_regeneration_as_it_was(store: Path) -> None:
    # --regenerate reads each source's kinds and caps from its entry, and keeps the entry's
    # other keys (counts[repo] = {**old, **new}).
    make = load_tool("make_feature_tasks")
    entry = json.loads((store / COUNTS_FILE).read_text())[REPO]
    probed = {**entry, "memorisation": {"model": "m", "date": "d", "tasks": 3, "recall": 0.5}}
    settings = GenerationSettings()
    assert make._as_made(probed, settings) == make._as_made(entry, settings)
    assert make._kind_counts(probed).keys() == make._kind_counts(entry).keys() == {"feature"}
