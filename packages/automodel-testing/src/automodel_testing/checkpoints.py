"""Compare saved safetensors checkpoints: tensor for tensor (key, dtype, shape, bytes) or file for file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["safetensors_differences", "stored_tensors"]


def stored_tensors(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of the ``*.safetensors`` files of ``folder``: key -> (dtype, shape, raw bytes).

    Read from the files' headers and data as stored, whatever their split into files.
    """
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        raw = file.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        data = raw[8 + length :]
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            out[key] = (entry["dtype"], tuple(entry["shape"]), data[start:end])
    return out


def _weight_files(folder: str | Path) -> set[str]:
    return {p.name for p in Path(folder).glob("model*.safetensors*")}


def safetensors_differences(a: str | Path, b: str | Path, *, files: bool = False) -> list[str]:
    """What differs between two checkpoint folders (empty when they hold the same tensors).

    Args:
        a: One folder.
        b: The other.
        files: Also require the same files, byte for byte (the same split, headers and index).
    """
    left, right = stored_tensors(a), stored_tensors(b)
    diffs = [f"only in {a}: {k}" for k in sorted(left.keys() - right.keys())]
    diffs += [f"only in {b}: {k}" for k in sorted(right.keys() - left.keys())]
    for key in sorted(left.keys() & right.keys()):
        (dtype_a, shape_a, bytes_a), (dtype_b, shape_b, bytes_b) = left[key], right[key]
        if (dtype_a, shape_a) != (dtype_b, shape_b):
            diffs.append(f"{key}: {dtype_a}{list(shape_a)} vs {dtype_b}{list(shape_b)}")
        elif bytes_a != bytes_b:
            diffs.append(f"{key}: other bytes")
    if files:
        names_a, names_b = _weight_files(a), _weight_files(b)
        if names_a != names_b:
            diffs.append(f"other files: {sorted(names_a)} vs {sorted(names_b)}")
        for name in sorted(names_a & names_b):
            if (Path(a) / name).read_bytes() != (Path(b) / name).read_bytes():
                diffs.append(f"{name}: other bytes")
    return diffs
