"""The templates of the synthetic Python function-synthesis tasks (``composer_tune.data.code_tasks``).

A template is one kind of function (``keep_greater``: the numbers above a threshold), written
once with its statement, its reference solution and the inputs its hidden tests call it with;
``params`` is the grid of its free constants (the threshold), so one template gives several
tasks and a held-out split *by parameters* exists (values of the grid never trained on) beside
the split *by template*. Expected outputs are never written here: the generator computes them by
running the reference, and the split grader checks every task (code_tasks.validate_task).

Difficulty is the reference body's size: 1 = one line, 2 = a few lines or one loop, 3 = a loop
with conditions or bookkeeping. Inputs list the edge cases first (empty, zero, negative, ties);
``random_inputs`` draws more from the generator's seeded ``random.Random``.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Params = Mapping[str, Any]
Inputs = list[tuple[Any, ...]]

CATEGORIES = ("strings", "lists", "dicts", "arithmetic", "conditions", "loops")

_WORDS = (
    "apple", "tree", "sky", "river", "stone", "level", "moon", "cat", "deed", "noon", "python",
    "code", "sun", "kayak", "red", "blue", "go", "a", "banana", "radar", "test", "ox", "eye",
)  # fmt: skip


@dataclass(frozen=True)
class CodeTemplate:
    """One kind of function task.

    name: the template's id (also the default function name).
    category, difficulty: see the module docstring.
    args: the function's parameter names, in order.
    statement: what the function returns, given ``params`` (the text after "that ...").
    solution: the reference solution's source, given ``params``; defines ``entry``.
    edge_inputs: argument tuples always tested (edge cases), given ``params``.
    random_inputs: ``(rng, params) -> one argument tuple``, for more tests and the example.
    params: the grid of the template's constants (``[{}]``: it has none).
    entry: the function's name, given ``params`` (default: ``name``).
    """

    name: str
    category: str
    difficulty: int
    args: tuple[str, ...]
    statement: Callable[[Params], str]
    solution: Callable[[Params], str]
    edge_inputs: Callable[[Params], Inputs]
    random_inputs: Callable[[random.Random, Params], tuple[Any, ...]]
    params: Sequence[Params] = field(default_factory=lambda: [{}])
    entry: Callable[[Params], str] | None = None

    def function_name(self, params: Params) -> str:
        return self.entry(params) if self.entry else self.name


# Random argument makers -----------------------------------------------------------------------


def _ints(rng: random.Random, low: int = -9, high: int = 20, max_len: int = 7) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(1, max_len))]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _sentence(rng: random.Random, max_words: int = 5) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words)))


def _letters(rng: random.Random, alphabet: str = "aeostxbc", max_len: int = 9) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, max_len)))


def _small_dict(rng: random.Random, low: int = -5, high: int = 15) -> dict[str, int]:
    keys = rng.sample(string.ascii_lowercase[:8], rng.randint(1, 5))
    return {key: rng.randint(low, high) for key in keys}


def _one(make: Callable[[random.Random], Any]) -> Callable[[random.Random, Params], tuple]:
    """A ``random_inputs`` of one argument made by ``make(rng)``."""
    return lambda rng, params: (make(rng),)


# The templates --------------------------------------------------------------------------------

TEMPLATES: tuple[CodeTemplate, ...] = (
    # strings
    CodeTemplate(
        "shout", "strings", 1, ("text",),
        lambda p: f"`text` in upper case followed by {p['n']} exclamation mark(s)",
        lambda p: f"def shout(text):\n    return text.upper() + '!' * {p['n']}\n",
        lambda p: [("",), ("hi",), ("Hello World",)],
        _one(_sentence),
        params=[{"n": n} for n in range(1, 6)],
    ),
    CodeTemplate(
        "repeat_text", "strings", 1, ("text",),
        lambda p: f"`text` repeated {p['n']} times, the copies separated by {p['sep']!r}",
        lambda p: f"def repeat_text(text):\n    return {p['sep']!r}.join([text] * {p['n']})\n",
        lambda p: [("",), ("ab",), ("x y",)],
        _one(_word),
        params=[{"n": n, "sep": s} for n in (2, 3, 4) for s in ("-", ", ", " ", "")],
    ),
    CodeTemplate(
        "count_char", "strings", 1, ("text",),
        lambda p: f"the number of times the character {p['c']!r} occurs in `text`",
        lambda p: f"def count_char(text):\n    return text.count({p['c']!r})\n",
        lambda p: [("",), (p["c"] * 3,), ("zzz",), (p["c"].upper() + p["c"],)],
        _one(_letters),
        params=[{"c": c} for c in "aeostxbc"],
    ),
    CodeTemplate(
        "remove_char", "strings", 1, ("text",),
        lambda p: f"`text` with every occurrence of the character {p['c']!r} removed",
        lambda p: f"def remove_char(text):\n    return text.replace({p['c']!r}, '')\n",
        lambda p: [("",), (p["c"] * 2,), ("zz",), ("a" + p["c"] + "b" + p["c"],)],
        _one(_letters),
        params=[{"c": c} for c in "aeostxbc"],
    ),
    CodeTemplate(
        "first_chars", "strings", 1, ("text",),
        lambda p: f"the first {p['n']} characters of `text` (all of it when it is shorter)",
        lambda p: f"def first_chars(text):\n    return text[:{p['n']}]\n",
        lambda p: [("",), ("ab",), ("abcdefghij",)],
        _one(_sentence),
        params=[{"n": n} for n in range(2, 8)],
    ),
    CodeTemplate(
        "last_chars", "strings", 1, ("text",),
        lambda p: f"the last {p['n']} characters of `text` (all of it when it is shorter)",
        lambda p: f"def last_chars(text):\n    return text[-{p['n']}:]\n",
        lambda p: [("",), ("ab",), ("abcdefghij",)],
        _one(_sentence),
        params=[{"n": n} for n in range(2, 8)],
    ),
    CodeTemplate(
        "replace_spaces", "strings", 1, ("text",),
        lambda p: f"`text` with every space replaced by {p['c']!r}",
        lambda p: f"def replace_spaces(text):\n    return text.replace(' ', {p['c']!r})\n",
        lambda p: [("",), ("nospace",), ("a  b",), (" x ",)],
        _one(_sentence),
        params=[{"c": c} for c in ("_", "-", "+", ".", "*", "")],
    ),
    CodeTemplate(
        "wrap_text", "strings", 1, ("text",),
        lambda p: f"`text` with {p['left']!r} added before it and {p['right']!r} after it",
        lambda p: f"def wrap_text(text):\n    return {p['left']!r} + text + {p['right']!r}\n",
        lambda p: [("",), ("a",), ("hello world",)],
        _one(_word),
        params=[{"left": a, "right": b} for a, b in ("()", "[]", "{}", "<>", "**", "''")],
    ),
    CodeTemplate(
        "capitalize_words", "strings", 2, ("text",),
        lambda p: "`text` with the first letter of every space-separated word in upper case "
        "and the rest in lower case, the words joined by single spaces",
        lambda p: "def capitalize_words(text):\n"
        "    return ' '.join(word.capitalize() for word in text.split())\n",
        lambda p: [("",), ("hELLO",), ("one  two",), ("a b c",)],
        _one(_sentence),
    ),
    CodeTemplate(
        "count_vowels", "strings", 2, ("text",),
        lambda p: "the number of vowels (a, e, i, o, u, in either case) in `text`",
        lambda p: "def count_vowels(text):\n"
        "    return sum(1 for ch in text.lower() if ch in 'aeiou')\n",
        lambda p: [("",), ("xyz",), ("AEIOU",), ("Banana",)],
        _one(_sentence),
    ),
    CodeTemplate(
        "is_palindrome", "strings", 2, ("text",),
        lambda p: "True when `text` reads the same forwards and backwards, ignoring case, "
        "and False otherwise",
        lambda p: "def is_palindrome(text):\n    lowered = text.lower()\n"
        "    return lowered == lowered[::-1]\n",
        lambda p: [("",), ("Abba",), ("ab",), ("x",), ("racecar",)],
        _one(_word),
    ),
    CodeTemplate(
        "acronym", "strings", 2, ("text",),
        lambda p: "the first letter of every space-separated word of `text`, in upper case, "
        "joined together",
        lambda p: "def acronym(text):\n    return ''.join(word[0].upper() for word in text.split())\n",
        lambda p: [("",), ("portable network graphics",), ("a",), ("  two  words ",)],
        _one(_sentence),
    ),
    CodeTemplate(
        "longest_word", "strings", 3, ("text",),
        lambda p: "the longest space-separated word of `text` (the first one when several "
        "are equally long; '' when there is none)",
        lambda p: "def longest_word(text):\n    best = ''\n    for word in text.split():\n"
        "        if len(word) > len(best):\n            best = word\n    return best\n",
        lambda p: [("",), ("ab cd",), ("a bbb cc ddd",), ("one",)],
        _one(_sentence),
    ),
    # lists
    CodeTemplate(
        "multiply_each", "lists", 1, ("nums",),
        lambda p: f"a new list with every number of `nums` multiplied by {p['k']}",
        lambda p: f"def multiply_each(nums):\n    return [x * {p['k']} for x in nums]\n",
        lambda p: [([],), ([0],), ([1, -2, 3],)],
        _one(_ints),
        params=[{"k": k} for k in range(2, 10)],
    ),
    CodeTemplate(
        "add_to_each", "lists", 1, ("nums",),
        lambda p: f"a new list with {p['k']} added to every number of `nums`",
        lambda p: f"def add_to_each(nums):\n    return [x + {p['k']} for x in nums]\n",
        lambda p: [([],), ([0],), ([1, -2, 3],)],
        _one(_ints),
        params=[{"k": k} for k in (1, 2, 3, 5, 7, 10, 100, -1, -4)],
    ),
    CodeTemplate(
        "keep_greater", "lists", 1, ("nums",),
        lambda p: f"a list of the numbers of `nums` that are greater than {p['t']}, in order",
        lambda p: f"def keep_greater(nums):\n    return [x for x in nums if x > {p['t']}]\n",
        lambda p: [([],), ([p["t"]],), ([p["t"] + 1, p["t"], p["t"] - 1, p["t"] + 5],)],
        _one(_ints),
        params=[{"t": t} for t in range(-3, 9)],
    ),
    CodeTemplate(
        "count_greater", "lists", 1, ("nums",),
        lambda p: f"how many numbers of `nums` are greater than {p['t']}",
        lambda p: f"def count_greater(nums):\n    return sum(1 for x in nums if x > {p['t']})\n",
        lambda p: [([],), ([p["t"]],), ([p["t"] + 1, p["t"], p["t"] - 1, p["t"] + 5],)],
        _one(_ints),
        params=[{"t": t} for t in range(-3, 9)],
    ),
    CodeTemplate(
        "last_items", "lists", 1, ("items",),
        lambda p: f"a list of the last {p['n']} items of `items` (all of them when there are "
        "fewer)",
        lambda p: f"def last_items(items):\n    return list(items[-{p['n']}:])\n",
        lambda p: [([],), ([1],), (list(range(10)),)],
        _one(_ints),
        params=[{"n": n} for n in range(2, 7)],
    ),
    CodeTemplate(
        "sum_of_squares", "lists", 1, ("nums",),
        lambda p: "the sum of the squares of the numbers in `nums` (0 for an empty list)",
        lambda p: "def sum_of_squares(nums):\n    return sum(x * x for x in nums)\n",
        lambda p: [([],), ([0],), ([-3],), ([1, 2, 3],)],
        _one(_ints),
    ),
    CodeTemplate(
        "count_even", "lists", 1, ("nums",),
        lambda p: "how many numbers of `nums` are even",
        lambda p: "def count_even(nums):\n    return sum(1 for x in nums if x % 2 == 0)\n",
        lambda p: [([],), ([0],), ([-2, -1, 1, 2, 3],)],
        _one(_ints),
    ),
    CodeTemplate(
        "max_minus_min", "lists", 1, ("nums",),
        lambda p: "the largest number of `nums` minus the smallest (0 for an empty list)",
        lambda p: "def max_minus_min(nums):\n    if not nums:\n        return 0\n"
        "    return max(nums) - min(nums)\n",
        lambda p: [([],), ([5],), ([-3, 7, 2],)],
        _one(_ints),
    ),
    CodeTemplate(
        "running_sum", "lists", 2, ("nums",),
        lambda p: "a list whose i-th element is the sum of the first i+1 numbers of `nums`",
        lambda p: "def running_sum(nums):\n    total, out = 0, []\n    for x in nums:\n"
        "        total += x\n        out.append(total)\n    return out\n",
        lambda p: [([],), ([4],), ([1, -1, 1],)],
        _one(_ints),
    ),
    CodeTemplate(
        "pairwise_diff", "lists", 2, ("nums",),
        lambda p: "a list of the differences between consecutive numbers of `nums` (each "
        "number minus the one before it; [] when there are fewer than two)",
        lambda p: "def pairwise_diff(nums):\n"
        "    return [b - a for a, b in zip(nums, nums[1:])]\n",
        lambda p: [([],), ([3],), ([1, 4, 2],)],
        _one(_ints),
    ),
    CodeTemplate(
        "remove_duplicates", "lists", 2, ("items",),
        lambda p: "a list of the items of `items` without repeats, each kept where it first "
        "occurs",
        lambda p: "def remove_duplicates(items):\n    seen, out = set(), []\n    for x in items:\n"
        "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n"
        "    return out\n",
        lambda p: [([],), ([1, 1, 1],), ([3, 1, 3, 2, 1],)],
        lambda rng, p: (_ints(rng, 0, 5, 9),),
    ),
    CodeTemplate(
        "rotate_left", "lists", 2, ("items",),
        lambda p: f"a list of `items` rotated left by {p['k']} positions (the first {p['k']} "
        "items move to the end, wrapping around when the list is shorter; [] stays [])",
        lambda p: f"def rotate_left(items):\n    if not items:\n        return []\n"
        f"    k = {p['k']} % len(items)\n    return list(items[k:] + items[:k])\n",
        lambda p: [([],), ([1],), ([1, 2, 3, 4, 5],), ([1, 2],)],
        _one(_ints),
        params=[{"k": k} for k in range(1, 5)],
    ),
    CodeTemplate(
        "chunk", "lists", 3, ("items",),
        lambda p: f"`items` split into consecutive lists of {p['n']} items (the last one may "
        "be shorter), as a list of lists",
        lambda p: f"def chunk(items):\n    return [list(items[i:i + {p['n']}]) "
        f"for i in range(0, len(items), {p['n']})]\n",
        lambda p: [([],), ([1],), (list(range(7)),)],
        _one(_ints),
        params=[{"n": n} for n in range(2, 6)],
    ),
    CodeTemplate(
        "second_largest", "lists", 3, ("nums",),
        lambda p: "the second largest distinct number in `nums`, or None when there are fewer "
        "than two distinct numbers",
        lambda p: "def second_largest(nums):\n    distinct = sorted(set(nums))\n"
        "    if len(distinct) < 2:\n        return None\n    return distinct[-2]\n",
        lambda p: [([],), ([5, 5],), ([1, 3, 3, 2],), ([-1, -7],)],
        _one(_ints),
    ),
    CodeTemplate(
        "interleave", "lists", 3, ("first", "second"),
        lambda p: "a list that alternates items of `first` and `second` (first[0], second[0], "
        "first[1], ...), with the leftover items of the longer list at the end",
        lambda p: "def interleave(first, second):\n    out = []\n"
        "    for i in range(max(len(first), len(second))):\n        if i < len(first):\n"
        "            out.append(first[i])\n        if i < len(second):\n"
        "            out.append(second[i])\n    return out\n",
        lambda p: [([], []), ([1, 2], []), ([1], [7, 8, 9]), ([1, 2, 3], [4, 5, 6])],
        lambda rng, p: (_ints(rng, max_len=4), _ints(rng, max_len=4)),
    ),
    # dicts
    CodeTemplate(
        "invert_dict", "dicts", 1, ("mapping",),
        lambda p: "a new dict whose keys are the values of `mapping` and whose values are its "
        "keys (the values are all different)",
        lambda p: "def invert_dict(mapping):\n    return {v: k for k, v in mapping.items()}\n",
        lambda p: [({},), ({"a": 1},), ({"x": "y", "y": "z"},)],
        lambda rng, p: ({k: i for i, k in enumerate(rng.sample("abcdefg", rng.randint(1, 5)))},),
    ),
    CodeTemplate(
        "filter_dict", "dicts", 1, ("mapping",),
        lambda p: f"a new dict with only the entries of `mapping` whose value is at least {p['t']}",
        lambda p: f"def filter_dict(mapping):\n"
        f"    return {{k: v for k, v in mapping.items() if v >= {p['t']}}}\n",
        lambda p: [({},), ({"a": p["t"]},), ({"a": p["t"] - 1, "b": p["t"] + 2},)],
        _one(_small_dict),
        params=[{"t": t} for t in range(-2, 9)],
    ),
    CodeTemplate(
        "sum_values", "dicts", 1, ("mapping",),
        lambda p: "the sum of the values of `mapping` (0 for an empty dict)",
        lambda p: "def sum_values(mapping):\n    return sum(mapping.values())\n",
        lambda p: [({},), ({"a": -4},), ({"a": 1, "b": 2},)],
        _one(_small_dict),
    ),
    CodeTemplate(
        "scale_values", "dicts", 1, ("mapping",),
        lambda p: f"a new dict with the keys of `mapping` and every value multiplied by {p['k']}",
        lambda p: f"def scale_values(mapping):\n"
        f"    return {{k: v * {p['k']} for k, v in mapping.items()}}\n",
        lambda p: [({},), ({"a": 0},), ({"a": -1, "b": 3},)],
        _one(_small_dict),
        params=[{"k": k} for k in range(2, 8)],
    ),
    CodeTemplate(
        "count_words", "dicts", 2, ("text",),
        lambda p: "a dict mapping each space-separated word of `text` to how many times it "
        "occurs",
        lambda p: "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
        lambda p: [("",), ("a a a",), ("x y x",)],
        _one(_sentence),
    ),
    CodeTemplate(
        "key_of_max", "dicts", 2, ("mapping",),
        lambda p: "the key of `mapping` with the largest value (the first such key in the "
        "dict's order when several tie), or None for an empty dict",
        lambda p: "def key_of_max(mapping):\n    best = None\n    for key, value in mapping.items():\n"
        "        if best is None or value > mapping[best]:\n            best = key\n"
        "    return best\n",
        lambda p: [({},), ({"a": 1},), ({"a": 2, "b": 2},), ({"a": -1, "b": -5},)],
        _one(_small_dict),
    ),
    CodeTemplate(
        "group_by_length", "dicts", 3, ("words",),
        lambda p: "a dict mapping each word length to the list of words of `words` with that "
        "length, in their original order",
        lambda p: "def group_by_length(words):\n    groups = {}\n    for word in words:\n"
        "        groups.setdefault(len(word), []).append(word)\n    return groups\n",
        lambda p: [([],), (["a"],), (["ab", "c", "de", "f"],)],
        lambda rng, p: (_sentence(rng, 6).split(),),
    ),
    CodeTemplate(
        "merge_add", "dicts", 3, ("first", "second"),
        lambda p: "a new dict with every key of `first` and `second`; a key in both maps to "
        "the sum of its two values",
        lambda p: "def merge_add(first, second):\n    merged = dict(first)\n"
        "    for key, value in second.items():\n        merged[key] = merged.get(key, 0) + value\n"
        "    return merged\n",
        lambda p: [({}, {}), ({"a": 1}, {}), ({"a": 1}, {"a": 2, "b": 3})],
        lambda rng, p: (_small_dict(rng), _small_dict(rng)),
    ),
    # arithmetic
    CodeTemplate(
        "power_of", "arithmetic", 1, ("n",),
        lambda p: f"`n` raised to the power {p['k']}",
        lambda p: f"def power_of(n):\n    return n ** {p['k']}\n",
        lambda p: [(0,), (1,), (-2,), (3,)],
        lambda rng, p: (rng.randint(-9, 12),),
        params=[{"k": k} for k in range(2, 6)],
    ),
    CodeTemplate(
        "is_multiple", "arithmetic", 1, ("n",),
        lambda p: f"True when the integer `n` is a multiple of {p['k']}, and False otherwise",
        lambda p: f"def is_multiple(n):\n    return n % {p['k']} == 0\n",
        lambda p: [(0,), (p["k"],), (p["k"] + 1,), (-p["k"] * 3,), (1,)],
        lambda rng, p: (rng.randint(-50, 100),),
        params=[{"k": k} for k in range(2, 12)],
    ),
    CodeTemplate(
        "clamp", "arithmetic", 1, ("x",),
        lambda p: f"`x` limited to the range from {p['lo']} to {p['hi']}: {p['lo']} when `x` is "
        f"smaller, {p['hi']} when it is larger, else `x`",
        lambda p: f"def clamp(x):\n    return max({p['lo']}, min({p['hi']}, x))\n",
        lambda p: [(p["lo"],), (p["hi"],), (p["lo"] - 1,), (p["hi"] + 10,), ((p["lo"] + p["hi"]) // 2,)],
        lambda rng, p: (rng.randint(-30, 60),),
        params=[{"lo": lo, "hi": hi} for lo, hi in ((0, 10), (1, 5), (-5, 5), (10, 20), (0, 100), (-10, 0))],
    ),
    CodeTemplate(
        "digit_sum", "arithmetic", 2, ("n",),
        lambda p: "the sum of the decimal digits of the integer `n` (ignoring its sign)",
        lambda p: "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
        lambda p: [(0,), (7,), (-123,), (909,)],
        lambda rng, p: (rng.randint(-9999, 99999),),
    ),
    CodeTemplate(
        "factorial", "arithmetic", 2, ("n",),
        lambda p: "the factorial of the non-negative integer `n` (1 for 0)",
        lambda p: "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n"
        "        result *= i\n    return result\n",
        lambda p: [(0,), (1,), (5,)],
        lambda rng, p: (rng.randint(2, 12),),
    ),
    CodeTemplate(
        "gcd", "arithmetic", 2, ("a", "b"),
        lambda p: "the greatest common divisor of the positive integers `a` and `b`",
        lambda p: "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        lambda p: [(1, 1), (12, 18), (7, 13), (100, 10)],
        lambda rng, p: (rng.randint(1, 120), rng.randint(1, 120)),
    ),
    CodeTemplate(
        "count_divisors", "arithmetic", 2, ("n",),
        lambda p: "how many positive integers divide the positive integer `n` exactly",
        lambda p: "def count_divisors(n):\n    return sum(1 for d in range(1, n + 1) if n % d == 0)\n",
        lambda p: [(1,), (2,), (12,), (13,)],
        lambda rng, p: (rng.randint(1, 200),),
    ),
    # conditions
    CodeTemplate(
        "sign_word", "conditions", 1, ("n",),
        lambda p: f"{p['pos']!r} when the number `n` is above zero, {p['neg']!r} when it is "
        f"below zero and {p['zero']!r} when it is zero",
        lambda p: f"def sign_word(n):\n    if n > 0:\n        return {p['pos']!r}\n"
        f"    if n < 0:\n        return {p['neg']!r}\n    return {p['zero']!r}\n",
        lambda p: [(0,), (1,), (-1,), (250,)],
        lambda rng, p: (rng.randint(-20, 20),),
        params=[
            {"pos": a, "neg": b, "zero": c}
            for a, b, c in (
                ("positive", "negative", "zero"), ("up", "down", "flat"), ("+", "-", "0"),
                ("plus", "minus", "none"), ("P", "N", "Z"),
            )
        ],  # fmt: skip
    ),
    CodeTemplate(
        "max_of_three", "conditions", 1, ("a", "b", "c"),
        lambda p: "the largest of the three numbers `a`, `b` and `c`",
        lambda p: "def max_of_three(a, b, c):\n    return max(a, b, c)\n",
        lambda p: [(1, 2, 3), (3, 2, 1), (2, 3, 1), (-1, -1, -2), (0, 0, 0)],
        lambda rng, p: tuple(rng.randint(-20, 20) for _ in range(3)),
    ),
    CodeTemplate(
        "grade", "conditions", 2, ("score",),
        lambda p: f"'A' when `score` is at least {p['a']}, 'B' when it is at least {p['b']}, "
        f"and 'C' otherwise",
        lambda p: f"def grade(score):\n    if score >= {p['a']}:\n        return 'A'\n"
        f"    if score >= {p['b']}:\n        return 'B'\n    return 'C'\n",
        lambda p: [(p["a"],), (p["b"],), (p["b"] - 1,), (p["a"] - 1,), (0,), (100,)],
        lambda rng, p: (rng.randint(0, 100),),
        params=[{"a": a, "b": b} for a, b in ((90, 75), (80, 60), (70, 50), (85, 65), (95, 80))],
    ),
    CodeTemplate(
        "fizz_word", "conditions", 2, ("n",),
        lambda p: f"{p['w1'] + p['w2']!r} when `n` is a multiple of both {p['k1']} and "
        f"{p['k2']}, {p['w1']!r} when it is a multiple of {p['k1']} only, {p['w2']!r} when it "
        f"is a multiple of {p['k2']} only, and `n` as a string otherwise",
        lambda p: f"def fizz_word(n):\n    if n % {p['k1'] * p['k2']} == 0:\n"
        f"        return {p['w1'] + p['w2']!r}\n    if n % {p['k1']} == 0:\n"
        f"        return {p['w1']!r}\n    if n % {p['k2']} == 0:\n        return {p['w2']!r}\n"
        "    return str(n)\n",
        lambda p: [(1,), (p["k1"],), (p["k2"],), (p["k1"] * p["k2"],), (p["k1"] * p["k2"] + 1,)],
        lambda rng, p: (rng.randint(1, 60),),
        params=[
            {"k1": a, "k2": b, "w1": w1, "w2": w2}
            for (a, b) in ((3, 5), (2, 7), (3, 4), (5, 7))
            for (w1, w2) in (("Fizz", "Buzz"), ("Ping", "Pong"))
        ],
    ),
    CodeTemplate(
        "is_leap_year", "conditions", 2, ("year",),
        lambda p: "True when `year` is a leap year in the Gregorian calendar (divisible by 4, "
        "except centuries not divisible by 400), and False otherwise",
        lambda p: "def is_leap_year(year):\n"
        "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        lambda p: [(2000,), (1900,), (2024,), (2023,), (2100,)],
        lambda rng, p: (rng.randint(1600, 2400),),
    ),
    CodeTemplate(
        "triangle_kind", "conditions", 3, ("a", "b", "c"),
        lambda p: "'equilateral' when the side lengths `a`, `b`, `c` are all equal, "
        "'isosceles' when exactly two are equal, and 'scalene' when all differ",
        lambda p: "def triangle_kind(a, b, c):\n    if a == b == c:\n        return 'equilateral'\n"
        "    if a == b or b == c or a == c:\n        return 'isosceles'\n    return 'scalene'\n",
        lambda p: [(1, 1, 1), (2, 2, 3), (3, 2, 2), (2, 3, 2), (3, 4, 5)],
        lambda rng, p: tuple(rng.randint(1, 4) for _ in range(3)),
    ),
    # loops
    CodeTemplate(
        "sum_multiples", "loops", 2, ("n",),
        lambda p: f"the sum of the positive multiples of {p['k']} that are at most `n` (0 when "
        "there are none)",
        lambda p: f"def sum_multiples(n):\n    return sum(range({p['k']}, n + 1, {p['k']}))\n",
        lambda p: [(0,), (p["k"] - 1,), (p["k"],), (p["k"] * 4 + 1,)],
        lambda rng, p: (rng.randint(1, 80),),
        params=[{"k": k} for k in range(2, 10)],
    ),
    CodeTemplate(
        "count_digits", "loops", 2, ("n",),
        lambda p: "how many decimal digits the integer `n` has (ignoring its sign; 1 for 0)",
        lambda p: "def count_digits(n):\n    return len(str(abs(n)))\n",
        lambda p: [(0,), (9,), (10,), (-4567,)],
        lambda rng, p: (rng.randint(-99999, 999999),),
    ),
    CodeTemplate(
        "reverse_number", "loops", 2, ("n",),
        lambda p: "the non-negative integer `n` with its decimal digits in reverse order, as an "
        "integer (leading zeros dropped)",
        lambda p: "def reverse_number(n):\n    return int(str(n)[::-1])\n",
        lambda p: [(0,), (7,), (120,), (12345,)],
        lambda rng, p: (rng.randint(0, 99999),),
    ),
    CodeTemplate(
        "fibonacci", "loops", 2, ("n",),
        lambda p: f"a list of the first `n` numbers of the sequence that starts {p['a']}, "
        f"{p['b']} and continues with each number the sum of the two before it ([] for 0)",
        lambda p: f"def fibonacci(n):\n    out, a, b = [], {p['a']}, {p['b']}\n"
        "    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n    return out\n",
        lambda p: [(0,), (1,), (2,), (7,)],
        lambda rng, p: (rng.randint(3, 12),),
        params=[{"a": a, "b": b} for a, b in ((0, 1), (1, 1), (2, 1), (1, 3), (2, 2))],
    ),
    CodeTemplate(
        "is_prime", "loops", 2, ("n",),
        lambda p: "True when the integer `n` is a prime number, and False otherwise",
        lambda p: "def is_prime(n):\n    if n < 2:\n        return False\n"
        "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n"
        "            return False\n    return True\n",
        lambda p: [(0,), (1,), (2,), (9,), (13,), (-7,)],
        lambda rng, p: (rng.randint(2, 200),),
    ),
    CodeTemplate(
        "countdown", "loops", 2, ("n",),
        lambda p: f"a list counting down from `n` to {p['stop']} in steps of 1 ([] when `n` is "
        f"below {p['stop']})",
        lambda p: f"def countdown(n):\n    return list(range(n, {p['stop'] - 1}, -1))\n",
        lambda p: [(p["stop"],), (p["stop"] - 1,), (p["stop"] + 3,)],
        lambda rng, p: (rng.randint(p["stop"], p["stop"] + 9),),
        params=[{"stop": s} for s in range(0, 4)],
    ),
    CodeTemplate(
        "collatz_steps", "loops", 3, ("n",),
        lambda p: "how many steps the positive integer `n` takes to reach 1, where a step "
        "halves an even number and turns an odd number m into 3*m + 1 (0 for 1)",
        lambda p: "def collatz_steps(n):\n    steps = 0\n    while n != 1:\n"
        "        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        steps += 1\n    return steps\n",
        lambda p: [(1,), (2,), (3,), (6,), (27,)],
        lambda rng, p: (rng.randint(1, 100),),
    ),
    CodeTemplate(
        "primes_below", "loops", 3, ("n",),
        lambda p: "a list of the prime numbers smaller than `n`, in increasing order",
        lambda p: "def primes_below(n):\n    primes = []\n    for m in range(2, n):\n"
        "        if all(m % p != 0 for p in primes):\n            primes.append(m)\n"
        "    return primes\n",
        lambda p: [(0,), (2,), (3,), (20,)],
        lambda rng, p: (rng.randint(4, 60),),
    ),
)  # fmt: skip

# Never trained on: two templates per category across difficulties, for the held-out-template
# split (generalising to a kind of function not seen in training).
HELDOUT_TEMPLATES = frozenset(
    {
        "acronym", "remove_char",
        "running_sum", "count_greater",
        "filter_dict", "key_of_max",
        "digit_sum", "clamp",
        "grade", "max_of_three",
        "fibonacci", "sum_multiples",
    }
)  # fmt: skip
