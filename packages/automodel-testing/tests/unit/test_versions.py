"""`automodel_testing.versions` names the transformers of the lock."""

from __future__ import annotations

import pathlib
import re

from automodel_testing.versions import LOCKED_TORCH, LOCKED_TRANSFORMERS

LOCK = pathlib.Path(__file__).resolve().parents[4] / "uv.lock"


def _locked(name: str) -> tuple[int, int]:
    found = re.search(rf'\[\[package\]\]\nname = "{name}"\nversion = "(\d+)\.(\d+)', LOCK.read_text())
    assert found is not None, f"no {name} package in {LOCK}"
    return int(found[1]), int(found[2])


def test_the_locked_versions_are_the_ones_in_uv_lock() -> None:
    assert _locked("transformers") == LOCKED_TRANSFORMERS
    assert _locked("torch") == LOCKED_TORCH
