"""TRL 1.16's own SDPOTrainer beside ``recipes/sdpo.py --config smollm2_trl``: its held-out curve.

    python tools/trl_sdpo_peer.py --steps 40 --eval-every 20 --seed 0 --out runs/trl_sdpo_peer
    python tools/ladder.py --config smollm2_trl --sft-config none --arms a2 --steps 40 \\
        --eval-every 20 --seeds 0 --out runs/ladder_smollm2_a2
    python tools/ladder.py --combine runs/ladder_smollm2_a2 runs/trl_sdpo_peer \\
        --out docs/ladder_smollm2_trl_peer
    python tools/trl_sdpo_peer.py --steps 2 --eval-every 1 --out /tmp/peer \\
        num_prompts_per_generation=2 group_size=4 eval_dataset.num_samples=8   # a smoke run

What it runs: ``trl.experimental.sdpo.SDPOTrainer`` (the project's ``bench`` extra: ``pip
install -e '.[bench]'``), its ``train()`` unchanged, on the project config
``recipes/configs/sdpo/smollm2_trl.yaml`` loaded with the project's own loader (``key=value``
arguments override it as in ``tune run``). The held-out accuracy is the recipes' own greedy
evaluation (``composer_tune.run.loop.evaluate_generation``: the config's ``eval_dataset``,
``eval_reward``, ``eval_batch_size``, ``eval_max_new_tokens``), run on the project's decoder
holding a copy of TRL's weights, at step 0, every ``--eval-every`` steps and at the end. Its
metrics go to a DiskLogger log, as a recipe writes them (``eval/accuracy``, ``reward/mean``,
``tokens/generated``: the completion tokens TRL sampled so far, counted from the completion mask
TRL hands its ``on_teacher_context_built`` callback, end-of-turn token included as the recipes
count it; plus TRL's own logged metrics under their names), and the run goes into
``<out>/results.json`` in the ladder's format as arm ``trl_sdpo`` (``composer_tune/ladder/arms.py``'s
PEER_ARMS), so ``ladder.py --combine`` puts it beside the ladder's arms (the ladder must have run
the same ``--steps``, ``--eval-every`` and held-out set, from the same checkpoint: with
``--sft-config none``). The run's files: ``<out>/runs/trl_sdpo_seed<k>/`` (``logs/``, the
resolved project config, TRL's output_dir ``trl/``); another ``--seed`` into the same ``--out``
adds a run.

TRL's defaults kept (SDPOConfig; the config's header maps each to the project's setting):
distillation_weight 1.0 (distillation only: TRL computes no policy loss), distillation_mode
sampled_token, distillation_alpha 1.0, distillation_is_clip 2.0, teacher_model_kind ema with
teacher_update_rate 0.05 and teacher_sync_steps 1, use_successful_as_teacher (another group
member's reply with reward >= success_reward_threshold 1.0, dont_reprompt_on_self_success),
include_environment_feedback off, its reprompt/solution templates, max_prompt_length 512,
max_reprompt_len 10240, top_p 1, top_k 0, optim adamw_torch_fused, beta 0. ``sdpo.*`` and
``loss.*`` overrides are refused: they would not reach TRL.

Matched to the project config (read from it, so overrides follow): the model and tokenizer
(``checkpoint.initial_checkpoint``, loaded by TRL from the path, in ``dtype``); the prompts, in
the recipe's own order (its ``PromptTask`` sampler from ``seed``, fed to TRL with
shuffle_dataset off, where TRL's default shuffles with its own permutation); the reward
(``reward`` as a TRL reward function); the batch (``num_prompts_per_generation`` x
``group_size`` rows per generation: TRL's ``num_generations`` = group_size and
``generation_batch_size`` = rows, cut into ``steps_per_generation`` optimiser steps,
``num_iterations`` passes, no gradient accumulation: with the config, 8 x 8 = 64 rows in one
step); ``max_new_tokens`` (max_completion_length), ``temperature``; the optimiser
(``optimizer.lr``, ``betas``, ``weight_decay``, ``eps``: TRL's default adam_beta2 0.999 becomes
the config's 0.99) at a constant rate (``lr_scheduler: null``; TRL's default decays linearly);
``clip_grad_norm`` (max_grad_norm); ``seed`` (``--seed``), ``max_steps`` (``--steps``);
precision (bf16 only where the config's ``autocast`` resolves to it: TRL's own default turns
bf16 on, and a SmolLM2 step under bf16 autocast ran ~7x slower on a CPU without native bf16,
``composer_tune.models.build.native_bf16``); gradient checkpointing as the config's
``enable_activation_checkpointing`` (off; TRL's default is on: speed only, same numbers).

Not matched (cannot be): the random streams (TRL seeds torch and samples with transformers'
``generate``; the recipe samples with its own generator), so the two runs see different
completions of the same prompts; prompt rendering (TRL: the tokenizer's Jinja template; the
recipe: its own renderer; the tool checks the token ids agree and prints it) and the teacher's
prompt (TRL puts the reprompt text in the user turn with its spacing, the recipe its templates,
the same words); padding (TRL left-pads prompts, the recipe packs right-padded rows) and the
log-prob path, so the losses agree only up to float rounding; the importance-sampling clip
(TRL computes old log-probs only when a generation batch spans several optimiser steps: with
the config's one step per generation it never clips, the recipe's ratio is 1 on-policy too);
the teacher-length cap (the recipe drops teacher rows over ``max_seq_len`` 256 tokens, TRL
truncates at 10240: neither is reached at 24 new tokens); and the wall time (TRL's
Trainer/accelerate overhead and the tool's weight copy before each evaluation are in it).

Cost: one step of the config (64 rows of at most 24 tokens) took 134 s with one thread on a
2-core machine shared with another job (cProfile: transformers' generate 34 s, the student and
teacher forwards 58 s, backward 41 s, AdamW and the EMA update under 2 s), so 40 steps with
three evaluations of 128 problems take about 1.5 h; the project's A2 runs of the smollm2 config
took 1781 s each for 40 steps with one thread too (docs/ladder_smollm2, evaluations included).
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/trl_sdpo_peer.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torchtune import training  # noqa: E402

from bench.bench_grpo_vs_trl import trl_prompt_ids  # noqa: E402
from composer_tune import config  # noqa: E402
from composer_tune.checkpointing.hf_checkpoint import hf_to_decoder_state_dict  # noqa: E402
from composer_tune.distributed import setup_distributed  # noqa: E402
from composer_tune.ladder.arms import PEER_ARMS  # noqa: E402
from composer_tune.ladder.report import save, settings_clash  # noqa: E402
from composer_tune.ladder.runs import (  # noqa: E402
    PlannedRun,
    collect_metrics,
    generated_tokens,
    load_results,
)
from composer_tune.models.build import resolve_autocast  # noqa: E402
from composer_tune.rewards.functions import RewardFunctions, ScoringBatch  # noqa: E402
from composer_tune.rollout import encode_prompts  # noqa: E402
from composer_tune.run.loop import (  # noqa: E402
    MetricLog,
    PromptTask,
    build_guard,
    build_model,
    check_rl_batch_layout,
    epoch_batches,
    evaluate_generation,
    print_accuracy_summary,
    steps_per_generation_batch,
)
from composer_tune.run.state import RunProgress  # noqa: E402

ARM = "trl_sdpo"
RECIPE = REPO_ROOT / "recipes" / "sdpo.py"
CONFIG = "smollm2_trl"
# Config sections the peer cannot pass on: TRL's SDPO defaults stand in for them.
REFUSED_OVERRIDES = ("sdpo.", "loss.", "sdpo=", "loss=")
# TRL's logged names -> the recipes' names for the same quantity (both are logged).
RECIPE_NAMES = {
    "self_distillation/reward_mean": "reward/mean",
    "completions/mean_length": "completion_length/mean",
    "learning_rate": "lr",
}
TRL_VERSION = "1.16."  # the release whose SDPOConfig defaults the module doc lists
MISSING_TRL = (
    "TRL is not installed (this tool runs trl.experimental.sdpo.SDPOTrainer, TRL 1.16): "
    "pip install -e '.[bench]'"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the config's 40)")
    parser.add_argument(
        "--eval-every",
        type=int,
        help="held-out evaluation every N steps (default: the config's 20)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/trl_sdpo_peer"), help="results folder"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (default 1, as the ladder)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help=f"overrides of recipes/configs/sdpo/{CONFIG}.yaml (not sdpo.* or loss.*)",
    )
    return parser


def load_peer_config(args: argparse.Namespace, run_dir: Path) -> DictConfig:
    """The project config with the overrides, then the command line's own settings.

    Raises:
        ValueError: naming an override the peer cannot pass on, or a config it cannot map.
    """
    refused = [o for o in args.overrides if o.startswith(REFUSED_OVERRIDES)]
    if refused:
        raise ValueError(
            f"{' '.join(refused)}: the peer keeps TRL's SDPO defaults (see --help); "
            "sdpo.* and loss.* overrides would not reach it"
        )
    settings = [f"output_dir={run_dir}", f"seed={args.seed}", "logging.progress_bar=false"]
    if args.steps is not None:
        settings.append(f"max_steps={args.steps}")
    if args.eval_every is not None:
        settings.append(f"eval_every_n_steps={args.eval_every}")
    cfg = config.load_recipe_config(RECIPE, CONFIG, [*args.overrides, *settings])
    if cfg.warm_start is not None:
        raise ValueError("warm_start: the peer starts from checkpoint.initial_checkpoint only")
    if cfg.optimizer._component_ != "torch.optim.AdamW" or cfg.lr_scheduler is not None:
        raise ValueError("the peer maps optimizer torch.optim.AdamW with lr_scheduler null only")
    if cfg.max_steps < 1 or cfg.eval_every_n_steps < 1:
        raise ValueError("--steps and --eval-every must be positive")
    return cfg


def reward_function(reward: RewardFunctions) -> Callable[..., list[float]]:
    """The run's ``reward`` as a TRL reward function: TRL passes the completions as chat
    messages and every other dataset column as a list (the samples' fields, rebuilt here)."""

    def score(
        prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **columns: Any
    ) -> list[float]:
        columns.pop("trainer_state", None)
        samples = [
            {"prompt": prompt, **{name: values[i] for name, values in columns.items()}}
            for i, prompt in enumerate(prompts)
        ]
        texts = [completion[-1]["content"] for completion in completions]
        return [r.score for r in reward.score(ScoringBatch(samples, texts, completion_ids))]

    score.__name__ = "_".join(reward.names)  # TRL's metric name for it
    return score


def trl_config(cfg: DictConfig, run_dir: Path) -> Any:
    """SDPOConfig: TRL's defaults, with the settings the module doc lists taken from ``cfg``."""
    from trl.experimental.sdpo import SDPOConfig

    rows = cfg.num_prompts_per_generation * cfg.group_size
    betas = cfg.optimizer.get("betas", [0.9, 0.999])
    return SDPOConfig(
        output_dir=str(run_dir / "trl"),
        seed=cfg.seed,
        use_cpu=cfg.device == "cpu",
        model_init_kwargs={"dtype": training.get_dtype(cfg.dtype)},
        per_device_train_batch_size=rows // cfg.steps_per_generation,
        steps_per_generation=cfg.steps_per_generation,
        num_iterations=cfg.num_iterations,
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature,
        chat_template_kwargs={} if cfg.enable_thinking else {"enable_thinking": False},
        learning_rate=cfg.optimizer.lr,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        weight_decay=cfg.optimizer.get("weight_decay", 0.01),  # torch's AdamW defaults
        adam_epsilon=cfg.optimizer.get("eps", 1e-8),
        lr_scheduler_type="constant",
        max_grad_norm=cfg.clip_grad_norm or 0.0,
        bf16=resolve_autocast(cfg.autocast, cfg.device) == "bf16",
        gradient_checkpointing=cfg.enable_activation_checkpointing,
        shuffle_dataset=False,
        max_steps=cfg.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


class PeerRun:
    """The project's side of the run: its prompts, reward, held-out set and greedy evaluation,
    its metric log and token counts; ``callback()`` hooks them into TRL's training loop."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.dist = setup_distributed(cfg.device)
        check_rl_batch_layout(cfg, self.dist)
        self.task = PromptTask.from_config(cfg, self.dist)
        self.progress = RunProgress(guard=build_guard(cfg, self.dist))
        self.tokenizer = config.instantiate(cfg.tokenizer)
        # The recipe's policy as it starts: each evaluation loads TRL's weights into it.
        self.eval_model = build_model(
            cfg, self.dist, cfg.checkpoint.initial_checkpoint, trainable=False
        )
        self.metric_log = MetricLog(cfg, self.dist, self.progress)
        self.trl_model: Any = None
        self.sampled = 0.0  # completion tokens since the last logged step
        self.step_seconds: list[float] = []
        self.evaluated_at: int | None = None
        self.last_result: Any = None

    def prompts(self) -> list[dict[str, Any]]:
        """The samples the recipe would take over the run, in its order (its sampler)."""
        batches = -(-self.cfg.max_steps // steps_per_generation_batch(self.cfg))
        # Its own progress: the sampler's data position is not the run's step.
        position = RunProgress(guard=self.progress.guard)
        loader = epoch_batches(self.task.loader, self.task.sampler, position)
        return [sample for batch in itertools.islice(loader, batches) for sample in batch]

    def evaluate(self) -> Any:
        """The recipes' greedy held-out evaluation of TRL's current weights, logged at the
        current step."""
        state = hf_to_decoder_state_dict(self.trl_model.state_dict(), self.eval_model.config)
        self.eval_model.load_state_dict(state)
        self.evaluated_at = self.progress.step
        self.last_result = evaluate_generation(
            self.cfg, self.dist, self.eval_model, self.tokenizer, self.task.eval_dataset,
            self.task.eval_reward, self.metric_log, where=f"step {self.progress.step}",
        )  # fmt: skip
        return self.last_result

    def step_logged(self, step: int, logs: dict[str, Any]) -> None:
        """TRL logged optimizer step ``step``: its metrics (and the recipes' names for them)
        with the cumulative generated tokens; then the evaluation, when due."""
        self.progress.step = step
        self.progress.count_tokens({"generated": self.sampled}, self.dist)
        self.sampled = 0.0
        numbers = {
            name: float(value)
            for name, value in logs.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        aliases = {
            ours: numbers[theirs] for theirs, ours in RECIPE_NAMES.items() if theirs in numbers
        }
        self.metric_log.log({**numbers, **aliases, **self.progress.token_metrics()})
        print(f"[step {step}] {self.step_seconds[-1]:.1f} s", flush=True)
        if step % self.cfg.eval_every_n_steps == 0 or step == self.cfg.max_steps:
            self.evaluate()

    def callback(self) -> Any:
        from transformers import TrainerCallback

        run = self

        class PeerCallback(TrainerCallback):
            def on_step_begin(self, *_: Any, **__: Any) -> None:
                self.start = time.perf_counter()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                run.step_seconds.append(time.perf_counter() - self.start)

            # SDPOTrainer's own event, once per generation batch, with its completion mask.
            def on_teacher_context_built(self, completion_mask: torch.Tensor, **_: Any) -> None:
                run.sampled += float(completion_mask.sum())

            def on_log(self, args: Any, state: Any, control: Any, logs: dict, **_: Any) -> None:
                if "train_runtime" not in logs:  # not train()'s closing summary
                    run.step_logged(state.global_step, logs)

        return PeerCallback()

    def close(self) -> None:
        self.metric_log.close()


def results_of(
    out: Path, cfg: DictConfig, argv: Sequence[str], record: dict[str, Any] | None
) -> dict[str, Any]:
    """``<out>/results.json`` with this run's ``record`` added (a ladder's results: one arm,
    the settings --combine compares; earlier seeds in ``out`` kept).

    Raises:
        ValueError: when ``out`` holds runs made with other settings.
    """
    settings = {
        "command": shlex.join(["python", "tools/trl_sdpo_peer.py", *argv]),
        "arms": [ARM],
        "seeds": [cfg.seed],
        "steps": cfg.max_steps,
        "eval_every": cfg.eval_every_n_steps,
        "heldout": OmegaConf.to_container(cfg.eval_dataset, resolve=True),
    }
    warm_start = {"path": str(cfg.checkpoint.initial_checkpoint)}
    results = load_results(out / "results.json")
    if results["runs"]:
        earlier = results["settings"]
        clash = settings_clash(results, {"settings": settings, "warm_start": warm_start})
        if clash == "warm_start":
            raise ValueError(f"{out} holds runs from another checkpoint: use another --out")
        if clash:
            raise ValueError(
                f"{out} holds runs with {clash} {earlier[clash]}, not {settings[clash]}: "
                "use another --out for these settings"
            )
        settings["seeds"] = sorted({*earlier["seeds"], cfg.seed})
        if settings["command"] not in earlier["command"].split("` and `"):
            settings["command"] = f"{earlier['command']}` and `{settings['command']}"
    results["settings"], results["warm_start"] = settings, warm_start
    if record is not None:
        results["runs"][f"{ARM}/seed{cfg.seed}"] = record
    return results


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    try:
        from trl.experimental.sdpo import SDPOTrainer
    except ImportError:
        print(f"error: {MISSING_TRL}", file=sys.stderr)
        return 2
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    if not trl.__version__.startswith(TRL_VERSION):
        print(f"warning: TRL {trl.__version__}; this peer maps TRL {TRL_VERSION}'s SDPOConfig")

    run_dir = (args.out / "runs" / f"{ARM}_seed{args.seed}").resolve()
    with config.setup_errors_as_one_line():
        cfg = load_peer_config(args, run_dir)
        results_of(args.out, cfg, argv, None)  # refuses a clashing --out before any compute
        if run_dir.exists():  # an earlier run of this seed: its logs would mix in
            shutil.rmtree(run_dir)
        peer = PeerRun(cfg)
    samples = peer.prompts()
    checkpoint = Path(cfg.checkpoint.initial_checkpoint)
    thinking = None if cfg.enable_thinking else False
    same_prompts = encode_prompts(
        peer.tokenizer, samples, enable_thinking=cfg.enable_thinking
    ) == trl_prompt_ids(AutoTokenizer.from_pretrained(checkpoint), samples, thinking)
    print(f"prompt token ids identical (project renderer vs TRL's chat template): {same_prompts}")
    trainer = SDPOTrainer(
        model=str(checkpoint),
        reward_funcs=reward_function(peer.task.reward),
        args=trl_config(cfg, run_dir),
        train_dataset=Dataset.from_list(samples),
        callbacks=[peer.callback()],
    )
    same_stops = sorted(trainer.eos_token_ids) == sorted(peer.tokenizer.stop_tokens)
    print(f"stop token ids identical (project tokenizer vs TRL's generation): {same_stops}")
    peer.trl_model = trainer.accelerator.unwrap_model(trainer.model)
    peer.progress.record_before(peer.evaluate())
    trainer.train()
    if peer.evaluated_at != cfg.max_steps:  # train() ended early
        peer.evaluate()
    print_accuracy_summary(peer.progress, peer.last_result, peer.dist)
    peer.close()
    median = statistics.median(peer.step_seconds) if peer.step_seconds else None
    if median is not None:
        print(
            f"median optimizer step: {median:.1f} s ({args.threads} thread(s), evaluations apart)"
        )
    planned = PlannedRun(PEER_ARMS[ARM], cfg.seed, run_dir, list(argv), CONFIG)
    metrics = collect_metrics(planned)
    record = {
        "arm": ARM,
        "seed": cfg.seed,
        "command": [sys.executable, str(Path(__file__).resolve()), *argv],
        "returncode": 0,
        "wall_s": time.perf_counter() - start,
        "log": str(run_dir / "logs"),
        "metrics": metrics,
        "generated_tokens": generated_tokens(metrics),
        "status": "ok",
        "trl_version": trl.__version__,
        "threads": args.threads,
        "step_s_median": median,
        "same_prompt_ids": same_prompts,
        "same_stop_ids": same_stops,
    }
    with config.setup_errors_as_one_line():
        results = results_of(args.out, cfg, argv, record)
    args.out.mkdir(parents=True, exist_ok=True)
    save(results, args.out, None)
    print(f"results: {args.out / 'results.json'} ({args.out / 'results.md'})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
