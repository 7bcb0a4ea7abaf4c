"""Every held-out set a shipped config evaluates on holds distinct problems.

An accuracy "over 128 problems" must count 128 problems: a repeated problem weighs its answer
twice and shrinks the set the figure rests on. GSM8K's configs read the hub's test split (network
needed), which is the benchmark as published, and are not built here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from torchtune import config as tune_config

from composer_tune.config import load_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CONFIGS = sorted((RECIPES / "configs").glob("*/*.yaml"))


def _eval_component(path: Path) -> str | None:
    node = (yaml.safe_load(path.read_text()) or {}).get("eval_dataset")
    return node["_component_"] if node else None


OFFLINE_EVAL_SETS = [
    path
    for path in CONFIGS
    if _eval_component(path) not in (None, "composer_tune.data.gsm8k.GSM8K")
]


def _user_supplied(node: dict, prefix: str = "") -> list[str]:
    """``key=/user/supplied`` for every mandatory (``???``) value under ``node``."""
    overrides = []
    for key, value in node.items():
        if value == "???":
            overrides.append(f"{prefix}{key}=/user/supplied")
        elif isinstance(value, dict):
            overrides += _user_supplied(value, f"{prefix}{key}.")
    return overrides


def _question(sample: dict) -> str:
    return "\n".join(message["content"] for message in sample["prompt"])


def test_every_recipe_family_ships_an_offline_eval_set() -> None:
    assert {path.parent.name for path in OFFLINE_EVAL_SETS} == {
        path.parent.name for path in CONFIGS
    }


@pytest.mark.parametrize(
    "config_path", OFFLINE_EVAL_SETS, ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_shipped_heldout_set_has_no_duplicate_problems(config_path: Path) -> None:
    recipe = RECIPES / f"{config_path.parent.name}.py"
    # The GPU configs leave paths to the user (???): filled here as on the command line.
    overrides = _user_supplied(yaml.safe_load(config_path.read_text()))
    cfg = load_config(config_path, overrides, recipe_file=recipe)
    eval_node = OmegaConf.select(cfg, "eval_dataset")
    assert eval_node is not None, f"{config_path} has no eval_dataset"
    dataset = tune_config.instantiate(eval_node)
    questions = [_question(dataset[i]) for i in range(len(dataset))]
    assert len(questions) == eval_node.get("num_samples", len(questions)) > 0
    repeated = sorted({q for q in questions if questions.count(q) > 1})
    assert not repeated, f"{config_path}: {len(repeated)} repeated problems, e.g. {repeated[:3]}"
