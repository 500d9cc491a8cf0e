"""No function in the packages' sources is longer than 80 lines, docstrings aside (the re-cut's rule)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 80


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the ``def`` to the end, less the docstring's."""
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _length(node) > LIMIT:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_length(node)} lines)")
    assert long == [], "split these functions:\n" + "\n".join(long)
