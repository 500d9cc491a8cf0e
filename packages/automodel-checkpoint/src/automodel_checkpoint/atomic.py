"""Atomic checkpoint folders: write into a hidden sibling, add a completion marker last, then rename.

A save goes to ``<parent>/.<name>.incomplete``. When every rank has finished writing, the ranks hash
its files together (`integrity.file_checksums`), then rank 0 writes ``COMPLETE_MARKER`` (JSON: format,
step, extra state, world size, time, and the size and SHA-256 of every file) into it, fsyncs, and
renames the folder to ``<parent>/<name>``. A crash at any point leaves either no ``<name>`` at all or the
previous complete one; loaders check the marker (and can verify the files against it,
`integrity.verify_checkpoint`), and `latest_checkpoint` only considers folders that have one and whose
names do not start with ``.``. A save that fails while writing (a full disk) removes its staging folder,
so the space it took is given back and the previous checkpoints stay as they were.

Overwriting an existing checkpoint (``overwrite=True``) renames it to ``.<name>.old`` just before the
new one is renamed into place, and deletes it afterwards; a crash between those two renames leaves the
old checkpoint intact under ``.<name>.old``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from automodel_checkpoint.integrity import MARKER_FILES_KEY, file_checksums
from automodel_checkpoint.ranks import agree_on_failure, rank_of, world_of

__all__ = [
    "COMPLETE_MARKER",
    "abandon_on_failure",
    "complete_checkpoints",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "prepare_staging_dir",
    "publish_staging_dir",
    "read_marker",
    "staging_dir_for",
]

COMPLETE_MARKER = ".automodel_complete.json"
"""File written last into a finished checkpoint folder."""


def staging_dir_for(final: str | os.PathLike[str]) -> Path:
    """The hidden sibling a save writes into before it is published."""
    path = Path(final)
    return path.parent / f".{path.name}.incomplete"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def prepare_staging_dir(
    final: str | os.PathLike[str], *, overwrite: bool, group: dist.ProcessGroup | None = None
) -> Path:
    """Create an empty staging folder for ``final`` (rank 0 does the file-system work).

    Collectives: one ``all_gather_object`` over ``group`` (an error on rank 0 raises everywhere).

    Raises:
        FileExistsError: ``final`` exists and ``overwrite`` is False.
    """
    path = Path(final)
    staging = staging_dir_for(path)
    error: BaseException | None = None
    if rank_of(group) == 0:
        try:
            if path.exists() and not overwrite:
                raise FileExistsError(
                    f"checkpoint folder {path} already exists; pass overwrite=True or choose another path"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # left by an interrupted save
            staging.mkdir()
        except Exception as exc:  # shared with every rank below, so none is left waiting
            error = exc
    agree_on_failure(error, f"preparing checkpoint folder {path}", group)
    return staging


def abandon_on_failure(
    staging: Path, error: BaseException | None, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Agree whether any rank failed ``what``; if one did, remove ``staging`` and raise on every rank.

    Collectives over ``group``: those of `agree_on_failure`. Rank 0 removes the folder only after the
    agreement, when every rank has stopped writing into it (a disk that filled up gets its space back).
    """
    try:
        agree_on_failure(error, what, group)
    except BaseException:
        if rank_of(group) == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def publish_staging_dir(
    staging: Path,
    final: str | os.PathLike[str],
    *,
    kind: str,
    step: int | None = None,
    extra_state: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    write_error: BaseException | None = None,
    known_checksums: Mapping[str, dict[str, Any]] | None = None,
) -> Path:
    """Finish a save: agree that every rank wrote its files, then write the marker and rename.

    Collectives over ``group``: the failure agreement (an ``all_reduce``), the checksums (two
    ``all_gather_object``; each rank hashes a share of the files) and one after publishing, so that on
    return every rank sees the published folder.

    Args:
        staging: The folder from `prepare_staging_dir`.
        final: Where the checkpoint is published.
        kind: Format recorded in the marker (``"hf"``, ``"peft"``, ``"dcp"``).
        step: Training step recorded in the marker.
        extra_state: JSON-serialisable data recorded in the marker.
        group: The ranks that saved.
        write_error: This rank's error while writing, if any (then nothing is published).
        known_checksums: Checksums this rank computed while writing its files (paths relative to
            ``staging``); those files are not read back.

    Returns:
        The published folder.

    Raises:
        The write error of any rank (nothing published; rank 0 removes the staging folder, so a disk that
        filled up gets its space back).
    """
    path = Path(final)
    abandon_on_failure(staging, write_error, f"writing checkpoint {path}", group)
    marker_excluded = frozenset({COMPLETE_MARKER})
    checksums = file_checksums(staging, exclude=marker_excluded, group=group, known=known_checksums)
    error: BaseException | None = None
    if rank_of(group) == 0:
        try:
            marker = {
                "format": kind,
                "step": step,
                "extra_state": dict(extra_state or {}),
                "world_size": world_of(group),
                "time": time.time(),
                MARKER_FILES_KEY: checksums,
            }
            marker_path = staging / COMPLETE_MARKER
            with marker_path.open("w", encoding="utf-8") as f:
                json.dump(marker, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(staging)
            old = path.parent / f".{path.name}.old"
            if path.exists():
                if old.exists():
                    shutil.rmtree(old)
                path.rename(old)
            staging.rename(path)
            _fsync_dir(path.parent)
            if old.exists():
                shutil.rmtree(old)
        except Exception as exc:  # shared with every rank below, so none is left waiting
            error = exc
    agree_on_failure(error, f"publishing checkpoint {path}", group)
    return path


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The completion marker of a published checkpoint.

    Raises:
        FileNotFoundError: The folder has no marker: it is not a complete checkpoint written by us
            (an interrupted save never has one).
    """
    marker = Path(path) / COMPLETE_MARKER
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: its completion marker {COMPLETE_MARKER} is missing "
            "(the save that wrote it was interrupted, or it was not written by automodel). Use "
            "latest_checkpoint(<root>) to find the newest complete one."
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FileNotFoundError(f"{marker} is unreadable ({exc}); treat {path} as incomplete") from None
    if not isinstance(data, dict):
        raise FileNotFoundError(f"{marker} does not hold a JSON object; treat {path} as incomplete")
    return data


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a published checkpoint folder with a readable completion marker."""
    try:
        read_marker(path)
    except FileNotFoundError:
        return False
    return not Path(path).name.startswith(".")


def complete_checkpoints(root: str | os.PathLike[str], *, kind: str | None = None) -> list[Path]:
    """The complete checkpoint folders directly under ``root``, newest first.

    Only folders with a completion marker count (staging and ``.old`` folders never do). Newest means
    the highest recorded ``step``, then the latest save time.

    Args:
        root: Folder holding checkpoint folders.
        kind: Only consider this format (``"dcp"``, ``"hf"``, ``"peft"``).
    """
    base = Path(root)
    if not base.is_dir():
        return []
    found: list[tuple[tuple[int, float, str], Path]] = []
    for child in base.iterdir():
        if not child.is_dir() or child.name.startswith("."):
            continue
        try:
            marker = read_marker(child)
        except FileNotFoundError:
            continue
        if kind is not None and marker.get("format") != kind:
            continue
        step = marker.get("step")
        found.append(
            ((step if isinstance(step, int) else -1, float(marker.get("time") or 0.0), child.name), child)
        )
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def latest_checkpoint(root: str | os.PathLike[str], *, kind: str | None = None) -> Path | None:
    """The newest complete checkpoint folder directly under ``root``, or None (see `complete_checkpoints`)."""
    found = complete_checkpoints(root, kind=kind)
    return found[0] if found else None
