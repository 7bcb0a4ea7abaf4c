"""One GRPO step of composer-tune (recipes/grpo.py) against TRL's GRPOTrainer, same work.

    .venv/bin/python bench/bench_grpo_vs_trl.py                       # tiny model, CPU
    .venv/bin/python bench/bench_grpo_vs_trl.py --model-size qwen3-0.6b-4l --device cuda

A step is the whole of one generation batch with one optimiser step on it: sample G completions
per prompt, score them, log-prob forward, loss, backward, clip, AdamW step. Both frameworks get
the same random Qwen3 (saved with ``save_hf_checkpoint``; TRL loads it with AutoModelForCausalLM), the
same prompts in the same order (synthetic arithmetic, chat-templated by each side's own template
code; the bench checks the token ids agree), the same reward (``MathAnswerReward``), group size,
completion cap, temperature, objective (grpo, beta=0, epsilon 0.2, group reward scaling), AdamW
hyper-parameters, gradient clipping and thread count.

composer-tune's step is ``GRPORecipe`` itself, built from the cpu_smoke config with overrides,
driven one generation batch at a time through the same methods its ``train()`` loop calls
(``_rollout`` -> ``group_advantages`` -> ``_optimizer_step``). TRL's step is one optimiser step of
``trainer.train()``, timed by a callback from ``on_step_begin`` (before TRL generates) to
``on_step_end`` (after its optimiser step). Timing runs both in ONE process, alternating
TRL step / composer-tune step (ABAB...), so load from other processes hits both alike; peak
memory runs each framework alone in a fresh subprocess (growth of the peak resident set,
VmHWM, over the post-import baseline on CPU; ``torch.cuda.max_memory_allocated`` on GPU).
Settings that cannot be made equal are printed under "not equal". ``--profile`` adds a
``torch.profiler`` table of the most expensive operators of each framework's last step.
"""

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/bench_grpo_vs_trl.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from composer_tune.channels.policy import group_advantages  # noqa: E402
from composer_tune.checkpointing import save_hf_checkpoint  # noqa: E402
from composer_tune.data.synthetic import SyntheticArithmetic  # noqa: E402
from composer_tune.data.tokenizer import ChatTokenizer  # noqa: E402
from composer_tune.models import qwen3_tiny  # noqa: E402
from composer_tune.rewards import MathAnswerReward  # noqa: E402

TOKENIZER_DIR = REPO_ROOT / "tests" / "assets" / "tokenizer"
# qwen3_tiny keyword arguments. The vocabulary is the committed test tokenizer's (994 ids) for
# both sizes: a random model over Qwen3's real 151,936 ids would sample ids that tokenizer
# cannot decode. "qwen3-0.6b-4l" is Qwen3-0.6B's layer shape with 4 of its 28 layers.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {  # recipes/configs/grpo/cpu_smoke.yaml's model (longer max_seq_len)
        "vocab_size": 994,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 128,
        "intermediate_dim": 384,
        "head_dim": 32,
        "max_seq_len": 512,
    },
    "qwen3-0.6b-4l": {
        "vocab_size": 994,
        "num_layers": 4,
        "num_heads": 16,
        "num_kv_heads": 8,
        "embed_dim": 1024,
        "intermediate_dim": 3072,
        "head_dim": 128,
        "max_seq_len": 1024,
    },
}
NOT_EQUAL = [
    "generation: TRL calls transformers' generate (HF KV cache, its sampling processors); "
    "composer-tune its own KV-cache generate. Same distribution, different random streams, "
    "so completion lengths can differ (both printed).",
    "padding: TRL left-pads prompts and right-pads completions in the training forward "
    "(attention mask); composer-tune packs prompt+completion right-padded, no mask needed.",
    "log-prob head: TRL asks transformers for fused_lm_head log-probs of the completion "
    "tokens; composer-tune uses its chunked logprob_head (chunk 1024 rows).",
    "chat template: TRL renders prompts with the tokenizer's Jinja template, composer-tune "
    "with its own renderer; the bench checks that the token ids are identical.",
    "framework overhead: TRL's step includes Trainer/accelerate bookkeeping and its metric "
    "gathering; composer-tune's includes the recipe's metric reduction.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per generation batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per framework")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per framework")
    # One thread by default: on a shared machine, OpenMP workers waiting on each other swamp
    # a tiny model's small kernels.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-memory", action="store_true", help="no peak-memory subprocesses")
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler table of each side's last step"
    )
    parser.add_argument("--worker", choices=["composer", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.group_size < 2:
        parser.error("--group-size must be >= 2 (GRPO advantages need a group)")
    if min(args.prompts, args.max_new_tokens, args.repeats) < 1 or args.warmup < 0:
        parser.error("--prompts, --max-new-tokens, --repeats must be >= 1, --warmup >= 0")
    return args


# ----------------------------------------------------------------------------- shared inputs


def save_model(args: argparse.Namespace, directory: Path) -> None:
    """A random Qwen3 of ``--model-size`` with the test tokenizer, as a Hugging Face directory."""
    torch.manual_seed(args.seed)
    model = qwen3_tiny(**MODEL_SIZES[args.model_size])
    tokenizer = ChatTokenizer.from_dir(TOKENIZER_DIR)
    save_hf_checkpoint(
        model.state_dict(),
        model.config,
        directory,
        copy_files_from=TOKENIZER_DIR,
        # TRL stops on the generation config's eos ids: the same ones composer-tune stops on.
        generation_config={"eos_token_id": tokenizer.stop_tokens, "pad_token_id": tokenizer.pad_id},
    )


def prompt_samples(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts of every step, in order: ``--prompts`` consecutive samples per step."""
    steps = args.warmup + args.repeats
    dataset = SyntheticArithmetic(split="train", num_samples=args.prompts * steps, seed=args.seed)
    return [dataset[index] for index in range(len(dataset))]


def step_batches(args: argparse.Namespace, samples: list[dict[str, Any]]) -> list[list[dict]]:
    """``samples`` cut into the per-step prompt batches, in TRL's (unshuffled) order."""
    return [samples[i : i + args.prompts] for i in range(0, len(samples), args.prompts)]


# ----------------------------------------------------------------------------- timing


PHASES = ("generation", "reward", "old log-prob pass", "train log-prob forward", "other")
OTHER_PHASE = "advantages, loss, backward, clip, AdamW step, framework bookkeeping"


class PhaseClock:
    """Wall time of one framework's steps, split into phases by timing wrapped functions.

    ``wrap`` returns a timed version of a function; the time of each call goes to its phase
    (a name, or a callable choosing the name at call time) within the current step. The rest
    of the step's time is "other".
    """

    def __init__(self, profile_step: int | None = None) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.start = 0.0
        # Index of a step to run under torch.profiler; its operator table lands in .profile.
        self.profile_step = profile_step
        self.profiler: torch.profiler.profile | None = None
        self.profile = ""

    def wrap(self, phase: str | Callable[[], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            _synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _synchronize()
                name = phase() if callable(phase) else phase
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start

        return timed

    def begin(self) -> None:
        if len(self.steps) == self.profile_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        _synchronize()
        self.current = {}
        self.start = time.perf_counter()

    def end(self) -> None:
        _synchronize()
        total = time.perf_counter() - self.start
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            self.profile = self.profiler.key_averages().table(sort_by=sort, row_limit=15)
            self.profiler = None
        self.current["other"] = total - sum(self.current.values())
        self.current["total"] = total
        self.steps.append(self.current)

    def median(self, phase: str, skip: int) -> float:
        """Median over the steps after the first ``skip`` of one phase (0 where absent)."""
        return statistics.median(step.get(phase, 0.0) for step in self.steps[skip:])


# ----------------------------------------------------------------------------- composer-tune


class ComposerStep:
    """``recipes/grpo.py``'s GRPORecipe, one generation batch (= one optimiser step) per call."""

    def __init__(self, args: argparse.Namespace, checkpoint: Path, output_dir: Path) -> None:
        from composer_tune import config
        from recipes.grpo import GRPOConfig, GRPORecipe

        rows = args.prompts * args.group_size
        overrides = [
            f"output_dir={output_dir}",
            f"seed={args.seed}",
            f"device={args.device}",
            "dtype=fp32",
            "warm_start=null",
            f"checkpoint.initial_checkpoint={checkpoint}",
            f"tokenizer.path={checkpoint}",
            *(f"model.{key}={value}" for key, value in MODEL_SIZES[args.model_size].items()),
            f"num_prompts_per_generation={args.prompts}",
            f"group_size={args.group_size}",
            f"max_new_tokens={args.max_new_tokens}",
            f"temperature={args.temperature}",
            "steps_per_generation=1",
            "num_iterations=1",
            f"micro_batch_size={rows}",  # TRL's per_device_train_batch_size: one forward
            "loss.objective=grpo",
            "loss.beta=0.0",
            "loss.epsilon_low=0.2",
            "loss.epsilon_high=0.2",
            "loss.scale_rewards=group",
            f"optimizer.lr={args.lr}",
            "optimizer.betas=[0.9,0.99]",
            "optimizer.weight_decay=0.0",
            # Cosine over max_steps without warm-up, as TRL's below (cpu_smoke's lr is constant).
            "lr_scheduler._component_=torchtune.training.lr_schedulers."
            "get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps=0",
            "clip_grad_norm=1.0",
            "enable_thinking=false",
            "logging.progress_bar=false",
            f"max_steps={args.warmup + args.repeats}",
            # The recipe's own dataset is never read (the bench feeds the prompts): keep it small.
            f"dataset.num_samples={args.prompts}",
        ]
        cfg = config.load_config(
            "cpu_smoke",
            overrides,
            recipe_file=REPO_ROOT / "recipes" / "grpo.py",
            schema=GRPOConfig,
        )
        self.recipe = GRPORecipe(cfg)
        self.recipe.setup()
        self.completion_tokens: list[float] = []

    def __call__(self, samples: list[dict[str, Any]]) -> None:
        # GRPORecipe.train()'s loop body with steps_per_generation = num_iterations = 1.
        recipe = self.recipe
        rollout = recipe._rollout(samples)
        advantages = (
            group_advantages(rollout, recipe.loss_cfg, recipe.cfg.group_size, recipe.dist)
            * recipe.cfg.advantage_sign
        )
        recipe._optimizer_step(rollout, advantages, on_policy=True)
        recipe.step += 1
        self.completion_tokens.append(float(rollout.completion_lengths.float().mean()))


# ----------------------------------------------------------------------------- TRL


def build_trl_trainer(
    args: argparse.Namespace,
    checkpoint: Path,
    samples: list[dict[str, Any]],
    output_dir: Path,
    callbacks: list[Any],
) -> Any:
    """A ``trl.GRPOTrainer`` set to do composer-tune's step (see the module doc)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    reward = MathAnswerReward()

    def math_answer_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [completion[-1]["content"] for completion in completions]
        return [r.score for r in reward(texts, [{"answer": a} for a in answer])]

    trl_config = GRPOConfig(
        output_dir=str(output_dir),
        seed=args.seed,
        use_cpu=args.device == "cpu",
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        steps_per_generation=1,
        num_iterations=1,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        optim="adamw_torch",
        lr_scheduler_type="cosine",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        use_vllm=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        chat_template_kwargs={"enable_thinking": False},
        max_steps=args.warmup + args.repeats,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": s["prompt"], "answer": s["answer"]} for s in samples])
    return GRPOTrainer(
        model=model,
        reward_funcs=math_answer_reward,
        args=trl_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def trl_step_callback(clock: PhaseClock, after_step: Callable[[], None] | None = None) -> Any:
    """A TrainerCallback clocking each TRL optimiser step (``on_step_begin``, before TRL
    generates, to ``on_step_end``, after its AdamW step), then calling ``after_step()`` outside
    the clocked window. Set ``.trainer`` to also record TRL's mean completion length per step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.lengths: list[float] = []  # mean completion tokens per step
            self.trainer: Any = None

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            clock.begin()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.end()
            if self.trainer is not None:  # TRL keeps per-step metrics until it logs
                self.lengths.append(self.trainer._metrics["train"]["completions/mean_length"][-1])
            if after_step is not None:
                after_step()

    return StepClock()


def clock_trl_phases(trainer: Any, clock: PhaseClock) -> None:
    """Time TRL's generation, reward and log-prob forwards (no grad: old log-probs)."""
    trainer._generate_single_turn = clock.wrap("generation", trainer._generate_single_turn)
    trainer._calculate_rewards = clock.wrap("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = clock.wrap(
        lambda: "train log-prob forward" if torch.is_grad_enabled() else "old log-prob pass",
        trainer._get_per_token_logps_and_entropies,
    )


def clock_composer_phases(step: ComposerStep, clock: PhaseClock) -> None:
    """Time the recipe's generation, reward and log-prob forwards, at the names it calls."""
    import recipes.grpo
    from composer_tune.rollout import rollouts

    rollouts.generate = clock.wrap("generation", rollouts.generate)
    rollouts._batched_logprobs = clock.wrap("old log-prob pass", rollouts._batched_logprobs)
    recipes.grpo.sequence_logprobs = clock.wrap(
        "train log-prob forward", recipes.grpo.sequence_logprobs
    )
    step.recipe.reward = clock.wrap("reward", step.recipe.reward)


def trl_prompt_ids(checkpoint: Path, samples: list[dict[str, Any]]) -> list[list[int]]:
    """The prompt ids TRL generates from: the Jinja chat template with thinking off."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [
        tokenizer.apply_chat_template(
            s["prompt"],
            add_generation_prompt=True,
            enable_thinking=False,
            tokenize=True,
            return_dict=False,
        )
        for s in samples
    ]


# ----------------------------------------------------------------------------- measurement


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _proc_status_mib(field: str) -> float:
    """A memory field of /proc/self/status (``VmRSS``: resident now, ``VmHWM``: its peak).

    ``VmHWM`` belongs to this process's own address space; ``getrusage``'s ``ru_maxrss`` would
    not do, as it keeps the parent's resident set from before ``exec``.
    """
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 2**10  # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def run_worker(args: argparse.Namespace) -> None:
    """One framework alone (fresh process): prints its peak memory and step times as JSON."""
    torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    samples = prompt_samples(args)
    # Imports are code, not training state: load them before the baseline.
    if args.worker == "composer":
        import recipes.grpo  # noqa: F401
    else:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    baseline = _proc_status_mib("VmRSS")
    with tempfile.TemporaryDirectory() as output_dir:
        clock = PhaseClock()
        if args.worker == "composer":
            step = ComposerStep(args, checkpoint, Path(output_dir))
            for batch in step_batches(args, samples):
                clock.begin()
                step(batch)
                clock.end()
        else:
            callback = trl_step_callback(clock)
            build_trl_trainer(args, checkpoint, samples, Path(output_dir), [callback]).train()
        times = [step["total"] for step in clock.steps]
    result = {
        "rss_growth_mib": _proc_status_mib("VmHWM") - baseline,
        "times": times[args.warmup :],
    }
    if args.device.startswith("cuda"):
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("WORKER_RESULT " + json.dumps(result), flush=True)


def spawn_worker(args: argparse.Namespace, framework: str, checkpoint: Path) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--worker", framework, "--checkpoint", str(checkpoint)]
    for name in ("model_size", "device", "prompts", "group_size", "max_new_tokens"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("temperature", "lr", "warmup", "repeats", "threads", "seed"):
        argv += [f"--{name}", str(getattr(args, name))]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("WORKER_RESULT "):
            return json.loads(line.removeprefix("WORKER_RESULT "))
    raise RuntimeError(
        f"{framework} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    )


def interleaved_run(
    args: argparse.Namespace, checkpoint: Path, samples: list[dict[str, Any]], workdir: Path
) -> tuple[PhaseClock, PhaseClock, list[float], ComposerStep]:
    """Both frameworks in this process, alternating steps: TRL, composer-tune, TRL, ...

    Returns:
        composer-tune's and TRL's clocks (warm-up steps included), TRL's mean completion
        length per step, and the composer-tune step object.
    """
    composer = ComposerStep(args, checkpoint, workdir / "composer")
    last = args.warmup + args.repeats - 1
    profile_step = last if args.profile else None
    composer_clock, trl_clock = PhaseClock(profile_step), PhaseClock(profile_step)
    clock_composer_phases(composer, composer_clock)
    batches = iter(step_batches(args, samples))

    def composer_step() -> None:
        batch = next(batches)  # the prompts TRL just used (in order: shuffle_dataset=False)
        composer_clock.begin()
        composer(batch)
        composer_clock.end()

    callback = trl_step_callback(trl_clock, after_step=composer_step)
    trainer = build_trl_trainer(args, checkpoint, samples, workdir / "trl", [callback])
    callback.trainer = trainer
    clock_trl_phases(trainer, trl_clock)
    trainer.train()
    return composer_clock, trl_clock, callback.lengths, composer


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return
    torch.set_num_threads(args.threads)
    samples = prompt_samples(args)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        checkpoint = workdir / "model"
        save_model(args, checkpoint)
        tokenizer = ChatTokenizer.from_dir(checkpoint)
        ours = [
            tokenizer.tokenize_messages(
                s["prompt"], add_generation_prompt=True, enable_thinking=False
            )[0]
            for s in samples
        ]
        same_prompts = ours == trl_prompt_ids(checkpoint, samples)
        composer_clock, trl_clock, trl_lengths, composer = interleaved_run(
            args, checkpoint, samples, workdir
        )
        memory = (
            {}
            if args.skip_memory
            else {name: spawn_worker(args, name, checkpoint) for name in ("composer", "trl")}
        )

    params = sum(p.numel() for p in composer.recipe.model.parameters())
    rows = args.prompts * args.group_size
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(
        f"model={args.model_size} params={params:,} prompts={args.prompts} "
        f"group_size={args.group_size} rows={rows} max_new_tokens={args.max_new_tokens} "
        f"temperature={args.temperature} objective=grpo beta=0 epsilon=0.2 lr={args.lr} "
        f"warmup={args.warmup} repeats={args.repeats}"
    )
    print(f"prompt token ids identical (our renderer vs TRL's chat template): {same_prompts}")
    print(
        "mean completion tokens per row (timed steps): composer-tune "
        f"{statistics.mean(composer.completion_tokens[args.warmup :]):.1f}, "
        f"trl {statistics.mean(trl_lengths[args.warmup :]):.1f}"
    )
    print()
    header = f"{'framework':<15}{'median s/step':>14}{'min s/step':>12}{'peak mem MiB':>14}"
    print(header)
    medians = {}
    for name, clock in (("composer-tune", composer_clock), ("trl", trl_clock)):
        times = [step["total"] for step in clock.steps[args.warmup :]]
        medians[name] = statistics.median(times)
        worker = memory.get("composer" if name == "composer-tune" else "trl", {})
        peak = worker.get("cuda_peak_mib", worker.get("rss_growth_mib"))
        peak_text = f"{peak:.0f}" if peak is not None else "-"
        print(f"{name:<15}{medians[name]:>14.3f}{min(times):>12.3f}{peak_text:>14}")
    print(
        f"speed-up (trl median / composer-tune median): {medians['trl'] / medians['composer-tune']:.2f}x"
    )
    if memory:
        kind = (
            "CUDA max_memory_allocated" if "cuda_peak_mib" in memory["trl"] else "peak RSS growth"
        )
        print(f"peak mem: {kind}, each framework alone in a fresh process")
    print(f"\n{'phase (median s/step)':<26}{'composer-tune':>14}{'trl':>10}")
    for phase in PHASES:
        values = [clock.median(phase, args.warmup) for clock in (composer_clock, trl_clock)]
        print(f"{phase:<26}{values[0]:>14.3f}{values[1]:>10.3f}")
    print(f"  other: {OTHER_PHASE}")
    for name, clock in (("composer-tune", composer_clock), ("trl", trl_clock)):
        if clock.profile:
            print(f"\ntorch.profiler, {name}, last step:\n{clock.profile}")
    print("\nnot equal:")
    for line in NOT_EQUAL:
        print(f"  - {line}")


if __name__ == "__main__":
    main()
