"""The installed transformers against the locked one: what a test may excuse at the `oldest` versions.

The ``oldest`` nox session runs the tests at the lowest supported versions. Some facts tests check come
from transformers itself and are newer than those versions (a model's router metadata, a config that
validates); a test excuses such a fact only when `older_transformers` is true, so the locked run never
excuses a regression.
"""

from __future__ import annotations

import functools

__all__ = ["LOCKED_TRANSFORMERS", "older_transformers"]

LOCKED_TRANSFORMERS: tuple[int, int] = (5, 24)
"""``(major, minor)`` of the transformers in ``uv.lock`` (a unit test checks the two agree)."""


@functools.cache
def older_transformers() -> bool:
    """Whether the installed transformers is older than `LOCKED_TRANSFORMERS`."""
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2]) < LOCKED_TRANSFORMERS
