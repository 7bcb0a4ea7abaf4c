"""Channel-3 pairs on a verifiable task: a model's own replies replayed through hinted teachers.

Trace-replay DPO (channel 3) is this project's own research addition, not part of Cursor's
published Composer recipe. Its pairs normally come from real agent traces replayed through
teacher models behind an API (tools/ingest_traces.py -> tools/replay_traces.py ->
tools/build_pairs.py). A small instruct model such as SmolLM2-135M-Instruct cannot use those:
its chat template renders no tool calls, and the traces are not its task. This tool makes pairs
it can learn from, on a recipe config's own task, with the same replayed-step records and the
same mining rules (composer_tune.data.pairs):

* the trace (the "agent's action"): the model's greedy reply to a training problem;
* the teachers: the same model, greedy, with the gold answer revealed in the user turn, one
  hint wording per teacher (privileged-information teachers, as SDPO's self-teacher; no API);
  on a code task (rows with ``tests``: ``--config smollm2_code``) the privileged information is
  the task's reference solution (``CODE_TEACHER_HINTS``);
* mining (``RULES``): replies agree when their final answers do; when the teachers agree with
  each other and all disagree with the trace, the first teacher's reply is chosen over the
  trace; when all but one agree with the trace, the trace is chosen over the outlier. On code
  (``CODE_RULES``) two replies agree when the task's hidden tests pass on both (the config's
  reward, the split grader, checks the trace and every teacher reply), so a teacher consensus
  is a consensus of passing programs over a failing trace.

The pairs' prompts are the plain problems (no hint): DPO teaches the student what its hinted
self would answer. Problems come from the config's training ``dataset`` (never its held-out
split).

    python tools/hinted_teacher_pairs.py --config smollm2 --num-problems 512 \\
        --out recipes/assets/smollm2_arithmetic_pairs/pairs.jsonl

Writes --out (pairs JSONL), <out>.replayed.jsonl (the records mining read) and
<out>.summary.json (kept pairs by mode, skipped steps by reason).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/hinted_teacher_pairs.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from composer_tune import config  # noqa: E402
from composer_tune.data.pairs import MODES, PairRules, write_pairs  # noqa: E402
from composer_tune.models.build import enable_autocast, load_pretrained  # noqa: E402
from composer_tune.rewards.functions import ScoringBatch, build_reward, score_completions  # noqa: E402
from composer_tune.rollout import encode_prompts, generate  # noqa: E402

# One teacher per wording; the hint follows the question in the user turn. SmolLM2-135M-Instruct
# follows these three best of the wordings tried on 512 training problems (greedy reply's last
# number = the answer: "A verifier checked ..." 0.93; "(Hint: the answer is N.)" only 0.38 and
# "The correct solution is N." 0.72, which made the teachers disagree on most problems).
TEACHER_HINTS: dict[str, str] = {
    "verifier": "A verifier checked this problem: the correct answer is {answer}.",
    "teacher": "A teacher checked this problem: the correct answer is {answer}.",
    "answer_key": "The answer key checked this problem: the correct answer is {answer}.",
}
# Code tasks: the reference solution is the privileged information, in three wordings.
CODE_TEACHER_HINTS: dict[str, str] = {
    "verifier": "A verifier checked this solution against the tests:\n```python\n{solution}```",
    "teacher": "A teacher wrote this solution, which passes the tests:\n```python\n{solution}```",
    "answer_key": "The answer key's solution:\n```python\n{solution}```",
}
SOURCE_FORMAT = "hinted_teacher_replay"
# The channel-3 rules with both modes; replies agree when their final answers do (their wording
# is not the action on a task with a verifiable answer).
RULES = PairRules(modes=MODES, text_match="final_answer")
CODE_RULES = PairRules(modes=MODES, text_match="verified")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a recipes/grpo.py config name or path")
    parser.add_argument("--num-problems", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's")
    parser.add_argument("--out", type=Path, required=True, help="pairs JSONL to write")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    if args.num_problems < 1 or args.batch_size < 1:
        parser.error("--num-problems and --batch-size must be >= 1")
    return args


def is_code_task(sample: Mapping[str, Any]) -> bool:
    """A row of a code task (hidden ``tests`` and a reference ``solution``), not an answer task."""
    return "tests" in sample and bool(sample.get("solution"))


def hinted(sample: Mapping[str, Any], wording: str) -> dict[str, Any]:
    """``sample`` with ``wording`` (formatted with its answer, or its reference solution on a code
    task) after the last user message."""
    messages = [dict(message) for message in sample["prompt"]]
    last = messages[-1]
    if last["role"] != "user":
        raise ValueError(f"sample {sample.get('id')!r}: the prompt must end with a user message")
    if is_code_task(sample):
        hint = wording.format(solution=sample["solution"])
    else:
        hint = wording.format(answer=sample["answer"])
    last["content"] = f"{last['content']} {hint}"
    return {**sample, "prompt": messages}


@torch.no_grad()
def greedy_replies(
    model: torch.nn.Module,
    tokenizer: Any,
    samples: Sequence[Mapping[str, Any]],
    *,
    batch_size: int,
    max_new_tokens: int,
    enable_thinking: bool,
) -> list[str]:
    """The model's greedy reply to each sample's prompt."""
    replies: list[str] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        output = generate(
            model,
            encode_prompts(tokenizer, batch, enable_thinking=enable_thinking),
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_id,
            greedy=True,
            stop_tokens=tokenizer.stop_tokens,
        )
        replies += [tokenizer.decode(ids, skip_special_tokens=True) for ids in output.completions]
    return replies


def replayed_record(
    sample: Mapping[str, Any],
    index: int,
    trace: str,
    teachers: Mapping[str, str],
    model: str,
    verified: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """One replayed-step record in tools/replay_traces.py's format (what mining reads);
    ``verified`` (code tasks) holds the tests' verdict on the trace (key ``trace``) and on each
    teacher's reply."""
    verdicts = verified or {}

    def action(text: str, who: str) -> dict[str, Any]:
        return {"text": text, "tool_calls": [], **({"verified": verdicts[who]} if verdicts else {})}

    return {
        "step_index": index,
        "step": {
            "context": list(sample["prompt"]),
            "action": action(trace, "trace"),
            "provenance": {
                "source_format": SOURCE_FORMAT,
                "session_id": str(sample["id"]),
                "step_index": 0,
                "record_ids": [str(sample["id"])],
                "is_sidechain": False,
                **({} if is_code_task(sample) else {"gold_answer": str(sample["answer"])}),
            },
        },
        "tools": [],
        "teachers": {
            name: {
                "status": "ok",
                "model": f"{model} + {name} hint",
                "action": action(text, name),
            }
            for name, text in teachers.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from recipes.grpo import GRPOConfig

    try:
        cfg = config.load_config(
            args.config,
            ["output_dir=unused", *args.overrides],
            recipe_file=REPO_ROOT / "recipes" / "grpo.py",
            schema=GRPOConfig,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not cfg.checkpoint.initial_checkpoint:
        print(
            f"error: config {args.config!r} has no checkpoint.initial_checkpoint: the teachers "
            "and the trace are that pretrained model",
            file=sys.stderr,
        )
        return 1
    checkpoint = Path(cfg.checkpoint.initial_checkpoint)
    model = load_pretrained(checkpoint, backend=cfg.model.get("backend", "auto"))
    enable_autocast(model, cfg.autocast, torch.device("cpu"))
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.dataset)
    samples, seen = [], set()
    for index in range(len(dataset)):  # distinct problems, in dataset order
        sample = dataset[index]
        key = json.dumps(sample["prompt"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            samples.append(sample)
        if len(samples) == args.num_problems:
            break
    generation = {
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens or cfg.max_new_tokens,
        "enable_thinking": cfg.enable_thinking,
    }
    code = is_code_task(samples[0])
    hints, rules = (CODE_TEACHER_HINTS, CODE_RULES) if code else (TEACHER_HINTS, RULES)
    traces = greedy_replies(model, tokenizer, samples, **generation)
    teacher_replies = {
        name: greedy_replies(model, tokenizer, [hinted(s, wording) for s in samples], **generation)
        for name, wording in hints.items()
    }
    verified: dict[str, list[bool]] = {}
    if code:  # the tests' verdict on every reply (the split grader behind the config's reward)
        reward = build_reward(cfg.reward)
        for name, texts in {"trace": traces, **teacher_replies}.items():
            results = score_completions(reward, ScoringBatch(samples, texts, [[]] * len(texts)))
            verified[name] = [bool(result.correct) for result in results]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    replayed_path = args.out.with_name(args.out.name + ".replayed.jsonl")
    with replayed_path.open("w", encoding="utf-8") as handle:
        for index, (sample, trace) in enumerate(zip(samples, traces, strict=True)):
            replies = {name: teacher_replies[name][index] for name in hints}
            verdicts = {name: flags[index] for name, flags in verified.items()}
            record = replayed_record(sample, index, trace, replies, checkpoint.name, verdicts)
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary = write_pairs(replayed_path, rules, args.out)
    summary_path = args.out.with_name(args.out.name + ".summary.json")
    summary_path.write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
    print(f"{args.out}: {json.dumps(summary.to_dict())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
