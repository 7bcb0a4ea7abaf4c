"""Does a model's SDPO teacher know better than its student? The held-out gold-answer gap.

    python tools/sdpo_teacher_gap.py --config smollm2                    # the config's model
    python tools/sdpo_teacher_gap.py --config smollm2 --checkpoint runs/x/checkpoints/step_0000040
    python tools/sdpo_teacher_gap.py --config cpu_smoke --checkpoint outputs/sft_cpu_smoke_hints \
        --num-problems 64

Scores the gold answer of the first ``--num-problems`` held-out problems of a ``recipes/sdpo.py``
config (its ``eval_dataset``, tokenizer and ``sdpo`` section) as the completion of the plain
prompt (the student) and of the prompt the SDPO channel builds for a wrong attempt (the teacher:
the verifier's feedback naming the answer), with the model of ``--checkpoint`` (a Hugging Face
directory, or a run folder whose latest checkpoint is taken; default: the config's
``checkpoint.initial_checkpoint``). Prints the mean gap (nats per answer) ± std, and the share of
problems where the teacher gives the gold answer more probability. Positive means the hint
helps: SDPO's premise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/sdpo_teacher_gap.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from omegaconf import OmegaConf  # noqa: E402

from composer_tune import config  # noqa: E402
from composer_tune.channels.sdpo import SDPOChannelConfig  # noqa: E402
from composer_tune.channels.sdpo.diagnostics import gold_answer_gap  # noqa: E402
from composer_tune.checkpointing.run_state import MODEL_DIR, latest_checkpoint  # noqa: E402
from composer_tune.models.build import load_pretrained  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a recipes/sdpo.py config name or path")
    parser.add_argument("--checkpoint", type=Path, help="HF model directory or run folder")
    parser.add_argument("--num-problems", type=int, default=64)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    if args.num_problems < 1:
        parser.error("--num-problems must be >= 1")
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


if __name__ == "__main__":
    sys.exit(main())
