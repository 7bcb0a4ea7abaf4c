#!/usr/bin/env python
"""Train a small Qwen3-style byte-level BPE tokenizer and write it in Hugging Face format.

The output directory holds ``vocab.json``, ``merges.txt``, ``generation_config.json`` and ``tokenizer_config.json`` (Qwen3's
added tokens appended after the vocabulary, in Qwen3's order and with its flags, plus Qwen3's
chat template), the same files a Qwen3 checkpoint ships, so both
``composer_tune.data.tokenizer.ChatTokenizer.from_dir`` and
``transformers.AutoTokenizer.from_pretrained`` load it. Pre-tokenisation is Qwen's (shared with
``ChatTokenizer``), so the merges learnt here are the ones the tokenizer applies.

Corpus: the given ``.txt`` files (one document per line) and ``.jsonl`` files (every string in
each row, or only the ``--jsonl-field`` keys), plus, unless ``--no-builtin``, a seeded synthetic
arithmetic corpus ("What is 347 + 68? ... The answer is 415") and a small built-in sample of
English, Python, JSON tool calls and non-ASCII text (accents, CJK, emoji).

Example (how tests/assets/tokenizer was made):
    python tools/train_tokenizer.py --output-dir tests/assets/tokenizer --vocab-size 1024
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_tune.data.qwen3_chat_template import QWEN3_CHAT_TEMPLATE  # noqa: E402
from composer_tune.data.tokenizer import (  # noqa: E402
    ENDOFTEXT,
    IM_END,
    QWEN3_ADDED_TOKENS,
    configure_qwen_pipeline,
)

# Hand-written sample so the vocabulary also covers prose, code, tool-call JSON and non-ASCII
# scripts that tests and CPU recipes exercise.
BUILTIN_TEXT = """\
The quick brown fox jumps over the lazy dog. She said: "It's fine, we'll see."
Reinforcement learning from verifiable rewards scores each completion with a checker.
The policy samples a group of answers, and the advantage is the reward minus the group mean.
Let me think step by step. First, add the ones column; then carry to the tens column.
I'm not sure, so let's check the result again before answering.
def add(a: int, b: int) -> int:
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b


for index, value in enumerate(values):
    if value % 2 == 0:
        print(f"{index}: {value}")
class Reward:
    def __call__(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)
{"name": "read_file", "arguments": {"path": "src/main.py", "start_line": 10}}
{"name": "run_command", "arguments": {"command": "pytest -q tests/test_math.py"}}
{"name": "search", "arguments": {"query": "def tokenize", "max_results": 5}}
$ git diff --stat && git commit -m "fix: handle empty input"
Crème brûlée, naïve café, façade, Ångström, São Paulo, Zürich, déjà vu, piñata.
Größe, Straße, Übermut; Łódź, Kraków; Ελληνικά; Русский текст; Türkçe.
中文分词测试：你好，世界！机器学习和强化学习。日本語のテキスト、ひらがなとカタカナ。한국어 문장입니다.
Emoji: 🙂 🚀 👍🏽 ✅ ❌ 🧮 — ellipsis… “quotes” ‘single’ « guillemets » ½ ² ≤ ≥ ≠ ∑ π.
Tabs\tand   runs   of   spaces,\n\nblank lines, trailing spaces   \r\nand CRLF endings.
"""

_WORDS = ("add", "sum", "plus", "total", "difference", "minus", "product", "times")


def arithmetic_corpus(num_examples: int, seed: int) -> list[str]:
    """Seeded arithmetic questions with worked answers, phrased a few different ways."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_examples):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        symbol, result = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
        question = rng.choice(
            (
                f"What is {a} {symbol} {b}?",
                f"Compute {a} {symbol} {b}.",
                f"Calculate {a}{symbol}{b} and give the {rng.choice(_WORDS)}.",
            )
        )
        work = f"{a} {symbol} {b} = {result}"
        texts.append(f"{question}\nLet me work it out: {work}.\nThe answer is {result}")
    return texts


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def read_corpus(paths: Sequence[Path], jsonl_fields: Sequence[str]) -> Iterator[str]:
    """Documents of ``.txt`` (one per line) and ``.jsonl`` (strings of each row) files."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        with path.open(encoding="utf-8") as lines:
            if path.suffix != ".jsonl":
                yield from (line.rstrip("\n") for line in lines if line.strip())
                continue
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_number}: invalid JSON: {err}") from err
                if jsonl_fields:
                    if not isinstance(row, dict):
                        raise ValueError(f"{path}:{line_number}: expected a JSON object")
                    row = [row[field] for field in jsonl_fields if field in row]
                yield from _strings(row)


def tokenizer_config(vocab_size: int, model_max_length: int) -> dict[str, Any]:
    """Qwen3-style ``tokenizer_config.json`` with the added tokens from id ``vocab_size`` on."""
    added = {
        str(vocab_size + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def train(
    texts: Iterator[str] | Sequence[str],
    output_dir: Path,
    vocab_size: int,
    min_frequency: int = 2,
    model_max_length: int = 32768,
) -> int:
    """Train the BPE on ``texts``, write the tokenizer files, return the BPE vocabulary size.

    ``vocab_size`` counts the 256 byte tokens and the merges, not the added tokens; a small
    corpus may stop short of it.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet):
        raise ValueError(f"--vocab-size must be >= {len(alphabet)} (the byte alphabet)")
    tokenizer = Tokenizer(BPE())
    configure_qwen_pipeline(tokenizer)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=alphabet,
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.model.save(str(output_dir))
    trained_size = tokenizer.get_vocab_size()
    config = tokenizer_config(trained_size, model_max_length)
    (output_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    # As in Qwen3's checkpoints: generation ends at the end of a turn or of the text.
    stop_ids = [
        trained_size + [c for c, _ in QWEN3_ADDED_TOKENS].index(t) for t in (IM_END, ENDOFTEXT)
    ]
    (output_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": stop_ids}, indent=2) + "\n", encoding="utf-8"
    )
    return trained_size


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="directory to write")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=1024,
        help="BPE vocabulary size: 256 byte tokens + merges, added tokens not counted "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--input",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="corpus file, repeatable: .txt (one document per line) or .jsonl",
    )
    parser.add_argument(
        "--jsonl-field",
        action="append",
        default=[],
        metavar="KEY",
        help="repeatable: read only these top-level keys of .jsonl rows (default: all strings)",
    )
    parser.add_argument(
        "--no-builtin",
        action="store_true",
        help="train on --input only, without the synthetic arithmetic and built-in sample text",
    )
    parser.add_argument(
        "--num-arithmetic",
        type=int,
        default=3000,
        help="synthetic arithmetic examples in the built-in corpus (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="arithmetic corpus seed")
    parser.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        help="least occurrences for a merge to be learnt (default: %(default)s)",
    )
    parser.add_argument(
        "--model-max-length",
        type=int,
        default=32768,
        help="model_max_length written to tokenizer_config.json (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.no_builtin and not args.input:
        parser.error("--no-builtin needs at least one --input file")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: train and write the tokenizer, print a one-line summary."""
    args = parse_args(argv)
    texts: list[str] = list(read_corpus(args.input, args.jsonl_field))
    if not args.no_builtin:
        # One document (its newline and space runs matter), repeated to clear --min-frequency.
        texts += arithmetic_corpus(args.num_arithmetic, args.seed) + [BUILTIN_TEXT] * 3
    size = train(texts, args.output_dir, args.vocab_size, args.min_frequency, args.model_max_length)
    print(
        f"wrote {args.output_dir}: {size} BPE tokens + {len(QWEN3_ADDED_TOKENS)} added tokens "
        f"from {len(texts)} documents"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
