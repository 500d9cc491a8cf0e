"""`automodel_testing.versions` names the transformers of the lock."""

from __future__ import annotations

import pathlib
import re

from automodel_testing.versions import LOCKED_TRANSFORMERS

LOCK = pathlib.Path(__file__).resolve().parents[4] / "uv.lock"


def test_the_locked_transformers_is_the_one_in_uv_lock() -> None:
    found = re.search(r'\[\[package\]\]\nname = "transformers"\nversion = "(\d+)\.(\d+)', LOCK.read_text())
    assert found is not None, f"no transformers package in {LOCK}"
    assert (int(found[1]), int(found[2])) == LOCKED_TRANSFORMERS
