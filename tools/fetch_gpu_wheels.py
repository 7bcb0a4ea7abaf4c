"""Download the wheels tools/gpu_check.py needs on the GPU machine that its image lacks.

    python tools/fetch_gpu_wheels.py                 # into gpu_wheels/wheels/ (git-ignored)
    python tools/fetch_gpu_wheels.py --dest DIR

The GPU machine has no network. Its image (Python 3.12, torch 2.11 + CUDA 13, transformers
5.17, accelerate, pandas, pyarrow, protobuf, requests, sentencepiece, tiktoken, xxhash,
python-dateutil, pytest, ...) lacks torchtune, torchao, torchft, TRL and what they and
composer_tune import that it does not hold. Those travel with the working tree, which may be
64 MiB in all (files + carried paths): this downloads them for CPython 3.12 manylinux x86_64
with ``pip download --only-binary=:all: --no-deps``, checks the total against that limit and
prints the commands for the GPU side (install with ``pip install --no-deps --target``, then run
the check with the repository, then the result, on ``PYTHONPATH``: torchtune's wheel ships a
top-level ``recipes`` package that would shadow this repository's).

The list was found by importing torchtune, composer_tune (DiLoCo included), recipes/grpo.py,
the benches gpu_check imports and ``trl.GRPOTrainer`` with only the image's packages and these on
the path. Versions are the project's (pyproject.toml and the CPU venv), except datasets 5.0.0,
whose pyarrow floor (21) fits older images than 5.2's (24). torch, vLLM and CUDA wheels are never
fetched: the image's torch 2.11 is what the check measures, and vLLM's GPU wheel alone is larger
than the limit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
# What travels to the GPU machine: the working tree and every carried path together.
TRAVEL_LIMIT_MIB = 64.0

# (requirement, why the check needs it). All import-time needs unless said otherwise.
WHEELS: tuple[tuple[str, str], ...] = (
    ("torchtune==0.6.1", "composer_tune's models, FSDP2/AC helpers, config, KV caches"),
    ("torchao==0.15.0", "imported by torchtune (torchtune 0.6.1 fails with torchao >= 0.16)"),
    ("omegaconf==2.4.0", "configs (composer_tune.config, torchtune.config)"),
    ("datasets==5.0.0", "imported by torchtune.data; TRL's training data"),
    ("dill==0.4.1", "imported by datasets"),
    ("multiprocess==0.70.19", "imported by datasets"),
    ("trl==1.16.0", "the peer part: GRPOTrainer"),
    ("torchft==0.2.0", "composer_tune.diloco (only the report's import check needs it)"),
    ("opentelemetry-api==1.45.2", "imported by torchft"),
    ("opentelemetry-sdk==1.45.2", "imported by torchft"),
    ("opentelemetry-semantic-conventions==0.66b2", "imported by opentelemetry-sdk"),
    ("opentelemetry-exporter-otlp-proto-http==1.45.2", "imported by torchft"),
    ("opentelemetry-exporter-otlp-proto-common==1.45.2", "imported by the otlp exporter"),
    ("opentelemetry-exporter-otlp-common==0.66b2", "imported by the otlp exporter"),
    ("opentelemetry-exporter-http-transport==0.66b2", "imported by the otlp exporter"),
    ("opentelemetry-proto==1.45.2", "imported by the otlp exporter"),
    ("googleapis-common-protos==1.76.0", "imported by opentelemetry-proto"),
)
# Never to be fetched (see the module doc): a list that named one is a bug.
FORBIDDEN_PREFIXES = ("torch==", "vllm", "nvidia-", "triton")
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux_2_28_x86_64",
]


def wheel_project(filename: str) -> str:
    """The normalised project name of a wheel file (``opentelemetry_api-1.45.2-...`` ->
    ``opentelemetry-api``)."""
    return filename.split("-")[0].lower().replace("_", "-")


def requirement_project(requirement: str) -> str:
    return requirement.split("==")[0].lower().replace("_", "-")


def working_tree_bytes() -> int:
    """Bytes of what travels besides carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        [
            "git",
            "-C",
            str(REPO_ROOT),
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = (REPO_ROOT / name.decode() for name in listed if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def download(dest: Path) -> list[Path]:
    """Every wheel of :data:`WHEELS` in ``dest``, and nothing else there (an older version left
    behind would make the install on the GPU machine fail: one version of each)."""
    requirements = [requirement for requirement, _ in WHEELS]
    forbidden = [r for r in requirements if r.lower().startswith(FORBIDDEN_PREFIXES)]
    if forbidden:
        raise SystemExit(f"error: refusing to fetch {forbidden} (see the module doc)")
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM_ARGS]
    command += ["-d", str(dest), *requirements]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"error: pip download failed (exit {done.returncode}):\n{tail}")
    wanted = {requirement_project(r): r.split("==")[1] for r in requirements}
    wheels = []
    for path in sorted(dest.glob("*.whl")):
        version = path.name.split("-")[1]
        if wanted.get(wheel_project(path.name)) == version:
            wheels.append(path)
        else:
            path.unlink()
            print(f"removed {path.name} (not in this list)")
    missing = set(wanted) - {wheel_project(path.name) for path in wheels}
    if missing:
        raise SystemExit(
            f"error: pip reported success but no wheel of {sorted(missing)} is in {dest}"
        )
    return wheels


def check_size(wheels: list[Path], tree_bytes: int, limit_mib: float) -> int:
    """Total wheel bytes; exits naming the largest wheels when wheels + tree exceed the limit."""
    total = sum(path.stat().st_size for path in wheels)
    if (total + tree_bytes) / MIB > limit_mib:
        largest = sorted(wheels, key=lambda path: path.stat().st_size, reverse=True)[:5]
        names = ", ".join(f"{path.name} ({path.stat().st_size / MIB:.1f} MiB)" for path in largest)
        raise SystemExit(
            f"error: wheels {total / MIB:.1f} MiB + working tree {tree_bytes / MIB:.1f} MiB exceed "
            f"the {limit_mib:g} MiB that may travel to the GPU machine; largest: {names}"
        )
    return total


def gpu_commands(dest: Path) -> list[str]:
    """What to run on the GPU machine, from the repository root (one part per command)."""
    relative = dest.resolve().relative_to(REPO_ROOT)
    site = relative.parent / "site"
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    install = (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --upgrade "
        f"--target {site} {relative}/*.whl"
    )
    run = f"PYTHONPATH=.:{site} python3 tools/gpu_check.py --commit {commit or 'UNKNOWN'}"
    return [
        f"{install} && {run} --part {part}; cp docs/gpu/report.* $OUT/"
        for part in ("parity", "memory", "speed", "sampling", "peer")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / "gpu_wheels" / "wheels")
    parser.add_argument("--limit-mib", type=float, default=TRAVEL_LIMIT_MIB)
    ns = parser.parse_args(argv)
    if not ns.dest.resolve().is_relative_to(REPO_ROOT):
        parser.error(f"--dest {ns.dest} must lie in the repository: it travels with it")
    wheels = download(ns.dest)
    why = {requirement_project(r): reason for r, reason in WHEELS}
    for path in wheels:
        size = path.stat().st_size / MIB
        print(f"{size:6.2f} MiB  {path.name}  ({why[wheel_project(path.name)]})")
    tree = working_tree_bytes()
    total = check_size(wheels, tree, ns.limit_mib)
    print(
        f"{len(wheels)} wheels, {total / MIB:.1f} MiB; with the working tree "
        f"({tree / MIB:.1f} MiB) {(total + tree) / MIB:.1f} of {ns.limit_mib:g} MiB"
    )
    print(f"\nOn the GPU machine (carry {ns.dest.resolve().relative_to(REPO_ROOT)}), one per call:")
    for command in gpu_commands(ns.dest):
        print(f"  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
