"""tools/check_dependency_graph.py finds file-level import cycles (and ignores ``TYPE_CHECKING`` imports)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from automodel_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    return load_script(ROOT / "tools" / "check_dependency_graph.py")


def _package(root: Path, files: dict[str, str]) -> None:
    (root / "packages" / "demo-pkg").mkdir(parents=True)
    (root / "packages" / "demo-pkg" / "pyproject.toml").write_text(
        '[project]\nname = "demo-pkg"\nversion = "0.1.0"\ndependencies = []\n'
    )
    for name, text in files.items():
        path = root / "packages" / "demo-pkg" / "src" / "demo_pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_lazy_cycle_is_found_and_a_typing_only_one_is_not(tmp_path: Path) -> None:
    tool = _tool()
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from demo_pkg.b import f\n",
            "b.py": "def f():\n    from demo_pkg.a import g\n",  # lazy: still runs, still a cycle
            "c.py": "from demo_pkg.d import h\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo_pkg.c import x\n",
        },
    )
    workspace = tool.read_workspace(tmp_path)
    errors = tool.check_file_cycles(workspace)
    assert len(errors) == 1 and "demo_pkg.a imports demo_pkg.b" in errors[0], errors
    assert "demo_pkg.c" not in errors[0]


def test_the_workspace_has_no_file_level_cycle() -> None:
    tool = _tool()
    assert tool.check_file_cycles(tool.read_workspace(ROOT)) == []
