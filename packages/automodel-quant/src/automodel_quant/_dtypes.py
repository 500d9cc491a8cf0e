"""dtype values in configs: accept ``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"``."""

from __future__ import annotations

import torch

__all__ = ["dtype_name", "parse_dtype"]


def parse_dtype(value: object, field: str) -> torch.dtype:
    """Turn a dtype or its name into a floating-point ``torch.dtype``.

    Raises:
        ValueError: Naming ``field`` when the value is not a floating-point dtype.
    """
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        candidate = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(candidate, torch.dtype):
            raise ValueError(f"{field}={value!r} is not a torch dtype; use e.g. 'bfloat16' or torch.bfloat16")
        dtype = candidate
    else:
        raise ValueError(f"{field} must be a torch.dtype or its name, got {type(value).__name__} {value!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"{field}={dtype} must be a floating-point dtype (e.g. torch.bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (for ``to_dict``)."""
    return str(dtype).removeprefix("torch.")
