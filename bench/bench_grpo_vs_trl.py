"""One GRPO step of composer-tune (recipes/grpo.py) against TRL's GRPOTrainer, same work.

    .venv/bin/python bench/bench_grpo_vs_trl.py                       # tiny random Qwen3, CPU
    .venv/bin/python bench/bench_grpo_vs_trl.py --model qwen3-0.6b-4l --device cuda
    .venv/bin/python bench/bench_grpo_vs_trl.py --model smollm2       # the real SmolLM2, bf16
    .venv/bin/python bench/bench_grpo_vs_trl.py --model smollm2 --sweep   # cost-growth curves

A step is the whole of one generation batch with one optimiser step on it: sample G completions
per prompt, score them, log-prob forward, loss, backward, clip, AdamW step. Both frameworks get
the same model (``tiny`` / ``qwen3-0.6b-4l``: a random Qwen3 saved with ``save_hf_checkpoint``
beside the test tokenizer; ``smollm2``: SmolLM2-135M-Instruct's real weights and tokenizer,
imported into the cache as ``${smollm2_checkpoint:}`` does; TRL loads the same directory with
AutoModelForCausalLM), the same prompts in the same order (synthetic arithmetic, chat-templated
by each side's own template code; the bench checks the token ids agree), the same reward
(``MathAnswerReward``), group size, completion cap, temperature, objective (grpo, beta=0,
epsilon 0.2, group reward scaling), AdamW hyper-parameters, gradient clipping, thread count and
precision (``--precision``, ``smollm2`` only: bf16 autocast over fp32 weights on both sides, TRL
``bf16=True``, where the CPU multiplies bf16 natively (AVX512-BF16/AMX) or on a GPU; fp32 on both
sides elsewhere: on an AVX2-only CPU a bf16 matmul runs ~65x slower than an fp32 one).

composer-tune's step is ``GRPORecipe`` itself, built from the cpu_smoke config (``smollm2``: the
smollm2 config) with overrides, driven one generation batch at a time through the same methods
its ``train()`` loop calls (``_rollout`` -> ``group_advantages`` -> ``_optimizer_step``); each
``--variant`` adds config overrides (e.g. ``rollout.engine=vllm``; ``shared_prefix_forward=false``
runs one row per completion instead of each group's prompt once,
``composer_tune.rollout.shared_prefix``). TRL's step is one optimiser step of
``trainer.train()``, timed by a callback from ``on_step_begin`` (before TRL generates) to
``on_step_end`` (after its optimiser step). Timing runs every side in ONE process, alternating
TRL step / each composer-tune variant's step, so load from other processes hits all alike; peak
memory runs each alone in a fresh subprocess (growth of the peak resident set, VmHWM, over the
post-import baseline on CPU; ``torch.cuda.max_memory_allocated`` on GPU). Settings that cannot
be made equal are printed under "not equal". ``--profile`` adds a ``torch.profiler`` table of
the most expensive operators of each side's last step. ``--sweep`` runs the step at several
completion lengths and group sizes (each point in a subprocess, every completion running to the
cap on both sides) and plots seconds per step against them.
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
from omegaconf import OmegaConf  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402

from composer_tune import config  # noqa: E402
from composer_tune.agents import calculator  # noqa: E402
from composer_tune.checkpointing import save_hf_checkpoint  # noqa: E402
from composer_tune.data.synthetic import SyntheticArithmetic  # noqa: E402
from composer_tune.data.tokenizer import ChatTokenizer  # noqa: E402
from composer_tune.models import qwen3_tiny  # noqa: E402
from composer_tune.models.build import native_bf16  # noqa: E402
from composer_tune.rewards import MathAnswerReward  # noqa: E402

TOKENIZER_DIR = REPO_ROOT / "tests" / "assets" / "tokenizer"
SMOLLM2_CONFIG = REPO_ROOT / "recipes" / "configs" / "grpo" / "smollm2.yaml"
# Random models: qwen3_tiny keyword arguments. The vocabulary is the committed test
# tokenizer's (994 ids) for both: a random model over Qwen3's real 151,936 ids would sample
# ids that tokenizer cannot decode. "qwen3-0.6b-4l" is Qwen3-0.6B's layer shape with 4 of its
# 28 layers. "smollm2" is the real SmolLM2-135M-Instruct (its grpo config).
RANDOM_MODELS: dict[str, dict[str, Any]] = {
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
MODELS = (*RANDOM_MODELS, "smollm2")
# composer-tune's sides for --model smollm2 when no --variant is given: both engines (the vLLM
# one in the run's precision), with fused AdamW as TRL's default (adamw_torch_fused).
SMOLLM2_VARIANTS = [
    "rollout.engine=native optimizer.fused=true",
    "rollout.engine=vllm optimizer.fused=true",
]
# --sweep: (max new tokens, group size) points; every completion runs to the cap.
SWEEP_POINTS = [(24, 8), (64, 8), (128, 8), (256, 8), (24, 4), (24, 16)]
# --episodes: the SmolLM2 calculator-tool task (grpo smollm2_tools: up to 3 turns, 40 tokens a
# turn, 120 an episode) from its A0 tool-use SFT checkpoint, which --a0-dir holds or gets.
EPISODE_CONFIG = REPO_ROOT / "recipes" / "configs" / "grpo" / "smollm2_tools.yaml"
A0_SECTION = {"recipe": "recipes/sft.py", "config": "smollm2_tools"}
NOT_EQUAL = [
    "generation: TRL calls transformers' generate (HF KV cache, its sampling processors); "
    "composer-tune its own KV-cache generate or the vLLM engine. Same distribution, different "
    "random streams, so completion lengths can differ (both printed).",
    "padding: TRL left-pads prompts and right-pads completions in the training forward "
    "(attention mask); composer-tune packs prompt+completion right-padded, or with the "
    "shared-prefix forward each group's prompt once followed by its completions.",
    "log-prob head: TRL asks transformers for fused_lm_head log-probs of the completion "
    "tokens; composer-tune uses its chunked logprob_head.",
    "chat template: TRL renders prompts with the tokenizer's Jinja template, composer-tune "
    "with its own renderer; the bench checks that the token ids are identical.",
    "framework overhead: TRL's step includes Trainer/accelerate bookkeeping and its metric "
    "gathering; composer-tune's includes the recipe's metric reduction.",
]
EPISODES_NOT_EQUAL = (
    "--episodes: both sides run up to 3 assistant turns of at most 40 tokens and 120 tokens "
    "after the prompt (TRL: generation_kwargs max_new_tokens=40, max_tool_calling_iterations=2, "
    "max_completion_length=120), render with the same ChatML + Hermes template and call the "
    "same calculate function; TRL parses the calls with Qwen's response template (the same "
    "<tool_call>{json}</tool_call> format), composer-tune with its own parser. Completion "
    "tokens count the model's own tokens (tool output excluded) on both sides."
)
NO_STOP_NOT_EQUAL = (
    "--no-stop: TRL suppresses the stop tokens until the cap (min_new_tokens), composer-tune "
    "samples them but does not stop on them: same lengths, slightly different distributions."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", "--model-size", dest="model", choices=MODELS, default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--prompts", type=int, help="prompts per step (default 4; smollm2: 8)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, help="default 16 (smollm2: 24)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="smollm2: bf16 autocast or fp32 on both sides (auto: bf16 where the CPU multiplies "
        "bf16 natively, or on a GPU)",
    )
    parser.add_argument(
        "--trl-optim",
        help="TRL's optim (default adamw_torch as the cpu_smoke config's AdamW; smollm2: "
        "adamw_torch_fused, transformers' default on torch >= 2.8)",
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per side")
    # One thread by default: on a shared machine, OpenMP workers waiting on each other swamp
    # a tiny model's small kernels.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="a composer-tune side: space-separated config overrides (e.g. "
        "shared_prefix_forward=false); repeat to compare "
        f"(default: the config as is; smollm2: {' / '.join(SMOLLM2_VARIANTS)})",
    )
    parser.add_argument(
        "--no-stop", action="store_true", help="every completion runs to --max-new-tokens"
    )
    parser.add_argument(
        "--episodes",
        action="store_true",
        help="--model smollm2: agent episodes of the calculator task (grpo smollm2_tools, up to "
        "3 turns) from its A0 SFT checkpoint; TRL runs them through environment_factory",
    )
    parser.add_argument(
        "--a0-dir",
        default=str(REPO_ROOT / "outputs" / "sft_smollm2_tools"),
        help="--episodes: the A0 run (sft smollm2_tools) to start from, trained there if absent",
    )
    parser.add_argument("--skip-memory", action="store_true", help="no peak-memory subprocesses")
    parser.add_argument(
        "--memory-steps", type=int, default=2, help="steps of each peak-memory subprocess"
    )
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler table of each side's last step"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="step time against completion length and group size (see SWEEP_POINTS), "
        "each point a subprocess; writes --sweep-out (.json and .png)",
    )
    parser.add_argument("--sweep-out", default=str(REPO_ROOT / "docs" / "bench_grpo_vs_trl_sweep"))
    parser.add_argument(
        "--sweep-work",
        default=str(REPO_ROOT / "outputs" / "bench_grpo_vs_trl_sweep"),
        help="each finished point's figures; a point whose command is unchanged is not rerun "
        "(delete the folder to measure every point again)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "trl" or a variant's index
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smollm2 = args.model == "smollm2"
    if args.episodes and (not smollm2 or args.no_stop):
        parser.error("--episodes is for --model smollm2, whose episodes end as the model ends them")
    if args.episodes and args.max_new_tokens is None:
        args.max_new_tokens = OmegaConf.load(EPISODE_CONFIG).agent.max_episode_tokens
    if args.prompts is None:
        args.prompts = 2 if args.sweep or args.episodes else 8 if smollm2 else 4
    if args.max_new_tokens is None:
        args.max_new_tokens = 24 if smollm2 else 16
    if not args.variant:
        args.variant = list(SMOLLM2_VARIANTS) if smollm2 else [""]
    if args.trl_optim is None:
        args.trl_optim = "adamw_torch_fused" if smollm2 else "adamw_torch"
    if args.precision == "auto":
        args.precision = "bf16" if smollm2 and native_bf16(args.device) else "fp32"
    elif args.precision == "bf16" and not smollm2:
        parser.error("--precision bf16 is for --model smollm2 (the random models run fp32)")
    if args.group_size < 2:
        parser.error("--group-size must be >= 2 (GRPO advantages need a group)")
    if min(args.prompts, args.max_new_tokens, args.repeats, args.memory_steps) < 1:
        parser.error("--prompts, --max-new-tokens, --repeats, --memory-steps must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def variant_label(args: argparse.Namespace, index: int) -> str:
    """``composer-tune`` for a single side, else ``composer-tune[i]`` (listed in a legend)."""
    return "composer-tune" if len(args.variant) == 1 else f"composer-tune[{index}]"


# ----------------------------------------------------------------------------- shared inputs


def prepare_checkpoint(args: argparse.Namespace, workdir: Path) -> Path:
    """The Hugging Face directory both frameworks load: SmolLM2 from the cache, or a random
    Qwen3 of ``--model`` with the test tokenizer saved under ``workdir``."""
    if args.episodes:
        from composer_tune.checkpointing.warm_start import WarmStartSection, resolve_warm_start
        from composer_tune.distributed import DistInfo

        section = WarmStartSection(**A0_SECTION, output_dir=args.a0_dir)
        return resolve_warm_start(
            section, DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
        )
    if args.model == "smollm2":
        from composer_tune.checkpointing.gguf_import import smollm2_checkpoint

        return smollm2_checkpoint()
    directory = workdir / "model"
    torch.manual_seed(args.seed)
    model = qwen3_tiny(**RANDOM_MODELS[args.model])
    tokenizer = ChatTokenizer.from_dir(TOKENIZER_DIR)
    save_hf_checkpoint(
        model.state_dict(),
        model.config,
        directory,
        copy_files_from=TOKENIZER_DIR,
        # TRL stops on the generation config's eos ids: the same ones composer-tune stops on.
        generation_config={"eos_token_id": tokenizer.stop_tokens, "pad_token_id": tokenizer.pad_id},
    )
    return directory


def enable_thinking(args: argparse.Namespace) -> bool | None:
    """The chat template's thinking switch: off for Qwen3; SmolLM2's template has none
    (composer-tune's configs then say ``enable_thinking: true``: send nothing)."""
    return None if args.model == "smollm2" else False


def prompt_samples(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts of every step, in order: ``--prompts`` consecutive samples per step
    (SmolLM2: its grpo config's task, instruction included)."""
    steps = args.warmup + args.repeats
    count = args.prompts * steps
    if args.model == "smollm2":
        section = OmegaConf.load(EPISODE_CONFIG if args.episodes else SMOLLM2_CONFIG).dataset
        dataset = config.instantiate(section, num_samples=count, seed=args.seed)
    else:
        dataset = SyntheticArithmetic(split="train", num_samples=count, seed=args.seed)
    return [dataset[index] for index in range(len(dataset))]


def step_batches(args: argparse.Namespace, samples: list[dict[str, Any]]) -> list[list[dict]]:
    """``samples`` cut into the per-step prompt batches, in TRL's (unshuffled) order."""
    return [samples[i : i + args.prompts] for i in range(0, len(samples), args.prompts)]


# ----------------------------------------------------------------------------- timing


PHASES = (
    "generation",
    "reward",
    "old log-prob pass",
    "train log-prob forward",
    "AdamW step",
    "other",
)
OTHER_PHASE = "advantages, loss, backward, clip, framework bookkeeping"


class PhaseClock:
    """Wall time of steps, split into phases by timing wrapped functions.

    ``wrap`` returns a timed version of a function; the time of each call goes to its phase
    (a name, or a callable choosing the name at call time) within the current step. The rest
    of the step's time is "other". ``end`` returns the step's phases; with ``begin(profile=True)``
    the step also runs under torch.profiler and ``profile`` holds its operator table.
    """

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.start = 0.0
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

    def begin(self, profile: bool = False) -> None:
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        _synchronize()
        self.current = {}
        self.start = time.perf_counter()

    def end(self) -> dict[str, float]:
        _synchronize()
        total = time.perf_counter() - self.start
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            self.profile = self.profiler.key_averages().table(sort_by=sort, row_limit=15)
            self.profiler = None
        step = dict(self.current)
        step["other"] = total - sum(step.values())
        step["total"] = total
        return step


def median_phase(steps: list[dict[str, float]], phase: str) -> float:
    """Median of one phase over ``steps`` (0 where absent)."""
    return statistics.median(step.get(phase, 0.0) for step in steps)


# ----------------------------------------------------------------------------- composer-tune


class _NoStops:
    """The recipe's tokenizer with no stop tokens (``--no-stop``): rows run to the cap."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.stop_tokens: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def composer_overrides(args: argparse.Namespace, checkpoint: Path, output_dir: Path) -> list[str]:
    """The recipe config's overrides that make composer-tune's step TRL's (see the module doc)."""
    rows = args.prompts * args.group_size
    common = [
        f"output_dir={output_dir}",
        f"seed={args.seed}",
        f"device={args.device}",
        "warm_start=null",
        "eval_dataset=null",
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
        # Cosine over max_steps without warm-up, as TRL's below (the configs' lr is constant).
        "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "lr_scheduler.num_warmup_steps=0",
        "clip_grad_norm=1.0",
        "logging.progress_bar=false",
        f"max_steps={args.warmup + args.repeats}",
        # The recipe's own dataset is never read (the bench feeds the prompts): keep it small.
        f"dataset.num_samples={args.prompts}",
    ]
    autocast = f"autocast={'bf16' if args.precision == 'bf16' else 'null'}"
    if args.episodes:  # the A0 checkpoint instead of training it as the config's warm start
        return [*common, "warm_start=null", f"checkpoint.initial_checkpoint={checkpoint}", autocast]
    if args.model == "smollm2":
        return [
            *common,
            # Room for the ~50-token prompt and the completion (the config's 256 fits 24).
            f"model.max_seq_len={max(256, 128 + args.max_new_tokens)}",
            autocast,
        ]
    return [
        *common,
        "dtype=fp32",
        f"checkpoint.initial_checkpoint={checkpoint}",
        f"tokenizer.path={checkpoint}",
        *(f"model.{key}={value}" for key, value in RANDOM_MODELS[args.model].items()),
        "enable_thinking=false",
    ]


class ComposerStep:
    """``recipes/grpo.py``'s GRPORecipe, one generation batch (= one optimiser step) per call,
    for one ``--variant`` (config overrides)."""

    def __init__(
        self, args: argparse.Namespace, checkpoint: Path, output_dir: Path, variant: str
    ) -> None:
        from recipes.grpo import GRPOConfig, GRPORecipe

        name = "smollm2_tools" if args.episodes else "smollm2" if args.model == "smollm2" else None
        cfg = config.load_config(
            name or "cpu_smoke",
            [*composer_overrides(args, checkpoint, output_dir), *variant.split()],
            recipe_file=REPO_ROOT / "recipes" / "grpo.py",
            schema=GRPOConfig,
        )
        self.recipe = GRPORecipe(cfg)
        self.recipe.setup()
        if args.no_stop:
            self.recipe.run.tokenizer = _NoStops(self.recipe.run.tokenizer)
        self.steps: list[dict[str, float]] = []
        self.completion_tokens: list[float] = []

    def __call__(self, samples: list[dict[str, Any]]) -> None:
        # GRPORecipe.train()'s loop body with steps_per_generation = num_iterations = 1.
        recipe = self.recipe
        rollout = recipe.run.rollout(samples, recipe.objective.reference)
        batch = recipe.objective.prepare(rollout, advantage_sign=recipe.cfg.advantage_sign)
        for _, step in batch.optimizer_steps(1, 1):
            recipe._optimizer_step(step)
            recipe.run.progress.step += 1
        # The model's own tokens per row, as TRL counts them (an episode's tool output is
        # outside the completion mask).
        self.completion_tokens.append(float(rollout.completion_mask.sum(dim=-1).float().mean()))

    def close(self) -> None:
        # The engine only: the recipe's cleanup would also destroy the process group, which
        # another side's in-process vLLM engine still uses.
        if self.recipe.run.engine is not None:
            self.recipe.run.engine.close()


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
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    reward = MathAnswerReward()

    def math_answer_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [completion[-1]["content"] for completion in completions]
        return [r.score for r in reward(texts, [{"answer": a} for a in answer])]

    thinking = enable_thinking(args)
    generation_kwargs = {"min_new_tokens": args.max_new_tokens} if args.no_stop else None
    episode_kwargs: dict[str, Any] = {}
    if args.episodes:
        agent = OmegaConf.load(EPISODE_CONFIG).agent
        # The episode budget as composer-tune's: max_completion_length caps TRL's whole
        # multi-turn completion (tool responses included), each generation call one turn.
        generation_kwargs = {"max_new_tokens": agent.max_tokens_per_turn}
        episode_kwargs["max_tool_calling_iterations"] = agent.max_turns - 1
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
        generation_kwargs=generation_kwargs,
        **episode_kwargs,
        learning_rate=args.lr,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        optim=args.trl_optim,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        use_vllm=False,
        # SmolLM2: bf16 autocast over fp32 weights, as composer-tune's smollm2 config.
        bf16=args.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        chat_template_kwargs={} if thinking is None else {"enable_thinking": thinking},
        max_steps=args.warmup + args.repeats,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = trl_tokenizer(args, checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": s["prompt"], "answer": s["answer"]} for s in samples])
    return GRPOTrainer(
        model=model,
        reward_funcs=math_answer_reward,
        args=trl_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        environment_factory=CalculatorEnvironment if args.episodes else None,
    )


class CalculatorEnvironment:
    """The calculator task in TRL's ``environment_factory`` shape: no state, one tool, the
    very function (and so the schema) composer-tune's ``agent.tools`` calls."""

    def reset(self, **_: Any) -> None:
        return None

    def calculate(self, expression: str) -> str:
        return calculator.calculate(expression)

    calculate.__doc__ = calculator.calculate.__doc__


def trl_tokenizer(args: argparse.Namespace, checkpoint: Path) -> Any:
    """The tokenizer TRL renders with: the checkpoint's, or for --episodes SmolLM2's with the
    ChatML + Hermes tool template composer-tune's episodes use, and Qwen's tool-call parser
    (the same ``<tool_call>{json}</tool_call>`` format; TRL knows no parser for SmolLM2)."""
    from transformers import AutoTokenizer

    if not args.episodes:
        return AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    from trl.chat_template_utils import qwen3_template

    from composer_tune.checkpointing.gguf_import import smollm2_checkpoint
    from composer_tune.data.tokenizer import NAMED_CHAT_TEMPLATES

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint(), padding_side="left")
    tokenizer.chat_template = Path(NAMED_CHAT_TEMPLATES["hermes"]).read_text()
    tokenizer.response_template = qwen3_template
    return tokenizer


def trl_tools(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The tool schemas TRL renders into the prompt: the calculator's for --episodes."""
    if not args.episodes:
        return None
    from transformers.utils import get_json_schema

    return [get_json_schema(CalculatorEnvironment().calculate)]


class TRLSide:
    """TRL's step times (a TrainerCallback clocks each optimiser step from ``on_step_begin``,
    before TRL generates, to ``on_step_end``, after its AdamW step) and mean completion
    lengths; ``after_step()`` runs outside the clocked window (the composer-tune steps)."""

    def __init__(self, clock: PhaseClock, profile_step: int | None = None) -> None:
        self.clock = clock
        self.profile_step = profile_step
        self.steps: list[dict[str, float]] = []
        self.completion_tokens: list[float] = []
        self.trainer: Any = None
        self.optimizer_step: Callable[..., Any] | None = None  # TRL's, once clocked
        self.after_step: Callable[[], None] | None = None

    def callback(self) -> Any:
        from transformers import TrainerCallback

        side = self

        class StepClock(TrainerCallback):
            def on_step_begin(self, *_: Any, **__: Any) -> None:
                if side.optimizer_step is None:  # train() built it: time it from now on
                    optimizer = side.trainer.optimizer
                    side.optimizer_step = optimizer.step
                    optimizer.step = side.clock.wrap("AdamW step", optimizer.step)
                side.clock.begin(profile=len(side.steps) == side.profile_step)

            def on_step_end(self, *_: Any, **__: Any) -> None:
                side.steps.append(side.clock.end())
                metrics = side.trainer._metrics["train"]  # kept per step until TRL logs
                side.completion_tokens.append(metrics["completions/mean_length"][-1])
                if side.after_step is not None:
                    side.after_step()

        return StepClock()

    def clock_phases(self) -> None:
        """Time TRL's generation, reward and log-prob forwards (no grad: old log-probs)."""
        trainer, clock = self.trainer, self.clock
        trainer._generate_single_turn = clock.wrap("generation", trainer._generate_single_turn)
        trainer._calculate_rewards = clock.wrap("reward", trainer._calculate_rewards)
        trainer._get_per_token_logps_and_entropies = clock.wrap(
            lambda: "train log-prob forward" if torch.is_grad_enabled() else "old log-prob pass",
            trainer._get_per_token_logps_and_entropies,
        )


def clock_composer_phases(clock: PhaseClock, steps: list[ComposerStep]) -> None:
    """Time the recipes' generation (with vLLM: also the weight push), reward and log-prob
    forwards, at the names they call."""
    from composer_tune.agents import episodes
    from composer_tune.channels import composer
    from composer_tune.rollout import rollouts, window

    window.generate = clock.wrap("generation", window.generate)
    episodes.generate = clock.wrap("generation", episodes.generate)
    rollouts._batched_logprobs = clock.wrap("old log-prob pass", rollouts._batched_logprobs)
    composer.rollout_logprobs = clock.wrap("train log-prob forward", composer.rollout_logprobs)
    for step in steps:
        run = step.recipe.run
        run.task.reward.score = clock.wrap("reward", run.task.reward.score)
        run.optimizer.step = clock.wrap("AdamW step", run.optimizer.step)
        engine = run.engine
        if engine is not None:
            engine.generate = clock.wrap("generation", engine.generate)
            engine.sync_weights = clock.wrap("generation", engine.sync_weights)


def trl_prompt_ids(
    tokenizer: Any,
    samples: list[dict[str, Any]],
    thinking: bool | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """The prompt ids TRL generates from: ``tokenizer``'s Jinja chat template (with ``tools``'
    schemas for episodes)."""
    kwargs: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
    if tools:
        kwargs["tools"] = tools
    return [
        tokenizer.apply_chat_template(
            s["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        for s in samples
    ]


def composer_prompt_ids(
    args: argparse.Namespace, checkpoint: Path, samples: list[dict[str, Any]]
) -> list[list[int]]:
    """The prompt ids composer-tune samples from (for --episodes: the first turn's, with the
    calculate tool's schema in the system turn)."""
    thinking = enable_thinking(args)
    if args.episodes:
        from composer_tune.checkpointing.gguf_import import smollm2_checkpoint

        tokenizer = ChatTokenizer.from_dir(smollm2_checkpoint()).with_chat_template("hermes")
        extra: dict[str, Any] = {"tools": [get_json_schema(calculator.calculate)]}
    else:
        tokenizer, extra = ChatTokenizer.from_dir(checkpoint), {}
    return [
        tokenizer.tokenize_messages(
            s["prompt"],
            add_generation_prompt=True,
            enable_thinking=thinking is None or thinking,
            **extra,
        )[0]
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
    """One side alone (fresh process) for ``--memory-steps`` steps: prints its peak memory."""
    torch.set_num_threads(args.threads)
    args.warmup, args.repeats = 0, args.memory_steps
    checkpoint = Path(args.checkpoint)
    samples = prompt_samples(args)
    # Imports are code, not training state: load them before the baseline.
    if args.worker == "trl":
        import datasets  # noqa: F401
        import trl  # noqa: F401
    else:
        import recipes.grpo  # noqa: F401
    baseline = _proc_status_mib("VmRSS")
    with tempfile.TemporaryDirectory() as output_dir:
        if args.worker == "trl":
            build_trl_trainer(args, checkpoint, samples, Path(output_dir), []).train()
        else:
            step = ComposerStep(args, checkpoint, Path(output_dir), args.variant[0])
            for batch in step_batches(args, samples):
                step(batch)
    result = {"rss_growth_mib": _proc_status_mib("VmHWM") - baseline}
    if args.device.startswith("cuda"):
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("WORKER_RESULT " + json.dumps(result), flush=True)


def common_argv(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that define the work, for a subprocess of this script."""
    argv = ["--model", args.model, "--device", args.device, "--precision", args.precision]
    argv += ["--trl-optim", args.trl_optim]
    for name in ("prompts", "group_size", "max_new_tokens", "temperature", "lr", "threads"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += ["--seed", str(args.seed), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    argv += ["--episodes", "--a0-dir", args.a0_dir] if args.episodes else []
    return argv + (["--no-stop"] if args.no_stop else [])


def spawn_worker(args: argparse.Namespace, worker: str, checkpoint: Path) -> dict[str, Any]:
    """Peak memory of one side alone: ``worker`` is "trl" or a ``--variant``'s overrides."""
    argv = [sys.executable, __file__, *common_argv(args), "--checkpoint", str(checkpoint)]
    argv += ["--memory-steps", str(args.memory_steps)]
    argv += (
        ["--worker", "trl"] if worker == "trl" else ["--worker", "composer", "--variant", worker]
    )
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("WORKER_RESULT "):
            return json.loads(line.removeprefix("WORKER_RESULT "))
    # The timing run still reports; the table shows "-" for this side's memory.
    print(f"{worker} memory worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {}


def interleaved_run(
    args: argparse.Namespace, checkpoint: Path, samples: list[dict[str, Any]], workdir: Path
) -> tuple[list[ComposerStep], TRLSide, PhaseClock]:
    """Every side in this process, alternating steps: TRL, each composer-tune variant, TRL, ...

    Returns:
        the composer-tune sides, the TRL side (warm-up steps included) and composer-tune's
        clock (its profile is the last variant's last step).
    """
    composers = [
        ComposerStep(args, checkpoint, workdir / f"composer{index}", variant)
        for index, variant in enumerate(args.variant)
    ]
    last = args.warmup + args.repeats - 1
    profile_step = last if args.profile else None
    composer_clock = PhaseClock()
    clock_composer_phases(composer_clock, composers)
    batches = iter(step_batches(args, samples))
    trl = TRLSide(PhaseClock(), profile_step)

    def composer_steps() -> None:
        batch = next(batches)  # the prompts TRL just used (in order: shuffle_dataset=False)
        for composer in composers:
            composer_clock.begin(profile=len(composer.steps) == profile_step)
            composer(batch)
            composer.steps.append(composer_clock.end())
        times = [f"trl {trl.steps[-1]['total']:.1f}"]
        times += [f"[{i}] {c.steps[-1]['total']:.1f}" for i, c in enumerate(composers)]
        print(f"step {len(trl.steps)} (s): {', '.join(times)}", file=sys.stderr, flush=True)

    trl.after_step = composer_steps
    trl.trainer = build_trl_trainer(args, checkpoint, samples, workdir / "trl", [trl.callback()])
    trl.clock_phases()
    trl.trainer.train()
    for composer in composers:
        composer.close()
    return composers, trl, composer_clock


# ----------------------------------------------------------------------------- report


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One interleaved run (and the peak-memory subprocesses): every side's figures."""
    samples = prompt_samples(args)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        checkpoint = prepare_checkpoint(args, workdir)
        ours = composer_prompt_ids(args, checkpoint, samples)
        same_prompts = ours == trl_prompt_ids(
            trl_tokenizer(args, checkpoint), samples, enable_thinking(args), trl_tools(args)
        )
        # Memory first, while this process holds no model: a worker's peak then has the
        # machine's memory to itself.
        memory = {}
        if not args.skip_memory:
            for worker in ("trl", *args.variant):
                memory[worker] = spawn_worker(args, worker, checkpoint)
        composers, trl, composer_clock = interleaved_run(args, checkpoint, samples, workdir)

    def side(steps: list[dict[str, float]], lengths: list[float], peak: dict) -> dict[str, Any]:
        timed = steps[args.warmup :]
        return {
            "median_s": median_phase(timed, "total"),
            "min_s": min(step["total"] for step in timed),
            "phases": {phase: median_phase(timed, phase) for phase in PHASES},
            "completion_tokens": statistics.mean(lengths[args.warmup :]),
            "peak_mib": peak.get("cuda_peak_mib", peak.get("rss_growth_mib")),
        }

    sides = {"trl": side(trl.steps, trl.completion_tokens, memory.get("trl", {}))}
    for index, (variant, composer) in enumerate(zip(args.variant, composers, strict=True)):
        sides[variant_label(args, index)] = {
            "variant": variant,
            **side(composer.steps, composer.completion_tokens, memory.get(variant, {})),
        }
    return {
        "setup": {
            "device": args.device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "model": args.model,
            "params": sum(p.numel() for p in composers[0].recipe.run.model.parameters()),
            "prompts": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "no_stop": args.no_stop,
            "episodes": args.episodes,
            "precision": args.precision,
            "trl_optim": args.trl_optim,
            "same_prompts": same_prompts,
            "memory_kind": (
                "CUDA max_memory_allocated"
                if "cuda_peak_mib" in memory.get("trl", {})
                else "peak RSS growth"
            ),
        },
        "sides": sides,
        "profiles": {
            "composer-tune (last variant)": composer_clock.profile,
            "trl": trl.clock.profile,
        },
    }


def print_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    setup, sides = result["setup"], result["sides"]
    rows = args.prompts * args.group_size
    print(f"device={setup['device']} threads={setup['threads']} torch={setup['torch']}")
    print(
        f"model={args.model} params={setup['params']:,} prompts={args.prompts} "
        f"group_size={args.group_size} rows={rows} max_new_tokens={args.max_new_tokens} "
        f"temperature={args.temperature} objective=grpo beta=0 epsilon=0.2 lr={args.lr} "
        f"precision={'bf16 autocast' if args.precision == 'bf16' else 'fp32'} "
        f"trl_optim={args.trl_optim} "
        f"warmup={args.warmup} repeats={args.repeats}" + (" no-stop" if args.no_stop else "")
    )
    print(
        f"prompt token ids identical (our renderer vs TRL's chat template): {setup['same_prompts']}"
    )
    ours = [name for name in sides if name != "trl"]
    for name in ours:
        print(f"{name}: {sides[name]['variant'] or '(config as is)'}")
    lengths = ", ".join(f"{name} {sides[name]['completion_tokens']:.1f}" for name in [*ours, "trl"])
    print(f"mean completion tokens per row (timed steps): {lengths}")
    print()
    width = max(15, *(len(name) + 2 for name in sides))
    print(f"{'framework':<{width}}{'median s/step':>14}{'min s/step':>12}{'peak mem MiB':>14}")
    for name in [*ours, "trl"]:
        figures = sides[name]
        peak = figures["peak_mib"]
        peak_text = f"{peak:.0f}" if peak is not None else "-"
        print(
            f"{name:<{width}}{figures['median_s']:>14.3f}{figures['min_s']:>12.3f}{peak_text:>14}"
        )
    for name in ours:
        ratio = sides["trl"]["median_s"] / sides[name]["median_s"]
        print(f"speed-up (trl median / {name} median): {ratio:.2f}x")
    if not args.skip_memory:
        print(f"peak mem: {setup['memory_kind']}, each side alone in a fresh process")
    columns = "".join(f"{name:>{max(len(name), 9) + 2}}" for name in [*ours, "trl"])
    print(f"\n{'phase (median s/step)':<26}{columns}")
    for phase in PHASES:
        values = "".join(
            f"{sides[name]['phases'][phase]:>{max(len(name), 9) + 2}.3f}" for name in [*ours, "trl"]
        )
        print(f"{phase:<26}{values}")
    print(f"  other: {OTHER_PHASE}")
    for name, profile in result["profiles"].items():
        if profile:
            print(f"\ntorch.profiler, {name}, last step:\n{profile}")
    print("\nnot equal:")
    extra = [NO_STOP_NOT_EQUAL] * args.no_stop + [EPISODES_NOT_EQUAL] * args.episodes
    for line in [*NOT_EQUAL, *extra]:
        print(f"  - {line}")


# ----------------------------------------------------------------------------- sweep


def sweep(args: argparse.Namespace) -> None:
    """Every SWEEP_POINTS point in a subprocess (its own engines and memory), every completion
    running to the cap, then (``--model smollm2``) an agent-episode point (``--episodes``, group
    size 4 as its config); writes ``--sweep-out`` .json (all figures), .md (the table) and .png
    (the curves). Peak memory per point unless ``--skip-memory``. Finished points are kept in
    ``--sweep-work``, so a sweep cut short (out of memory on a shared machine) goes on where it
    stopped."""
    runs: list[tuple[str, dict[str, Any]]] = [
        (f"{tokens}_{group}", {"max_new_tokens": tokens, "group_size": group, "no_stop": True})
        for tokens, group in SWEEP_POINTS
    ]
    if args.model == "smollm2":
        budget = OmegaConf.load(EPISODE_CONFIG).agent.max_episode_tokens
        episodes = {"episodes": True, "group_size": 4, "max_new_tokens": budget, "no_stop": False}
        runs.append(("episodes", episodes))
    points = []
    work = Path(args.sweep_work)
    work.mkdir(parents=True, exist_ok=True)
    for name, changes in runs:
        point = argparse.Namespace(**{**vars(args), **changes})
        argv = [*common_argv(point), "--memory-steps", str(args.memory_steps)]
        argv += ["--skip-memory"] if args.skip_memory else []
        for variant in args.variant:
            argv += ["--variant", variant]
        # A point measured by this very command before (a sweep cut short) is kept.
        out = work / f"{name}.json"
        done = json.loads(out.read_text()) if out.is_file() else {}
        if done.get("argv") != argv:
            print(f"sweep: {name}: bench_grpo_vs_trl.py {' '.join(argv)}", flush=True)
            subprocess.run(
                [sys.executable, __file__, *argv, "--json", str(out)], check=True, cwd=REPO_ROOT
            )
            done = {"argv": argv, **json.loads(out.read_text())}
            out.write_text(json.dumps(done, indent=1))
        else:
            print(f"sweep: {name}: measured before with the same command, {out}", flush=True)
        points.append(done)
    base = Path(args.sweep_out)
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(points, indent=1))
    base.with_suffix(".md").write_text(sweep_table(points))
    plot_sweep(points, base.with_suffix(".png"))
    print(sweep_table(points))
    print(f"sweep: wrote {base.with_suffix('.json')}, .md and .png")


def sweep_table(points: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table: per point, each side's median (fastest) s/step, peak
    memory and TRL's median over composer-tune's."""
    sides = [name for name in points[0]["sides"] if name != "trl"]
    header = ["point", "TRL s/step (fastest)", "TRL peak MiB"]
    for name in sides:
        header += [f"{name} s/step (fastest)", f"{name} peak MiB", f"TRL / {name}"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for point in points:
        setup, figures = point["setup"], point["sides"]
        if setup.get("episodes"):
            where = f"episodes, group {setup['group_size']}"
        else:
            where = f"{setup['max_new_tokens']} tokens, group {setup['group_size']}"

        def cells(side: dict[str, Any]) -> list[str]:
            peak = side["peak_mib"]
            return [
                f"{side['median_s']:.1f} ({side['min_s']:.1f})",
                "-" if peak is None else f"{peak:,.0f}",
            ]

        row = [where, *cells(figures["trl"])]
        for name in sides:
            ratio = figures["trl"]["median_s"] / figures[name]["median_s"]
            row += [*cells(figures[name]), f"**{ratio:.2f}x**"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(points: list[dict[str, Any]], path: Path) -> None:
    """Median s/step (solid) and the fastest timed step (dashed) against new tokens (group
    size 8) and against group size (24 tokens), and the episode point's bars: with few timed
    steps on a shared machine, one slow step moves the median, and the gap between the two
    lines shows it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [p for p in points if not p["setup"].get("episodes")]
    episodes = [p for p in points if p["setup"].get("episodes")]
    setup = curves[0]["setup"]
    figure, axes = plt.subplots(1, 2 + bool(episodes), figsize=(5.5 * (2 + bool(episodes)), 4.2))
    panels = [("max_new_tokens", "group_size", 8), ("group_size", "max_new_tokens", 24)]
    for axis, (x_key, fixed_key, fixed) in zip(axes, panels, strict=False):
        chosen = sorted(
            (p for p in curves if p["setup"][fixed_key] == fixed), key=lambda p: p["setup"][x_key]
        )
        xs = [p["setup"][x_key] for p in chosen]
        for name in chosen[0]["sides"]:
            label = chosen[0]["sides"][name].get("variant") or name
            medians = [p["sides"][name]["median_s"] for p in chosen]
            (line,) = axis.plot(xs, medians, "o-", label=label)
            axis.plot(xs, [p["sides"][name]["min_s"] for p in chosen], "--", color=line.get_color())
        axis.set_xlabel(f"{x_key.replace('_', ' ')} ({fixed_key.replace('_', ' ')} {fixed})")
        axis.set_ylabel("median s / GRPO step")
        axis.set_xticks(xs)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if episodes:
        point = episodes[0]
        names = list(point["sides"])
        axes[2].bar(names, [point["sides"][n]["median_s"] for n in names], color="C2", alpha=0.7)
        axes[2].plot(names, [point["sides"][n]["min_s"] for n in names], "k_", markersize=20)
        axes[2].set_ylabel("median s / GRPO step (bar), fastest (tick)")
        axes[2].set_xlabel(f"calculator episodes, <= 3 turns, group {point['setup']['group_size']}")
        axes[2].grid(alpha=0.3, axis="y")
    figure.suptitle(
        f"{setup['model']} ({setup['precision']}), {setup['prompts']} prompts/step, every "
        f"completion to the cap, {setup['device']} {setup['threads']} thread(s)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return
    if args.sweep:
        sweep(args)
        return
    torch.set_num_threads(args.threads)
    result = measure(args)
    print_report(args, result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
