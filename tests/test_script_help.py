"""Every script in bench/ and tools/ answers ``--help`` (argparse formats each help string with
``%``, so one stray percent sign breaks the whole help, and only when a user asks for it)."""

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    path
    for folder in ("bench", "tools")
    for path in (REPO_ROOT / folder).glob("*.py")
    if "argparse" in path.read_text()
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_help_prints_usage_and_exits_0(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0, out.getvalue()
    assert out.getvalue().startswith("usage:"), out.getvalue()[:500]
