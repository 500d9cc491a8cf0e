"""docs/benchmarks.md is what tools/benchmark_report.py renders from docs/benchmarks.json.

The page's table is generated from the JSON that a ``uvx nox -s benchmarks -- --publish`` run wrote,
so a number on the page is always one that a run produced. These tests are cheap (no benchmark runs):
they check that the committed page matches its committed data, that the data says where each
section was measured, that each figure that depends on a setting is shown for every value of it, and
the renderer's own logic (merging a partial run, rendering, the check).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from automodel_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


report = load_script(ROOT / "tools" / "benchmark_report.py")


def _section(key: str, *rows: object, commit: str = "0123456789ab") -> object:
    prov = report.Provenance(
        date="2026-01-01 00:00 UTC",
        commit=commit,
        machine="test cpu, 2 cores",
        load_before=(0.5, 0.4, 0.3),
        load_after=(1.5, 0.6, 0.4),
        wall_s=12.0,
    )
    return report.Section(key=key, provenance=prov, rows=list(rows))


def _row(name: str, ours: float | None, baseline: float | None, **kw: object) -> object:
    return report.Row(section="s", name=name, ours=ours, baseline=baseline, **kw)


def test_committed_page_is_rendered_from_committed_data() -> None:
    sections = report.load_sections(report.DATA)
    assert sections, "docs/benchmarks.json holds no sections"
    problem = report.check_page(report.PAGE.read_text(), sections)
    assert problem is None, (
        f"docs/benchmarks.md differs from docs/benchmarks.json ({problem}); regenerate it with "
        "`python tools/benchmark_report.py` (never edit the generated block by hand)"
    )


def test_committed_data_has_provenance_and_ratios() -> None:
    for s in report.load_sections(report.DATA):
        p = s.provenance
        assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", p.commit), (s.key, p.commit)
        assert not p.commit.endswith("+dirty"), f"section {s.key} was measured on uncommitted code"
        assert len(p.load_before) == 3 and len(p.load_after) == 3
        assert s.rows, s.key
        for r in s.rows:
            assert (r.ratio is None) == (r.ours is None or not r.baseline), r


def test_settings_dependent_rows_show_every_value() -> None:
    """A figure measured under a setting of ours appears once per value of that setting, in one run."""
    for s in report.load_sections(report.DATA):
        by_name: dict[str, set[str]] = {}
        for r in s.rows:
            if r.settings:
                by_name.setdefault(r.name, set()).add(r.settings)
        for name, values in by_name.items():
            assert len(values) >= 2, f"{s.key}: {name!r} is shown only for {values}"


def test_merge_replaces_only_the_sections_run() -> None:
    old = [_section("a", _row("x", 1.0, 2.0)), _section("b", _row("y", 3.0, 3.0))]
    new = [_section("b", _row("y", 4.0, 2.0), commit="fedcba987654"), _section("c", _row("z", 1.0, 1.0))]
    merged = report.merge_sections(old, new)
    assert [s.key for s in merged] == ["a", "b", "c"]
    assert merged[0] is old[0]
    assert merged[1].provenance.commit == "fedcba987654"
    assert merged[1].rows[0].ratio == 2.0


def test_round_trip_and_render(tmp_path: Path) -> None:
    sections = [
        _section(
            "a",
            _row("step", 0.5, 0.25, unit="ms", settings="on", spread=(1.8, 2.2), notes="n"),
            _row("step", 0.25, 0.25, unit="ms", settings="off"),
            _row("missing", None, None, notes="not run: why"),
        )
    ]
    path = tmp_path / "b.json"
    report.dump_sections(sections, path)
    loaded = report.load_sections(path)
    assert loaded == sections
    text = report.render(loaded)
    assert "| a | 2026-01-01 00:00 UTC | `0123456789ab` | test cpu, 2 cores | 0.5, 1.5 | 12 s |" in text
    assert "| s | step | on | 0 ms | 0 ms | 2.00 | 1.80 to 2.20 | n |" in text
    assert "| s | missing |  | - | - | - |  | not run: why |" in text


def test_update_and_check_page() -> None:
    sections = [_section("a", _row("x", 1.0, 2.0))]
    page = f"# t\n\nprose\n{report.BEGIN}\nstale\n{report.END}\nmore prose\n"
    updated = report.update_page(page, sections)
    assert updated.startswith("# t\n\nprose\n") and updated.endswith(f"{report.END}\nmore prose\n")
    assert report.check_page(updated, sections) is None
    problem = report.check_page(updated.replace("0.50", "0.49"), sections)
    assert problem is not None and "0.49" in problem
    with pytest.raises(ValueError, match="generated block"):
        report.update_page("# no markers\n", sections)


def test_unknown_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text('{"format": 99, "sections": {}}')
    with pytest.raises(ValueError, match="format 99"):
        report.load_sections(path)
