"""`latest` never mixes runs: checkpoints record their run's identity (the resolved config minus
what a resume may change), and resuming with other settings is one error line naming them."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from composer_tune.checkpointing.run_identity import (
    IDENTITY_FILE,
    check_resume_identity,
    identity_defaults,
    run_identity,
)
from composer_tune.checkpointing.run_state import latest_checkpoint
from composer_tune.config import load_recipe_config, recipe_schema
from tests.recipe_runs import REPO_ROOT, run_recipe, run_tune

# A one-step grpo cpu_smoke run from random weights.
QUICK = (
    "warm_start=null",
    "num_prompts_per_generation=4",
    "group_size=4",
    "micro_batch_size=8",
    "max_new_tokens=6",
    "eval_dataset.num_samples=8",
    "eval_max_new_tokens=4",
    "max_steps=1",
    "logging.progress_bar=false",
)
CONFIG = OmegaConf.create(
    {
        "output_dir": "/runs/a",
        "max_steps": 10,
        "seed": 0,
        "loss": {"objective": "grpo", "beta": 0.0},
        "dpo": {"cache_dir": "${output_dir}/reference_logps"},
        "logging": {"log_every_n_steps": 1},
        "checkpoint": {"save_every_n_steps": 5, "resume_from_checkpoint": None},
    }
)


def test_identity_leaves_out_what_a_resume_may_change() -> None:
    identity = run_identity(CONFIG)
    assert identity == {
        "dpo.cache_dir": "<output_dir>/reference_logps",
        "loss.beta": 0.0,
        "loss.objective": "grpo",
        "seed": 0,
    }
    moved = OmegaConf.merge(CONFIG, {"output_dir": "/elsewhere", "max_steps": 99})
    assert run_identity(moved) == identity


def test_a_changed_key_is_refused_by_name_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / IDENTITY_FILE).write_text(json.dumps(run_identity(CONFIG)))
    check_resume_identity(tmp_path, run_identity(CONFIG), allow_changes=False)  # same run
    dapo = run_identity(OmegaConf.merge(CONFIG, {"loss": {"objective": "dapo"}, "lr": 1e-3}))
    with pytest.raises(ValueError) as error:
        check_resume_identity(tmp_path, dapo, allow_changes=False)
    message = str(error.value)
    assert "was written by a different run (loss.objective: 'grpo' -> 'dapo'" in message
    assert "lr: (unset) -> 0.001" in message
    assert "checkpoint.resume_with_changed_config=true" in message
    check_resume_identity(tmp_path, dapo, allow_changes=True)
    assert "with a changed config (loss.objective" in capsys.readouterr().out


def test_a_checkpoint_without_identity_resumes_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    check_resume_identity(tmp_path, run_identity(CONFIG), allow_changes=False)
    assert "records no run identity" in capsys.readouterr().out


def test_a_setting_the_checkpoint_predates_is_no_change_at_its_default(tmp_path: Path) -> None:
    # A checkpoint written before the recipe had ``agent`` (or typed channel sections): its
    # identity lacks those keys. At their defaults that is the run it was; set, it is not.
    cfg = load_recipe_config(
        REPO_ROOT / "recipes" / "grpo.py", "cpu_smoke", [f"output_dir={tmp_path}"]
    )
    identity = run_identity(cfg)
    defaults = identity_defaults(recipe_schema(REPO_ROOT / "recipes" / "grpo.py"))
    assert identity["agent"] is None and defaults["agent"] is None
    older = {key: value for key, value in identity.items() if key != "agent"}
    (tmp_path / IDENTITY_FILE).write_text(json.dumps(older, default=str))
    check_resume_identity(tmp_path, identity, allow_changes=False, defaults=defaults)
    with pytest.raises(ValueError, match="agent: \\(unset\\) -> None"):
        check_resume_identity(tmp_path, identity, allow_changes=False)  # without the defaults
    changed = {**identity, "agent": "calculator"}
    with pytest.raises(ValueError, match="agent: \\(unset\\) -> 'calculator'"):
        check_resume_identity(tmp_path, changed, allow_changes=False, defaults=defaults)


@pytest.mark.slow
def test_latest_refuses_another_objectives_run_and_leaves_the_folder_as_it_was(
    tmp_path: Path,
) -> None:
    run_recipe("grpo", "cpu_smoke", tmp_path, *QUICK, "loss.objective=dapo")
    assert (latest_checkpoint(tmp_path) / IDENTITY_FILE).is_file()
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    result = run_tune(
        "recipes/grpo.py",
        "--config",
        "cpu_smoke",
        f"output_dir={tmp_path}",
        *QUICK,
        "checkpoint.resume_from_checkpoint=latest",
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr
    assert "was written by a different run (loss.objective: 'dapo' -> 'grpo')" in lines[-1]
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before


@pytest.mark.slow
def test_a_fresh_run_refuses_a_folder_with_checkpoints_unless_told_to_replace_them(
    tmp_path: Path,
) -> None:
    command = ("recipes/grpo.py", "--config", "cpu_smoke", f"output_dir={tmp_path}", *QUICK)
    run_recipe("grpo", "cpu_smoke", tmp_path, *QUICK, "loss.objective=dapo")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    refused = run_tune(*command)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in refused.stderr
    assert "already holds 1 checkpoint(s) of a run (newest step_0000001)" in lines[-1]
    assert "checkpoint.replace_existing=true" in lines[-1]
    # Replacing is deferred until set-up succeeds: a start that fails later deletes nothing.
    failed = run_tune(
        *command,
        "checkpoint.replace_existing=true",
        f"checkpoint.initial_checkpoint={tmp_path}/none",
    )
    assert failed.returncode == 2 and "/none" in failed.stderr.strip().splitlines()[-1]
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before

    replaced = run_tune(*command, "checkpoint.replace_existing=true")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "deleted the previous run's checkpoints (step_0000001)" in replaced.stdout
    identity = json.loads((latest_checkpoint(tmp_path) / IDENTITY_FILE).read_text())
    assert identity["loss.objective"] == "grpo"
