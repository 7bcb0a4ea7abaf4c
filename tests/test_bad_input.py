"""Bad input stops ``recipes/sft.py`` early, with an error that names the file, key or row.

Config-level mistakes go through the real ``tune`` console script (as a user hits them). The rest
call the recipe's entry point in-process with the real cpu_smoke config and a booby-trapped model
builder (or weight loader): if the bad input were only noticed after the model was built (or the
weights read), the test would fail on the trap instead of the expected message.
"""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.checkpointing import save_hf_checkpoint
from composer_tune.models import build as decoder_build
from recipes import sft
from tests.recipe_runs import REPO_ROOT, run_tune

CPU_SMOKE = REPO_ROOT / "recipes" / "configs" / "sft" / "cpu_smoke.yaml"
TOKENIZER = REPO_ROOT / "tests" / "assets" / "tokenizer"
GSM8K_TRAIN = REPO_ROOT / "tests" / "assets" / "gsm8k" / "train.jsonl"
QUICK = ("max_steps=1", "dataset.num_samples=64", "eval_dataset.num_samples=4")
# Swaps the synthetic training set for GSM8K read from a file (its other keys do not apply).
AS_GSM8K = (
    "dataset._component_=composer_tune.data.gsm8k.GSM8K",
    *(
        f"~dataset.{key}"
        for key in ("num_samples", "seed", "operations", "min_digits", "max_digits")
    ),
)


class ExpensiveWorkStarted(AssertionError):
    """The trap: the recipe got to building the model or reading weights."""


def _trap(*_args: object, **_kwargs: object) -> None:
    raise ExpensiveWorkStarted("the bad input was not caught before the expensive work")


def _setup_error(tmp_path: Path, *overrides: str) -> str:
    """The one ``error:`` line the SFT recipe stops with (exit status 2), run in-process. The
    trap's error is no config error: it propagates and fails the test."""
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(stderr):
        sft.recipe_main(["--config", "cpu_smoke", f"output_dir={tmp_path / 'out'}", *overrides])
    assert info.value.code == 2
    (line,) = stderr.getvalue().splitlines()
    assert line.startswith("error: ")
    return line.removeprefix("error: ")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sft, "build_model", _trap)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoder_build, "load_model_weights", _trap)


def _save_cpu_smoke_model(directory: Path, **changes: int) -> Path:
    """An HF checkpoint of the cpu_smoke architecture (with ``changes``), in small shards."""
    model_cfg = OmegaConf.load(CPU_SMOKE).model
    model = config.instantiate(OmegaConf.merge(model_cfg, changes))
    save_hf_checkpoint(model.state_dict(), model.config, directory, max_shard_size_bytes=500_000)
    return directory


# ----------------------------------------------------------------------------- through `tune`


def _tune_sft(*args: str) -> str:
    result = run_tune("recipes/sft.py", *args)
    assert result.returncode != 0, result.stdout[-2000:]
    return result.stderr


@pytest.mark.slow
def test_broken_yaml_names_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(CPU_SMOKE.read_text().replace("batch_size: 64", "batch_size: [64"))
    stderr = _tune_sft("--config", str(broken), f"output_dir={tmp_path}")
    assert f"Config file {broken} is not valid YAML" in stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("batch_sise=8", "Key 'batch_sise' not in 'SFTConfig'. Did you mean"),
        ("optimizer.lrr=0.1", "key 'optimizer.lrr' is not an argument of torch.optim.AdamW"),
        ("batch_size=abc", "(key 'batch_size'): Value 'abc' of type 'str' could not be converted"),
    ],
)
def test_config_key_mistakes_name_the_key(tmp_path: Path, override: str, expected: str) -> None:
    stderr = _tune_sft("--config", "cpu_smoke", f"output_dir={tmp_path}", override)
    assert expected in stderr


@pytest.mark.slow
def test_gsm8k_row_without_a_field_names_file_and_line(tmp_path: Path) -> None:
    source = tmp_path / "train.jsonl"
    rows = GSM8K_TRAIN.read_text().splitlines()[:3]
    rows[1] = json.dumps({"answer": json.loads(rows[1])["answer"]})  # line 2 lost its question
    source.write_text("\n".join(rows) + "\n")
    stderr = _tune_sft(
        "--config", "cpu_smoke", f"output_dir={tmp_path}", *AS_GSM8K, f"dataset.source={source}"
    )
    assert f"{source}:2: missing field 'question'" in stderr


@pytest.mark.slow
def test_missing_checkpoint_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_checkpoint"
    stderr = _tune_sft(
        "--config",
        "cpu_smoke",
        f"output_dir={tmp_path}",
        f"checkpoint.initial_checkpoint={missing}",
    )
    assert f"checkpoint directory {missing} does not exist" in stderr


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def _one_error_line(result) -> str:
    """The single ``error:`` line of a run that stopped at set-up, which printed no traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("loss.objective=dappo",), "loss: PolicyLossConfig.objective must be one of"),
        (
            ("checkpoint.initial_checkpoint=/some/model",),
            "not both (got initial_checkpoint=/some/model); to start from that checkpoint, "
            "add warm_start=null",
        ),
    ],
)
def test_config_value_errors_are_one_line(
    tmp_path: Path, overrides: tuple[str, ...], expected: str
) -> None:
    result = run_tune(
        "recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={tmp_path / 'out'}", *overrides
    )
    assert expected in _one_error_line(result)


@pytest.mark.slow
def test_a_failed_start_leaves_the_output_dir_unchanged(tmp_path: Path) -> None:
    """A good run's folder (config record, logs) is not touched by a start that fails."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "torchtune_config.yaml").write_text("output_dir: the good run\n")
    (out / "logs" / "log_1.txt").write_text("Step 1 | loss:0.5\n")
    before = _tree(out)
    missing = tmp_path / "no_such_checkpoint"
    result = run_tune(
        "recipes/grpo.py",
        "--config",
        "cpu_smoke",
        f"output_dir={out}",
        "warm_start=null",
        f"checkpoint.initial_checkpoint={missing}",
    )
    assert f"checkpoint directory {missing} does not exist" in _one_error_line(result)
    assert _tree(out) == before


# ----------------------------------------------------------------------------- in-process


@pytest.mark.parametrize("missing", ["vocab.json", "merges.txt"])
def test_tokenizer_without_its_files_names_the_file(
    tmp_path: Path, no_model: None, missing: str
) -> None:
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, tokenizer)
    (tokenizer / missing).unlink()
    message = _setup_error(tmp_path, *QUICK, f"tokenizer.path={tokenizer}")
    assert str(tokenizer / missing) in message


def test_empty_synthetic_dataset_names_the_dataset(tmp_path: Path, no_model: None) -> None:
    message = _setup_error(tmp_path, *QUICK, "dataset.num_samples=0")
    assert "config key dataset: composer_tune.data.synthetic.SyntheticArithmetic(" in message
    assert "has no samples" in message


def test_empty_eval_dataset_names_the_dataset(tmp_path: Path, no_model: None) -> None:
    message = _setup_error(tmp_path, *QUICK, "eval_dataset.num_samples=0")
    assert "config key eval_dataset:" in message and "has no samples" in message


def test_empty_gsm8k_file_names_the_dataset_and_file(tmp_path: Path, no_model: None) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    message = _setup_error(tmp_path, "max_steps=1", *AS_GSM8K, f"dataset.source={empty}")
    assert "config key dataset: composer_tune.data.gsm8k.GSM8K(" in message
    assert str(empty) in message and "has no samples" in message


def test_gsm8k_row_without_answer_names_file_and_line(tmp_path: Path, no_model: None) -> None:
    source = tmp_path / "train.jsonl"
    first = GSM8K_TRAIN.read_text().splitlines()[0]
    source.write_text(first + "\n\n" + json.dumps({"question": "How many?"}) + "\n")
    message = _setup_error(tmp_path, "max_steps=1", *AS_GSM8K, f"dataset.source={source}")
    assert message == f"{source}:3: missing field 'answer'"


def test_dataset_smaller_than_a_batch_names_the_batch_size(tmp_path: Path, no_model: None) -> None:
    # With drop_last, such a dataset yields no batch at all: the loop would wait forever.
    message = _setup_error(tmp_path, "max_steps=1", "dataset.num_samples=8", "batch_size=16")
    assert "config key dataset: 8 samples, fewer than one batch (batch_size=16" in message


@pytest.mark.parametrize(
    "override",
    [
        "batch_size=0",
        "gradient_accumulation_steps=0",
        "logging.log_every_n_steps=0",
        "max_consecutive_nonfinite_steps=0",
        "checkpoint.save_every_n_steps=-1",
        "checkpoint.keep_last=0",
    ],
)
def test_counts_out_of_range_name_the_key(tmp_path: Path, no_model: None, override: str) -> None:
    key, value = override.split("=")
    message = _setup_error(tmp_path, *QUICK, override)
    assert message.startswith(f"config key {key} must be >= ") and message.endswith(f"got {value}")


def test_checkpoint_without_config_names_the_file(tmp_path: Path, no_weights: None) -> None:
    checkpoint = _save_cpu_smoke_model(tmp_path / "ckpt")
    (checkpoint / "config.json").unlink()
    message = _setup_error(tmp_path, *QUICK, f"checkpoint.initial_checkpoint={checkpoint}")
    assert message == f"missing file {checkpoint / 'config.json'}"


def test_checkpoint_missing_a_shard_names_it_before_reading_weights(
    tmp_path: Path, no_weights: None
) -> None:
    checkpoint = _save_cpu_smoke_model(tmp_path / "ckpt")
    shards = sorted(checkpoint.glob("*.safetensors"))
    assert len(shards) > 2
    shards[-1].unlink()  # the last one: a plain loader reads every other shard first
    message = _setup_error(tmp_path, *QUICK, f"checkpoint.initial_checkpoint={checkpoint}")
    assert message == f"missing weight file {shards[-1]}"


def test_checkpoint_of_another_architecture_names_the_model_key(
    tmp_path: Path, no_weights: None
) -> None:
    checkpoint = _save_cpu_smoke_model(tmp_path / "ckpt", num_layers=2)
    message = _setup_error(tmp_path, *QUICK, f"checkpoint.initial_checkpoint={checkpoint}")
    assert f"checkpoint {checkpoint} holds a different architecture than config key 'model'" in (
        message
    )
    assert "num_layers=2" in message


def test_resume_from_a_folder_that_is_no_checkpoint_names_it(
    tmp_path: Path, no_weights: None
) -> None:
    folder = tmp_path / "not_a_checkpoint"
    folder.mkdir()
    message = _setup_error(tmp_path, *QUICK, f"checkpoint.resume_from_checkpoint={folder}")
    assert f"resume_from_checkpoint: {folder} is not a complete checkpoint" in message
