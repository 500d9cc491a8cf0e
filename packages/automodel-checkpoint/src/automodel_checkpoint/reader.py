"""A checkpoint's tensors by key, from safetensors headers or memory-mapped ``.bin`` files.

`open_checkpoint` reads metadata only: every safetensors header (validated, `read_safetensors_header`)
or every ``.bin`` file loaded with ``torch.load(weights_only=True, mmap=True)`` (tensors stay on disk
until sliced). It cross-checks the index against the files, so everything that can be wrong with the
files is found before any weight is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from automodel_checkpoint.files import CheckpointFiles
from automodel_checkpoint.safetensors_io import (
    CorruptCheckpointError,
    TensorEntry,
    read_box,
    read_safetensors_header,
)
from automodel_checkpoint.slices import Box

__all__ = ["CheckpointReader", "StoredTensor", "open_checkpoint"]


@dataclass(frozen=True)
class StoredTensor:
    """Where one checkpoint tensor lives and what it is.

    Attributes:
        key: Its key in the checkpoint.
        path: Its file.
        dtype: Stored dtype.
        shape: Stored shape.
        entry: The safetensors header entry (None for ``.bin``).
    """

    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    entry: TensorEntry | None = None


@dataclass
class CheckpointReader:
    """Reads boxes of checkpoint tensors. Open files stay open until `close`.

    Attributes:
        files: The checkpoint's files.
        tensors: Key -> stored tensor.
    """

    files: CheckpointFiles
    tensors: Mapping[str, StoredTensor]
    _bin: dict[Path, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    _fds: dict[Path, int] = field(default_factory=dict)

    def read(self, key: str, box: Box, out: torch.Tensor) -> int:
        """Read ``box`` of tensor ``key`` into ``out`` (cast to its dtype); returns bytes read."""
        stored = self.tensors[key]
        if stored.entry is not None:
            fd = self._fds.get(stored.path)
            if fd is None:
                fd = self._fds[stored.path] = os.open(stored.path, os.O_RDONLY)
            return read_box(fd, stored.path, stored.entry, box, out)
        src = self._bin[stored.path][key]
        region = tuple(slice(s, s + n) for s, n in zip(box.global_start, box.shape, strict=True))
        out.copy_(src[region])
        return box.numel * src.element_size()

    def close(self) -> None:
        """Close open files and drop ``.bin`` mappings."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bin.clear()


def _load_bin(path: Path) -> Mapping[str, torch.Tensor]:
    try:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            data = torch.load(path, map_location="cpu", weights_only=True)  # legacy non-zip format
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {path} does not exist") from None
    except Exception as exc:
        raise CorruptCheckpointError(path, f"torch.load(weights_only=True) failed: {exc}") from None
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CorruptCheckpointError(path, "it does not hold a flat mapping of names to tensors")
    return data


def open_checkpoint(files: CheckpointFiles) -> CheckpointReader:
    """Read the metadata of every file of a checkpoint and check it against the index.

    Raises:
        FileNotFoundError: A file is missing.
        CorruptCheckpointError: A file is truncated or unreadable, a key appears in two files, or the
            index places a key in a file that does not hold it.
    """
    tensors: dict[str, StoredTensor] = {}
    bins: dict[Path, Mapping[str, torch.Tensor]] = {}
    for path in files.files:
        if files.format == "safetensors":
            header = read_safetensors_header(path)
            found = {k: StoredTensor(k, path, e.dtype, e.shape, e) for k, e in header.entries.items()}
        else:
            bins[path] = _load_bin(path)
            found = {k: StoredTensor(k, path, t.dtype, tuple(t.shape)) for k, t in bins[path].items()}
        for key, stored in found.items():
            if key in tensors and files.weight_map.get(key, stored.path) != stored.path:
                continue  # the index places it elsewhere; that copy is the one we read
            if key in tensors and not files.weight_map:
                raise CorruptCheckpointError(
                    path, f"key {key!r} is also in {tensors[key].path.name}; which copy to load is ambiguous"
                )
            tensors[key] = stored
    if files.weight_map:
        wrong = sorted(
            f"{key} (index: {where.name})"
            for key, where in files.weight_map.items()
            if key not in tensors or tensors[key].path != where
        )
        if wrong:
            raise CorruptCheckpointError(
                files.index or files.root,
                f"{len(wrong)} key(s) are not in the file its index names: {wrong[:10]}",
            )
        tensors = {k: v for k, v in tensors.items() if k in files.weight_map}
    return CheckpointReader(files, tensors, bins)
