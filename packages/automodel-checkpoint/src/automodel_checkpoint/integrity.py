"""Checksums of a checkpoint's files, recorded in its completion marker and verified before a load.

When a save publishes a folder (`publish_staging_dir`), the SHA-256 and size of every file in it go into
the completion marker under ``"files"``. The ranks share the hashing: file ``i`` (in sorted order) is
read by rank ``i % world_size``, which works on the shared file system a distributed checkpoint needs
anyway. `verify_checkpoint` repeats that split and fails, on every rank alike, with a
`CorruptCheckpointError` naming the first file whose bytes differ (a flipped bit, a truncated copy),
is missing, or was added.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from automodel_checkpoint.ranks import is_distributed, rank_of, world_of
from automodel_checkpoint.safetensors_io import CorruptCheckpointError

__all__ = ["MARKER_FILES_KEY", "file_checksums", "verify_checkpoint"]

MARKER_FILES_KEY = "files"
"""Key of the completion marker holding ``{relative path: {"size": bytes, "sha256": hex}}``."""


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _listing(folder: Path, exclude: frozenset[str]) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name not in exclude
    )


def _gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not is_distributed(group):
        return [value]
    out: list[Any] = [None] * world_of(group)
    dist.all_gather_object(out, value, group=group)
    return out


def file_checksums(
    folder: str | os.PathLike[str],
    *,
    exclude: frozenset[str] = frozenset(),
    group: dist.ProcessGroup | None = None,
    known: Mapping[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under ``folder`` (recursively), hashed by the ranks together.

    Collective over ``group`` (two ``all_gather_object``): every rank must call it, after every rank
    has finished writing into ``folder``. Without a process group the one process hashes everything.

    Args:
        folder: The folder (a checkpoint's staging folder).
        exclude: File names left out (the completion marker).
        group: The ranks that share the work.
        known: This rank's checksums of files it wrote (computed as it wrote them): not read again,
            as long as the file still has the recorded size.

    Returns:
        ``{path relative to folder: {"size": int, "sha256": str}}``, the same on every rank.
    """
    root = Path(folder)
    gathered = _gather((_listing(root, exclude) if rank_of(group) == 0 else None, dict(known or {})), group)
    names: list[str] = gathered[0][0]
    merged = {
        name: record
        for _, part in gathered
        for name, record in part.items()
        if name in names and (root / name).stat().st_size == record["size"]
    }
    rank, world = rank_of(group), world_of(group)
    unhashed = [name for name in names if name not in merged]
    mine = {
        name: {"size": (root / name).stat().st_size, "sha256": _sha256(root / name)}
        for name in unhashed[rank::world]
    }
    for part in _gather(mine, group):
        merged.update(part)
    return dict(sorted(merged.items()))


def verify_checkpoint(
    folder: str | os.PathLike[str],
    recorded: dict[str, dict[str, Any]],
    *,
    exclude: frozenset[str] = frozenset(),
    group: dist.ProcessGroup | None = None,
) -> None:
    """Check every file of ``folder`` against the ``recorded`` checksums (collective, like `file_checksums`).

    Raises:
        CorruptCheckpointError: On every rank: a file is missing, has another size or other bytes, or is
            not recorded; the message names the first such file (in path order) and counts the others.
    """
    root = Path(folder)
    problems: list[tuple[str, str]] = []
    if rank_of(group) == 0:
        present = set(_listing(root, exclude))
        problems += [
            (name, "missing (recorded in the completion marker)") for name in sorted(set(recorded) - present)
        ]
        problems += [
            (name, "not recorded in the completion marker") for name in sorted(present - set(recorded))
        ]
    rank, world = rank_of(group), world_of(group)
    for name in sorted(recorded)[rank::world]:
        path = root / name
        if not path.is_file():
            continue  # reported by rank 0
        expected = recorded[name]
        size = path.stat().st_size
        if size != expected.get("size"):
            problems.append((name, f"{size} bytes, {expected.get('size')} recorded"))
        elif _sha256(path) != expected.get("sha256"):
            problems.append(
                (name, "its SHA-256 differs from the one recorded at save time (the bytes changed)")
            )
    found = sorted(p for part in _gather(problems, group) for p in part)
    if found:
        name, problem = found[0]
        more = f" ({len(found) - 1} more file(s) affected)" if len(found) > 1 else ""
        raise CorruptCheckpointError(root / name, problem + more)
