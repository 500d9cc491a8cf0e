"""Every test of the suite runs under a timeout, so a hang fails fast instead of holding a CI machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
# The most any single test may ask for with @pytest.mark.timeout(N).
MAX_TEST_TIMEOUT_S = 900


def test_the_root_configuration_sets_a_timeout(pytestconfig: pytest.Config) -> None:
    """The root pyproject's pytest options are the ones in force (nox runs pytest from the root)."""
    assert pytestconfig.inipath == ROOT / "pyproject.toml", pytestconfig.inipath
    timeout = float(pytestconfig.getini("timeout"))
    assert 0 < timeout <= 300, timeout
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"


def test_no_package_has_its_own_pytest_configuration() -> None:
    """A package-level [tool.pytest.ini_options] or pytest.ini would replace the root config and timeout."""
    own = [
        str(p.relative_to(ROOT))
        for p in sorted(ROOT.glob("packages/*/pyproject.toml"))
        if "[tool.pytest.ini_options]" in p.read_text(encoding="utf-8")
    ]
    own += [
        str(p.relative_to(ROOT))
        for name in ("pytest.ini", "tox.ini")
        for p in ROOT.glob(f"packages/*/{name}")
    ]
    assert not own, f"these files would override the root pytest configuration (and its timeout): {own}"


def test_no_test_switches_its_timeout_off() -> None:
    """``timeout(0)`` disables pytest-timeout; larger explicit limits must stay bounded."""
    pattern = re.compile(r"mark\.timeout\(\s*(?:timeout\s*=\s*)?([0-9.]+|None)")
    bad = []
    for path in sorted([*ROOT.glob("packages/*/tests/**/*.py"), *ROOT.glob("tests/**/*.py")]):
        for value in pattern.findall(path.read_text(encoding="utf-8")):
            if value == "None" or not 0 < float(value) <= MAX_TEST_TIMEOUT_S:
                bad.append(f"{path.relative_to(ROOT)}: timeout({value})")
    assert not bad, bad
