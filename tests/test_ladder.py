"""tools/ladder.py and composer_tune/analysis/metrics_log.py.

Fast: the DiskLogger parser against lines written here from known values; the ladder's table
(accuracy at fixed steps as mean ± sample std, wall time, generated tokens, seeds) and plot
bands recomputed here by hand from hand-made logs of three seeds of A1 and two two-replica
DiLoCo seeds; override routing; refusals before any compute (unequal held-out sets, a --out made
with other settings); and, with a stand-in ``tune`` that writes known logs or fails, failure
recording (the other runs go on, finished results stay, a hung run is stopped at
--run-timeout), a rerun that skips completed runs and retries the failed one, and the ladder's own
warm start (trained once, reused by later runs; its failure stops the ladder before any arm).

Slow: one ladder through the real CLI (arms A1 and DiLoCo, 2 steps, from the session's SFT warm
start): each arm's step-0 accuracy equals the warm start's own last held-out accuracy (same
weights, same held-out set), and the generated-token count equals the sum of the policy loss's
logged ``num_tokens`` over steps and replicas (one micro-batch per step and replica in
cpu_smoke, so that count is the step's completion tokens).
"""

import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from composer_tune.analysis.metrics_log import parse_metric_lines, read_metrics, series
from composer_tune.config import load_recipe_config
from composer_tune.ladder import arms as ladder_arms
from composer_tune.ladder import figures as ladder_figures
from composer_tune.ladder import report as ladder_report
from composer_tune.ladder import runs as ladder_runs
from tests.recipe_runs import REPO_ROOT, RecipeRun

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_ladder():
    spec = importlib.util.spec_from_file_location("ladder", REPO_ROOT / "tools" / "ladder.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ladder"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


ladder = _load_ladder()


def _mean_std_by_hand(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _write_log(log_dir: Path, lines: list[str], name: str = "log_1000.txt") -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / name).write_text("".join(line + "\n" for line in lines))


# ------------------------------------------------------------------------------ the parser


def test_parser_reads_every_metric_and_later_lines_win(tmp_path: Path) -> None:
    rng = random.Random(0)
    expected = {
        step: {"loss": rng.uniform(-1, 1), "reward/mean": rng.random()} for step in range(1, 5)
    }
    lines = ["Writing logs to somewhere", "Step 0 | eval/accuracy:0.25 "]
    lines += [
        f"Step {step} | " + " ".join(f"{k}:{v}" for k, v in values.items()) + " "
        for step, values in expected.items()
    ]
    lines.append("Step 4 | eval/accuracy:0.5 loss:nan ")  # a second line for step 4
    expected[0] = {"eval/accuracy": 0.25}
    expected[4].update({"eval/accuracy": 0.5})
    parsed = parse_metric_lines(lines)
    assert math.isnan(parsed[4].pop("loss"))
    del expected[4]["loss"]
    assert parsed == expected

    # Two files of one run (a resume): the newer one's value wins at a shared step.
    _write_log(tmp_path, ["Step 1 | loss:1.0 ", "Step 2 | loss:2.0 "], "log_1.txt")
    _write_log(tmp_path, ["Step 2 | loss:-2.0 ", "Step 3 | loss:3.0 "], "log_2.txt")
    os.utime(tmp_path / "log_1.txt", (1, 1))  # older, whatever the file system's clock says
    assert series(read_metrics(tmp_path), "loss") == [(1, 1.0), (2, -2.0), (3, 3.0)]


def test_parser_names_the_culprit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"run\.txt:2: cannot read metric 'loss:tensor\(1\.\)'"):
        parse_metric_lines(["Step 1 | loss:1.0 ", "Step 2 | loss:tensor(1.) "], source="run.txt")
    with pytest.raises(ValueError, match=r"<lines>:1: .*'loss'"):
        parse_metric_lines(["Step 1 | loss "])
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        read_metrics(tmp_path)


# ------------------------------------------------------------------------------ aggregation


def _args(tmp_path: Path, *extra: str):
    return ladder.build_parser().parse_args(["--out", str(tmp_path / "out"), *extra])


def _sft_cfg():
    return load_recipe_config(REPO_ROOT / ladder_runs.SFT_RECIPE, "cpu_smoke", [])


def test_table_and_bands_equal_values_computed_by_hand(tmp_path: Path) -> None:
    args = _args(
        tmp_path,
        *("--arms", "a1", "diloco", "--seeds", "0", "1", "2", "--steps", "8"),
        *("--eval-every", "2", "--diloco-sync-every", "2"),
    )
    runs = ladder_runs.plan_runs(args, ["warm_start.output_dir=/nowhere"], _sft_cfg())
    rng = random.Random(1)
    truth: dict[str, dict] = {}  # run key -> what its logs say
    results = {"runs": {}}
    for run in runs:
        if run.key == "diloco/seed2":
            continue  # DiLoCo finished only 2 seeds
        accuracy = {step: rng.random() for step in range(0, 9, 2)}
        replicas = []
        for log_dir in run.log_dirs():
            reward = {step: rng.random() for step in range(1, 9)}
            sampled = {step: rng.randint(100, 400) for step in range(1, 9)}  # by each step
            lines = [f"Step 0 | eval/accuracy:{accuracy[0]} "]
            for step in range(1, 9):
                total = sum(sampled[done] for done in range(1, step + 1))  # the logged count
                lines.append(
                    f"Step {step} | loss:0.1 reward/mean:{reward[step]} "
                    f"completion_length/mean:99 tokens/generated:{total} "
                )
                if step % 2 == 0:
                    lines.append(f"Step {step} | eval/accuracy:{accuracy[step]} ")
            _write_log(log_dir, lines)
            replicas.append((reward, sampled))
        truth[run.key] = {"accuracy": accuracy, "replicas": replicas, "wall": rng.uniform(5, 50)}
        results["runs"][run.key] = ladder_runs.run_record(run, 0, truth[run.key]["wall"])

    # Tokens: each replica's logged running total at the step, summed over replicas.
    def sampled_by(step: int, replica: tuple) -> int:
        _, sampled = replica
        return sum(sampled[done] for done in range(1, step + 1))

    for key, record in results["runs"].items():
        expected = sum(sampled_by(8, replica) for replica in truth[key]["replicas"])
        assert record["status"] == "ok"
        assert record["generated_tokens"] == expected
        # Accuracy at equal tokens: each evaluation against the tokens logged at or before it.
        by_tokens = ladder_report.accuracy_by_tokens(record)
        assert by_tokens == [
            [sum(sampled_by(step, replica) for replica in truth[key]["replicas"]), accuracy]
            for step, accuracy in sorted(truth[key]["accuracy"].items())
        ]
        assert by_tokens[0][0] == 0  # nothing sampled before the first evaluation

    report = ladder_report.report_steps(8, 2)
    assert report == [0, 4, 8]
    table = ladder_report.table_rows(results, ["a1", "diloco"], report)
    assert table[0].startswith("| arm | held-out acc @ step 0 | held-out acc @ step 4 |")
    for row, arm, seeds in ((table[2], "a1", [0, 1, 2]), (table[3], "diloco", [0, 1])):
        keys = [f"{arm}/seed{seed}" for seed in seeds]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        expected_cells = [ladder_arms.ARMS[arm].title]
        for step in report:
            mean, std = _mean_std_by_hand([truth[k]["accuracy"][step] for k in keys])
            expected_cells.append(f"{mean:.3f} ± {std:.3f}")
        expected_cells.append(f"{std / len(seeds) ** 0.5:.3f}")  # the final step's
        mean, std = _mean_std_by_hand([truth[k]["wall"] for k in keys])
        expected_cells.append(f"{mean:.0f} ± {std:.0f}")
        tokens = [results["runs"][k]["generated_tokens"] for k in keys]
        mean, std = _mean_std_by_hand(tokens)
        expected_cells.append(f"{mean:.0f} ± {std:.0f}")
        expected_cells.append(str(len(seeds)))
        assert cells == expected_cells

    # The reward band: per step, replicas averaged within a run, then mean ± std over seeds.
    keys = ["diloco/seed0", "diloco/seed1"]
    steps, means, stds = ladder_report.band_series(
        [ladder_report.reward_series(results["runs"][k]) for k in keys]
    )
    assert steps == list(range(1, 9))
    for step, mean, std in zip(steps, means, stds, strict=True):
        per_seed = [sum(reward[step] for reward, _ in truth[k]["replicas"]) / 2 for k in keys]
        assert (mean, std) == pytest.approx(_mean_std_by_hand(per_seed), rel=1e-12)


def test_channel_gradient_table_and_plot_equal_values_computed_by_hand(tmp_path: Path) -> None:
    """Two A4 seeds that logged log_channel_gradients (one with a skipped, NaN step) and an A1
    seed that did not: A4's rows (gradient norm and share, end-of-reply push and share) average
    each run over its finite steps, then mean ± std over seeds; A1 gets no row; the plot is
    written."""
    args = _args(tmp_path, "--arms", "a1", "a4", "--seeds", "0", "1", "--steps", "3")
    runs = ladder_runs.plan_runs(args, ["warm_start.output_dir=/nowhere"], _sft_cfg())
    rng = random.Random(2)
    logged: dict[str, dict[str, list[float]]] = {}  # A4 run key -> metric -> value per step
    results = {"settings": {"arms": ["a1", "a4"]}, "runs": {}}
    for run in runs:
        lines = ["Step 0 | eval/accuracy:0.5 "]
        names = ("grad_norm", "grad_norm/policy", "grad_norm/dpo", "grad_share/policy")
        names += tuple(f"eos_{kind}/{c}" for kind in ("push", "share") for c in ("policy", "dpo"))
        values = {name: [rng.uniform(0.1, 8.0) for _ in range(3)] for name in names}
        values["grad_share/dpo"] = [1.0 - share for share in values["grad_share/policy"]]
        if run.key == "a4/seed1":
            for series_values in values.values():
                series_values[1] = math.nan  # a skipped non-finite step
        for step in range(3):
            items = "reward/mean:0.5 tokens/generated:10 "
            if run.arm.key == "a4":
                items += " ".join(f"{name}:{v[step]}" for name, v in values.items()) + " "
            lines.append(f"Step {step + 1} | {items}")
        _write_log(run.log_dirs()[0], lines)
        if run.arm.key == "a4":
            logged[run.key] = values
        results["runs"][run.key] = ladder_runs.run_record(run, 0, 1.0)

    def cell(name: str) -> str:
        averages = []
        for key in ("a4/seed0", "a4/seed1"):
            finite = [v for v in logged[key][name] if not math.isnan(v)]
            averages.append(sum(finite) / len(finite))
        mean, std = _mean_std_by_hand(averages)
        return f"{mean:.3f} ± {std:.3f}"

    rows = ladder_report.channel_gradient_rows(results, ["a1", "a4"])
    assert len(rows) == 4  # header, rule, and A4's two channels: A1 logged none
    for row, channel in zip(rows[2:], ("dpo", "policy"), strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells == [
            ladder_arms.ARMS["a4"].title,
            channel,
            cell(f"grad_norm/{channel}"),
            cell(f"grad_share/{channel}"),
            cell(f"eos_push/{channel}"),
            cell(f"eos_share/{channel}"),
            cell("grad_norm"),
            "2",
        ]
    assert ladder_report.channel_gradient_rows(results, ["a1"]) == []
    written = ladder_report.write_plots(results, tmp_path, ladder_report.require_matplotlib())
    assert tmp_path / "channel_gradients.png" in written
    assert (tmp_path / "channel_gradients.png").read_bytes().startswith(PNG_MAGIC)


def test_tokens_at_a_logging_cadence_coarser_than_the_evaluations() -> None:
    """A replica that logs every 3rd step: an evaluation counts the tokens of the last logged
    step at or before it; a replica that logged no count (it sampled nothing) adds 0."""
    replicas = [
        {"tokens/generated": [[3, 30.0], [6, 70.0]], "eval/accuracy": [[0, 0.1], [4, 0.2]]},
        {"tokens/generated": [[1, 5.0], [2, 9.0], [4, 20.0], [8, 41.0]]},
        {"reward/mean": [[1, 0.5]]},
    ]
    assert ladder_runs.generated_tokens(replicas) == 70.0 + 41.0
    assert ladder_runs.generated_tokens(replicas, until=5) == 30.0 + 20.0
    record = {"metrics": replicas}
    assert ladder_report.accuracy_by_tokens(record) == [[0.0, 0.1], [50.0, 0.2]]


def test_report_steps_and_single_seed_cells() -> None:
    assert ladder_report.report_steps(12, 4) == [0, 4, 12]  # the last evaluation at or before 6
    assert ladder_report.report_steps(2, 2) == [0, 2]
    assert ladder_figures.fmt_mean_std([0.25], 3) == "0.250"
    assert ladder_figures.fmt_mean_std([], 3) == "–"
    assert ladder_figures.fmt_mean_std([None, 0.25, None], 3) == "0.250"  # runs without one


def test_every_arm_gets_the_warm_starts_heldout_set_and_task(tmp_path: Path) -> None:
    # An SFT config whose held-out set and task differ from every arm's own cpu_smoke config.
    sft_cfg = load_recipe_config(
        REPO_ROOT / ladder_runs.SFT_RECIPE,
        "cpu_smoke",
        ["eval_dataset.num_samples=32", "eval_dataset.seed=5", "dataset.max_digits=3"],
    )
    args = _args(tmp_path, "--arms", *ladder_arms.ARMS)
    runs = ladder_runs.plan_runs(args, ["warm_start.output_dir=/nowhere"], sft_cfg)
    assert sorted({run.arm.key for run in runs}) == sorted(ladder_arms.ARMS)
    # The recipes log their token counts at whatever cadence the config logs: none is forced.
    assert not [o for run in runs for o in run.overrides if o.startswith("logging.log_every")]
    sft_yaml = yaml.safe_load((REPO_ROOT / "recipes/configs/sft/cpu_smoke.yaml").read_text())
    expected = {**sft_yaml["eval_dataset"], "num_samples": 32, "seed": 5}
    assert ladder_runs.heldout_set(runs) == expected
    for run in runs:
        own = yaml.safe_load(
            (
                REPO_ROOT / "recipes/configs" / Path(run.arm.recipe).stem / "cpu_smoke.yaml"
            ).read_text()
        )
        dataset = run.resolved_config().dataset
        assert dataset.max_digits == 3  # the warm start's task...
        assert dataset.seed == own["dataset"]["seed"]  # ...with the arm's own training problems


def test_overrides_go_to_every_arm_or_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    per_arm = ladder_runs.split_overrides(
        ["optimizer.lr=1e-5", "a2:sdpo.weight=0.5", "a1:dpo.pairs=http://host:1/p"], ["a1", "a2"]
    )
    assert per_arm == {
        "a1": ["optimizer.lr=1e-5", "dpo.pairs=http://host:1/p"],
        "a2": ["optimizer.lr=1e-5", "sdpo.weight=0.5"],
    }
    with pytest.raises(ValueError, match="arm 'a3' is not in this ladder"):
        ladder_runs.split_overrides(["a3:x=1"], ["a1"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        ladder_runs.split_overrides(["optimizer.lr"], ["a1"])

    # An arm-only override of the held-out set, and a key a recipe does not take, are refused
    # before anything runs (no warm start is trained).
    for bad, reason in (
        ("a2:eval_dataset.seed=7", "arm a2 would be evaluated on another held-out set"),
        ("a2:sdpo.wieght=0.5", "sdpo.wieght"),
    ):
        with pytest.raises(SystemExit):
            ladder.main(["--out", str(tmp_path), "--arms", "a1", "a2", "--override", bad])
        assert reason in capsys.readouterr().err
        assert not (tmp_path / "warm_start").exists()


def test_ablation_arms_are_a4_with_one_channel_off_whatever_the_overrides(tmp_path: Path) -> None:
    """Each "A4 minus one channel" arm runs composer_full with that channel's weight at 0, after
    every --override (a sweep of that weight leaves the arm an ablation), and resolves to A4's
    config but for that weight."""
    args = _args(
        tmp_path,
        *("--arms", "a4", *ladder_arms.ABLATION_ARMS, "--seeds", "0", "--steps", "2"),
        *("--override", "sdpo.weight=0.5", "--override", "a4_no_dpo:optimizer.lr=2e-5"),
    )
    runs = {run.arm.key: run for run in ladder_runs.plan_runs(args, [], _sft_cfg())}
    for key, weight in (("a4_no_policy", "loss"), ("a4_no_sdpo", "sdpo"), ("a4_no_dpo", "dpo")):
        command = runs[key].command()
        assert command[2] == "recipes/composer_full.py"
        assert command[-1] == f"{weight}.weight=0"
        resolved = runs[key].resolved_config()
        assert resolved[weight].weight == 0
        a4 = runs["a4"].resolved_config()
        assert a4[weight].weight != 0
    assert runs["a4_no_dpo"].resolved_config().sdpo.weight == 0.5
    assert runs["a4_no_dpo"].resolved_config().optimizer.lr == 2e-5
    assert ladder.build_parser().parse_args([]).arms == ["a1", "a2", "a3", "a4", "diloco"]


def test_contribution_table_equals_values_computed_by_hand(tmp_path: Path) -> None:
    """A1, A4 and two ablation arms (two seeds each, one ablation seed failed): each arm's
    final accuracy, tokens, final-step completion length and truncated share (mean ± std), and
    for an ablation arm the channel it leaves out and A4's mean minus its own."""
    arms = ["a1", "a4", "a4_no_sdpo", "a4_no_dpo"]
    args = _args(tmp_path, "--arms", *arms, "--seeds", "0", "1", "--steps", "4")
    rng = random.Random(5)
    results = {"settings": {"arms": arms, "steps": 4}, "runs": {}}
    truth: dict[str, dict[str, list[float]]] = {key: {} for key in arms}
    for run in ladder_runs.plan_runs(args, [], _sft_cfg()):
        values = {
            "accuracy": rng.random(),
            "tokens": rng.randint(1000, 5000),
            "length": rng.uniform(5, 24),
            "truncated": rng.random(),
        }
        lines = ["Step 0 | eval/accuracy:0.1 "]
        for step in (1, 2, 3):  # earlier steps: other values, not read
            lines.append(f"Step {step} | completion_length/mean:99 truncation_rate:0.9 ")
        lines.append(
            f"Step 4 | completion_length/mean:{values['length']} "
            f"truncation_rate:{values['truncated']} tokens/generated:{values['tokens']} "
        )
        lines.append(f"Step 4 | eval/accuracy:{values['accuracy']} ")
        _write_log(run.log_dirs()[0], lines)
        failed = run.key == "a4_no_dpo/seed1"
        results["runs"][run.key] = ladder_runs.run_record(run, 1 if failed else 0, 1.0)
        if not failed:
            for name, value in values.items():
                truth[run.arm.key].setdefault(name, []).append(value)

    rows = ladder_report.contribution_rows(results, arms)
    assert rows[0].startswith("| arm | channel left out | held-out acc @ step 4 |")
    digits = {"accuracy": 3, "tokens": 0, "length": 1, "truncated": 2}
    for row, key in zip(rows[2:], arms, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        expected = [ladder_arms.ARMS[key].title, ladder_arms.ARMS[key].without or "–"]
        for name, places in digits.items():
            own = truth[key][name]
            if len(own) > 1:
                mean, std = _mean_std_by_hand(own)
                expected.append(f"{mean:.{places}f} ± {std:.{places}f}")
            else:
                expected.append(f"{own[0]:.{places}f}")
            if key in ("a1", "a4"):
                expected.append("–")
            else:
                change = sum(truth["a4"][name]) / 2 - sum(own) / len(own)
                expected.append(f"{change:+.{places}f}")
        expected.append(str(len(truth[key]["accuracy"])))
        assert cells == expected
    assert ladder_report.contribution_rows(results, ["a1", "a4"]) == []  # no ablation arm
    assert "## What each A4 channel adds" in ladder_report.render_markdown(
        {**results, "settings": {**results["settings"], **_settings(arms)}}
    )
    written = ladder_report.write_plots(results, tmp_path, ladder_report.require_matplotlib())
    for name in ("completion_length.png", "truncation.png"):
        assert tmp_path / name in written


def _settings(arms: list[str]) -> dict:
    return {"command": "x", "arms": arms, "seeds": [0, 1], "steps": 4, "eval_every": 4,
            "heldout": {"seed": 1}}  # fmt: skip


def test_a_ladder_that_imported_another_checkout_refuses_to_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ladder, "imported_checkout", lambda: Path("/elsewhere"))
    with pytest.raises(SystemExit):
        ladder.main(["--arms", "a1", "--no-plots"])
    assert f"run with PYTHONPATH={REPO_ROOT}" in capsys.readouterr().err
    monkeypatch.undo()
    assert ladder.imported_checkout() == REPO_ROOT  # this test session's own checkout


def test_runs_import_this_repository_first() -> None:
    """`tune run` puts the working directory after site-packages, where an editable install of
    another checkout would be imported instead: the runs get this repository on PYTHONPATH."""
    env = ladder.subprocess_env(3)
    assert env["PYTHONPATH"] == str(REPO_ROOT)
    assert env["OMP_NUM_THREADS"] == "3"
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.append('.'); import composer_tune; "
         "print(composer_tune.__file__)"],
        env=env, cwd="/", capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(probe.stdout.strip()).is_relative_to(REPO_ROOT)


# ------------------------------------------------------------------------------ failures, resume

FAKE_TUNE = """\
#!{python}
# Stand-in for `tune run RECIPE --config NAME key=value...`: logs known values, or fails.
import os, sys, time
from pathlib import Path

overrides = dict(arg.split("=", 1) for arg in sys.argv[5:])
if sys.argv[2] == "recipes/sft.py":  # the warm start: a complete checkpoint and its accuracy
    with open(os.environ["FAKE_TUNE_CALLS"], "a") as calls:
        calls.write("sft\\n")
    if "sft" in os.environ.get("FAKE_TUNE_FAIL", "").split(","):
        print("boom: sft fails here")
        sys.exit(4)
    steps = int(os.environ.get("FAKE_TUNE_SFT_STEPS") or overrides.get("max_steps", "10"))
    checkpoint = Path(overrides["output_dir"]) / "checkpoints" / f"step_{{steps:07d}}"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "config.json").write_text("{{}}")
    (checkpoint / "training_state.pt").write_text("")
    (Path(overrides["output_dir"]) / "logs").mkdir()
    (Path(overrides["output_dir"]) / "logs" / "log_1.txt").write_text(
        "Step 0 | eval/accuracy:0.0 \\nStep 10 | eval/accuracy:0.375 \\n"
    )
    sys.exit(0)
seed, steps = int(overrides["seed"]), int(overrides["max_steps"])
every = int(overrides["eval_every_n_steps"])
with open(os.environ["FAKE_TUNE_CALLS"], "a") as calls:
    calls.write(f"{{seed}}\\n")
if str(seed) in os.environ.get("FAKE_TUNE_HANG", "").split(","):
    time.sleep(600)
if str(seed) in os.environ.get("FAKE_TUNE_FAIL", "").split(","):
    print(f"boom: seed {{seed}} fails here")
    sys.exit(3)
logs = Path(overrides["output_dir"]) / "logs"
checkpoints = Path(overrides["output_dir"]) / "checkpoints"
resumed = overrides.get("checkpoint.resume_from_checkpoint") == "latest"
first = 1
if resumed:  # from the newest checkpoint, into a log file of its own
    first = 1 + max(int(path.name.removeprefix("step_")) for path in checkpoints.iterdir())
killed_at = os.environ.get("FAKE_TUNE_KILL_AT_STEP", "") if not resumed else ""
logs.mkdir(parents=True, exist_ok=resumed)
with open(logs / f"log_{{first}}.txt", "w") as log:
    if not resumed:
        log.write(f"Step 0 | eval/accuracy:{{0.1 * seed}} \\n")
    for step in range(first, steps + 1):
        if killed_at and step > int(killed_at):  # killed after its step-`killed_at` checkpoint
            checkpoint = checkpoints / f"step_{{int(killed_at):07d}}"
            (checkpoint / "model").mkdir(parents=True)  # complete: weights' folder and state
            (checkpoint / "model" / "config.json").write_text("{{}}")
            (checkpoint / "training_state.pt").write_text("")
            log.flush()
            os.kill(os.getpid(), 9)
        log.write(f"Step {{step}} | reward/mean:{{step / 10}} tokens/generated:{{48 * step}} \\n")
        if step % every == 0:
            log.write(f"Step {{step}} | eval/accuracy:{{0.1 * seed + 0.01 * step}} \\n")
"""


@pytest.fixture
def fake_tune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake_tune"
    script.write_text(FAKE_TUNE.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setattr(ladder_runs, "TUNE", str(script))
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_TUNE_CALLS", str(calls))
    return calls


def _hf_warm_start(tmp_path: Path) -> Path:
    folder = tmp_path / "hf_model"  # only looked at, never loaded, by the stand-in
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _a1_ladder_argv(tmp_path: Path, *seeds: str) -> tuple[Path, list[str]]:
    """The results folder and the argv of a 4-step A1 ladder over ``seeds`` from a stand-in
    warm start."""
    out = tmp_path / "out"
    return out, [
        *("--out", str(out), "--arms", "a1", "--seeds", *seeds, "--steps", "4"),
        *("--eval-every", "2", "--warm-start", str(_hf_warm_start(tmp_path))),
    ]


def test_failure_is_recorded_and_rerun_retries_only_it(
    tmp_path: Path, fake_tune: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, argv = _a1_ladder_argv(tmp_path, "0", "1", "2")
    monkeypatch.setenv("FAKE_TUNE_FAIL", "1")
    assert ladder.main(argv) == 1  # a failure makes the exit status non-zero...
    assert fake_tune.read_text().split() == ["0", "1", "2"]  # ...and the others went on
    results = json.loads((out / "results.json").read_text())
    failed = results["runs"]["a1/seed1"]
    assert failed["status"] == "failed" and failed["returncode"] == 3
    assert "boom: seed 1 fails here" in failed["log_tail"]
    for seed in (0, 2):
        record = results["runs"][f"a1/seed{seed}"]
        assert record["status"] == "ok"
        assert record["metrics"][0]["eval/accuracy"] == [
            [0, 0.1 * seed],
            [2, 0.1 * seed + 0.02],
            [4, 0.1 * seed + 0.04],
        ]
        assert record["generated_tokens"] == 4 * 48  # the last logged tokens/generated
    markdown = (out / "results.md").read_text()
    assert "| A1 GRPO | 0.100 ± 0.141 |" in markdown  # seeds 0 and 2: 0.0 and 0.2
    assert "2 (1 failed: [1])" in markdown
    assert "- a1 seed 1: exit status 3" in markdown
    for name in ("accuracy.png", "reward.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)

    # The rerun runs the failed seed only; the finished records are kept as they were.
    monkeypatch.delenv("FAKE_TUNE_FAIL")
    fake_tune.write_text("")
    assert ladder.main(argv) == 0
    assert fake_tune.read_text().split() == ["1"]
    rerun = json.loads((out / "results.json").read_text())
    assert rerun["runs"]["a1/seed0"] == results["runs"]["a1/seed0"]
    assert rerun["runs"]["a1/seed1"]["status"] == "ok"
    assert "| A1 GRPO | 0.100 ± 0.100 |" in (out / "results.md").read_text()

    # A run past --run-timeout is stopped and recorded as failed.
    monkeypatch.setenv("FAKE_TUNE_HANG", "3")
    timeout_argv = [*argv, "--seeds", "0", "1", "2", "3", "--run-timeout", "3"]
    assert ladder.main(timeout_argv) == 1
    hung = json.loads((out / "results.json").read_text())["runs"]["a1/seed3"]
    assert hung["status"] == "failed" and hung["returncode"] == -signal.SIGTERM
    assert "stopped: it ran past --run-timeout 3 s" in hung["log_tail"]
    assert hung["wall_s"] < 60

    # Other settings in the same --out are refused, not mixed into the table.
    with pytest.raises(SystemExit):
        ladder.main([*argv, "--override", "optimizer.lr=1e-5"])
    assert fake_tune.read_text().split() == ["1", "3"]


def test_a_killed_run_resumes_from_its_checkpoint_and_a_rerun_of_a_checkpointless_one_restarts(
    tmp_path: Path, fake_tune: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, argv = _a1_ladder_argv(tmp_path, "0")
    monkeypatch.setenv("FAKE_TUNE_KILL_AT_STEP", "2")
    assert ladder.main(argv) == 1
    killed = json.loads((out / "results.json").read_text())["runs"]["a1/seed0"]
    assert killed["returncode"] == -signal.SIGKILL

    monkeypatch.delenv("FAKE_TUNE_KILL_AT_STEP")
    assert ladder.main(argv) == 0
    record = json.loads((out / "results.json").read_text())["runs"]["a1/seed0"]
    assert record["status"] == "ok" and record["resumed_from_step"] == 2
    assert record["command"] == killed["command"]  # the run's identity, without the resume flag
    # Steps 0-2 come from the first attempt's log, 3-4 from the resumed one's.
    assert record["metrics"][0]["eval/accuracy"] == [[0, 0.0], [2, 0.02], [4, 0.04]]
    assert record["wall_s"] > killed["wall_s"]
    run_log = (out / "runs" / "a1_seed0" / "run.log").read_text().splitlines()
    commands = [line for line in run_log if line.startswith("$ ")]  # both attempts' output kept
    assert len(commands) == 2 and "resume_from_checkpoint" not in commands[0]
    assert commands[1].endswith("checkpoint.resume_from_checkpoint=latest")

    # A failed run that left no checkpoint is trained again from scratch, its folder emptied.
    monkeypatch.setenv("FAKE_TUNE_FAIL", "1")
    one = [*argv, "--seeds", "1"]
    assert ladder.main(one) == 1
    (out / "runs" / "a1_seed1" / "stale.txt").write_text("from the failed attempt")
    monkeypatch.delenv("FAKE_TUNE_FAIL")
    assert ladder.main(one) == 0
    rerun = json.loads((out / "results.json").read_text())["runs"]["a1/seed1"]
    assert "resumed_from_step" not in rerun and rerun["status"] == "ok"
    assert not (out / "runs" / "a1_seed1" / "stale.txt").exists()


def test_a_run_whose_ladder_died_with_it_resumes_instead_of_being_deleted(
    tmp_path: Path, fake_tune: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ladder itself killed mid-run (a session ends, the machine reboots): results.json
    holds the run as running, and the next ladder resumes its checkpoint, logs kept."""
    out, argv = _a1_ladder_argv(tmp_path, "0")
    monkeypatch.setenv("FAKE_TUNE_KILL_AT_STEP", "2")
    real_run_logged = ladder_runs.run_logged

    def ladder_dies_after_the_run(*args, **kwargs):
        real_run_logged(*args, **kwargs)
        raise SystemExit("the ladder is killed")

    monkeypatch.setattr(ladder_runs, "run_logged", ladder_dies_after_the_run)
    with pytest.raises(SystemExit):
        ladder.main(argv)
    left = json.loads((out / "results.json").read_text())["runs"]["a1/seed0"]
    assert left["status"] == "running" and left["returncode"] is None

    monkeypatch.setattr(ladder_runs, "run_logged", real_run_logged)
    monkeypatch.delenv("FAKE_TUNE_KILL_AT_STEP")
    assert ladder.main(argv) == 0
    record = json.loads((out / "results.json").read_text())["runs"]["a1/seed0"]
    assert record["status"] == "ok" and record["resumed_from_step"] == 2
    assert record["metrics"][0]["eval/accuracy"] == [[0, 0.0], [2, 0.02], [4, 0.04]]
    assert record["wall_s"] > 0
    commands = [
        line
        for line in (out / "runs" / "a1_seed0" / "run.log").read_text().splitlines()
        if line.startswith("$ ")
    ]
    assert len(commands) == 2 and commands[1].endswith("checkpoint.resume_from_checkpoint=latest")


def test_warm_start_is_trained_once_and_its_failure_stops_the_ladder(
    tmp_path: Path,
    fake_tune: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "out"
    argv = ["--out", str(out), "--arms", "a1", "--steps", "2", "--eval-every", "2"]
    argv += ["--sft-override", "max_steps=10"]
    monkeypatch.setenv("FAKE_TUNE_FAIL", "sft")
    assert ladder.main([*argv, "--seeds", "0"]) == 1
    assert fake_tune.read_text().split() == ["sft"]  # no arm ran without a warm start
    results = json.loads((out / "results.json").read_text())
    assert "boom: sft fails here" in results["warm_start"]["log_tail"]
    assert results["runs"] == {}

    monkeypatch.delenv("FAKE_TUNE_FAIL")
    fake_tune.write_text("")
    assert ladder.main([*argv, "--seeds", "0"]) == 0
    assert ladder.main([*argv, "--seeds", "0", "1"]) == 0  # a seed more: the same warm start
    assert fake_tune.read_text().split() == ["sft", "0", "1"]
    results = json.loads((out / "results.json").read_text())
    assert results["warm_start"]["heldout_accuracy"] == 0.375
    final = out.resolve() / "warm_start" / "checkpoints" / "step_0000010" / "model"
    for seed in (0, 1):
        assert (
            f"checkpoint.initial_checkpoint={final}" in results["runs"][f"a1/seed{seed}"]["command"]
        )

    # A warm start that stops short of its max_steps is no warm start: the ladder says so.
    monkeypatch.setenv("FAKE_TUNE_SFT_STEPS", "4")
    short = ["--out", str(tmp_path / "short"), *argv[2:], "--seeds", "0"]
    assert ladder.main(short) == 1
    results = json.loads((tmp_path / "short" / "results.json").read_text())
    assert results["runs"] == {}
    assert "no checkpoint at its max_steps=10" in capsys.readouterr().err


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_ladder_end_to_end_through_the_cli(sft_warm_start: RecipeRun, tmp_path: Path) -> None:
    out = tmp_path / "ladder"
    command = [
        *(sys.executable, str(REPO_ROOT / "tools" / "ladder.py"), "--out", str(out)),
        *("--arms", "a1", "diloco", "--steps", "2", "--seeds", "0", "--eval-every", "2"),
        *("--diloco-sync-every", "2", "--warm-start", str(sft_warm_start.output_dir)),
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[2/2] diloco/seed0: done in" in done.stdout

    runs = json.loads((out / "results.json").read_text())["runs"]
    warm_start_accuracy = series(sft_warm_start.metrics(), "eval/accuracy")[-1][1]
    markdown = (out / "results.md").read_text()
    for key, log_dirs in (
        ("a1/seed0", [out / "runs" / "a1_seed0" / "logs"]),
        ("diloco/seed0", [out / "runs" / "diloco_seed0" / f"replica_{i}" / "logs" for i in (0, 1)]),
    ):
        record = runs[key]
        assert record["status"] == "ok"
        accuracy = record["metrics"][0]["eval/accuracy"]
        assert [step for step, _ in accuracy] == [0, 2]
        # Same weights, same held-out set: the warm start's own last score.
        assert accuracy[0][1] == warm_start_accuracy
        title = ladder_arms.ARMS[key.split("/")[0]].title
        assert f"| {title} | {accuracy[0][1]:.3f} | {accuracy[1][1]:.3f} |" in markdown
        # The policy loss's count of completion tokens, over every step of every replica.
        logged = [value for d in log_dirs for _, value in series(read_metrics(d), "num_tokens")]
        assert len(logged) == 2 * len(log_dirs)
        assert record["generated_tokens"] == pytest.approx(sum(logged), rel=1e-12)
    assert (out / "runs" / "a1_seed0" / "run.log").read_text().startswith("$ ")
    for name in ("accuracy.png", "reward.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_without_sft_the_arms_start_from_their_configs_checkpoint(
    tmp_path: Path, fake_tune: Path, smollm2_dir: Path
) -> None:
    out = tmp_path / "out"
    argv = [
        *("--out", str(out), "--arms", "a1", "--seeds", "0", "--steps", "2"),
        *("--eval-every", "2", "--config", "smollm2", "--sft-config", "none", "--no-plots"),
    ]
    assert ladder.main(argv) == 0
    assert fake_tune.read_text().split() == ["0"]  # no SFT run
    results = json.loads((out / "results.json").read_text())
    assert results["warm_start"]["path"] == str(smollm2_dir)
    command = results["runs"]["a1/seed0"]["command"]
    # The config's own held-out set and task: nothing from an SFT config overrides them.
    assert not [arg for arg in command if arg.startswith(("eval_dataset.", "dataset.", "warm"))]
    smollm2_yaml = yaml.safe_load((REPO_ROOT / "recipes/configs/grpo/smollm2.yaml").read_text())
    assert results["settings"]["heldout"] == smollm2_yaml["eval_dataset"]


def test_combine_merges_ladders_of_other_arms_or_seeds_and_refuses_unequal_ones(
    tmp_path: Path, fake_tune: Path, capsys: pytest.CaptureFixture
) -> None:
    common = [
        *("--seeds", "0", "--steps", "2", "--eval-every", "2"),
        *("--warm-start", str(_hf_warm_start(tmp_path)), "--no-plots"),
    ]
    for arm in ("a2", "a1"):
        assert ladder.main(["--out", str(tmp_path / arm), "--arms", arm, *common]) == 0
    out = tmp_path / "both"
    combine = ["--combine", str(tmp_path / "a2"), str(tmp_path / "a1"), "--out", str(out)]
    assert ladder.main(combine) == 0
    combined = json.loads((out / "results.json").read_text())
    assert combined["settings"]["arms"] == ["a1", "a2"]  # the ladder's order
    assert sorted(combined["runs"]) == ["a1/seed0", "a2/seed0"]
    markdown = (out / "results.md").read_text()
    assert "| A1 GRPO |" in markdown and "| A2 SDPO |" in markdown
    assert (out / "accuracy_vs_tokens.png").read_bytes().startswith(PNG_MAGIC)
    assert fake_tune.read_text().split() == ["0", "0"]  # combining ran nothing

    # Another arm with other seeds combines: the table counts each arm's seeds.
    seeds_1_2 = [*common[2:], "--seeds", "1", "2"]
    assert ladder.main(["--out", str(tmp_path / "a3"), "--arms", "a3", *seeds_1_2]) == 0
    three = tmp_path / "three"
    assert ladder.main(["--combine", str(out), str(tmp_path / "a3"), "--out", str(three)]) == 0
    combined = json.loads((three / "results.json").read_text())
    assert combined["settings"]["seeds"] == [0, 1, 2]
    assert sorted(combined["runs"]) == ["a1/seed0", "a2/seed0", "a3/seed1", "a3/seed2"]
    assert re.search(r"\| A3 [^|]*\|.*\| 2 \|", (three / "results.md").read_text())

    # Seeds of one arm run as separate ladders combine too, when the arm's command is the same.
    a1_seed1, a1_other_lr = tmp_path / "a1_seed1", tmp_path / "a1_other_lr"
    assert ladder.main(["--out", str(a1_seed1), "--arms", "a1", *seeds_1_2[:-1]]) == 0
    both_seeds = tmp_path / "both_seeds"
    assert ladder.main(["--combine", str(out), str(a1_seed1), "--out", str(both_seeds)]) == 0
    combined = json.loads((both_seeds / "results.json").read_text())
    assert combined["settings"]["arms"] == ["a1", "a2"]
    assert sorted(combined["runs"]) == ["a1/seed0", "a1/seed1", "a2/seed0"]
    assert re.search(r"\| A1 [^|]*\|.*\| 2 \|", (both_seeds / "results.md").read_text())
    lr = ["--override", "optimizer.lr=1e-6"]
    assert ladder.main(["--out", str(a1_other_lr), "--arms", "a1", *seeds_1_2[:-1], *lr]) == 0

    other = tmp_path / "other"
    assert ladder.main(["--out", str(other), "--arms", "a3", *common, "--steps", "4"]) == 0
    for parts, reason in (
        ([other, tmp_path / "a1"], "steps 2 differs"),
        ([tmp_path / "a1", tmp_path / "a1"], "runs ['a1/seed0'] are in two of the ladders"),
        ([tmp_path / "a1", a1_other_lr], "arm a1 ran another command than in an earlier folder"),
    ):
        with pytest.raises(SystemExit):
            ladder.main(["--combine", *map(str, parts), "--out", str(tmp_path / "x")])
        assert reason in capsys.readouterr().err


def test_results_with_another_budget_cadence_heldout_set_or_warm_start_do_not_combine() -> None:
    settings = {
        "steps": 8,
        "eval_every": 2,
        "heldout": {"num_samples": 16},
        "seeds": [0],
        "command": "c",
    }
    first = {"settings": {**settings, "arms": ["a1"]}, "warm_start": {"path": "/sft"}, "runs": {}}
    second = {**first, "settings": {**settings, "arms": ["a2"]}}
    assert ladder_report.settings_clash(first, second) is None
    assert ladder_report.combine_results([first, second], [Path("a"), Path("b")])["runs"] == {}
    for key, value in {"steps": 9, "eval_every": 4, "heldout": {"num_samples": 32}}.items():
        other = {**second, "settings": {**second["settings"], key: value}}
        assert ladder_report.settings_clash(first, other) == key
        with pytest.raises(ValueError, match=f"^b: {key} .* differs from a's"):
            ladder_report.combine_results([first, other], [Path("a"), Path("b")])
    other = {**second, "warm_start": {"path": "/elsewhere"}}
    assert ladder_report.settings_clash(first, other) == "warm_start"
    with pytest.raises(ValueError, match="^b: another warm start than a's"):
        ladder_report.combine_results([first, other], [Path("a"), Path("b")])


def test_an_arms_command_leaves_out_only_what_differs_per_seed() -> None:
    def runs(*commands: list[str]) -> dict:
        return {f"x/seed{i}": {"arm": "x", "command": c} for i, c in enumerate(commands)}

    recipe = ["tune", "run", "r.py", "--config", "c", "output_dir=/o/x_seed3", "seed=3", "lr=1"]
    assert ladder_report.arm_command(runs(recipe), "x") == [
        "tune",
        "run",
        "r.py",
        "--config",
        "c",
        "lr=1",
    ]
    peer = ["python", "peer.py", "--steps", "4", "--seed", "2", "--out", "/o", "k=v"]
    assert ladder_report.arm_command(runs(peer), "x") == [
        "python",
        "peer.py",
        "--steps",
        "4",
        "k=v",
    ]
    assert ladder_report.arm_command(runs(peer), "other") is None
