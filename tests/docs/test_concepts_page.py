"""docs/concepts.md shows the order of operations that `apply_model_infrastructure` runs (APPLY_STEPS)."""

from __future__ import annotations

from pathlib import Path

from automodel_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_lists_the_steps_that_run() -> None:
    tool = load_script(ROOT / "tools" / "concepts_doc.py")
    page = tool.PAGE.read_text(encoding="utf-8")  # type: ignore[attr-defined]
    assert tool.current(page) == tool.rendered(), (  # type: ignore[attr-defined]
        "docs/concepts.md is out of date: run `uv run --all-packages python tools/concepts_doc.py`"
    )
