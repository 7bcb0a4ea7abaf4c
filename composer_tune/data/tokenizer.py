"""A checkpoint's own tokenizer and chat template: ``ChatTokenizer``.

Loaded from a Hugging Face checkpoint directory: ``tokenizer.json`` when present (any fast
tokenizer: SmolLM2, Llama 3, Qwen ...), else the Qwen2/Qwen3 ``vocab.json`` + ``merges.txt``
format (a byte-level BPE split by Qwen's pre-tokenizer regex after NFC normalisation, plus the
added tokens of ``tokenizer_config.json``), whose files are parsed here so malformed ones fail
with the file and line at fault. Encoding and decoding run in the Rust ``tokenizers`` library
because RL recipes decode thousands of completions per step.

Chat is rendered with the checkpoint's Jinja template (``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``; see :mod:`composer_tune.data.chat_template`). The
end of a turn, EOS and the stop tokens come from the checkpoint: the token the template writes
after an assistant message, ``generation_config.json``'s ``eos_token_id`` and
``tokenizer_config.json``'s ``eos_token``.

``ChatTokenizer`` follows torchtune's ``ModelTokenizer`` protocol where it makes sense
(``encode``, ``decode``, ``tokenize_messages``, ``max_seq_len``, ``special_tokens`` and a
``__call__`` transform for torchtune's SFT datasets); ``from_pretrained`` is the YAML builder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from composer_tune.data.chat_template import ChatTemplate, ChatTemplateError

# Qwen2/Qwen3's split: English contractions, letter runs with one optional leading non-letter,
# single digits (so numbers are tokenised digit by digit), punctuation runs, newline runs and
# other whitespace, keeping a single space attached to the following word.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order (151643.. in the real vocabulary), with the "special" flag of
# its tokenizer_config.json: special tokens are dropped by decode(skip_special_tokens=True), the
# others (<think>, <tool_call>...) are kept because they are part of the model's visible output.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
# tokenizer_config.json keys the chat template sees as variables, as transformers passes them.
_TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

_ADDED_TOKEN_FLAGS = ("lstrip", "rstrip", "single_word", "normalized")
# Chat templates shipped with composer-tune, by the name ``with_chat_template`` accepts.
_TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "teachers" / "templates"
NAMED_CHAT_TEMPLATES = {"hermes": str(_TEMPLATES_DIR / "chatml_hermes_tools.jinja")}


def configure_qwen_pipeline(tokenizer: Tokenizer) -> None:
    """Give ``tokenizer`` Qwen2/Qwen3's normaliser, pre-tokeniser and decoder, in place.

    Shared by ``ChatTokenizer`` (for ``vocab.json`` + ``merges.txt``) and ``tools/train_tokenizer.py`` so that a trained vocabulary
    and the tokenizer that reads it split text identically.
    """
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
            # The regex already split the text; ByteLevel only maps bytes to GPT-2's alphabet.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()


def load_vocab(path: str | Path) -> dict[str, int]:
    """Read a ``vocab.json`` mapping token -> id, checking ids are distinct non-negative ints."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer vocabulary not found: {path}")
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid UTF-8 JSON: {err}") from err
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{path}: expected a non-empty JSON object mapping token -> id")
    seen: dict[int, str] = {}
    for token, token_id in vocab.items():
        if type(token_id) is not int or token_id < 0:
            raise ValueError(f"{path}: token {token!r} has id {token_id!r}, expected an int >= 0")
        if token_id in seen:
            raise ValueError(
                f"{path}: id {token_id} is used by both {seen[token_id]!r} and {token!r}"
            )
        seen[token_id] = token
    return vocab


def load_merges(path: str | Path, vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Read a ``merges.txt`` (optional ``#version`` header, then ``left right`` per line).

    Every merge must join two tokens of ``vocab`` into a token of ``vocab``; a merge that does
    not would silently produce unknown tokens, so it is reported with its line number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer merges not found: {path}")
    merges: list[tuple[str, str]] = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            line = line.rstrip("\r\n")
            if not line or (line_number == 1 and line.startswith("#version")):
                continue
            pair = line.split(" ")
            if len(pair) != 2 or not all(pair):
                raise ValueError(
                    f"{path}:{line_number}: expected two tokens separated by one space, got {line!r}"
                )
            left, right = pair
            for token in (left, right, left + right):
                if token not in vocab:
                    raise ValueError(
                        f"{path}:{line_number}: merge {line!r} uses {token!r}, absent from vocab.json"
                    )
            merges.append((left, right))
    return merges


def load_added_tokens(
    config_path: str | Path, vocab: Mapping[str, int]
) -> list[tuple[int, AddedToken]]:
    """The added tokens of ``tokenizer_config.json``, as ``(id, AddedToken)`` sorted by id.

    Read from ``added_tokens_decoder`` when the file has one; otherwise Qwen3's tokens are
    appended after the vocabulary in Qwen3's order. An added token may reuse a vocabulary entry
    only with the same id.
    """
    config_path = Path(config_path)
    decoder: Mapping[str, Any] | None = None
    if config_path.is_file():
        decoder = _read_json_object(config_path).get("added_tokens_decoder")
        if decoder is not None and not isinstance(decoder, dict):
            raise ValueError(f"{config_path}: added_tokens_decoder must be an object id -> token")
    if not decoder:
        first_id = max(vocab.values()) + 1
        return [
            (first_id + offset, AddedToken(content, special=special, normalized=False))
            for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
        ]

    added: list[tuple[int, AddedToken]] = []
    for key, entry in decoder.items():
        where = f"{config_path}: added_tokens_decoder[{key!r}]"
        if not key.isdigit():
            raise ValueError(f"{where}: key must be a token id")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{where}: expected an object with a string 'content'")
        token_id, content = int(key), entry["content"]
        if content in vocab and vocab[content] != token_id:
            raise ValueError(f"{where}: {content!r} has id {vocab[content]} in vocab.json")
        flags = {flag: bool(entry.get(flag, False)) for flag in _ADDED_TOKEN_FLAGS}
        added.append(
            (token_id, AddedToken(content, special=bool(entry.get("special", False)), **flags))
        )
    added.sort(key=lambda pair: pair[0])
    taken = {token_id: token for token, token_id in vocab.items()}
    for token_id, token in added:
        if taken.get(token_id, token.content) != token.content:
            raise ValueError(
                f"{config_path}: added token {token.content!r} has id {token_id}, "
                f"already used by {taken[token_id]!r}"
            )
        taken[token_id] = token.content
    return added


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid UTF-8 JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _token_string(config: Mapping[str, Any], key: str, path: Path) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, an AddedToken dict, or None."""
    value = config.get(key)
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: {key} must be a token string, got {value!r}")
    return value


def _bpe_from_vocab_files(path: Path) -> Tokenizer:
    """The Qwen2/Qwen3 byte-level BPE of ``vocab.json`` + ``merges.txt`` + added tokens."""
    vocab = load_vocab(path / "vocab.json")
    merges = load_merges(path / "merges.txt", vocab)
    added_tokens = load_added_tokens(path / TOKENIZER_CONFIG, vocab)
    full_vocab = dict(vocab)
    for token_id, token in added_tokens:
        full_vocab[token.content] = token_id
    tokenizer = Tokenizer(BPE(vocab=full_vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    configure_qwen_pipeline(tokenizer)
    # Added tokens already sit in the BPE vocabulary, so they keep their ids; registering them
    # makes the encoder match them whole before BPE sees the text.
    tokenizer.add_tokens([token for _, token in added_tokens])
    return tokenizer


def _chat_template_source(path: Path, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """The template text and its origin: ``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates of which ``default`` is used)."""
    jinja_file = path / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    template = config.get("chat_template")
    origin = f"{path / TOKENIZER_CONFIG}: chat_template"
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ValueError(f"{origin} must be a string or a list of named templates")
    return template, origin


def _generation_eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list), [] without the file."""
    file = path / GENERATION_CONFIG
    if not file.is_file():
        return []
    eos = _read_json_object(file).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


class ChatTokenizer:
    """A checkpoint's tokenizer with its chat template, EOS, padding and stop tokens.

    Build it with :meth:`from_dir` (or the YAML builder :func:`from_pretrained`).

    Args:
        tokenizer: the ``tokenizers`` pipeline (added tokens registered).
        chat_template: the compiled template; None if the checkpoint has none (chat methods
            then raise).
        eos_id: the id that ends an assistant turn, and so every generation.
        pad_id: the padding id.
        stop_tokens: every id that ends generation.
        bos_id: the beginning-of-sequence id if the tokenizer adds one, else None.
        max_seq_len: if set, ``tokenize_messages`` truncates to this many tokens.
        source: where the files came from, used in error messages.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: ChatTemplate | None,
        eos_id: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        bos_id: int | None = None,
        max_seq_len: int | None = None,
        source: str = "<memory>",
    ) -> None:
        if max_seq_len is not None and max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len}")
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_seq_len = max_seq_len
        self.source = source
        self.special_tokens: dict[str, int] = {
            token.content: token_id
            for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
        }
        self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self._eos_id, self._pad_id, self._bos_id = eos_id, pad_id, bos_id
        self._stop_tokens = list(dict.fromkeys(stop_tokens))
        # Tool schemas rendered when a caller passes none (from_pretrained's ``tools``).
        self.default_tools: list[dict[str, Any]] | None = None
        for name, token_id in [
            ("eos", eos_id),
            ("pad", pad_id),
            *(("stop", t) for t in stop_tokens),
        ]:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"{source}: {name} token id {token_id} is not in the vocabulary")

    @classmethod
    def from_dir(cls, path: str | Path, max_seq_len: int | None = None) -> ChatTokenizer:
        """Load the tokenizer files of a Hugging Face checkpoint directory (see module doc)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        config_path = path / TOKENIZER_CONFIG
        config = _read_json_object(config_path) if config_path.is_file() else {}
        if (path / TOKENIZER_FILE).is_file():
            try:
                tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
            except Exception as err:  # the Rust library raises a bare Exception
                raise ValueError(f"{path / TOKENIZER_FILE}: cannot be read: {err}") from err
        else:
            tokenizer = _bpe_from_vocab_files(path)

        def token_id(token: str | None, what: str) -> int | None:
            if token is None:
                return None
            found = tokenizer.token_to_id(token)
            if found is None:
                raise ValueError(f"{config_path}: {what} {token!r} is not in the vocabulary")
            return found

        tokens = {key: _token_string(config, key, config_path) for key in _TEMPLATE_TOKEN_KEYS}
        template_source = _chat_template_source(path, config)
        template = None
        if template_source is not None:
            added = [t.content for _, t in sorted(tokenizer.get_added_tokens_decoder().items())]
            template = ChatTemplate(
                template_source[0],
                origin=template_source[1],
                special_tokens={k: v for k, v in tokens.items() if v is not None},
                candidate_tokens=added,
            )
        end_of_turn = token_id(template.end_of_turn if template else None, "end-of-turn token")
        config_eos = token_id(tokens["eos_token"], "eos_token")
        generation_eos = _generation_eos_ids(path)
        stops = [t for t in (end_of_turn, *generation_eos, config_eos) if t is not None]
        if not stops:
            raise ValueError(
                f"{path}: no end-of-sequence token (no chat template end of turn, "
                f"{GENERATION_CONFIG} eos_token_id or {TOKENIZER_CONFIG} eos_token)"
            )
        bos = token_id(tokens["bos_token"], "bos_token") if config.get("add_bos_token") else None
        return cls(
            tokenizer,
            chat_template=template,
            eos_id=stops[0],
            pad_id=token_id(tokens["pad_token"], "pad_token") or stops[0],
            stop_tokens=stops,
            bos_id=bos,
            max_seq_len=max_seq_len,
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Embedding rows needed: highest token id (added tokens included) plus one."""
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        """The end of an assistant turn (``<|im_end|>`` for ChatML): every generation ends
        with it."""
        return self._eos_id

    @property
    def pad_id(self) -> int:
        """``tokenizer_config.json``'s ``pad_token``, else the EOS id."""
        return self._pad_id

    @property
    def bos_id(self) -> int | None:
        """The BOS id when the tokenizer config adds one (``add_bos_token``), else None."""
        return self._bos_id

    @property
    def stop_tokens(self) -> list[int]:
        """Ids that end generation: the end of turn, then the checkpoint's other EOS ids."""
        return list(self._stop_tokens)

    def token_to_id(self, token: str) -> int:
        """Id of one vocabulary or added token; KeyError naming the token if absent."""
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not a token of the tokenizer at {self.source}")
        return token_id

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``; added tokens written in the text are matched as single ids.

        ``add_bos`` prepends the BOS id if the tokenizer has one; ``add_eos`` appends
        :attr:`eos_id`.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        return ids + [self.eos_id] if add_eos else ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of many texts, parallelised in Rust."""
        return [
            encoding.ids
            for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        ]

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if not isinstance(ids, list):  # tensors, arrays, tuples
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        # Rust would silently drop unknown ids; a corrupted rollout should fail loudly instead.
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD.

        ``skip_special_tokens`` drops the tokens flagged special (``<|im_end|>``...) but keeps
        added tokens not flagged special (Qwen3's ``<think>``/``<tool_call>``), which are part
        of the model's visible output.
        """
        return self._tokenizer.decode(
            self._check_ids(token_ids), skip_special_tokens=skip_special_tokens
        )

    def decode_batch(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """``decode`` of many sequences, parallelised in Rust."""
        return self._tokenizer.decode_batch(
            [self._check_ids(ids) for ids in sequences], skip_special_tokens=skip_special_tokens
        )

    def with_chat_template(self, template: str) -> ChatTokenizer:
        """A copy that renders with another chat template: a name of
        :data:`NAMED_CHAT_TEMPLATES` (``hermes``: ChatML with Hermes tool calls, for checkpoints
        whose own template drops them, such as SmolLM2) or a path to a ``.jinja`` file. Stop
        tokens gain the new template's end of turn."""
        path = Path(NAMED_CHAT_TEMPLATES.get(template, template))
        if not path.is_file():
            raise FileNotFoundError(
                f"chat template {template!r}: not one of {sorted(NAMED_CHAT_TEMPLATES)} and no "
                f"such file"
            )
        special = self.chat_template.special_tokens if self.chat_template else {}
        compiled = ChatTemplate(
            path.read_text(encoding="utf-8"),
            origin=str(path),
            special_tokens=special,
            candidate_tokens=list(self.special_tokens),
        )
        copy = ChatTokenizer(
            self._tokenizer,
            chat_template=compiled,
            eos_id=self._eos_id,
            pad_id=self._pad_id,
            stop_tokens=self._stop_tokens
            + ([self.token_to_id(compiled.end_of_turn)] if compiled.end_of_turn else []),
            bos_id=self._bos_id,
            max_seq_len=self.max_seq_len,
            source=self.source,
        )
        copy.default_tools = self.default_tools
        return copy

    def _template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: the checkpoint has no chat template")
        return self.chat_template

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        strip_thinking: bool = True,
        enable_thinking: bool = True,
    ) -> str:
        """The chat text of ``messages``, by the checkpoint's template.

        ``strip_thinking`` (False keeps the reasoning of assistant turns before the last user
        query) and ``enable_thinking`` (False asks Qwen3 for an answer without reasoning) are
        template variables; a template without such a switch refuses a non-default value.
        """
        return self._template().render(
            messages,
            tools=tools if tools is not None else self.default_tools,
            add_generation_prompt=add_generation_prompt,
            strip_thinking=strip_thinking,
            enable_thinking=enable_thinking,
        )

    def tokenize_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        strip_thinking: bool = True,
        enable_thinking: bool = True,
    ) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered chat and a loss mask, truncated to ``max_seq_len``.

        ``loss_mask[i]`` is True exactly when token ``i`` lies in text an assistant turn
        generated (reasoning, content, tool calls and the closing end-of-turn token; see
        :meth:`ChatTemplate.assistant_spans`), so SFT trains only on what the model must
        produce. NOTE: this is the inverse of torchtune's ``mask`` convention (True = ignore);
        ``__call__`` returns the torchtune form.

        The whole text is encoded at once, so ids equal those of the chat template applied by
        ``transformers``; the mask comes from token character offsets. A token straddling a span
        edge (possible when assistant content starts with whitespace that merges with the
        preceding newline) counts as prompt.
        """
        switches = {"strip_thinking": strip_thinking, "enable_thinking": enable_thinking}
        template = self._template()
        tools = tools if tools is not None else self.default_tools
        text = template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **switches
        )
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        loss_mask = [False] * len(encoding.ids)
        if any(message["role"] == "assistant" for message in messages):
            spans = template.assistant_spans(messages, text, tools=tools, **switches)
            span_index = 0
            for token_index, (start, end) in enumerate(encoding.offsets):
                while span_index < len(spans) and spans[span_index][1] <= start:
                    span_index += 1
                if span_index == len(spans):
                    break
                span_start, span_end = spans[span_index]
                loss_mask[token_index] = span_start <= start and end <= span_end
        ids = encoding.ids
        if self.max_seq_len is not None:
            ids, loss_mask = ids[: self.max_seq_len], loss_mask[: self.max_seq_len]
        return ids, loss_mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> dict[str, Any]:
        """torchtune transform: ``sample["messages"]`` -> ``tokens`` and ``mask`` (True = no loss).

        With ``inference`` the generation prompt is appended for the model to answer.
        """
        if "messages" not in sample:
            raise KeyError(f"sample has no 'messages' key (keys: {sorted(sample)})")
        tokens, loss_mask = self.tokenize_messages(
            sample["messages"], tools=sample.get("tools"), add_generation_prompt=inference
        )
        return {**sample, "tokens": tokens, "mask": [not keep for keep in loss_mask]}


def from_pretrained(
    path: str,
    max_seq_len: int | None = None,
    chat_template: str | None = None,
    tools: Sequence[str] | None = None,
) -> ChatTokenizer:
    """YAML builder (``_component_: composer_tune.data.tokenizer.from_pretrained``): the
    tokenizer of a Hugging Face checkpoint directory (or a tokenizer-only directory).

    ``chat_template`` replaces the checkpoint's template (see
    :meth:`ChatTokenizer.with_chat_template`: ``hermes`` or a ``.jinja`` path). ``tools``
    (dotted paths of tool functions or TRL-style environment classes) are rendered whenever a
    caller passes none: for supervised data whose samples carry no tool list (an SFT run on
    tool demonstrations), so it sees the system prompt its agent episodes will."""
    tokenizer = ChatTokenizer.from_dir(path, max_seq_len=max_seq_len)
    if chat_template is not None:
        tokenizer = tokenizer.with_chat_template(chat_template)
    if tools:
        from composer_tune.agents.tools import schemas_of_paths

        tokenizer.default_tools = schemas_of_paths(tools, "tokenizer.tools")
    return tokenizer
