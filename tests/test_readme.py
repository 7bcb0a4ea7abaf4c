"""The README is a short user guide whose every command works as written.

Each command of its ```bash blocks is run when it is cheap (file copies, the memory estimate),
and otherwise checked without training anything: a ``tune run`` loads its config, with the
command's overrides, through the loader the recipe itself uses, and its channel sections as the
recipe's set-up reads them (unknown keys, wrong types or values, a missing recipe or config
fail), and its torchrun flags through torchrun's own parser; a
``python SCRIPT ...`` has its arguments parsed by the script's own argparse parser, stopped before
the script does any work; the set-up commands are the ones CI runs. Every relative link of
README.md, docs/index.md and the pages the README's sections moved to points at a file, every
docs/ page has an index entry, and the README stays at most 350 lines.
"""

import argparse
import contextlib
import io
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser as torchrun_parser

from composer_tune.channels.composer import ComposerChannels
from composer_tune.config import ConfigError, load_recipe_config
from composer_tune.distributed import DistInfo

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
MAX_README_LINES = 350
# Scripts cheap enough (seconds) to run as the README writes them.
RUN_AS_WRITTEN = {"tools/estimate_memory.py"}
FILE_COMMANDS = {"cp", "mkdir"}
ONE_CPU_PROCESS = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))


def readme_commands(text: str) -> list[str]:
    """Every command of the text's ```bash blocks: continuation lines joined, comments and blank
    lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                commands.append(line.strip())
    return commands


class _ArgumentsParsed(Exception):
    """Raised once a script's outermost argparse call has accepted the arguments."""


@contextlib.contextmanager
def _stop_after_parsing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Makes a script's outermost ``parse_args`` / ``parse_known_args`` raise _ArgumentsParsed
    once it has parsed (argparse's own errors still exit 2 first)."""
    depth = 0

    def wrap(name: str) -> None:
        original = getattr(argparse.ArgumentParser, name)

        def parse(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> object:
            nonlocal depth
            depth += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                raise _ArgumentsParsed
            return result

        monkeypatch.setattr(argparse.ArgumentParser, name, parse)

    wrap("parse_args")
    wrap("parse_known_args")
    yield


def _run_script(script: Path, args: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Runs ``python script args`` in this process; returns None or what went wrong (a non-zero
    exit with its output)."""
    out = io.StringIO()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), *args])
        patch.syspath_prepend(str(script.parent))
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exited:
            if exited.code not in (0, None):
                return f"exit status {exited.code}: {out.getvalue()[-1500:]}"
        except Exception as error:  # noqa: BLE001 - reported as the command's failure
            return f"raised {type(error).__name__}: {error}"
    return None


def _parse_script_arguments(
    script: Path, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> str | None:
    """Parses ``args`` with the script's own argparse parser without running the script."""
    if "argparse" not in script.read_text():
        return f"{script} has no argparse parser to check its arguments with"
    err = io.StringIO()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), *args])
        patch.syspath_prepend(str(script.parent))
        with _stop_after_parsing(patch), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except _ArgumentsParsed:
                return None
            except SystemExit as exited:
                return f"its parser refused the arguments (exit {exited.code}): {err.getvalue()}"
    return f"{script} finished without parsing arguments: it ran"


def _check_tune_run(words: list[str]) -> str | None:
    """``tune run [torchrun flags] RECIPE --config NAME [key=value ...]``."""
    if words[:2] != ["tune", "run"]:
        return "only `tune run` is checked"
    recipe_at = next((i for i, word in enumerate(words) if word.endswith(".py")), None)
    if recipe_at is None or "--config" not in words[recipe_at:]:
        return "no recipe file or no --config"
    flags, recipe = words[2:recipe_at], words[recipe_at]
    rest = words[recipe_at + 1 :]
    config_at = rest.index("--config")
    config, overrides = rest[config_at + 1], rest[:config_at] + rest[config_at + 2 :]
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            torchrun_parser().parse_args([*flags, recipe])
    except SystemExit:
        return f"torchrun refuses {flags}: {err.getvalue()}"
    if not Path(recipe).is_file():
        return f"no recipe file {recipe}"
    try:
        cfg = load_recipe_config(recipe, config, overrides)
        if "loss" in cfg:  # an RL recipe: its channel sections parse as its set-up parses them
            ComposerChannels.from_config(cfg, ONE_CPU_PROCESS)
    except (ConfigError, ValueError) as error:
        return str(error)
    return None


def check_command(command: str, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None if ``command`` (from the README, run in the current directory) works as written
    or, where it is not run, checks out; else what is wrong."""
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the program
        words = words[1:]
    program = words[0]
    if program in ("python3", ".venv/bin/python") and command.startswith(
        ("python3 -m venv .venv ", ".venv/bin/python -m pytest")
    ):
        ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        return None if command in ci else "the set-up command is not what .ci/run runs"
    if program in FILE_COMMANDS:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        return None if done.returncode == 0 else done.stderr
    if program == "tune":
        tune = Path(sys.executable).parent / "tune"
        return _check_tune_run(words) if tune.is_file() else f"no {tune}"
    if program == "python":
        script, args = Path(words[1]), words[2:]
        if not script.is_file():
            return f"no script {script}"
        if words[1] in RUN_AS_WRITTEN:
            return _run_script(script, args, monkeypatch)
        inner = args[args.index("--") + 1 :] if "--" in args else []
        problem = _parse_script_arguments(script, args, monkeypatch)
        if problem is None and inner:  # a launcher's replica command
            problem = check_command(shlex.join(inner), monkeypatch)
        return problem
    return f"no rule checks a `{program}` command: add one to tests/test_readme.py"


@pytest.fixture
def scratch_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory that is the repository (top-level entries linked) but for a private
    copy of recipes/, which the README's copy-a-recipe commands write into."""
    for entry in REPO_ROOT.iterdir():
        if entry.name == "recipes":
            shutil.copytree(
                entry, tmp_path / "recipes", ignore=shutil.ignore_patterns("__pycache__")
            )
        elif entry.name not in (".git", "outputs", "checkpoints"):
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_is_a_short_guide() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_every_readme_command_works_as_written(
    scratch_checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = readme_commands(README.read_text())
    assert len(commands) >= 20, commands  # the blocks were found
    problems = {}
    for command in commands:
        problem = check_command(command, monkeypatch)
        if problem:
            problems[command] = problem
    assert not problems, "\n\n".join(f"{c}\n  -> {p}" for c, p in problems.items())
    # The copy-a-recipe commands ran here, not in the repository.
    assert (scratch_checkout / "recipes" / "configs" / "my_grpo" / "cpu_smoke.yaml").is_file()
    assert not (REPO_ROOT / "recipes" / "my_grpo.py").exists()


@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        ("python tools/no_such_tool.py --help", "no script"),
        ("python tools/build_pairs.py --replayed r.jsonl --output p.jsonl", "refused"),
        ("python tools/estimate_memory.py --recipe grpo --config no_such_config", "exit status"),
        ("tune run recipes/grpo.py --config cpu_smoke loss.objectiv=dapo", "objectiv"),
        ("tune run recipes/grpo.py --config no_such_config", "Unknown config"),
        ("tune run recipes/no_such_recipe.py --config cpu_smoke", "no recipe file"),
        ("tune run recipes/grpo.py --config cpu_smoke loss.objective=dappo", "dappo"),
        ("tune run --nprocs_per_node 2 recipes/sft.py --config cpu_smoke", "torchrun refuses"),
        (
            "python tools/launch_diloco.py --replicas 2 -- tune run recipes/diloco.py "
            "--config cpu_smoke diloco.no_such_key=1",
            "no_such_key",
        ),
        ("python3 -m venv .venv && .venv/bin/pip install -e .", "not what .ci/run runs"),
        ("wget https://example.com/model", "no rule"),
    ],
)
def test_a_broken_command_is_caught(
    command: str, complaint: str, scratch_checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = check_command(command, monkeypatch)
    assert problem is not None and complaint in problem, problem


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]


# The README, the docs index, and the pages the README's long sections moved to.
LINKING_PAGES = [
    "README.md",
    "docs/index.md",
    *(
        f"docs/{name}"
        for name in (
            "set_up.md running_recipes.md your_own_model.md your_own_task.md agents.md "
            "coding_tasks.md channel3_data.md rollouts_vllm/README.md layout.md "
            "recipe_anatomy.md status.md results_history.md"
        ).split()
    ),
]


@pytest.mark.parametrize("page", LINKING_PAGES)
def test_relative_links_point_at_files(page: str) -> None:
    path = REPO_ROOT / page
    links = _relative_links(path)
    assert links or page != "README.md", "no links found in the README: the pattern broke"
    missing = [link for link in links if not (path.parent / link).exists()]
    assert not missing, f"{page} links to missing files: {missing}"


def test_docs_index_names_every_page() -> None:
    """Each Markdown page under docs/ (its results tables aside, which their pages link) has an
    entry in docs/index.md."""
    index = REPO_ROOT / "docs" / "index.md"
    linked = {(index.parent / link).resolve() for link in _relative_links(index)}
    pages = [
        page
        for page in (REPO_ROOT / "docs").rglob("*.md")
        if page != index and page.name != "results.md"
    ]
    unlisted = [str(page.relative_to(REPO_ROOT)) for page in pages if page.resolve() not in linked]
    assert not unlisted, f"docs/index.md has no entry for {unlisted}"
