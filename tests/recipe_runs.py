"""Running recipes through the real `tune` console script, as a user types it, and loading
`tools/` scripts as modules."""

import importlib.util
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from composer_tune.analysis.metrics_log import Metrics, read_metrics

REPO_ROOT = Path(__file__).resolve().parent.parent
TUNE = str(Path(sys.executable).parent / "tune")


@dataclass
class RecipeRun:
    output_dir: Path
    stdout: str
    stderr: str

    def heldout_accuracies(self) -> list[float]:
        """Every held-out accuracy the recipe printed, in order."""
        return [float(m) for m in re.findall(r"held-out accuracy ([0-9.]+) over", self.stdout)]

    def metrics(self) -> Metrics:
        """Every metric the run's DiskLogger wrote under ``<output_dir>/logs``: step -> values."""
        return read_metrics(self.output_dir / "logs")


def checkout_env(cwd: Path = REPO_ROOT) -> dict[str, str]:
    """This process's environment for a recipe subprocess run in ``cwd``: it imports the
    checkout there, whatever checkout the venv installed (a git worktree's tests test its own
    code), and nothing else from this process's ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": str(cwd)}


def run_tune(
    *args: str, cwd: Path = REPO_ROOT, timeout: float = 1800
) -> subprocess.CompletedProcess:
    """`tune run ...` from the repo root, as a user types it (:func:`checkout_env`)."""
    env = checkout_env(cwd)
    env["PYTHONUNBUFFERED"] = "1"
    # A process that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack, so
    # a rare multi-process crash under load names where each thread was.
    env["PYTHONFAULTHANDLER"] = "1"
    return subprocess.run(
        [TUNE, "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_torchrun(
    script: str | Path, *args: str, nproc: int = 2, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc script args`` on a free loopback port (gloo, one
    thread per rank), asserting it succeeded; its output is in the assertion message.
    Timeouts are generous: the ranks share 2 cores with whatever else runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), *args,
    ]  # fmt: skip
    env = {**checkout_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def run_recipe(recipe: str, config: str, output_dir: Path, *overrides: str) -> RecipeRun:
    result = run_tune(
        f"recipes/{recipe}.py", "--config", config, f"output_dir={output_dir}", *overrides
    )
    if result.returncode != 0:
        raise AssertionError(
            f"tune run recipes/{recipe}.py --config {config} failed ({result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return RecipeRun(output_dir=output_dir, stdout=result.stdout, stderr=result.stderr)


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (``tools/`` is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
