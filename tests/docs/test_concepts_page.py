"""docs/concepts.md shows the order of operations that `apply_model_infrastructure` runs (APPLY_STEPS)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> object:
    spec = importlib.util.spec_from_file_location("concepts_doc", ROOT / "tools" / "concepts_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["concepts_doc"] = module
    spec.loader.exec_module(module)
    return module


def test_the_page_lists_the_steps_that_run() -> None:
    tool = _tool()
    page = tool.PAGE.read_text(encoding="utf-8")  # type: ignore[attr-defined]
    assert tool.current(page) == tool.rendered(), (  # type: ignore[attr-defined]
        "docs/concepts.md is out of date: run `uv run --all-packages python tools/concepts_doc.py`"
    )
