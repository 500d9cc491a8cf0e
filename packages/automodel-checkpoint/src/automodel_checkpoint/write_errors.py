"""Errors of a save that could not be written, and the publish that reports them on every rank."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from automodel_checkpoint.atomic import publish_staging_dir
from automodel_checkpoint.ranks import rank_of

__all__ = ["CheckpointWriteError", "publish_or_explain", "write_failure"]

_KINDS = {"dcp": "distributed checkpoint", "hf": "Hugging Face checkpoint"}

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointWriteError(OSError):
    """A checkpoint (distributed, or a Hugging Face export) could not be written; nothing was published.

    Attributes:
        path: The checkpoint folder that was being saved.
    """

    def __init__(self, path: Path, cause: BaseException, kind: str = "dcp") -> None:
        self.path = path
        found = _os_error(cause)
        reason = f"{type(cause).__name__}: {cause}"
        hint = ""
        if found is not None:
            reason = f"{found.strerror or found} ({found.filename or 'a checkpoint file'})"
            if found.errno in _DISK_FULL:
                hint = "; free disk space (or lower the number of checkpoints kept) and save again"
        super().__init__(
            found.errno if found is not None else errno.EIO,
            f"saving the {_KINDS.get(kind, kind)} {path} failed: {reason}. Nothing was published and its "
            f"staging folder was removed; the previous checkpoints are intact{hint}",
        )


def _probe_space(folder: Path, rank: int) -> OSError | None:
    """After a failed write: whether ``folder``'s file system still takes 1 MiB (the error if not).

    torch's writers can report a full disk without its errno (``torch.save`` raises ``RuntimeError:
    unexpected pos``); writing a probe tells a full disk apart from other failures.
    """
    probe = folder / f".space_probe_{rank}"
    try:
        with probe.open("wb") as handle:
            handle.write(bytes(2**20))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return exc
    finally:
        probe.unlink(missing_ok=True)
    return None


def _os_error(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The first ``OSError`` in ``exc``, its causes, or the per-rank failures of a DCP exception."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, Mapping):
        for item in failures.values():
            inner = item[0] if isinstance(item, tuple) else item
            if isinstance(inner, BaseException) and (found := _os_error(inner, depth + 1)) is not None:
                return found
    return _os_error(exc.__cause__ or exc.__context__, depth + 1)


def write_failure(exc: BaseException, staging: Path, group: dist.ProcessGroup | None) -> BaseException:
    """The error to report for a failed write: ``exc``, or the disk-full error it hides (a probe write)."""
    if _os_error(exc) is None and (full := _probe_space(staging, rank_of(group))) is not None:
        full.__cause__ = exc  # the probe's errno (ENOSPC) names what the writer's message hides
        return full
    return exc


def publish_or_explain(staging: Path, final: Path, *, kind: str, **publish: Any) -> Path:
    """`publish_staging_dir`, a failed write raised as `CheckpointWriteError` naming ``final`` and the cause.

    Collective over ``publish["group"]``. A rank whose own write did not fail, when another's did,
    raises the agreement's ``ValueError`` (naming the path and the ranks) unless a file-system error
    is found in it.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    error = publish.get("write_error")
    try:
        return publish_staging_dir(staging, final, kind=kind, **publish)
    except (Exception, CheckpointException) as exc:
        if error is None and _os_error(exc) is None:
            raise
        raise CheckpointWriteError(final, error if error is not None else exc, kind) from exc
