"""`tune run recipes/<x>.py --config <name>` through the real `tune` console script.

Uses a throw-away recipes folder so the mechanism is tested apart from any real recipe: the
composer-tune import hook (composer_tune/recipe_finder.py) must make torchtune import the local
`recipes` package instead of the broken one its wheel installs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_tune.recipe_finder import MARKER

TUNE = str(Path(sys.executable).parent / "tune")

ECHO_RECIPE = """
import json, os, sys
from dataclasses import dataclass
from composer_tune.config import parse

@dataclass
class EchoConfig:
    greeting: str = "hi"
    repeat: int = 1

@parse(schema=EchoConfig)
def main(cfg):
    rank = os.environ.get("RANK", "single")
    line = "ECHO " + rank + " " + json.dumps({"greeting": cfg.greeting, "repeat": cfg.repeat})
    # One write per line: two ranks share the pipe, and print's separate writes interleave.
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()

if __name__ == "__main__":
    main()
"""


def _make_project(root: Path, *, marked: bool = True) -> None:
    (root / "recipes" / "configs" / "echo").mkdir(parents=True)
    init = f'"""{MARKER}"""\n' if marked else '"""some other recipes"""\n'
    (root / "recipes" / "__init__.py").write_text(init)
    (root / "recipes" / "echo.py").write_text(ECHO_RECIPE)
    (root / "recipes" / "configs" / "echo" / "tiny.yaml").write_text("greeting: hello\n")


def _tune(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [TUNE, "run", *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_bare_config_name_and_overrides(tmp_path: Path) -> None:
    _make_project(tmp_path)
    result = _tune(tmp_path, "recipes/echo.py", "--config", "tiny", "repeat=3")
    assert result.returncode == 0, result.stderr
    assert 'ECHO single {"greeting": "hello", "repeat": 3}' in result.stdout


def test_config_path_works(tmp_path: Path) -> None:
    _make_project(tmp_path)
    custom = tmp_path / "mine.yaml"
    custom.write_text("greeting: yo\n")
    result = _tune(tmp_path, "recipes/echo.py", "--config", str(custom))
    assert result.returncode == 0, result.stderr
    assert '"greeting": "yo"' in result.stdout


def test_unknown_config_name_lists_available(tmp_path: Path) -> None:
    _make_project(tmp_path)
    result = _tune(tmp_path, "recipes/echo.py", "--config", "huge")
    assert result.returncode != 0
    assert "Unknown config 'huge'" in result.stderr and "Available: tiny" in result.stderr


def test_typo_key_is_an_error(tmp_path: Path) -> None:
    _make_project(tmp_path)
    result = _tune(tmp_path, "recipes/echo.py", "--config", "tiny", "reepat=3")
    assert result.returncode != 0
    assert "reepat" in result.stderr and "Did you mean: 'repeat'" in result.stderr


def test_without_the_hook_torchtune_shadows_local_recipes(tmp_path: Path) -> None:
    # Control: an unmarked recipes folder is left alone, and torchtune's package wins.
    _make_project(tmp_path, marked=False)
    result = _tune(tmp_path, "recipes/echo.py", "--config", "tiny")
    assert result.returncode != 0
    assert "torchtune recipes directory isn't a package" in result.stderr


@pytest.mark.slow
def test_torchrun_form_two_processes(tmp_path: Path) -> None:
    _make_project(tmp_path)
    result = _tune(tmp_path, "--nproc_per_node", "2", "recipes/echo.py", "--config", "tiny")
    assert result.returncode == 0, result.stderr
    for rank in ("0", "1"):
        assert f'ECHO {rank} {{"greeting": "hello", "repeat": 1}}' in result.stdout


WITHOUT_HOOK = "[f for f in sys.meta_path if type(f).__name__ != 'LocalRecipesFinder']"


def test_torchao_version_warning_is_filtered_and_nothing_else() -> None:
    """The hook drops torchao's import-time version warning (its C++ kernels are unused); other
    torchao warnings still print."""
    script = (
        "import logging; import torchtune; "
        "logging.getLogger('torchao').warning('another torchao warning')"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Skipping import of cpp extensions" not in result.stderr
    assert "another torchao warning" in result.stderr
    # Control: without the hook's finder the pinned torch/torchao pair does print the warning.
    unhooked = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.meta_path[:] = {WITHOUT_HOOK}; {script}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Skipping import of cpp extensions" in unhooked.stderr


def test_torchrun_signal_stop_is_one_line_and_other_errors_keep_their_traceback() -> None:
    """The hook prints torchrun's uncaught SignalException (its agent's Ctrl-C stop) as one
    line; any other uncaught exception, even one named the same elsewhere, is a traceback."""

    def uncaught(raise_it: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", raise_it], capture_output=True, text=True, timeout=300
        )

    torchrun = uncaught(
        "from torch.distributed.elastic.multiprocessing.api import SignalException; "
        "raise SignalException('Process 7 got signal: 2', sigval=2)"
    )
    assert torchrun.returncode == 1
    assert torchrun.stderr == "torchrun: Process 7 got signal: 2; its workers were told to stop\n"
    other = uncaught("class SignalException(Exception): pass\nraise SignalException('mine')")
    assert other.returncode == 1
    assert "Traceback" in other.stderr and "SignalException: mine" in other.stderr
