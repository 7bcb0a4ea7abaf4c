"""Procedural bugs: the second synthetic task kind, in the spirit of SWE-smith.

Where a feature-deletion task removes a whole body, a bug task changes one small thing inside a
function, as a slip of a programmer would, and the agent must find and undo it:

* ``flip_comparison``: ``<`` <-> ``<=``, ``>`` <-> ``>=`` (off by one), ``==`` <-> ``!=``,
  ``is`` <-> ``is not``, ``in`` <-> ``not in``;
* ``change_constant``: an integer literal ``n`` becomes ``n + 1``;
* ``drop_branch``: an ``if`` statement without ``else`` is replaced by ``pass``;
* ``swap_arguments``: a call's first two positional arguments change places;
* ``flip_boolean``: ``and`` <-> ``or``.

:func:`find_bug_sites` finds, per function or method of the package (no dunders) and per
operator, its first site in line order whose mutated file still parses, as a line edit; the
generator makes each a candidate of the task format (``Feature.kind == "bug"``,
``Feature.mutation`` the operator) and validates it exactly as deletions
(``composer_tune.data.feature_generator``): some baseline tests fail, at most the allowed
share, the grader passes them on the original and fails them on the agent's tree, and every
other test passes there. The sites come round by round (every function's first, then every
function's second, ...), the functions in an order fixed by a hash of their names and each
starting at another operator, so that a ``max_candidates`` cap spreads over the package's
files, functions and operators alike.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from composer_tune.data.feature_tasks import LineEdit, text_sha256

# A change: spans (start, end as ``ast`` positions: line, byte column) and what replaces each:
# a text, another span of the original (a swap), or a function of the span's text (None: the
# site does not fit); the rest keeps its formatting.
Position = tuple[int, int]
Replacement = str | tuple[Position, Position] | Callable[[str], str | None]
Change = list[tuple[Position, Position, Replacement]]

_COMPARISONS: dict[type, str] = {
    ast.Lt: "<=",
    ast.LtE: "<",
    ast.Gt: ">=",
    ast.GtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Is: "is not",
    ast.IsNot: "is",
    ast.In: "not in",
    ast.NotIn: "in",
}


def _start(node: ast.AST) -> Position:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _end(node: ast.AST) -> Position:
    return node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]


# Between two operands there are only brackets, blanks, comments and the operator itself.
_OPERATOR = re.compile(r"\bis\s+not\b|\bnot\s+in\b|\bis\b|\bin\b|\band\b|\bor\b|[<>=!]=|[<>]")
_COMMENT = re.compile(r"#[^\n]*")


def _swap_operator(new: str) -> Callable[[str], str | None]:
    """Replace the one operator of the text between two operands by ``new``."""

    def swap(between: str) -> str | None:
        blanked = _COMMENT.sub(lambda m: " " * len(m.group()), between)
        found = list(_OPERATOR.finditer(blanked))
        if len(found) != 1:
            return None
        return between[: found[0].start()] + new + between[found[0].end() :]

    return swap


def _flip_comparison(node: ast.AST) -> Change | None:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARISONS:
        swap = _swap_operator(_COMPARISONS[type(node.ops[0])])
        return [(_end(node.left), _start(node.comparators[0]), swap)]
    return None


def _change_constant(node: ast.AST) -> Change | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [(_start(node), _end(node), str(node.value + 1))]
    return None


def _swap_arguments(node: ast.AST) -> Change | None:
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    first, second = node.args[:2]
    if isinstance(first, ast.Starred) or isinstance(second, ast.Starred):
        return None
    if ast.dump(first) == ast.dump(second):
        return None
    return [
        (_start(first), _end(first), (_start(second), _end(second))),
        (_start(second), _end(second), (_start(first), _end(first))),
    ]


def _flip_boolean(node: ast.AST) -> Change | None:
    if not isinstance(node, ast.BoolOp):
        return None
    swap = _swap_operator("or" if isinstance(node.op, ast.And) else "and")
    return [
        (_end(left), _start(right), swap)
        for left, right in zip(node.values, node.values[1:], strict=False)
    ]


_EXPRESSIONS: dict[str, Callable[[ast.AST], Change | None]] = {
    "flip_comparison": _flip_comparison,
    "change_constant": _change_constant,
    "swap_arguments": _swap_arguments,
    "flip_boolean": _flip_boolean,
}
OPERATORS = (*_EXPRESSIONS, "drop_branch")


def _functions(module: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) of the module's functions and its classes' methods (no dunders)."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in module.body:
        if isinstance(node, functions):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                dunder = member.name.startswith("__") if isinstance(member, functions) else True
                if isinstance(member, functions) and not dunder:
                    yield f"{node.name}.{member.name}", member


def _body_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of a function's body in source order, nested functions and classes left out
    (they are candidates of their own or not at all), and its docstring left out."""
    body = function.body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    found: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for statement in body:
        visit(statement)
    return sorted(
        (n for n in found if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset)
    )


def _expression_edit(
    lines: list[str], node: ast.AST, change: Change
) -> tuple[int, int, str] | None:
    """(first line, last line, replacement) of ``node``'s lines with ``change`` made, or None
    where a span does not fit it."""
    first, last = node.lineno, node.end_lineno  # type: ignore[attr-defined]
    block = [line.encode() for line in lines[first - 1 : last]]

    def offset(position: Position) -> int:
        line, column = position
        return sum(len(b) for b in block[: line - first]) + column

    original = b"".join(block)
    text = original
    for start, end, replacement in sorted(change, key=lambda c: offset(c[0]), reverse=True):
        span = original[offset(start) : offset(end)]
        if isinstance(replacement, str):
            new = replacement.encode()
        elif isinstance(replacement, tuple):
            new = original[offset(replacement[0]) : offset(replacement[1])]
        else:
            made = replacement(span.decode())
            if made is None:
                return None
            new = made.encode()
        text = text[: offset(start)] + new + text[offset(end) :]
    return first, last, text.decode()


def _branch_edit(lines: list[str], node: ast.AST) -> tuple[int, int, str] | None:
    if not isinstance(node, ast.If) or node.orelse:
        return None
    indent = lines[node.lineno - 1][: node.col_offset]
    return node.lineno, node.end_lineno, f"{indent}pass\n"  # type: ignore[return-value]


def find_bug_sites(
    root: Path, package_files: list[str]
) -> list[tuple[str, str, ast.AST, str, LineEdit]]:
    """Bug sites of the package's files (see the module docstring), round by round:
    ``(file, qualname, function node, operator, edit)``."""
    per_function = []
    for file in package_files:
        text = (Path(root) / file).read_text(encoding="utf-8")
        try:
            module = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for qualname, function in _functions(module):
            turn = len(per_function) % len(OPERATORS)  # each function starts elsewhere
            nodes = _body_nodes(function)
            sites = []
            for operator in OPERATORS[turn:] + OPERATORS[:turn]:
                site = _first_site(file, lines, nodes, operator)
                if site is not None:
                    sites.append((file, qualname, function, operator, site))
            per_function.append(sites)
    # Within a round, functions in an order fixed by their names' hash, not by file: a cap on
    # the candidates spreads over the package's files too.
    per_function.sort(key=lambda sites: _name_hash(*sites[0][:2]) if sites else "")
    depth = max((len(sites) for sites in per_function), default=0)
    return [sites[r] for r in range(depth) for sites in per_function if r < len(sites)]


def _name_hash(file: str, qualname: str) -> str:
    return hashlib.sha256(f"{file}:{qualname}".encode()).hexdigest()


def _first_site(
    file: str, lines: list[str], nodes: list[ast.AST], operator: str
) -> LineEdit | None:
    """The edit of the first of ``nodes`` that ``operator`` changes and whose file still
    parses once changed."""
    for node in nodes:
        if operator == "drop_branch":
            site = _branch_edit(lines, node)
        else:
            change = _EXPRESSIONS[operator](node)
            site = None if change is None else _expression_edit(lines, node, change)
        if site is None:
            continue
        start, end, replacement = site
        replacement = replacement if replacement.endswith("\n") else replacement + "\n"
        try:
            ast.parse("".join(lines[: start - 1]) + replacement + "".join(lines[end:]))
        except SyntaxError:
            continue
        original = "".join(lines[start - 1 : end])
        return LineEdit(file, start, end, replacement, text_sha256(original))
    return None
