"""Resumable distributed checkpoints of model and optimizer (torch.distributed.checkpoint).

Each rank writes its own shards (``dcp.save`` with a ``FileSystemWriter``) into the staging folder
of an atomic save; the step and any JSON extra state go into the completion marker. Loading goes
through ``get_state_dict`` / ``dcp.load`` / ``set_state_dict``, so a checkpoint saved on one world
size or layout loads on another (DCP reshards by global offsets).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_distributed.checkpoint.atomic import (
    prepare_staging_dir,
    publish_staging_dir,
    read_marker,
)
from automodel_distributed.checkpoint.hf_load import _default_device, _has_meta, _reshard_fsdp
from automodel_distributed.checkpoint.keys import collect_tensor_slots
from automodel_distributed.checkpoint.materialize import _mark, materialize_meta_tensors, verify_materialized

__all__ = ["CheckpointInfo", "load_distributed_checkpoint", "save_distributed_checkpoint"]


@dataclass(frozen=True)
class CheckpointInfo:
    """What a distributed checkpoint recorded besides tensors.

    Attributes:
        path: The checkpoint folder.
        step: The training step given at save time (None if none was).
        extra_state: The JSON extra state given at save time.
        world_size: Ranks that saved it.
    """

    path: Path
    step: int | None
    extra_state: Mapping[str, Any] = field(default_factory=dict)
    world_size: int = 1


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_distributed_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    extra_state: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save model (and optimizer) state for resuming, each rank writing its own shards, atomically.

    Preconditions: every rank calls this with the same ``path`` on a shared file system. Collectives:
    those of ``get_state_dict`` and ``dcp.save`` (plan gather/scatter over the default group) plus the
    atomic publish (three ``all_gather_object`` over ``process_group``). Nothing is mutated, except that
    an optimizer without state yet gets it initialised by ``get_state_dict``, and FSDP2 modules are
    resharded.

    Args:
        model: The (sharded) model.
        optimizer: Its optimizer, or None for model state only.
        path: The checkpoint folder to publish (e.g. ``<root>/step_00001000``).
        step: Training step, recorded in the marker (`latest_checkpoint` orders by it).
        extra_state: JSON-serialisable state to record (data-loader position, RNG seeds, ...).
        overwrite: Replace an existing folder at ``path``.
        process_group: Ranks that save together (default: the world).

    Returns:
        The published folder.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        torch.distributed.checkpoint.api.CheckpointException: A rank failed to write (on every rank).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    _reshard_fsdp(model)
    staging = prepare_staging_dir(path, overwrite=overwrite, group=process_group)
    state = _state(model, optimizer)
    error: BaseException | None = None
    try:
        save(state, storage_writer=FileSystemWriter(str(staging)))
    except Exception as exc:  # dcp gathers every rank's failure and raises on all of them
        error = exc
    return publish_staging_dir(
        staging, path, kind="dcp", step=step, extra_state=extra_state, group=process_group, write_error=error
    )


def load_distributed_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> CheckpointInfo:
    """Load a checkpoint written by `save_distributed_checkpoint` into ``model`` (and ``optimizer``).

    The world size and sharding may differ from the saving run. A model still on meta is materialised
    on ``device`` first (every tensor is then filled from the checkpoint).

    Preconditions: ``path`` is complete (has the completion marker; checked before any collective, on
    every rank); every rank calls this. Collectives: those of ``dcp.load`` and ``set_state_dict``.

    Args:
        model: The (sharded) model; loaded in place.
        optimizer: Its optimizer (state is loaded in place), or None to load model state only.
        path: A published checkpoint folder.
        strict: Every model (and optimizer) tensor must be in the checkpoint. With False, a model
            that was on meta must be initialised first (`initialize_model_weights`).
        device: Where meta tensors are materialised (default as in `load_hf_checkpoint`).

    Returns:
        The recorded step, extra state and saving world size.

    Raises:
        FileNotFoundError: ``path`` is missing or incomplete (an interrupted save).
        RuntimeError: A tensor is still on meta or uninitialised afterwards.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"distributed checkpoint {folder} does not exist")
    marker = read_marker(folder)
    if marker.get("format") != "dcp":
        raise ValueError(
            f"{folder} holds a {marker.get('format')!r} checkpoint, not a distributed one; load it with "
            "load_hf_checkpoint"
        )
    if _has_meta(model):
        materialize_meta_tensors(model, device if device is not None else _default_device(model))
    _reshard_fsdp(model)
    state = _state(model, optimizer)
    load(
        state,
        storage_reader=FileSystemReader(str(folder)),
        planner=DefaultLoadPlanner(allow_partial_load=not strict),
    )
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if strict:  # every tensor came from the checkpoint; a partial load into a meta model fails below
        for slot in collect_tensor_slots(model, include_adapters=True):
            _mark(slot.tensor, False)
    verify_materialized(model)
    step = marker.get("step")
    return CheckpointInfo(
        folder,
        step if isinstance(step, int) else None,
        dict(marker.get("extra_state") or {}),
        int(marker.get("world_size") or 1),
    )
