"""Config parsing for composer-tune recipes: torchtune's YAML + ``key=value`` conventions, plus

- bare config names: ``--config cpu_smoke`` resolves to ``<recipe dir>/configs/<recipe>/cpu_smoke.yaml``
  (torchtune 0.6.1 only knows its own registry and would treat the name as a path);
- a typed schema per recipe (a dataclass): unknown keys (typos), wrong types and missing required
  keys are errors that name the key and the config file, raised before any expensive work;
- ``_component_`` nodes are checked against the signature of the callable they name.
"""

from torchtune.config import instantiate

from composer_tune.config._parse import (
    ConfigError,
    available_configs,
    load_config,
    load_recipe_config,
    parse,
    recipe_schema,
    resolve_config_path,
    setup_errors_as_one_line,
    validate_components,
)
from composer_tune.config._schema import (
    CheckpointSection,
    EvalSampling,
    LoggingSection,
    TrainingConfig,
)

__all__ = [
    "CheckpointSection",
    "ConfigError",
    "EvalSampling",
    "LoggingSection",
    "TrainingConfig",
    "available_configs",
    "instantiate",
    "load_config",
    "load_recipe_config",
    "parse",
    "recipe_schema",
    "resolve_config_path",
    "setup_errors_as_one_line",
    "validate_components",
]
