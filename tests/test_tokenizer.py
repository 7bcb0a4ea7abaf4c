"""ChatTokenizer and the Qwen3 chat format against transformers' Qwen2Tokenizer + Jinja template.

The peer is ``transformers.AutoTokenizer`` loading the same files: it builds its own BPE pipeline
from vocab.json/merges.txt and renders chats with the official Jinja template stored in
tokenizer_config.json, so a wrong regex, byte mapping, added-token table or rendering rule shows
up as different ids or text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from composer_tune.data.tokenizer import QWEN3_ADDED_TOKENS, ChatTokenizer, from_pretrained
from tests.recipe_runs import load_tool

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "tests" / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def ours() -> ChatTokenizer:
    return ChatTokenizer.from_dir(ASSET)


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(str(ASSET))


TEXTS = [
    "What is 347 + 68? Let me work it out: 347 + 68 = 415.\nThe answer is 415",
    "digits 1234567890, 3.14159, -42, 1e-9, 0x1F and 12,345,678",
    "whitespace   runs\t\ttabs\n\n\nnewlines   \n  \r\n trailing   ",
    "I'm sure you'll see THEY'RE right; it's what we'd do. Don't.",
    "Crème brûlée à São Paulo, Größe, Łódź, Ελληνικά, Русский",
    "中文分词测试：你好，世界！日本語のテキスト。한국어 문장입니다.",
    "emoji 🙂🚀 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 ✅",
    "def add(a: int, b: int) -> int:\n    return a + b  # comment\n",
    '{"name": "read_file", "arguments": {"path": "src/main.py"}}',
    "specials inline <|im_start|>user\nhi<|im_end|>\n<think>\nplan\n</think>\n\n<tool_call>",
    "unseen words: xylophone quixotic zephyr — ellipsis… “quotes”",
    "e\u0301 vs \u00e9 (NFD vs NFC)",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: ChatTokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_texts_detect_a_wrong_pretokenizer(hf) -> None:
    # GPT-2's regex instead of Qwen's (digit runs, contractions, whitespace differ) must change
    # ids on the texts above, else the comparison could not catch a wrong regex.
    wrong = ChatTokenizer.from_dir(ASSET)
    wrong._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=True
    )
    differing = [t for t in TEXTS if wrong.encode(t) != hf.encode(t, add_special_tokens=False)]
    assert len(differing) >= 3


def test_digits_stay_single_even_with_a_digit_merge(tmp_path: Path) -> None:
    # The trained vocabulary has no digit merges (Qwen's regex never lets digits meet), so a
    # wrong digit rule would go unnoticed on it: add the merge "1 2" and compare again.
    target = _copy_asset(tmp_path)
    vocab = json.loads((target / "vocab.json").read_text(encoding="utf-8"))
    vocab["12"] = len(vocab)
    (target / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with (target / "merges.txt").open("a", encoding="utf-8") as merges:
        merges.write("1 2\n")
    config = load_tool("train_tokenizer").tokenizer_config(len(vocab), 32768)
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours_12 = ChatTokenizer.from_dir(target)
    hf_12 = AutoTokenizer.from_pretrained(str(target))
    text = "2012 + 12 = 2024, x12y"
    ids = ours_12.encode(text)
    assert ids == hf_12.encode(text, add_special_tokens=False)
    assert ours_12.token_to_id("12") not in ids


def test_vocabulary_is_trained_and_ids_follow_qwen3_layout(ours: ChatTokenizer, hf) -> None:
    vocab = json.loads((ASSET / "vocab.json").read_text(encoding="utf-8"))
    assert 900 <= len(vocab) <= 1024
    # Merges were learnt: common text is much shorter in tokens than in bytes.
    text = TEXTS[0]
    assert len(ours.encode(text)) < 0.7 * len(text.encode())
    assert ours.vocab_size == len(vocab) + len(QWEN3_ADDED_TOKENS) == len(hf)
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert ours.token_to_id(content) == len(vocab) + offset == hf.convert_tokens_to_ids(content)
    assert ours.eos_id == ours.token_to_id("<|im_end|>") == hf.eos_token_id
    assert ours.pad_id == ours.token_to_id("<|endoftext|>") == hf.pad_token_id
    assert ours.stop_tokens == [ours.eos_id, ours.pad_id]
    assert ours.bos_id is None


@pytest.mark.parametrize("text", [t for t in TEXTS if "e\u0301" not in t])
def test_round_trip(ours: ChatTokenizer, hf, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_non_nfc_text_is_normalised_like_transformers(ours: ChatTokenizer, hf) -> None:
    ids = ours.encode("e\u0301")
    assert ours.decode(ids) == "\u00e9" == hf.decode(hf.encode("e\u0301"))


def test_skip_special_tokens_keeps_think_and_tool_tags(ours: ChatTokenizer) -> None:
    ids = ours.encode(
        "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n</tool_call><|im_end|>"
    )
    assert ours.decode(ids) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n</tool_call>"


def test_batch_apis_match_single_calls(ours: ChatTokenizer) -> None:
    batch = ours.encode_batch(TEXTS)
    assert batch == [ours.encode(t) for t in TEXTS]
    assert ours.decode_batch(batch) == [ours.decode(ids) for ids in batch]


def test_encode_add_eos_and_decode_bad_id(ours: ChatTokenizer) -> None:
    assert ours.encode("hi", add_bos=True, add_eos=True) == ours.encode("hi") + [ours.eos_id]
    with pytest.raises(ValueError, match=f"token id {ours.vocab_size} is outside"):
        ours.decode([1, ours.vocab_size])


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

CHATS = {
    "plain": [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "The answer is 4"},
    ],
    "reasoning_content": [
        {"role": "user", "content": "What is 12 * 3?"},
        {"role": "assistant", "reasoning_content": "\n12*3 = 36\n", "content": "\n36"},
    ],
    "inline_think": [
        {"role": "user", "content": "Crème brûlée ou 中文? 🙂"},
        {"role": "assistant", "content": "<think>\nChoose one.\n</think>\n\nCrème brûlée 🍮"},
    ],
    "multi_turn_stripping": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "<think>old plan</think>first answer"},
        {"role": "user", "content": "Second?"},
        {"role": "assistant", "reasoning_content": "new plan", "content": "second answer"},
        {"role": "user", "content": "Third?"},
        {"role": "assistant", "content": "third answer"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris and Zürich?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool twice.",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            ],
        },
        {"role": "tool", "content": "Paris: 18°C"},
        {"role": "tool", "content": "Zürich: 12°C"},
        {
            "role": "assistant",
            "content": "<think>\nBoth known.\n</think>\n\nParis 18°C, Zürich 12°C.",
        },
    ],
    "tool_call_with_text_then_new_query": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "Oslo: 3°C"},
        {"role": "assistant", "reasoning_content": "cold", "content": "3°C in Oslo."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "noop", "arguments": {}}]},
    ],
    "wrapped_tool_response_user": [
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": "<think>a</think>step",
            "tool_calls": [{"name": "t", "arguments": {}}],
        },
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        {"role": "assistant", "reasoning_content": "b", "content": "done"},
    ],
    "no_user_message": [
        {"role": "system", "content": "sys"},
        {"role": "assistant", "reasoning_content": "hidden", "content": "only me"},
    ],
    "whitespace_and_digits": [
        {"role": "user", "content": "  spaced   out\n\n\tand 1234567890  "},
        {"role": "assistant", "content": "  ok  \n\n"},
    ],
}

RENDER_OPTIONS = [
    {"add_generation_prompt": False},
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": False, "tools": [WEATHER_TOOL]},
]


def _hf_apply(hf, messages, strip_thinking: bool = True, **options):
    # The project's Qwen3 template reads strip_thinking (see composer_tune/data/qwen3_chat_template.py).
    text = hf.apply_chat_template(
        messages, tokenize=False, strip_thinking=strip_thinking, **options
    )
    ids = hf.apply_chat_template(messages, tokenize=True, strip_thinking=strip_thinking, **options)
    return text, ids["input_ids"]


@pytest.mark.parametrize("options", RENDER_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("name", CHATS)
@pytest.mark.parametrize("strip_thinking", [True, False])
def test_chat_matches_transformers(
    ours, hf, name: str, options: dict, strip_thinking: bool
) -> None:
    messages = CHATS[name]
    expected_text, expected_ids = _hf_apply(hf, messages, strip_thinking, **options)
    assert ours.render(messages, strip_thinking=strip_thinking, **options) == expected_text
    ids, loss_mask = ours.tokenize_messages(messages, strip_thinking=strip_thinking, **options)
    assert ids == expected_ids
    assert len(loss_mask) == len(ids)


def test_strip_thinking_option_changes_history_only(ours) -> None:
    messages = CHATS["multi_turn_stripping"]
    stripped = ours.render(messages)
    kept = ours.render(messages, strip_thinking=False)
    assert "old plan" not in stripped and "new plan" not in stripped
    assert "<think>\nold plan\n</think>\n\nfirst answer" in kept
    assert "<think>\nnew plan\n</think>\n\nsecond answer" in kept
    # The turn after the last query renders identically either way.
    assert stripped.endswith("<think>\n\n</think>\n\nthird answer<|im_end|>\n")
    assert kept.endswith("<think>\n\n</think>\n\nthird answer<|im_end|>\n")


def _masked_runs(tokenizer: ChatTokenizer, ids: list[int], loss_mask: list[bool]) -> list[str]:
    runs, current = [], []
    for token_id, keep in zip(ids, loss_mask, strict=True):
        if keep:
            current.append(token_id)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


# Hand-written assistant outputs: exactly what the loss mask must cover, turn by turn.
EXPECTED_ASSISTANT_TEXT = {
    "plain": ["<think>\n\n</think>\n\nThe answer is 4<|im_end|>"],
    "reasoning_content": ["<think>\n12*3 = 36\n</think>\n\n36<|im_end|>"],
    "multi_turn_stripping": [
        "first answer<|im_end|>",
        "second answer<|im_end|>",
        "<think>\n\n</think>\n\nthird answer<|im_end|>",
    ],
    "tool_calls": [
        "<think>\nCall the tool twice.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        "<|im_end|>",
        "<think>\nBoth known.\n</think>\n\nParis 18°C, Zürich 12°C.<|im_end|>",
    ],
}


@pytest.mark.parametrize("name", EXPECTED_ASSISTANT_TEXT)
def test_loss_mask_covers_exactly_assistant_output(ours, name: str) -> None:
    ids, loss_mask = ours.tokenize_messages(CHATS[name], add_generation_prompt=False)
    assert _masked_runs(ours, ids, loss_mask) == EXPECTED_ASSISTANT_TEXT[name]


def test_non_thinking_mask_leaves_the_empty_think_block_to_the_prompt(ours) -> None:
    ids, loss_mask = ours.tokenize_messages(CHATS["plain"], enable_thinking=False)
    assert _masked_runs(ours, ids, loss_mask) == ["The answer is 4<|im_end|>"]


@pytest.mark.parametrize("name", CHATS)
def test_loss_mask_complement_is_the_prompt(ours, name: str) -> None:
    # Removing the masked text from the render leaves only template and non-assistant text:
    # every assistant turn shrinks to its "<|im_start|>assistant\n" header.
    messages = CHATS[name]
    ids, loss_mask = ours.tokenize_messages(messages, add_generation_prompt=True)
    prompt = ours.decode([i for i, keep in zip(ids, loss_mask, strict=True) if not keep], False)
    runs = _masked_runs(ours, ids, loss_mask)
    assert len(runs) == sum(m["role"] == "assistant" for m in messages)
    assert all(run.endswith("<|im_end|>") for run in runs)
    rebuilt = ours.render(messages, add_generation_prompt=True)
    for run in runs:
        rebuilt = rebuilt.replace("<|im_start|>assistant\n" + run, "<|im_start|>assistant\n", 1)
    assert prompt == rebuilt
    assert prompt.endswith("<|im_start|>assistant\n")


# Non-thinking mode only for chats whose final turn has no reasoning to produce.
@pytest.mark.parametrize(
    "name, enable_thinking",
    [
        ("plain", True),
        ("plain", False),
        ("whitespace_and_digits", True),
        ("whitespace_and_digits", False),
        ("tool_calls", True),
        ("tool_call_with_text_then_new_query", False),
    ],
)
def test_loss_mask_starts_where_the_generation_prompt_ends(ours, name, enable_thinking) -> None:
    # Training and inference agree: a conversation starts token for token with the generation
    # prompt of its history (earlier assistant turns keep their own mask), and everything after
    # it is trained on except the template's newline after the final <|im_end|>.
    messages = CHATS[name]
    ids, loss_mask = ours.tokenize_messages(messages, enable_thinking=enable_thinking)
    prompt_ids, prompt_mask = ours.tokenize_messages(
        messages[:-1], add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert ids[: len(prompt_ids)] == prompt_ids
    num_trained = len(ids) - len(prompt_ids) - 1
    assert loss_mask == prompt_mask + [True] * num_trained + [False]
    assert ours.decode(ids[-2:], skip_special_tokens=False) == "<|im_end|>\n"


def test_call_uses_torchtune_mask_convention_and_truncates() -> None:
    tokenizer = from_pretrained(str(ASSET), max_seq_len=12)
    sample = {"messages": CHATS["plain"], "id": 7}
    full_ids, full_mask = ChatTokenizer.from_dir(ASSET).tokenize_messages(CHATS["plain"])
    out = tokenizer(sample)
    assert out["id"] == 7
    assert out["tokens"] == full_ids[:12]
    assert out["mask"] == [not keep for keep in full_mask[:12]]
    inference = tokenizer({"messages": CHATS["plain"][:2]}, inference=True)
    # A prompt-only sample has nothing to learn: every token is masked out.
    assert all(inference["mask"])


def test_yaml_builder_instantiates() -> None:
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.create(
        {
            "_component_": "composer_tune.data.tokenizer.from_pretrained",
            "path": str(ASSET),
            "max_seq_len": 64,
        }
    )
    tokenizer = config.instantiate(cfg)
    assert isinstance(tokenizer, ChatTokenizer) and tokenizer.max_seq_len == 64


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ([], ValueError, "non-empty list"),
        ([{"role": "robot", "content": "x"}], ValueError, r"messages\[0\]\.role"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [1]}],
            TypeError,
            r"messages\[1\]\.content",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "reasoning_content": 3},
            ],
            TypeError,
            r"messages\[1\]\.reasoning_content",
        ),
        (
            [{"role": "user", "content": "a", "tool_calls": [{"name": "f", "arguments": {}}]}],
            ValueError,
            r"messages\[0\] has tool_calls",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": ["f()"]}],
            ValueError,
            r"messages\[0\]\.tool_calls",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
            ValueError,
            r"messages\[0\]\.tool_calls",
        ),
    ],
)
def test_bad_messages_name_the_culprit(ours, messages, error, match) -> None:
    with pytest.raises(error, match=match):
        ours.render(messages)


def _copy_asset(tmp_path: Path) -> Path:
    target = tmp_path / "tok"
    shutil.copytree(ASSET, target)
    return target


def test_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        ChatTokenizer.from_dir(tmp_path / "nope")
    for name in ("vocab.json", "merges.txt"):
        target = _copy_asset(tmp_path / name)
        (target / name).unlink()
        with pytest.raises(FileNotFoundError, match=name):
            ChatTokenizer.from_dir(target)


def test_without_config_qwen3_tokens_follow_the_vocab(ours, tmp_path: Path) -> None:
    target = _copy_asset(tmp_path)
    (target / "tokenizer_config.json").unlink()
    bare = ChatTokenizer.from_dir(target)
    assert bare.special_tokens == ours.special_tokens
    assert bare.encode(TEXTS[9]) == ours.encode(TEXTS[9])


@pytest.mark.parametrize(
    "file, edit, match",
    [
        ("merges.txt", lambda s: s + "a b c\n", r"merges\.txt:\d+: expected two tokens"),
        ("merges.txt", lambda s: s + "Ġ zzz\n", r"merges\.txt:\d+: merge 'Ġ zzz' uses 'zzz'"),
        ("vocab.json", lambda s: s[: len(s) // 2], r"vocab\.json: not valid UTF-8 JSON"),
        ("vocab.json", lambda s: s.replace('"!":0', '"!":"0"'), r"token '!' has id '0'"),
        ("vocab.json", lambda s: s.replace('"!":0', '"!":1'), r"id 1 is used by both"),
        (
            "tokenizer_config.json",
            lambda s: s.replace('"<|im_end|>",\n      "lstrip"', '"A",\n      "lstrip"', 1),
            r"'A' has id \d+ in vocab\.json",
        ),
        (
            "tokenizer_config.json",
            lambda s: s.replace('"pad_token": "<|endoftext|>"', '"pad_token": "<|pad|>"'),
            r"tokenizer_config\.json: pad_token '<\|pad\|>' is not in the vocabulary",
        ),
        (
            "generation_config.json",
            lambda s: s.replace("[", '["x", '),
            r"generation_config\.json: eos_token_id must be an int or a list of ints",
        ),
    ],
)
def test_malformed_files_are_reported(tmp_path: Path, file: str, edit, match: str) -> None:
    target = _copy_asset(tmp_path)
    path = target / file
    edited = edit(path.read_text(encoding="utf-8"))
    assert edited != path.read_text(encoding="utf-8")
    path.write_text(edited, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        ChatTokenizer.from_dir(target)


def test_committed_asset_is_what_the_tool_generates(tmp_path: Path) -> None:
    tool = load_tool("train_tokenizer")
    assert tool.main(["--output-dir", str(tmp_path), "--vocab-size", "1024"]) == 0
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (ASSET / name).read_bytes(), name


def test_tool_trains_on_jsonl_and_transformers_loads_it(tmp_path: Path) -> None:
    tool = load_tool("train_tokenizer")
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "zyzzyva quokka " * 5}], "skip": "ignored"}
    ] * 20
    corpus.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    out = tmp_path / "tok"
    args = ["--output-dir", str(out), "--vocab-size", "300", "--no-builtin", "--input", str(corpus)]
    assert tool.main([*args, "--jsonl-field", "messages"]) == 0
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert "Ġzyzzyva" in vocab and "Ġquokka" in vocab and "ignored" not in vocab
    assert len(vocab) <= 300
    ours_small = ChatTokenizer.from_dir(out)
    hf_small = AutoTokenizer.from_pretrained(str(out))
    text = "zyzzyva quokka 🙂 <|im_end|>"
    assert ours_small.encode(text) == hf_small.encode(text, add_special_tokens=False)
    assert ours_small.decode(ours_small.encode(text), skip_special_tokens=False) == text


def test_tool_reports_bad_jsonl_line(tmp_path: Path) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n\n{"text": broken}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        load_tool("train_tokenizer").main(
            ["--output-dir", str(tmp_path / "o"), "--input", str(corpus)]
        )
