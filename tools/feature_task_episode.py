#!/usr/bin/env python
"""Run one feature-deletion episode of a recipe config and log its tool calls and reward.

The episode runs exactly as in training: the config's agent section
(composer_tune.agents.repository.RepositoryEnvironment, its limits and tools), its dataset, its
tokenizer and chat template, and its reward (the hidden tests through the split grader). Each
tool call (turn, name, arguments, observation, error) and the reward with its feedback are
printed and written to --out as JSON.

--policy model samples from the config's policy as a run of it starts (its warm start or
checkpoint.initial_checkpoint; the cpu_smoke configs' random toy model: it calls no tool and
scores 0). --policy oracle replays a scripted agent instead of a model: it lists the files,
reads the damaged function, puts the removed code (a bug task: the original lines) back with
replace_in_file, runs the visible tests and answers; it scores 1 when the environment and the
grader work.

Examples:
    python tools/feature_task_episode.py --config cpu_smoke_feature_tasks --policy oracle
    python tools/feature_task_episode.py --config cpu_smoke_feature_tasks --policy model \
        --task 'inflection-0.5.1:inflection/__init__.py:camelize' --out episode.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Runnable as a script from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from composer_tune.agents import build_agent  # noqa: E402
from composer_tune.agents.episodes import EpisodeLimits, EpisodeRunner, score_episodes  # noqa: E402
from composer_tune.checkpointing.warm_start import initial_checkpoint  # noqa: E402
from composer_tune.config import ConfigError, instantiate, load_recipe_config  # noqa: E402
from composer_tune.data.feature_tasks import (  # noqa: E402
    LineEdit,
    read_source_file,
    task_from_sample,
)
from composer_tune.distributed import DistInfo  # noqa: E402
from composer_tune.rollout.generation import GenerationOutput  # noqa: E402
from composer_tune.run.loop import build_model  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="config name or YAML path")
    parser.add_argument(
        "--recipe", default="grpo", help="recipe whose configs hold it (default grpo)"
    )
    parser.add_argument("--task", help="task id (default: the dataset's first task)")
    parser.add_argument("--policy", choices=["model", "oracle"], default="model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the episode's record here (JSON)")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    return parser


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def restoring_edit(deletion: LineEdit, original_file: str) -> tuple[str, str]:
    """(old, new) for replace_in_file that undoes ``deletion``: the text it put in, with as
    many lines around it as make it occur once in the damaged file (a bug's changed line or a
    class's ``pass`` may occur more often), and the original text of the same lines."""
    lines = original_file.splitlines(keepends=True)
    start, end = deletion.start - 1, deletion.end
    damaged = "".join(lines[:start]) + deletion.replacement + "".join(lines[end:])
    for around in range(len(lines) + 1):
        before = "".join(lines[max(0, start - around) : start])
        after = "".join(lines[end : end + around])
        old = before + deletion.replacement + after
        if old and damaged.count(old) == 1:
            return old, before + "".join(lines[start:end]) + after
    raise ValueError(f"{deletion.file}: no text around the edit occurs once")


def oracle_script(sample: dict[str, Any]) -> list[str]:
    """The scripted agent's turns for ``sample``: look, read, restore, test, answer."""
    task, store = task_from_sample(sample)
    deletion = task.deletion
    old, new = restoring_edit(deletion, read_source_file(store, task, deletion.file))
    return [
        _call("list_files", {"path": "."}),
        _call(
            "read_file",
            {
                "path": deletion.file,
                "start_line": max(deletion.start - 5, 1),
                "end_line": deletion.end + 5,
            },
        ),
        _call("replace_in_file", {"path": deletion.file, "old": old, "new": new}),
        _call("run_tests", {"tests": ""}),
        f"I restored `{task.feature.qualname}` in {deletion.file}; the visible tests pass.",
    ]


class ScriptedSampler:
    """A sampler answering turn k with ``script[k]`` (tokenised, then the end of turn)."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer, self.script, self.turn = tokenizer, script, 0

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> GenerationOutput:
        ids = self.tokenizer.encode(self.script[self.turn])
        ids.append(self.tokenizer.token_to_id(self.tokenizer.chat_template.end_of_turn))
        self.turn += 1
        return GenerationOutput(
            completions=[list(ids) for _ in prompts],
            completion_lengths=torch.tensor([len(ids)] * len(prompts)),
            truncated=torch.tensor([False] * len(prompts)),
            logprobs=[torch.zeros(len(ids)) for _ in prompts],
        )


def _starting_policy(cfg: Any) -> torch.nn.Module:
    """The config's policy as a run of it starts: from its warm start (trained first if
    missing) or ``checkpoint.initial_checkpoint``, on this CPU; random weights only where the
    config loads none (and its model has none to miss: ``check_weights_are_loaded``)."""
    one = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
    start = initial_checkpoint(cfg.get("warm_start"), cfg.checkpoint.initial_checkpoint, one)
    return build_model(cfg, one, start, trainable=False)


def run_episode(cfg: Any, task_id: str | None, policy: str, seed: int) -> dict[str, Any]:
    """One episode of ``cfg``'s agent on one task; its record, reward and feedback."""
    agent = build_agent(cfg.agent)
    if agent is None:
        raise ConfigError("the config has no agent section")
    tokenizer = instantiate(cfg.tokenizer)
    samples = instantiate(cfg.dataset)
    sample = (
        samples[0] if task_id is None else next((s for s in samples if s["id"] == task_id), None)
    )
    if sample is None:
        raise ConfigError(f"no task {task_id!r} in the config's dataset")
    reward = instantiate(cfg.reward)
    torch.manual_seed(seed)
    if policy == "model":
        model = _starting_policy(cfg)
        episodes, results = agent.run(
            model,
            tokenizer,
            [sample],
            reward,
            greedy=False,
            temperature=float(cfg.get("temperature", 1.0)),
            generator=torch.Generator().manual_seed(seed),
            enable_thinking=bool(cfg.get("enable_thinking", False)),
        )
    else:
        script = oracle_script(sample)
        agent.limits = EpisodeLimits(len(script), 8192, None, agent.limits.tool_timeout_s)
        rendered = agent.tokenizer_for(tokenizer)
        episodes = agent.start([sample], rendered, enable_thinking=False)
        runner = EpisodeRunner(rendered, agent.limits, seq_limit=None, enable_thinking=False)
        runner.run(episodes, ScriptedSampler(rendered, script), sync_ranks=False)
        results = score_episodes(episodes, reward)
    record = episodes[0].record
    return {
        "task": sample["id"],
        "policy": policy,
        "reward": results[0].score,
        "success": results[0].correct,
        "feedback": results[0].feedback,
        "turns": record.turns,
        "truncated": record.truncated,
        "tool_calls": record.tool_calls,
        "final_text": episodes[0].final_text,
        "env_seconds": record.env_seconds,
        "generation_seconds": record.generation_seconds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_recipe_config(
            REPO / "recipes" / f"{args.recipe}.py", args.config, args.overrides
        )
        episode = run_episode(cfg, args.task, args.policy, args.seed)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for call in episode["tool_calls"]:
        arguments = json.dumps(call["arguments"])
        print(f"turn {call['turn']} {call['name']}({arguments[:160]}) error={call['error']}")
        print("    " + call["content"][:300].replace("\n", "\n    "))
    print(f"task {episode['task']}: reward {episode['reward']} after {episode['turns']} turns")
    if episode["feedback"]:
        print("feedback: " + episode["feedback"][:600])
    if args.out:
        args.out.write_text(json.dumps(episode, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
