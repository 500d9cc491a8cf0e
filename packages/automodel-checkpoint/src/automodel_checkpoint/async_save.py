"""Distributed checkpoints written in the background: training waits only while the shards are copied.

`AsyncCheckpointer.save` does on the calling thread what must see the model as it is at that step: the
NaN/Inf check, the staging folder, this rank's ``rank_state`` and the copy of its shards of model and
optimizer state to host memory (DCP's own staging, `FileSystemWriter.stage`; pinned and reused from
one save to the next when the state lives on an accelerator). It then returns, and a background thread
writes the copy (``dcp.save``) and publishes the checkpoint as `save_distributed_checkpoint` does:
checksums and the completion marker only once every rank's files are durable (DCP fsyncs them), then
the rename. At most one save is in flight: the next `save` (or `wait`, or `close`) first waits for it.

The background collectives (DCP's plan exchange, the failure agreement, the checksums) run over a
``gloo`` group of their own, made when the checkpointer is built: a group is used by one thread at a
time, and the training's collectives (NCCL on GPUs) go on meanwhile. This is ``dcp.async_save``
taken apart: the staging is agreed on by every rank before any rank starts the write (a rank that
failed to stage would otherwise leave the others in the write's collectives), and the publish follows
the write on the same thread.

A crash, ``kill -9`` or SIGTERM while a save is in flight leaves its ``.<name>.incomplete`` folder,
which `latest_checkpoint` never picks: the previous complete checkpoint stays the resume target.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.atomic import abandon_on_failure, prepare_staging_dir
from automodel_checkpoint.dcp import (
    check_finite_or_raise,
    checkpoint_state,
    export_weights,
    hf_weights_options,
    publish_dcp,
    save_rank_state,
)
from automodel_checkpoint.ranks import is_distributed
from automodel_checkpoint.storage_view import storage_view
from automodel_checkpoint.write_errors import write_failure
from automodel_modules import reshard_fsdp_units

__all__ = ["AsyncCheckpointer"]


def _on_accelerator(state: Mapping[str, Any]) -> bool:
    """Whether any tensor of a (nested) state dict lives off the CPU."""
    for value in state.values():
        if isinstance(value, Mapping) and _on_accelerator(value):
            return True
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta"):
            return True
    return False


class AsyncCheckpointer:
    """Saves distributed checkpoints in the background, at most one in flight.

    Build it on every rank at the same point (it makes a ``gloo`` process group, a collective over the
    world; ``timeout`` is that group's, torch's default when None: give the training's, so that a rank
    that died during a background write stops the others as soon). Use it as a context manager, or
    call `close` at the end: it waits for the save in flight.

    Attributes:
        last_blocking_s: Seconds the last `save` held the caller (the check, folder and staging).
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
    ) -> None:
        self._group = process_group
        self._upload: dist.ProcessGroup | None = None
        if is_distributed():
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            assert isinstance(group, dist.ProcessGroup)  # every rank of the world is a member
            self._upload = group
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="automodel-checkpoint")
        self._writer: Any = None  # one FileSystemWriter: it keeps the (pinned) staging buffers
        self._pending: Future[Path] | None = None
        self.last_blocking_s = 0.0

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        extra_state: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        check_finite: bool = True,
        hf_weights: str = "none",
        parts: Sequence[nn.Module] | None = None,
    ) -> None:
        """Stage a checkpoint of ``model`` (and ``optimizer``) and write it in the background.

        The arguments are those of `save_distributed_checkpoint`; an ``hf/`` folder (``hf_weights``) is
        written before this returns (a consolidated export gathers every tensor), the DCP files in the
        background. Preconditions: every rank calls this with the same ``path``, on a shared file
        system. Collectives (calling thread, over the checkpointer's process group): those of the
        previous save's `wait`, the finite check, the folder, the ``hf/`` export and the staging
        agreement; the write's and the publish's run in the background over the ``gloo`` group.
        Nothing is mutated, except as `save_distributed_checkpoint` says.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is False.
            ValueError: Some rank's shards hold a NaN or Inf (nothing written).
            CheckpointWriteError: The previous save failed (raised here, from its `wait`), or a rank
                failed to stage this one (nothing published).
        """
        with_model = hf_weights_options(hf_weights, optimizer)
        self.wait()
        start = time.perf_counter()
        reshard_fsdp_units(model)
        if check_finite:
            check_finite_or_raise(model, self._group)
        final = Path(path)
        staging = prepare_staging_dir(final, overwrite=overwrite, group=self._group)
        error: BaseException | None = None
        staged = None
        try:
            if hf_weights != "none":
                export_weights(staging, parts or [model], self._group)
            state = storage_view(checkpoint_state(model, optimizer, with_model))
            if rank_state is not None:
                save_rank_state(staging, rank_state, self._group)
            staged = self._stage(state, staging)
        except Exception as exc:  # agreed on below, before any rank starts writing
            error = write_failure(exc, staging, self._group)
        abandon_on_failure(staging, error, f"staging checkpoint {final}", self._group)
        self._pending = self._executor.submit(self._write, staged, staging, final, step, extra_state)
        self.last_blocking_s = time.perf_counter() - start

    def _stage(self, state: dict[str, Any], staging: Path) -> Any:
        """A host copy of ``state`` (DCP's staging), into buffers kept from the last save on GPUs."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        if self._writer is None:
            self._writer = FileSystemWriter(str(staging), cache_staged_state_dict=_on_accelerator(state))
        return self._writer.stage(state)

    def _write(
        self,
        staged: Any,
        staging: Path,
        final: Path,
        step: int | None,
        extra_state: Mapping[str, Any] | None,
    ) -> Path:
        """Background thread: write the staged shards, then publish (collectives over the gloo group)."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_saver import save

        error: BaseException | None = None
        try:
            save(staged, checkpoint_id=str(staging), storage_writer=self._writer, process_group=self._upload)
        except (Exception, CheckpointException) as exc:
            error = write_failure(exc, staging, self._upload)
        return publish_dcp(staging, final, step, extra_state, self._upload, error)

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any (every rank calls this).

        Returns:
            The folder it published (None when no save was in flight).

        Raises:
            CheckpointWriteError: That save failed on some rank; nothing of it was published, and the
                previous checkpoints are intact.
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
