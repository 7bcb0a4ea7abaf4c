"""Does a model's SDPO teacher know better than its student? The held-out gold-answer gap; and
where does the teacher want the student's reply to end?

    python tools/sdpo_teacher_gap.py --config smollm2                    # the config's model
    python tools/sdpo_teacher_gap.py --config smollm2 --checkpoint runs/x/checkpoints/step_0000040
    python tools/sdpo_teacher_gap.py --config cpu_smoke --checkpoint outputs/sft_cpu_smoke_hints \
        --num-problems 64
    python tools/sdpo_teacher_gap.py --config smollm2 --end-of-reply 4   # 4 generation batches

Scores the gold answer of the first ``--num-problems`` held-out problems of a ``recipes/sdpo.py``
config (its ``eval_dataset``, tokenizer and ``sdpo`` section) as the completion of the plain
prompt (the student) and of the prompt the SDPO channel builds for a wrong attempt (the teacher:
the verifier's feedback naming the answer), with the model of ``--checkpoint`` (a Hugging Face
directory, or a run folder whose latest checkpoint is taken; default: the config's
``checkpoint.initial_checkpoint``). Prints the mean gap (nats per answer) ± std, and the share of
problems where the teacher gives the gold answer more probability. Positive means the hint
helps: SDPO's premise.

``--end-of-reply N`` samples N generation batches of the config's training task with the model
(its sampling settings, seed ``seed``), builds the channel's teacher contexts, and prints, per
kind of row (ended and correct, ended and wrong: at the position where the student ended;
cut off at ``max_new_tokens``: averaged over its positions) and hint source, the end-of-reply
token's probability under the plain prompt (the student) and under the hinted prompt (the
teacher), the share of rows where the teacher's is lower, and the teacher's most likely tokens
where it would not end. A teacher that ends later than its student distils longer replies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/sdpo_teacher_gap.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from composer_tune import config  # noqa: E402
from composer_tune.channels.composer import ComposerChannels  # noqa: E402
from composer_tune.channels.sdpo import SDPOChannelConfig  # noqa: E402
from composer_tune.channels.sdpo.channel import build_sdpo_teacher_batch  # noqa: E402
from composer_tune.channels.sdpo.diagnostics import (  # noqa: E402
    end_of_reply_probs,
    gold_answer_gap,
)
from composer_tune.checkpointing.run_state import MODEL_DIR, latest_checkpoint  # noqa: E402
from composer_tune.distributed import setup_distributed  # noqa: E402
from composer_tune.models.build import load_pretrained  # noqa: E402
from composer_tune.run.loop import epoch_batches  # noqa: E402
from composer_tune.run.rl import RLRun  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a recipes/sdpo.py config name or path")
    parser.add_argument("--checkpoint", type=Path, help="HF model directory or run folder")
    parser.add_argument("--num-problems", type=int, default=64)
    parser.add_argument(
        "--end-of-reply",
        type=int,
        metavar="BATCHES",
        help="instead of the gold-answer gap: the end-of-reply probabilities of the student and "
        "the teacher on this many sampled generation batches",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    if args.num_problems < 1:
        parser.error("--num-problems must be >= 1")
    if args.end_of_reply is not None and args.end_of_reply < 1:
        parser.error("--end-of-reply must be >= 1")
    return args


def model_directory(checkpoint: Path) -> Path:
    """``checkpoint`` itself if it holds a config.json, else its run's latest checkpoint."""
    if (checkpoint / "config.json").is_file():
        return checkpoint
    latest = latest_checkpoint(checkpoint)
    if latest is None:
        raise FileNotFoundError(
            f"{checkpoint}: neither a Hugging Face model directory (config.json) nor a run "
            "folder with a complete checkpoint"
        )
    return latest / MODEL_DIR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from recipes.sdpo import SDPOConfig

    try:
        cfg = config.load_config(
            args.config,
            ["output_dir=unused", *args.overrides],
            recipe_file=REPO_ROOT / "recipes" / "sdpo.py",
            schema=SDPOConfig,
        )
        checkpoint = args.checkpoint or Path(cfg.checkpoint.initial_checkpoint)
        model_dir = model_directory(checkpoint)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.end_of_reply is not None:
        print(end_of_reply_report(cfg, model_dir, args.end_of_reply, SDPOConfig))
        return 0
    sdpo_cfg = SDPOChannelConfig.from_mapping(OmegaConf.to_container(cfg.sdpo, resolve=True))
    model = load_pretrained(model_dir, backend=cfg.model.get("backend", "auto"))
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.eval_dataset)
    samples = [dataset[index] for index in range(min(args.num_problems, len(dataset)))]
    gap = gold_answer_gap(model, tokenizer, samples, sdpo_cfg, enable_thinking=cfg.enable_thinking)
    spread = float(gap.std()) if len(gap) > 1 else 0.0
    print(
        f"{model_dir}: teacher - student log p(gold answer) = {float(gap.mean()):+.3f} ± "
        f"{spread:.3f} nats per answer over {len(gap)} held-out problems; the teacher prefers "
        f"the gold answer on {float((gap > 0).double().mean()):.2f} of them"
    )
    return 0


def end_of_reply_report(cfg: Any, model_dir: Path, batches: int, schema: type) -> str:
    """The ``--end-of-reply`` table (markdown) for ``batches`` generation batches sampled by
    ``model_dir``'s model with ``cfg``'s task, sampling settings and SDPO teacher contexts."""
    with tempfile.TemporaryDirectory() as scratch:
        cfg = OmegaConf.merge(
            cfg,
            {"output_dir": scratch, "checkpoint": {"initial_checkpoint": str(model_dir)}},
        )
        dist = setup_distributed(cfg.device)
        channels = ComposerChannels.from_config(cfg, dist)
        if not channels.sdpo.enabled:
            raise ValueError("--end-of-reply needs the SDPO channel on (sdpo.weight > 0)")
        run = RLRun(cfg, dist, channels, schema=schema)
        run.finish_setup()
        prompts = epoch_batches(run.task.loader, run.task.sampler, run.progress)
        model, tokenizer = run.model.eval(), run.tokenizer
        rows: list[dict[str, Any]] = []
        for _ in range(batches):
            rollouts = run.rollout(next(prompts))
            teacher_batch = build_sdpo_teacher_batch(
                rollouts, tokenizer=tokenizer, cfg=channels.sdpo
            )
            student, teacher, top = end_of_reply_probs(
                model, rollouts, teacher_batch, tokenizer.eos_id, temperature=cfg.temperature
            )
            for row in range(len(rollouts)):
                if not bool(teacher_batch.has_teacher[row]):
                    continue
                length = int(rollouts.completion_lengths[row])
                cut = bool(rollouts.truncated[row])
                rows.append(
                    {
                        "kind": "cut off"
                        if cut
                        else ("ended, correct" if bool(rollouts.correct[row]) else "ended, wrong"),
                        "source": teacher_batch.hint_sources[row],
                        # Where the student ended, or every position of a cut-off reply.
                        "student": float(
                            student[row, :length].mean() if cut else student[row, length - 1]
                        ),
                        "teacher": float(
                            teacher[row, :length].mean() if cut else teacher[row, length - 1]
                        ),
                        "top": None if cut else int(top[row, length - 1]),
                    }
                )
        run.close()
    lines = [
        f"{model_dir}: end-of-reply probability, student (plain prompt) vs SDPO teacher (hinted "
        f"prompt), {batches} generation batches of {cfg.num_prompts_per_generation} x "
        f"{cfg.group_size} at temperature {cfg.temperature}, rows with a teacher",
        "",
        "| rows | hint | n | student p(end) | teacher p(end) | teacher lower | teacher's top "
        "tokens where it would go on |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in ("ended, correct", "ended, wrong", "cut off"):
        for source in sorted({r["source"] for r in rows if r["kind"] == kind}):
            group = [r for r in rows if r["kind"] == kind and r["source"] == source]
            others = Counter(
                tokenizer.decode([r["top"]])
                for r in group
                if r["top"] not in (None, tokenizer.eos_id)
            )
            shown = ", ".join(f"{text!r} {count}" for text, count in others.most_common(3))
            lines.append(
                f"| {kind} | {source} | {len(group)} | "
                f"{statistics.fmean(r['student'] for r in group):.3f} | "
                f"{statistics.fmean(r['teacher'] for r in group):.3f} | "
                f"{sum(r['teacher'] < r['student'] for r in group) / len(group):.2f} | "
                f"{shown or '–'} |"
            )
    lines.append(
        "\n(ended rows: at the position where the student ended its reply; cut-off rows: the "
        "mean over their positions)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
