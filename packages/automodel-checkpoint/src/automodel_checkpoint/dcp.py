"""Resumable distributed checkpoints of model and optimizer (torch.distributed.checkpoint).

Each rank writes its own shards (``dcp.save`` with a ``FileSystemWriter``) into the staging folder
of an atomic save, and optionally its own small state (``rank_state``: RNG states, ...) as
``rank_state/rank_<r>.pt``; the step, any JSON extra state and the checksums of every file go into the
completion marker. Loading verifies the files against those checksums, then goes through
``get_state_dict`` / ``dcp.load`` / ``set_state_dict``, so a checkpoint saved on one world size or layout
loads on another (DCP reshards by global offsets).

Guards: a model holding a NaN or Inf is not saved (`save_distributed_checkpoint` raises before writing
anything, naming the tensor and the ranks); a write that fails (a full disk) publishes nothing, removes
its staging folder and raises `CheckpointWriteError`, naming the cause; the previous checkpoints are
untouched in both cases.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.atomic import (
    COMPLETE_MARKER,
    prepare_staging_dir,
    read_marker,
)
from automodel_checkpoint.integrity import MARKER_FILES_KEY, verify_checkpoint
from automodel_checkpoint.keys import collect_tensor_slots
from automodel_checkpoint.materialize import (
    default_device,
    has_meta_tensors,
    mark_needs_init,
    materialize_meta_tensors,
    verify_materialized,
)
from automodel_checkpoint.ranks import agree_on_failure, rank_of
from automodel_checkpoint.storage_view import storage_view
from automodel_checkpoint.write_errors import CheckpointWriteError, publish_or_explain, write_failure
from automodel_modules import reshard_fsdp_units

__all__ = [
    "HF_DIR",
    "HF_WEIGHTS",
    "RANK_STATE_DIR",
    "CheckpointInfo",
    "CheckpointWriteError",
    "load_distributed_checkpoint",
    "save_distributed_checkpoint",
]

RANK_STATE_DIR = "rank_state"
"""Sub-folder of a distributed checkpoint holding each rank's ``rank_state`` (``rank_<r>.pt``)."""

HF_DIR = "hf"
"""Sub-folder of a distributed checkpoint holding the model's weights in the Hugging Face format."""

HF_WEIGHTS = ("none", "also", "only")
"""``hf_weights`` values: no ``hf/`` folder; ``hf/`` beside the full DCP; ``hf/`` and DCP without weights."""


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
    rank_state: Mapping[str, Any] | None = None
    """This rank's ``rank_state`` from the save (None when that rank did not exist or saved none)."""


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, with_model: bool = True
) -> dict[str, Any]:
    """What a distributed checkpoint holds: ``{"model": ..., "optim": ...}`` (DCP's state dicts).

    ``with_model=False``: the optimizer's state only (the weights are in the checkpoint's ``hf/``).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    if not with_model:
        return {"optim": get_optimizer_state_dict(model, optimizer)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def hf_weights_options(hf_weights: str, optimizer: torch.optim.Optimizer | None) -> bool:
    """Check ``hf_weights``; whether the model's state goes into the DCP files (all but ``only``).

    Raises:
        ValueError: An unknown value, or ``only`` without an optimizer (nothing would be left for DCP).
    """
    if hf_weights not in HF_WEIGHTS:
        raise ValueError(f"hf_weights={hf_weights!r}: use one of {', '.join(HF_WEIGHTS)}")
    if hf_weights == "only" and optimizer is None:
        raise ValueError("hf_weights='only' keeps the optimizer's state in DCP: give the optimizer")
    return hf_weights != "only"


def export_weights(staging: Path, parts: Sequence[nn.Module], group: dist.ProcessGroup | None) -> None:
    """The model's weights as a Hugging Face folder ``staging/hf`` (`save_hf_checkpoint`; collective)."""
    from automodel_checkpoint.hf_save import save_hf_checkpoint

    save_hf_checkpoint(parts, staging / HF_DIR, process_group=group)


def _nonfinite(model: nn.Module) -> list[str]:
    """The names of this rank's floating-point tensors (local shards) that hold a NaN or Inf.

    One pass per tensor (its min and max: a NaN or an infinity shows in one of them, without a mask of
    the tensor's size) and one host sync per device, not one per tensor.
    """
    from torch.distributed.tensor import DTensor

    extremes: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            names, values = extremes.setdefault(local.device, ([], []))
            names.append(name)
            values.append(torch.stack(torch.aminmax(local.detach())).float())
    bad = []
    for names, values in extremes.values():
        finite = torch.isfinite(torch.stack(values)).all(dim=1).tolist()
        bad += [name for name, ok in zip(names, finite, strict=True) if not ok]
    return bad


def check_finite_or_raise(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank's share of the model holds a NaN or Inf (collective)."""
    bad = _nonfinite(model)
    error = None
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        error = ValueError(
            f"not saving a checkpoint: {bad[0]}{more} holds NaN or Inf values on rank {rank_of(group)}; the "
            "training diverged (a NaN/Inf check on the loss and gradient norm stops it earlier)"
        )
    agree_on_failure(error, "checking the model for NaN/Inf before saving", group)


def save_rank_state(staging: Path, rank_state: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """Write this rank's own state (RNG states, ...) as ``rank_state/rank_<r>.pt`` of ``staging``."""
    folder = staging / RANK_STATE_DIR
    folder.mkdir(exist_ok=True)
    torch.save(dict(rank_state), folder / f"rank_{rank_of(group):05d}.pt")


def save_distributed_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    extra_state: Mapping[str, Any] | None = None,
    rank_state: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    check_finite: bool = True,
    process_group: dist.ProcessGroup | None = None,
    hf_weights: str = "none",
    parts: Sequence[nn.Module] | None = None,
) -> Path:
    """Save model (and optimizer) state for resuming, each rank writing its own shards, atomically.

    Preconditions: every rank calls this with the same ``path`` on a shared file system. Collectives:
    the finite check (an ``all_reduce``), those of ``get_state_dict`` and ``dcp.save`` (plan
    gather/scatter over ``process_group``) plus the atomic publish (failure agreement, checksums and a
    final ``all_gather_object`` over ``process_group``). Nothing is mutated, except that an optimizer
    without state yet gets it initialised by ``get_state_dict``, and FSDP2 modules are resharded.

    Args:
        model: The (sharded) model.
        optimizer: Its optimizer, or None for model state only.
        path: The checkpoint folder to publish (e.g. ``<root>/step_00001000``).
        step: Training step, recorded in the marker (`latest_checkpoint` orders by it).
        extra_state: JSON-serialisable state to record, the same on every rank (data-loader position,
            ...); it goes into the completion marker.
        rank_state: This rank's own state (RNG states, ...), anything ``torch.load(weights_only=True)``
            reads back (tensors, numbers, strings, lists, tuples, dicts); written per rank.
        overwrite: Replace an existing folder at ``path``.
        check_finite: Refuse to save a model holding a NaN or Inf (checked on every rank's shards).
        process_group: Ranks that save together (default: the world).
        hf_weights: ``also``: the checkpoint also holds the weights as a Hugging Face folder ``hf/``
            (``from_pretrained`` loads it; written by every rank, `save_hf_checkpoint`); ``only``: the
            weights are in ``hf/`` only, the DCP files hold the optimizer's state; ``none``: no ``hf/``.
            One marker covers both, so the pair is published (or not) as one.
        parts: What ``hf/`` is exported from: the model's parts as `save_hf_checkpoint` takes them
            (default ``[model]``; under pipeline parallelism, this rank's stages).

    Returns:
        The published folder.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ValueError: ``check_finite`` and some rank's shards hold a NaN or Inf (nothing written); a bad
            ``hf_weights``.
        CheckpointWriteError: A rank failed to write (on every rank; nothing published, the staging
            folder removed).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with_model = hf_weights_options(hf_weights, optimizer)
    reshard_fsdp_units(model)
    if check_finite:
        check_finite_or_raise(model, process_group)
    final = Path(path)
    staging = prepare_staging_dir(final, overwrite=overwrite, group=process_group)
    error: BaseException | None = None
    try:
        if hf_weights != "none":  # agreed on every rank (its own publish): all go on, or all stop here
            export_weights(staging, parts or [model], process_group)
        state = checkpoint_state(model, optimizer, with_model)
        save(storage_view(state), storage_writer=FileSystemWriter(str(staging)), process_group=process_group)
        if rank_state is not None:
            save_rank_state(staging, rank_state, process_group)
    # dcp gathers every rank's failure and raises it on all of them, as a BaseException subclass.
    except (Exception, CheckpointException) as exc:
        error = write_failure(exc, staging, process_group)
    return publish_dcp(staging, final, step, extra_state, process_group, error)


def publish_dcp(
    staging: Path,
    final: Path,
    step: int | None,
    extra_state: Mapping[str, Any] | None,
    group: dist.ProcessGroup | None,
    error: BaseException | None,
) -> Path:
    """Publish a written distributed checkpoint (collective over ``group``; see `publish_staging_dir`).

    Raises:
        CheckpointWriteError: Some rank's write (``error`` here) or the publish itself failed on a
            file-system error; nothing was published.
    """
    return publish_or_explain(
        staging, final, kind="dcp", step=step, extra_state=extra_state, group=group, write_error=error
    )


def load_distributed_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    verify: bool = True,
    parts: Sequence[nn.Module] | None = None,
) -> CheckpointInfo:
    """Load a checkpoint written by `save_distributed_checkpoint` into ``model`` (and ``optimizer``).

    The world size and sharding may differ from the saving run. A model still on meta is materialised
    on ``device`` first (every tensor is then filled from the checkpoint).

    Preconditions: ``path`` is complete (has the completion marker; checked before any collective, on
    every rank); every rank calls this. Collectives: the verification (``all_gather_object``; each rank
    hashes a share of the files), those of ``dcp.load`` and ``set_state_dict``.

    Args:
        model: The (sharded) model; loaded in place.
        optimizer: Its optimizer (state is loaded in place), or None to load model state only.
        path: A published checkpoint folder.
        strict: Every model (and optimizer) tensor must be in the checkpoint. With False, a model
            that was on meta must be initialised first (`initialize_model_weights`).
        device: Where meta tensors are materialised (default as in `load_hf_checkpoint`).
        verify: Check every file against the checksums of the completion marker first (checkpoints
            saved before checksums existed have none and are loaded unverified).
        parts: Where the weights of a checkpoint saved with ``hf_weights="only"`` are loaded from its
            ``hf/`` folder (`load_hf_checkpoint`, part by part; default ``[model]``). Given parts are
            pipeline stages: the folder's tensors of other stages are not an error.

    Returns:
        The recorded step, extra state, saving world size and this rank's ``rank_state``.

    Raises:
        FileNotFoundError: ``path`` is missing or incomplete (an interrupted save).
        CorruptCheckpointError: ``verify`` and a file's bytes differ from the recorded checksum (on every
            rank, naming the file); nothing was loaded.
        RuntimeError: A tensor is still on meta or uninitialised afterwards.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )
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
    recorded = marker.get(MARKER_FILES_KEY)
    if verify and isinstance(recorded, dict):
        verify_checkpoint(folder, recorded, exclude=frozenset({COMPLETE_MARKER}))
    reader = FileSystemReader(str(folder))
    with_model = any(key.startswith("model.") for key in reader.read_metadata().state_dict_metadata)
    if not with_model:  # saved with hf_weights="only": the weights come from hf/
        from automodel_checkpoint.hf_load import load_hf_checkpoint

        for part in parts or [model]:  # a pipeline stage finds the other stages' tensors there too
            load_hf_checkpoint(part, folder / HF_DIR, device=device, allow_unexpected=parts is not None)
    if has_meta_tensors(model):
        materialize_meta_tensors(model, device if device is not None else default_device(model))
    reshard_fsdp_units(model)
    state = checkpoint_state(model, optimizer, with_model)
    # The storage view shares the state's tensors: DCP writes into them.
    load(
        storage_view(state), storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict)
    )
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    elif with_model:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if strict:  # every tensor came from the checkpoint; a partial load into a meta model fails below
        for slot in collect_tensor_slots(model, include_adapters=True):
            mark_needs_init(slot.tensor, False)
    verify_materialized(model)
    step = marker.get("step")
    own = folder / RANK_STATE_DIR / f"rank_{rank_of():05d}.pt"
    return CheckpointInfo(
        folder,
        step if isinstance(step, int) else None,
        dict(marker.get("extra_state") or {}),
        int(marker.get("world_size") or 1),
        torch.load(own, weights_only=True) if own.is_file() else None,
    )
