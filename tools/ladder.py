"""The ladder: A1-A4 and DiLoCo from one A0 warm start, equal step budgets, several seeds.

    python tools/ladder.py                                   # the default (see the budget below)
    python tools/ladder.py --steps 40 --seeds 0 1 2 3 4 --eval-every 8 --out runs/ladder_40
    python tools/ladder.py --arms a1 a2 --override optimizer.lr=1e-5 --override a2:sdpo.weight=0.5
    python tools/ladder.py --warm-start outputs/sft_cpu_smoke --steps 4 --seeds 0 --eval-every 2 \
        --diloco-sync-every 2
    python tools/ladder.py --config smollm2 --sft-config none --out runs/ladder_smollm2
    python tools/ladder.py --combine runs/ladder_a1 runs/ladder_a2 --out runs/ladder_a1_a2

One A0 SFT run (``recipes/sft.py``, ``--sft-config``, by default ``cpu_smoke_hints``: the SFT
smoke run that also learnt to read SDPO's hints, which A2, A4 and DiLoCo need) is trained into
``<out>/warm_start`` (or ``--warm-start`` names an existing one: an SFT output folder or a
Hugging Face model folder). With ``--sft-config none`` there is no SFT run: A0 is the pretrained
checkpoint the arms' configs start from (``--config smollm2``: SmolLM2-135M-Instruct), and every
arm keeps its config's own task and held-out set (the ladder checks that they agree).
Every arm then starts from it with the same ``max_steps`` (``--steps``), the same seeds, the
warm start's held-out set and training-task distribution (the SFT config's ``eval_dataset``
section and its ``dataset`` operations/digits, passed to every arm), and a held-out evaluation
every ``--eval-every`` steps. The arms run their own ``cpu_smoke`` configs (``--config``),
sequentially, through the real ``tune run`` console script (DiLoCo: 2 replicas under
``tools/launch_diloco.py``, its ``diloco.sync_every`` set by ``--diloco-sync-every``), with
``OMP_NUM_THREADS=1`` unless ``--omp-threads`` says otherwise. ``--override KEY=VALUE`` goes to
every arm, ``--override ARM:KEY=VALUE`` to one (after the ladder's own overrides, so it wins).

The DiLoCo arm's inner loop is A4's composer loop (all three channels, recipes/diloco.py). Steps
are optimizer steps of one process; a DiLoCo replica takes that many inner steps, so DiLoCo
samples twice the rollouts of a single-process arm (the tokens column shows it).

The results folder holds ``runs/<arm>_seed<k>/`` (the run's console log ``run.log``, its
DiskLogger files, its final checkpoint), ``results.json`` (settings, every metric series of every
run, failures with their log tails; rewritten atomically after each run), ``results.md`` (the
table below), ``accuracy.png`` / ``reward.png`` (mean over seeds with a ±1 std band) and
``accuracy_vs_tokens.png`` (each run's accuracy against its generated tokens); where runs
logged per-channel gradients (``--override log_channel_gradients=true``), results.md adds each
channel's gradient norm before clipping and share of the step, and ``channel_gradients.png``
plots them per step. A failed
run is recorded and the ladder goes on; rerunning with the same ``--out`` skips every completed
run and retries failed ones, resuming from its last checkpoint one that left any (a run killed
out of memory or past --run-timeout loses only the steps since that checkpoint). Arms, or seeds of an arm, can also run as separate ladders side by
side (one ``--out`` each, e.g. one per core) and be combined into one table with ``--combine``
(the same arm's runs must share their command but for ``output_dir`` and ``seed``), as can a
peer's results (``PEER_ARMS``: tools/trl_sdpo_peer.py runs TRL's SDPOTrainer on the smollm2_trl
task).
The table, per arm: held-out accuracy at step 0, at the last evaluation at or before half-way,
and at the final step, as mean ± sample std over seeds, the standard error of the final
accuracy, wall time per run, generated tokens per run (see below) and the number of seeds.

Tokens: every RL recipe logs ``tokens/generated``, the completion tokens it has sampled since
step 0 over all its ranks (kept across a resume), at every logged step. A run's generated tokens
are its last logged value, summed over DiLoCo replicas (each counts its own ranks); an
evaluation's are the value at the last logged step at or before it (exact when the config's
``logging.log_every_n_steps`` divides the evaluation cadence, as in the cpu_smoke and smollm2
configs, which log every step). Prompt tokens, and the DPO pairs of A3/A4, are not in it.

Default budget (--steps 24 --seeds 0 1 2 --eval-every 4 --diloco-sync-every 4: 15 arm-runs),
measured with OMP_NUM_THREADS=1 on a 2-core machine shared with other jobs (load average about
4): one seed of the default, the five arms from an existing warm start (``--seeds 0
--warm-start ...``), took 272 s (A1 32 s, A2 47 s, A3 40 s, A4 45 s, DiLoCo 100 s); the A0 SFT
warm start took 4.3 min inside the ladder at that load (3.4 min at a lighter one; its config
says about 7 min on a heavily shared machine). So the default takes about 3 x 4.5 + 4.3 = 18 min
(about 21 min with the slowest warm start); --warm-start skips the warm start's share.

The library behind this command: ``composer_tune/ladder/`` (``arms``; ``runs``: planning,
running, resuming and recording; ``report``: the tables, plots and ``--combine``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# First on the path, from any working directory: the schemas are read from this repository's
# `recipes` package, not from the broken one torchtune's wheel installs (the import hook of
# composer_tune/recipe_finder.py only answers in the repository root).
sys.path.insert(0, str(REPO_ROOT))

from composer_tune.checkpointing.run_state import MODEL_DIR, checkpoint_dir  # noqa: E402
from composer_tune.config import load_recipe_config  # noqa: E402
from composer_tune.ladder.arms import ABLATION_ARMS, ARMS, DEFAULT_ARMS  # noqa: E402
from composer_tune.ladder.report import (  # noqa: E402
    accuracy_series,
    combine_results,
    require_matplotlib,
    save,
)
from composer_tune.ladder.runs import (  # noqa: E402
    SFT_RECIPE,
    execute,
    heldout_set,
    load_results,
    plan_runs,
    running_record,
    should_skip,
    train_warm_start,
    warm_start_overrides,
    write_json_atomic,
)

NO_SFT = "none"  # --sft-config value: no SFT run, the arms start from their configs' checkpoint


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("runs/ladder"), help="results folder")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=list(ARMS),
        default=DEFAULT_ARMS,
        help="arms to run; the A4 ablations (A4 minus one channel): " + " ".join(ABLATION_ARMS),
    )
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per arm-run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds per arm")
    parser.add_argument(
        "--eval-every", type=int, default=4, help="held-out evaluation every N steps"
    )
    parser.add_argument(
        "--diloco-sync-every",
        type=int,
        default=4,
        help="DiLoCo inner steps per sync (H); must divide --eval-every and --steps",
    )
    parser.add_argument("--config", default="cpu_smoke", help="config of every arm")
    parser.add_argument(
        "--warm-start",
        type=Path,
        help="reuse this A0 warm start (SFT output folder or HF model folder) instead of training",
    )
    parser.add_argument(
        "--sft-config",
        default="cpu_smoke_hints",
        help="config of the A0 SFT run (the default's model can read SDPO's hints); "
        f"'{NO_SFT}': A0 is the checkpoint the arms' configs start from (e.g. --config smollm2), "
        "and their own task and held-out set are used",
    )
    parser.add_argument(
        "--sft-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for the A0 SFT run (repeatable)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="[ARM:]KEY=VALUE",
        help="override for every arm, or for one with ARM: (repeatable; wins over the ladder's)",
    )
    parser.add_argument(
        "--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of every run (default 1)"
    )
    parser.add_argument(
        "--run-timeout", type=float, default=3600.0, help="seconds before a run is stopped"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="run nothing: write --out's table and plots from these ladders' results (the same "
        "settings, different arms, e.g. one ladder per core)",
    )
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be positive")
    if "diloco" in args.arms:
        h = args.diloco_sync_every
        if h < 1 or args.eval_every % h or args.steps % h:
            parser.error(
                f"--diloco-sync-every {h} must divide --eval-every ({args.eval_every}) and "
                f"--steps ({args.steps}): DiLoCo evaluates its global weights at syncs"
            )
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.arms)) != len(args.arms):
        parser.error("--seeds and --arms must not repeat")


def subprocess_env(omp_threads: int) -> dict[str, str]:
    """The runs' environment: this one, this repository first on PYTHONPATH (``tune run``
    appends the working directory to ``sys.path`` after site-packages, where an editable
    install of another checkout would win), OMP_NUM_THREADS pinned, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["OMP_NUM_THREADS"] = str(omp_threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def imported_checkout() -> Path:
    """The checkout this process imported ``composer_tune`` from. An editable install's ``.pth``
    imports it at interpreter start, before this file puts its repository first on the path, so
    another checkout's package (and its config schemas) can win."""
    import composer_tune

    return Path(composer_tune.__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    if imported_checkout() != REPO_ROOT:
        parser.error(
            f"composer_tune was imported from {imported_checkout()}, not from this checkout "
            f"({REPO_ROOT}), so configs would be checked against another version: run with "
            f"PYTHONPATH={REPO_ROOT}"
        )
    plt = None if args.no_plots else require_matplotlib()  # fail before the compute, not after
    if args.combine:
        try:
            parts = [load_results(folder / "results.json") for folder in args.combine]
            combined = combine_results(parts, args.combine)
        except ValueError as err:
            parser.error(str(err))
        args.out.mkdir(parents=True, exist_ok=True)
        save(combined, args.out, plt)
        print(f"results: {args.out / 'results.md'}", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    env = subprocess_env(args.omp_threads)
    # Everything that can be refused is checked before any compute: the warm start, the
    # overrides, equal held-out sets, and earlier runs in --out made with other settings.
    try:
        results = load_results(results_path)
        sft_cfg = None
        if args.sft_config != NO_SFT:
            sft_cfg = load_recipe_config(REPO_ROOT / SFT_RECIPE, args.sft_config, args.sft_override)
        if args.warm_start is not None:
            warm_start = args.warm_start.resolve()
            warm_start_args = warm_start_overrides(warm_start)
        elif sft_cfg is None:  # the arms' configs name their checkpoint
            warm_start, warm_start_args = None, []
        else:
            warm_start = (args.out / "warm_start").resolve()
            final = checkpoint_dir(warm_start, sft_cfg.max_steps) / MODEL_DIR  # once trained
            warm_start_args = ["warm_start=null", f"checkpoint.initial_checkpoint={final}"]
        runs = plan_runs(args, warm_start_args, sft_cfg)
        if warm_start is None:
            warm_start = runs[0].resolved_config().checkpoint.initial_checkpoint
        heldout = heldout_set(runs)
        pending = [run for run in runs if not should_skip(results["runs"].get(run.key), run)]
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    results["settings"] = {
        "command": shlex.join(
            ["python", "tools/ladder.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "arms": args.arms,
        "seeds": args.seeds,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "heldout": heldout,
    }
    results.setdefault("warm_start", {"path": str(warm_start)})
    if pending and args.warm_start is None and sft_cfg is not None:
        try:
            train_warm_start(args, warm_start, sft_cfg.max_steps, results, env)
        except RuntimeError as err:
            write_json_atomic(results_path, results)
            print(f"error: {err}", file=sys.stderr)
            return 1
    failures = 0
    for index, run in enumerate(runs, start=1):
        progress = f"[{index}/{len(runs)}] {run.key}"
        if run not in pending:
            print(f"{progress}: completed earlier, skipped", flush=True)
            continue
        print(f"{progress}: {run.arm.title} ...", flush=True)
        previous = results["runs"].get(run.key)
        results["runs"][run.key] = running_record(run, previous)
        write_json_atomic(results_path, results)
        record = execute(run, env, args.run_timeout, previous)
        results["runs"][run.key] = record
        save(results, args.out, plt)
        if record["status"] == "ok":
            accuracy = accuracy_series(record)
            change = f"{accuracy[0][1]:.3f} -> {accuracy[-1][1]:.3f}" if accuracy else "not logged"
            print(f"{progress}: done in {record['wall_s']:.0f} s, held-out accuracy {change}")
        else:
            failures += 1
            print(f"{progress}: FAILED (exit {record['returncode']}), log {record['log']}")
    save(results, args.out, plt)
    print(f"results: {args.out / 'results.md'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
