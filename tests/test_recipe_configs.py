"""Every shipped recipe config validates against its recipe's schema (typos in a YAML we ship
would otherwise only surface on the hardware it targets)."""

import importlib
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from composer_tune.channels.composer import ComposerChannels
from composer_tune.config import ConfigError, available_configs, load_config
from composer_tune.distributed import DistInfo

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SCHEMAS = {
    "sft": "SFTConfig",
    "grpo": "GRPOConfig",
    "sdpo": "SDPOConfig",
    "replay_dpo": "ReplayDPOConfig",
    "composer_full": "ComposerFullConfig",
    "diloco": "DiLoCoRecipeConfig",
}
CASES = [
    (recipe, name) for recipe in SCHEMAS for name in available_configs(RECIPES / f"{recipe}.py")
]


def test_every_recipe_ships_the_three_configs() -> None:
    for recipe in SCHEMAS:
        assert {"cpu_smoke", "qwen3_7b", "qwen3_32b"} <= set(
            available_configs(RECIPES / f"{recipe}.py")
        ), recipe


def _load(recipe: str, name: str) -> DictConfig:
    module = importlib.import_module(f"recipes.{recipe}")
    schema = getattr(module, SCHEMAS[recipe])
    # GPU configs leave the user's paths as required values (???); CPU ones run as shipped.
    runs_as_shipped = name.startswith(("cpu", "smollm2"))
    overrides = [] if runs_as_shipped else ["checkpoint.initial_checkpoint=/models/qwen3"]
    if recipe in ("replay_dpo", "composer_full", "diloco") and not runs_as_shipped:
        overrides.append("dpo.pairs=/data/pairs.jsonl")
    return load_config(name, overrides, recipe_file=RECIPES / f"{recipe}.py", schema=schema)


@pytest.mark.parametrize(("recipe", "name"), CASES)
def test_config_validates(recipe: str, name: str) -> None:
    assert _load(recipe, name).output_dir


@pytest.mark.parametrize(
    ("recipe", "name"), [case for case in CASES if case[0] in ("composer_full", "diloco")]
)
def test_composer_channels_parse(recipe: str, name: str) -> None:
    """The channel sections of the composer-loop configs parse as the recipes parse them
    (interpolations into other sections included), with channel 2 on."""
    one_process = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
    channels = ComposerChannels.from_config(_load(recipe, name), one_process)
    assert channels.sdpo.enabled


@pytest.mark.parametrize("recipe", ["grpo", "sdpo", "replay_dpo", "composer_full", "diloco"])
def test_rl_recipes_reject_gradient_accumulation_steps(recipe: str) -> None:
    """The RL recipes accumulate over micro_batch_size rows; an SFT-only key they would ignore
    is an error naming it, not a silent no-op."""
    module = importlib.import_module(f"recipes.{recipe}")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        load_config(
            "cpu_smoke",
            ["gradient_accumulation_steps=2"],
            recipe_file=RECIPES / f"{recipe}.py",
            schema=getattr(module, SCHEMAS[recipe]),
        )
    assert _load("sft", "cpu_smoke").gradient_accumulation_steps == 1  # SFT keeps it
