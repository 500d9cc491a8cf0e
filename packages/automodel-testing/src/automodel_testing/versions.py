"""The installed torch and transformers against the locked ones: what a test may excuse at `oldest`.

The ``oldest`` nox session runs the tests at the lowest supported versions. Some facts tests check come
from torch or transformers itself and are newer than those versions (a model's router metadata, a
config that validates, a self-send on gloo); a test excuses such a fact only when `older_transformers`
or `older_torch` is true, so the locked run never excuses a regression.
"""

from __future__ import annotations

import functools

__all__ = ["LOCKED_TORCH", "LOCKED_TRANSFORMERS", "older_torch", "older_transformers"]

LOCKED_TRANSFORMERS: tuple[int, int] = (5, 24)
"""``(major, minor)`` of the transformers in ``uv.lock`` (a unit test checks the two agree)."""
LOCKED_TORCH: tuple[int, int] = (2, 15)
"""``(major, minor)`` of the torch in ``uv.lock`` (a unit test checks the two agree)."""


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@functools.cache
def older_torch() -> bool:
    """Whether the installed torch is older than `LOCKED_TORCH`."""
    import torch

    return _minor(torch.__version__) < LOCKED_TORCH


@functools.cache
def older_transformers() -> bool:
    """Whether the installed transformers is older than `LOCKED_TRANSFORMERS`."""
    import transformers

    return _minor(transformers.__version__) < LOCKED_TRANSFORMERS
