"""tools/trl_sdpo_peer.py: TRL's own SDPOTrainer as a ladder peer of recipes/sdpo.py.

TRL is in the ``bench`` extra, not a CI dependency: the run is skipped without it, and the tool's
answer to a missing TRL (one ``error:`` line, exit status 2) is checked by hiding TRL from it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_tune.analysis.metrics_log import read_metrics, series

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL = REPO_ROOT / "tools" / "trl_sdpo_peer.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PEER_TITLE = "TRL 1.16 SDPOTrainer (peer)"
# A small run: 2 prompts x 4 completions of at most 8 tokens per step, 8 held-out problems.
SMALL = [
    "num_prompts_per_generation=2",
    "group_size=4",
    "max_new_tokens=8",
    "eval_dataset.num_samples=8",
]
ROWS, MAX_NEW_TOKENS = 2 * 4, 8


def _run(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )


def test_without_trl_one_error_line_and_exit_status_2(tmp_path: Path) -> None:
    # None in sys.modules makes `import trl...` fail as if TRL were not installed.
    hide_trl = (
        "import runpy, sys\n"
        "sys.modules['trl'] = sys.modules['trl.experimental.sdpo'] = None\n"
        f"sys.argv = [{str(TOOL)!r}, '--out', {str(tmp_path / 'out')!r}]\n"
        f"runpy.run_path({str(TOOL)!r}, run_name='__main__')\n"
    )
    done = _run("-c", hide_trl, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: TRL is not installed (this tool runs trl.experimental.sdpo.SDPOTrainer, "
        "TRL 1.16): pip install -e '.[bench]'"
    ]
    assert not (tmp_path / "out").exists()


def _ladder_part(folder: Path, peer: dict) -> None:
    """A ladder's results.json with one A2 run, made with the peer's settings."""
    settings = {**peer["settings"], "arms": ["a2"], "command": "python tools/ladder.py ..."}
    record = {
        "arm": "a2",
        "seed": 0,
        "command": ["tune", "run", "recipes/sdpo.py"],
        "returncode": 0,
        "wall_s": 30.0,
        "log": "run.log",
        "metrics": [
            {
                "eval/accuracy": [[0, 0.25], [1, 0.375], [2, 0.5]],
                "tokens/generated": [[1, 40.0], [2, 90.0]],
                "reward/mean": [[1, 0.25], [2, 0.5]],
            }
        ],
        "generated_tokens": 90.0,
        "status": "ok",
    }
    folder.mkdir()
    (folder / "results.json").write_text(
        json.dumps(
            {"settings": settings, "warm_start": peer["warm_start"], "runs": {"a2/seed0": record}}
        )
    )


@pytest.mark.slow
def test_peer_run_evaluates_counts_tokens_and_joins_a_ladder_table(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    pytest.importorskip("trl.experimental.sdpo")
    out = tmp_path / "peer"
    done = _run(str(TOOL), "--steps", "2", "--eval-every", "1", "--out", str(out), *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "prompt token ids identical (project renderer vs TRL's chat template): True" in (
        done.stdout
    )
    assert "stop token ids identical (project tokenizer vs TRL's generation): True" in done.stdout

    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert (settings["arms"], settings["seeds"], settings["steps"], settings["eval_every"]) == (
        ["trl_sdpo"],
        [0],
        2,
        1,
    )
    assert settings["heldout"]["num_samples"] == 8
    assert settings["heldout"]["split"] == "heldout"
    assert results["warm_start"]["path"] == str(smollm2_dir)
    record = results["runs"]["trl_sdpo/seed0"]
    assert record["status"] == "ok" and record["trl_version"].startswith("1.16")

    # The DiskLogger log, read with the project's parser, and the record agree.
    metrics = read_metrics(out / "runs" / "trl_sdpo_seed0" / "logs")
    accuracy = series(metrics, "eval/accuracy")
    assert [step for step, _ in accuracy] == [0, 1, 2]  # step 0, every step, the end
    assert all(0.0 <= value <= 1.0 for _, value in accuracy)
    assert record["metrics"][0]["eval/accuracy"] == [list(point) for point in accuracy]
    tokens = series(metrics, "tokens/generated")
    assert [step for step, _ in tokens] == [1, 2]
    # Cumulative, counted from TRL's completion masks: each step's share is its mean
    # completion length (TRL's own metric) times its rows.
    sampled = [tokens[0][1], tokens[1][1] - tokens[0][1]]
    lengths = [value for _, value in series(metrics, "completion_length/mean")]
    assert sampled == pytest.approx([length * ROWS for length in lengths], rel=1e-9)
    assert all(0 < count <= ROWS * MAX_NEW_TOKENS for count in sampled)
    assert record["generated_tokens"] == tokens[-1][1] > 0
    assert [step for step, _ in series(metrics, "reward/mean")] == [1, 2]

    # The ladder's --combine reads it beside a ladder's arm, in a table row and the plots.
    ladder_dir, combined = tmp_path / "ladder", tmp_path / "combined"
    _ladder_part(ladder_dir, results)
    joined = _run(
        str(REPO_ROOT / "tools" / "ladder.py"),
        *("--combine", str(ladder_dir), str(out), "--out", str(combined)),
        timeout=300,
    )
    assert joined.returncode == 0, joined.stderr[-3000:]
    markdown = (combined / "results.md").read_text()
    cells = " | ".join(f"{value:.3f}" for _, value in accuracy)
    peer_row = f"| {PEER_TITLE} | {cells} | – | "
    assert peer_row in markdown, markdown
    assert markdown.index("| A2 SDPO | 0.250 | 0.375 | 0.500 |") < markdown.index(peer_row)
    assert f"| {record['generated_tokens']:.0f} | 1 |" in markdown.split(peer_row)[1]
    for name in ("accuracy.png", "reward.png", "accuracy_vs_tokens.png"):
        assert (combined / name).read_bytes().startswith(PNG_MAGIC)
