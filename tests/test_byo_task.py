"""The README's "Bring your own task" example (examples/byo_task: a JSONL file in TRL's format,
TRL reward functions, a TRL environment), with no project code: its rewards through the recipe's
own set-up and episode scoring equal TRL 1.16's ``GRPOTrainer`` reward path on the same
completions; its README command runs as written in a fresh copy of the repository; and a
held-out TRL-contract environment with its own dataset and no gold answer trains two steps and
evaluates on SmolLM2 at the shipped ``smollm2_tools`` window."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from composer_tune import config
from composer_tune.agents import build_agent
from composer_tune.agents.episodes import EpisodeRunner, score_episodes
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.distributed import DistInfo
from composer_tune.run.loop import PromptTask
from tests.recipe_runs import REPO_ROOT, TUNE, RecipeRun, checkout_env
from tests.test_agent_episodes import QWEN3_TOKENIZER, ScriptedPolicy

EXAMPLE = REPO_ROOT / "examples" / "byo_task"
EXAMPLE_CONFIG = "examples/byo_task/grpo_smollm2.yaml"
CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _recipe_task(monkeypatch: pytest.MonkeyPatch):
    """The example's agent and task exactly as ``recipes/grpo.py`` builds them from its config
    (relative paths from the repository root, as the README runs it)."""
    monkeypatch.chdir(REPO_ROOT)
    cfg = config.load_recipe_config(REPO_ROOT / "recipes" / "grpo.py", EXAMPLE_CONFIG)
    agent = build_agent(cfg.agent)
    return cfg, agent, PromptTask.from_config(cfg, CPU, agent=agent)


def _episodes(agent, scripts: list[list[str]], samples: list[dict]):
    """One scripted episode per sample, run by the recipe's episode runner."""
    tokenizer = agent.tokenizer_for(ChatTokenizer.from_dir(QWEN3_TOKENIZER))
    episodes = agent.start(samples, tokenizer, enable_thinking=True)
    runner = EpisodeRunner(tokenizer, agent.limits, seq_limit=None, enable_thinking=True)
    for episode, script in zip(episodes, scripts, strict=True):
        runner.run([episode], ScriptedPolicy(tokenizer, script), sync_ranks=False)
    return episodes


def test_example_rewards_equal_trls_grpo_trainer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Four scripted episodes (the tool called and the stock reported; a guess; a wrong item
    and a long reply; tool calls until the turns run out, no reply) through the recipe's scoring
    and through ``GRPOTrainer._calculate_rewards`` with the environment TRL builds from the same
    class, summed as TRL sums (``reward_weights``, nansum, all-None rows unscored)."""
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_chat_template

    from examples.byo_task.rewards import reports_stock, short_reply
    from examples.byo_task.warehouse import Warehouse

    cfg, agent, task = _recipe_task(monkeypatch)
    samples = [task.dataset[index] for index in range(4)]
    items = [sample["item"] for sample in samples]
    scripts = [
        [_call("check_stock", {"item": items[0]}), str(samples[0]["stock"])],
        ["I cannot tell."],
        [_call("check_stock", {"item": "widgets"}), "There are 12 boxes of them in the room."],
        [_call("check_stock", {"item": items[3]})] * cfg.agent.max_turns,
    ]
    episodes = _episodes(agent, scripts, samples)
    ours = [result.score for result in score_episodes(episodes, task.reward)]
    # reports_stock + 0.1 * short_reply + get_reward (0.5 for looking the item up).
    assert ours == pytest.approx([1.0 + 0.1 + 0.5, 0.1, 0.0, 0.5])

    # TRL: the same rows read by its own loader, the same completions and completion ids.
    rows = datasets.load_dataset("json", data_files=str(EXAMPLE / "train.jsonl"), split="train")
    inputs = [rows[task.dataset.rows[index]] for index in range(4)]
    assert [(row["item"], row["stock"]) for row in inputs] == [
        (sample["item"], sample["stock"]) for sample in samples
    ]
    tokenizer = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER, padding_side="left")
    tokenizer.chat_template = qwen3_chat_template  # TRL parses tool calls for templates it knows
    tiny = Qwen3Config(
        vocab_size=994, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, head_dim=8,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=Qwen3ForCausalLM(tiny),
        reward_funcs=[reports_stock, short_reply],
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            use_cpu=True,
            per_device_train_batch_size=2,
            num_generations=2,
            reward_weights=list(task.reward.weights),
            report_to="none",
            max_steps=1,
            logging_strategy="no",
            save_strategy="no",
        ),
        train_dataset=rows,
        processing_class=tokenizer,
        environment_factory=Warehouse,
    )
    assert trainer.reward_func_names == ["reports_stock", "short_reply", "Warehouse"]
    environments = []
    for row, episode in zip(inputs, episodes, strict=True):
        environment = Warehouse()  # TRL's instance, driven by the episode's executed calls
        environment.reset(**row)
        for call in episode.record.tool_calls:
            getattr(environment, call["name"])(**call["arguments"])
        environments.append(environment)
    trainer.environments = environments
    per_function = trainer._calculate_rewards(
        inputs,
        [episode.prompt_messages for episode in episodes],
        [episode.completion_messages() for episode in episodes],
        [episode.ids[episode.prompt_length :] for episode in episodes],
    )
    # GRPOTrainer._generate_and_score_completions (sum_then_normalize), verbatim.
    unscorable = torch.isnan(per_function).all(dim=1)
    theirs = (per_function * trainer.reward_weights.unsqueeze(0)).nansum(dim=1)
    theirs[unscorable] = torch.nan
    assert math.isnan(per_function[3, 1])  # short_reply: None for the episode with no reply
    assert theirs.tolist() == pytest.approx(ours)


def test_example_config_is_checked_against_the_window(
    monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    """The example's prompts with the tool schema, in SmolLM2's Hermes template, fit the
    window with ``max_episode_tokens``; one token less of window is one error line naming the
    keys."""
    from composer_tune.run.lengths import check_prompt_lengths

    cfg, agent, task = _recipe_task(monkeypatch)
    tokenizer = config.instantiate(cfg.tokenizer)
    check_prompt_lengths(cfg, tokenizer, task.dataset, task.eval_dataset, agent)
    longest = max(
        len(agent.prompt_ids(task.dataset[row], tokenizer, cfg.enable_thinking))
        for row in range(len(task.dataset))
    )
    cfg.model.max_seq_len = longest + cfg.agent.max_episode_tokens - 1
    with pytest.raises(ValueError) as info:
        check_prompt_lengths(cfg, tokenizer, task.dataset, task.eval_dataset, agent)
    assert str(info.value).endswith(
        f"past model.max_seq_len={cfg.model.max_seq_len}: raise model.max_seq_len or lower "
        "agent.max_episode_tokens"
    )


def _readme_command() -> str:
    """The one command of the README's "Bring your own task" section."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Bring your own task", 1)[1].split("\n## ", 1)[0]
    (command,) = re.findall(r"^tune run .*$", section, re.M)
    return command


def _fresh_copy(destination: Path) -> Path:
    """The checkout's files as a fresh clone of it would hold them (tracked and new files,
    nothing git ignores: no outputs, caches or virtual environment)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def _tune(command: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``command`` (``tune run ...``) in ``cwd`` with the venv's ``tune``, importing the checkout
    in ``cwd``."""
    args = command.split()[1:]
    env = {**checkout_env(cwd), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [TUNE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_readme_command_trains_the_example_in_a_fresh_copy(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    clone = _fresh_copy(tmp_path / "clone")
    assert not (clone / "outputs").exists()
    result = _tune(_readme_command(), clone)
    assert result.returncode == 0, result.stderr[-4000:]
    run = RecipeRun(clone / "outputs" / "byo_task", result.stdout, result.stderr)
    metrics = run.metrics()
    steps = [metrics[s] for s in sorted(metrics) if "episode/turns" in metrics[s]]
    assert len(steps) == 2 and all(math.isfinite(step["grad_norm"]) for step in steps)
    evaluations = [metrics[s] for s in sorted(metrics) if "eval/accuracy" in metrics[s]]
    assert len(evaluations) == 2  # before and after, on heldout.jsonl, no gold answer
    assert all(0.0 <= e["eval/accuracy"] <= 1.0 and "eval/tool_use_rate" in e for e in evaluations)
    assert len(run.heldout_accuracies()) == 2
    assert (run.output_dir / "checkpoints" / "step_0000002").is_dir()


HELDOUT_ENVIRONMENT = '''
"""A TRL 1.16 environment_factory class written for this test only: three tools, a dataset of
its own, no gold answer: the environment's get_reward() is the reward."""


class Library:
    def reset(self, shelf: str, title: str, year: int, **row) -> str:
        self.shelf, self.title, self.year, self.found = shelf, title, year, False
        return f" (The catalogue covers shelf {shelf}.)"

    def search(self, words: str) -> str:
        """Search the catalogue for a title.

        Args:
            words: Words of the title to look for.
        """
        hit = any(word.lower() in self.title.lower() for word in words.split())
        return f"{self.title!r} is on shelf {self.shelf}" if hit else "no match"

    def borrow(self, title: str) -> str:
        """Borrow a book by its exact title.

        Args:
            title: The exact title, as the catalogue gives it.
        """
        self.found = title.strip().lower() == self.title.lower()
        return "Borrowed." if self.found else "No such book on this shelf."

    def publication_year(self, title: str) -> str:
        """The year a book in the catalogue was published.

        Args:
            title: The exact title.
        """
        return str(self.year) if title.strip().lower() == self.title.lower() else "unknown"

    def get_reward(self) -> float:
        return 1.0 if self.found else 0.0
'''


@pytest.mark.slow
def test_a_heldout_trl_environment_trains_and_evaluates_on_smollm2_tools(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    """The issue's new-user run: a TRL environment and dataset of its own (no ``answer``
    column), ``grpo smollm2_tools`` with overrides only. Its three tools' schemas make the
    prompt long: at the shipped window (384) the config's ``max_episode_tokens`` does not fit,
    which set-up says in one line naming the keys; with a smaller budget it trains two steps
    and evaluates, greedy and sampled, with the environment's reward."""
    (tmp_path / "library_task").mkdir()
    (tmp_path / "library_task" / "library.py").write_text(HELDOUT_ENVIRONMENT)
    titles = ["Dune", "Emma", "Ulysses", "Beloved", "Middlemarch", "Persuasion"]
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Please borrow {title} for me."}],
            "shelf": f"{chr(65 + i)}{i}",
            "title": title,
            "year": 1800 + 20 * i,
        }
        for i, title in enumerate(titles)
    ]
    for name, part in (("train", rows[:4]), ("heldout", rows[4:])):
        with (tmp_path / "library_task" / f"{name}.jsonl").open("w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in part)
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        "warm_start=null",
        "checkpoint.initial_checkpoint=${model.path}",
        "dataset._component_=composer_tune.data.TaskDataset",
        f"dataset.source={tmp_path / 'library_task' / 'train.jsonl'}",
        "~dataset.split", "~dataset.num_samples", "~dataset.seed",
        "eval_dataset._component_=composer_tune.data.TaskDataset",
        f"eval_dataset.source={tmp_path / 'library_task' / 'heldout.jsonl'}",
        "~eval_dataset.split", "~eval_dataset.num_samples", "~eval_dataset.seed",
        "reward=null", "eval_reward=null",
        "agent.environment=library_task.library.Library", "agent.tools=[]",
        "agent.max_turns=2", "agent.max_tokens_per_turn=24",
        "num_prompts_per_generation=2", "group_size=2", "micro_batch_size=4", "max_steps=2",
        "eval_sampling.samples_per_problem=2",
    ]  # fmt: skip
    env = checkout_env()  # and the task's own folder, as a user's PYTHONPATH would hold it
    env.update(PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{tmp_path}", PYTHONUNBUFFERED="1")

    def tune(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [TUNE, "run", "recipes/grpo.py", "--config", "smollm2_tools", *overrides, *extra],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip

    refused = tune()
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "with the tool schemas" in line and "agent.max_episode_tokens=120" in line
    assert line.endswith(
        "past model.max_seq_len=384: raise model.max_seq_len or lower agent.max_episode_tokens"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()

    # What the training prompts leave, less a margin for the held-out ones (other titles).
    budget = 384 - int(re.search(r"its prompt is (\d+) tokens", line).group(1)) - 8
    result = tune(f"agent.max_episode_tokens={budget}")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = RecipeRun(tmp_path / "run", result.stdout, result.stderr).metrics()
    steps = [metrics[s] for s in sorted(metrics) if "episode/turns" in metrics[s]]
    assert len(steps) == 2 and all(math.isfinite(step["loss"]) for step in steps)
    assert all(step["reward/unscored"] == 0.0 for step in steps)  # get_reward scored every one
    greedy = [metrics[s] for s in sorted(metrics) if "eval/accuracy" in metrics[s]]
    sampled = [metrics[s] for s in sorted(metrics) if "eval_sampled/accuracy" in metrics[s]]
    assert len(greedy) == 2 and len(sampled) == 2
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()
