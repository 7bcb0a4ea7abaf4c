"""Agent episodes against the chat template: packed ids, loss mask, tool-response placement and
every malformed case, with a scripted policy (no model) so each test is fast and exact."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from composer_tune.agents import build_agent
from composer_tune.agents.calculator import calculate
from composer_tune.agents.episodes import EpisodeRunner
from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout.generation import GenerationOutput
from composer_tune.rollout.rollouts import episode_metrics

QWEN3_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"


class ScriptedPolicy:
    """A sampler that answers turn ``k`` of every episode with ``script[k]`` (text, tokenised
    canonically, then the end of turn) and records the prompts it was given."""

    def __init__(self, tokenizer: ChatTokenizer, script: list[str], close: bool = True) -> None:
        self.tokenizer, self.script, self.close = tokenizer, script, close
        self.calls: list[list[list[int]]] = []

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> GenerationOutput:
        turn = len(self.calls)
        self.calls.append([list(p) for p in prompts])
        ids = self.tokenizer.encode(self.script[turn])
        if self.close:
            ids.append(self.tokenizer.token_to_id(self.tokenizer.chat_template.end_of_turn))
        ids = ids[:max_new_tokens]
        completions = [list(ids) for _ in prompts]
        return GenerationOutput(
            completions=completions,
            completion_lengths=torch.tensor([len(c) for c in completions]),
            truncated=torch.tensor([len(ids) == max_new_tokens and not self.close] * len(prompts)),
            logprobs=[torch.full((len(c),), -0.5) for c in completions],
        )


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _run(agent_section: dict, tokenizer: ChatTokenizer, script: list[str], samples, **kwargs):
    agent = build_agent(agent_section)
    tokenizer = agent.tokenizer_for(tokenizer)
    episodes = agent.start(samples, tokenizer, enable_thinking=True)
    runner = EpisodeRunner(
        tokenizer, agent.limits, seq_limit=kwargs.get("seq_limit"), enable_thinking=True
    )
    policy = ScriptedPolicy(tokenizer, script, close=kwargs.get("close", True))
    runner.run(episodes, policy, sync_ranks=False)
    return agent, tokenizer, episodes, policy


CALC = {"tools": ["composer_tune.agents.calculator.calculate"], "max_turns": 3}
SAMPLE = {"prompt": [{"role": "user", "content": "What is 347 * 68?"}], "answer": "23596"}


def _check_packing(tokenizer, hf_tokenizer, episode, schemas) -> None:
    """ids == apply_chat_template(conversation) up to the final end of turn; mask == exactly
    the model's spans."""
    expected = hf_tokenizer.apply_chat_template(
        episode.record.conversation, tools=schemas, tokenize=True, return_dict=False
    )
    eot = tokenizer.token_to_id(tokenizer.chat_template.end_of_turn)
    last = len(expected) - 1 - expected[::-1].index(eot)
    assert episode.ids == expected[: last + 1]
    spans = [i for start, end in episode.record.turn_spans for i in range(start, end)]
    assert [i for i, m in enumerate(episode.model_mask) if m] == spans
    # The model's spans are exactly the assistant turns the template marks.
    _, template_mask = tokenizer.tokenize_messages(episode.record.conversation, tools=schemas)
    assert episode.model_mask == template_mask[: len(episode.ids)]


def test_qwen3_episode_packs_like_the_chat_template() -> None:
    tokenizer = ChatTokenizer.from_dir(QWEN3_TOKENIZER)
    hf = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    script = [_call("calculate", {"expression": "347 * 68"}), "<think>\n\n</think>\n\n23596"]
    agent, tokenizer, episodes, policy = _run(CALC, tokenizer, script, [SAMPLE, SAMPLE])
    episode = episodes[0]
    assert [m["role"] for m in episode.record.conversation] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert episode.record.conversation[2]["content"] == "23596"
    assert episode.record.turns == 2 and episode.record.truncated is None
    assert len(policy.calls) == 2 and len(policy.calls[1]) == 2  # both episodes, batched
    _check_packing(tokenizer, hf, episode, episode.schemas)
    assert episode.final_text.endswith("23596")


def test_smollm2_hermes_episode_packs_like_the_chat_template(smollm2_dir: Path) -> None:
    tokenizer = ChatTokenizer.from_dir(smollm2_dir)
    section = {**CALC, "tool_template": "hermes"}
    script = [_call("calculate", {"expression": "347 * 68"}), "23596"]
    agent, tokenizer, episodes, _ = _run(section, tokenizer, script, [SAMPLE])
    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    hf.chat_template = tokenizer.chat_template.source
    _check_packing(tokenizer, hf, episodes[0], episodes[0].schemas)
    rendered = tokenizer.render(episodes[0].record.conversation, tools=episodes[0].schemas)
    assert "<tools>" in rendered and "<tool_response>\n23596\n</tool_response>" in rendered


def test_trl_environment_reset_observation_and_reward() -> None:
    tokenizer = ChatTokenizer.from_dir(QWEN3_TOKENIZER)
    section = {"environment": "tests.test_agent_episodes.CounterEnv", "max_turns": 3}
    script = [_call("increment", {"step": 2}), "done"]
    agent, tokenizer, episodes, _ = _run(section, tokenizer, script, [{**SAMPLE, "start": 5}])
    episode = episodes[0]
    assert episode.record.conversation[0]["content"] == "What is 347 * 68? Counter starts at 5."
    assert episode.record.conversation[2]["content"] == "7"
    from composer_tune.agents.episodes import score_episodes

    [result] = score_episodes(episodes, MathAnswerReward())
    assert result.score == 0.0 + 7.0  # the recipe reward (wrong answer) + get_reward()


class CounterEnv:
    """A TRL-style environment, written only against TRL's documented contract."""

    def __init__(self) -> None:
        self.value = 0

    def reset(self, **sample) -> str | None:
        self.value = sample.get("start", 0)
        return f" Counter starts at {self.value}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return float(self.value)


class NoReset:
    def undocumented(self, x):
        return x


def slow_tool(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def failing_tool(x: int) -> str:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


BAD_TOOLS = {
    "tools": [
        "composer_tune.agents.calculator.calculate",
        "tests.test_agent_episodes.slow_tool",
        "tests.test_agent_episodes.failing_tool",
    ],
    "max_turns": 3,
    "tool_timeout_s": 0.2,
}


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (
            '<tool_call>\n{"name": "calculate", "arguments": {"expression": \n</tool_call>',
            "invalid JSON",
        ),
        ('<tool_call>\n{"name": "calculate"', "never closed"),
        (_call("search_web", {"q": "x"}), "Tool search_web not found."),
        (
            _call("calculate", {"expression": "1", "digits": 2}),
            "unexpected keyword argument 'digits'",
        ),
        (_call("calculate", {}), "missing a required argument: 'expression'"),
        (_call("calculate", {"expression": "import os"}), "SyntaxError"),
        (_call("failing_tool", {"x": 3}), "RuntimeError: boom 3"),
        (_call("slow_tool", {"seconds": 5}), "slow_tool timed out after 0.2 s"),
    ],
)
def test_bad_tool_calls_become_error_observations(call: str, error: str) -> None:
    tokenizer = ChatTokenizer.from_dir(QWEN3_TOKENIZER)
    agent, tokenizer, episodes, policy = _run(BAD_TOOLS, tokenizer, [call, "42"], [SAMPLE])
    record = episodes[0].record
    assert len(policy.calls) == 2, "the episode continued after the bad call"
    assert record.tool_errors == 1 and record.error_turn == 0
    assert error in record.feedback and record.feedback.startswith("{'error':")
    assert record.conversation[-2] == {
        "role": "tool",
        "name": record.conversation[-2]["name"],
        "content": record.feedback,
    }
    assert episode_metrics([record], "episode/", "cpu")["episode/tool_errors"] == 1.0
    # The model sees the error: it is in the ids, outside the loss mask.
    observation = tokenizer.encode(record.feedback)
    ids, mask = episodes[0].ids, episodes[0].model_mask
    start = next(i for i in range(len(ids)) if ids[i : i + len(observation)] == observation)
    assert not any(mask[start : start + len(observation)])


def test_limits_truncate_and_flag_episodes() -> None:
    tokenizer = ChatTokenizer.from_dir(QWEN3_TOKENIZER)
    call = _call("calculate", {"expression": "2 * 3"})
    # max_turns: the last turn still calls a tool.
    _, _, [episode], _ = _run({**CALC, "max_turns": 2}, tokenizer, [call, call], [SAMPLE])
    assert episode.record.truncated == "max_turns" and episode.record.turns == 2
    # A turn longer than max_tokens_per_turn.
    _, _, [episode], _ = _run(
        {**CALC, "max_tokens_per_turn": 5}, tokenizer, [call], [SAMPLE], close=False
    )
    assert episode.record.truncated == "max_tokens_per_turn" and sum(episode.model_mask) == 5
    # A tool response that would outgrow max_seq_len is dropped (TRL) and the episode ends.
    prompt = build_agent(CALC).start([SAMPLE], tokenizer, True)[0].prompt_length
    _, _, [episode], _ = _run(CALC, tokenizer, [call, "6"], [SAMPLE], seq_limit=prompt + 25)
    assert episode.record.truncated == "max_seq_len" and episode.record.turns == 1
    assert (
        len(episode.ids) <= prompt + 25 and episode.record.conversation[-1]["role"] == "assistant"
    )
    # max_episode_tokens caps sampled + tool tokens after the prompt.
    _, _, [episode], _ = _run({**CALC, "max_episode_tokens": 30}, tokenizer, [call, "6"], [SAMPLE])
    assert episode.record.truncated == "max_episode_tokens"
    assert len(episode.ids) - episode.prompt_length <= 30
    assert episode_metrics([episode.record], "episode/", "cpu")["episode/truncated"] == 1.0


def test_tokenizer_tool_template_and_default_tools(smollm2_dir: Path) -> None:
    from composer_tune.data.tokenizer import from_pretrained

    question = [{"role": "user", "content": "What is 2 * 3?"}]
    plain = from_pretrained(str(smollm2_dir))
    assert plain.render(question, tools=[{"name": "calculate"}]) == plain.render(question)
    hermes = from_pretrained(
        str(smollm2_dir),
        chat_template="hermes",
        tools=["composer_tune.agents.calculator.calculate"],
    )
    rendered = hermes.render(question)  # the default tools, as an SFT run renders its data
    assert '<tools>\n{"name": "calculate"' in rendered
    assert (
        hermes.stop_tokens == plain.stop_tokens and hermes.chat_template.end_of_turn == "<|im_end|>"
    )
    with pytest.raises(
        FileNotFoundError, match="chat template 'chatml2': not one of \\['hermes'\\]"
    ):
        from_pretrained(str(smollm2_dir), chat_template="chatml2")


def test_environments_are_chosen_per_sample_one_instance_per_episode() -> None:
    tokenizer = ChatTokenizer.from_dir(QWEN3_TOKENIZER)
    section = {
        "environment": {
            "counter": {"_component_": "tests.test_agent_episodes.CounterEnv"},
            "coding": {"_component_": "composer_tune.agents.coding.CodingEnvironment"},
        },
        "max_turns": 2,
    }
    samples = [
        {**SAMPLE, "environment": "counter", "start": 1},
        {**SAMPLE, "environment": "counter", "start": 2},
        {**SAMPLE, "environment": "coding", "tests": ["assert True"]},
    ]
    agent, _, episodes, _ = _run(section, tokenizer, ["done"], samples)
    first, second, coding = (e.environment for e in episodes)
    assert (first.value, second.value) == (1, 2) and first is not second
    assert sorted(episodes[0].tools) == ["increment"] and sorted(episodes[2].tools) == [
        "run_code",
        "run_tests",
    ]
    assert [s["function"]["name"] for s in episodes[2].schemas] == ["run_code", "run_tests"]
    with pytest.raises(
        ValueError,
        match=r"environment='chess', not among the configured environments \['coding', 'counter'\]",
    ):
        agent.start([{**SAMPLE, "environment": "chess"}], tokenizer, True)


def test_unknown_environment_fails_at_setup() -> None:
    with pytest.raises(
        ValueError, match=r"agent.environment: cannot import 'composer_tune.agents.NoSuchEnv'"
    ):
        build_agent({"environment": {"_component_": "composer_tune.agents.NoSuchEnv"}})
    with pytest.raises(ValueError, match=r"agent: unknown keys \['max_turn'\]"):
        build_agent({"tools": ["composer_tune.agents.calculator.calculate"], "max_turn": 2})
    with pytest.raises(ValueError, match="NoReset has no callable reset"):
        build_agent({"environment": "tests.test_agent_episodes.NoReset"})
    with pytest.raises(ValueError, match="CalculatorProblems does not take"):
        build_agent({"environment": "composer_tune.agents.calculator.CalculatorProblems"})
    with pytest.raises(ValueError, match="agent.tools: a tool has no usable schema"):
        build_agent({"tools": ["tests.test_agent_episodes.NoReset.undocumented"]})
    assert build_agent(None) is None


def test_calculator_tool_and_problems() -> None:
    from composer_tune.agents.calculator import CalculatorDemonstrations, CalculatorProblems

    assert calculate("347 * 68") == "23596" and calculate("12 * 34 - 100") == "308"
    with pytest.raises(ValueError):
        calculate("__import__('os')")
    heldout = CalculatorProblems("heldout", 200, seed=1)
    train = CalculatorProblems("train", 500, seed=0)
    held = [heldout.expression(i) for i in range(200)]
    assert len(set(held)) == 200
    assert not set(held) & {train.expression(i) for i in range(500)}
    assert held == [CalculatorProblems("heldout", 200, seed=1).expression(i) for i in range(200)]
    demos = CalculatorDemonstrations(50, tool_rate=0.5)
    with_tool = [d for d in (demos[i] for i in range(50)) if len(d["prompt"]) == 3]
    assert 10 < len(with_tool) < 40 and all(
        d["prompt"][2]["content"] == d["target"] for d in with_tool
    )
