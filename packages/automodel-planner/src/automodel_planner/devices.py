"""Accelerator memory sizes by name, for ``--device-memory`` (`DEVICE_PRESETS`, `device_memory_bytes`)."""

from __future__ import annotations

import re

from automodel_planner.hardware import DEVICES

__all__ = ["DEVICE_PRESETS", "device_memory_bytes"]

DEVICE_PRESETS: dict[str, int] = {
    **{name: device.memory_bytes for name, device in DEVICES.items()},  # the time model's devices
    "h100-80g": DEVICES["h100"].memory_bytes,
    "a100-80g": DEVICES["a100"].memory_bytes,
    # Memory-only presets: total memory as torch.cuda.get_device_properties reports it (MiB).
    "a100-40g": 40_536 * 2**20,
    "l40s": 46_068 * 2**20,
    "a10g": 22_731 * 2**20,
    "rtx4090": 24_217 * 2**20,
    "mi300x": 196_592 * 2**20,
}
"""Accelerator name -> bytes."""

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def device_memory_bytes(text: str) -> int:
    """Bytes of a preset (`DEVICE_PRESETS`) or of a size such as ``80GiB`` / ``40GB``.

    Raises:
        ValueError: Neither a preset nor a size (the message lists the presets).
    """
    key = text.strip().lower()
    if key in DEVICE_PRESETS:
        return DEVICE_PRESETS[key]
    match = re.fullmatch(r"([\d.]+)\s*([a-z]*)", key)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"{text!r}: expected a size such as 80GiB or 40GB, or one of {', '.join(sorted(DEVICE_PRESETS))}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])
