"""A model whose ``model.path`` holds weights is never trained from random ones by accident.

Every recipe and the tools build their models through ``models.build.build_decoder``, which
calls ``check_weights_are_loaded`` for a run that loads no checkpoint (no
``checkpoint.initial_checkpoint``, warm start or resumed checkpoint): it stops at set-up with one
``error:`` line naming the keys, unless ``model.random_init: true``. The recipes run in-process
with a trap in place of the model builder, so a check that came too late (or not at all) fails
on the trap instead of the expected message.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from composer_tune import config, models
from composer_tune.checkpointing.hf_checkpoint import checkpoint_tensors
from composer_tune.models.build import check_weights_are_loaded
from recipes.grpo import GRPORecipe
from tests.recipe_runs import REPO_ROOT, load_tool

# Each recipe's SmolLM2 config (a model.path holding weights) with nothing to load, one step.
NO_WARM_START = ("warm_start=null", "checkpoint.initial_checkpoint=null", "max_steps=1")
SMOLLM2_CONFIGS = {
    "sft": ("smollm2_tools", "checkpoint.initial_checkpoint=null", "max_steps=1"),
    "grpo": ("smollm2_tools", *NO_WARM_START),
    "sdpo": ("smollm2_tools", *NO_WARM_START),
    "replay_dpo": ("smollm2", *NO_WARM_START),
    "composer_full": ("smollm2_tools", *NO_WARM_START),
    # One replica, one sync window.
    "diloco": (
        "smollm2",
        "warm_start=null",
        "checkpoint.initial_checkpoint=null",
        "max_steps=10",
        "num_replicas=1",
        "diloco.replica_id=0",
    ),
}


class ModelBuilt(AssertionError):
    """The trap: the recipe went on to build the model."""


def _trap(*_args: object, **_kwargs: object) -> None:
    raise ModelBuilt("the model was built")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_component_: composer_tune.models.from_pretrained`` resolves to the trap."""
    monkeypatch.setattr(models, "from_pretrained", _trap)


def _setup_error(recipe: str, args: tuple[str, ...], tmp_path: Path) -> str:
    """The one ``error:`` line the recipe stops with at set-up (exit status 2), in-process."""
    module = importlib.import_module(f"recipes.{recipe}")
    stderr = io.StringIO()
    argv = ["--config", args[0], f"output_dir={tmp_path / 'out'}", *args[1:]]
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(stderr):
        module.recipe_main(argv)
    assert info.value.code == 2, stderr.getvalue()
    (line,) = stderr.getvalue().splitlines()
    assert line.startswith("error: ")
    return line


@pytest.mark.parametrize("recipe", sorted(SMOLLM2_CONFIGS))
def test_a_run_that_loads_no_weights_into_a_pretrained_model_stops_naming_the_keys(
    recipe: str, smollm2_dir: Path, tmp_path: Path, no_model: None
) -> None:
    line = _setup_error(recipe, SMOLLM2_CONFIGS[recipe], tmp_path)
    assert f"model.path {smollm2_dir} holds weights, but the run loads none" in line
    assert f"set checkpoint.initial_checkpoint={smollm2_dir}" in line
    assert "model.random_init=true" in line
    assert not (tmp_path / "out").exists()  # nothing written


def test_random_init_true_builds_the_random_model(
    smollm2_dir: Path, tmp_path: Path, no_model: None
) -> None:
    """The opt-out: past the check, the recipe builds the model (and meets the trap)."""
    with pytest.raises(ModelBuilt):
        _setup_error("grpo", (*SMOLLM2_CONFIGS["grpo"], "model.random_init=true"), tmp_path)


def test_the_check_passes_models_with_no_weights_to_load(tmp_path: Path, smollm2_dir: Path) -> None:
    # A preset builds an architecture: there is no path, hence nothing to miss.
    check_weights_are_loaded(OmegaConf.create({"_component_": "composer_tune.models.qwen3_tiny"}))
    # A folder with only config.json describes an architecture too (e.g. gpu_check's shapes).
    (tmp_path / "config.json").write_text((smollm2_dir / "config.json").read_text())
    node = {"_component_": "composer_tune.models.from_pretrained", "path": str(tmp_path)}
    check_weights_are_loaded(OmegaConf.create(node))
    # With weights beside it, the same node is refused, and passes again with the opt-out.
    (tmp_path / "model.safetensors").symlink_to(smollm2_dir / "model.safetensors")
    with pytest.raises(ValueError, match="holds weights, but the run loads none"):
        check_weights_are_loaded(OmegaConf.create(node))
    check_weights_are_loaded(OmegaConf.create({**node, "random_init": True}))


def test_the_feature_task_tool_refuses_a_pretrained_model_it_would_not_load(
    smollm2_dir: Path, no_model: None
) -> None:
    starting_policy = load_tool("feature_task_episode")._starting_policy
    cfg = config.load_recipe_config(
        REPO_ROOT / "recipes" / "grpo.py", "smollm2_tools", ["warm_start=null"]
    )
    with pytest.raises(ValueError, match="checkpoint.initial_checkpoint="):
        starting_policy(cfg)


def test_with_the_initial_checkpoint_set_the_policy_starts_from_its_weights(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """The issue's case: ``grpo smollm2_tools warm_start=null`` with the key the error names
    set to the model's path starts from SmolLM2's weights, every tensor of them."""
    cfg = config.load_recipe_config(
        REPO_ROOT / "recipes" / "grpo.py",
        "smollm2_tools",
        [
            f"output_dir={tmp_path / 'out'}",
            "warm_start=null",
            f"checkpoint.initial_checkpoint={smollm2_dir}",
        ],
    )
    recipe = GRPORecipe(cfg)
    recipe.setup()
    try:
        stored = load_file(smollm2_dir / "model.safetensors")
        loaded = dict(checkpoint_tensors(recipe.run.model, lambda weight: weight.detach()))
        assert loaded.keys() == stored.keys()
        for name, tensor in loaded.items():
            assert torch.equal(tensor, stored[name].to(tensor.dtype)), name
    finally:
        recipe.cleanup()
