"""Checkpoints of a run: what each distributed checkpoint records, and resuming from the newest good one.

A checkpoint (``<output_dir>/checkpoints/step_XXXXXXXX``, `automodel_distributed`'s atomic DCP save)
holds the model and AdamW state, and records in its completion marker:

- ``data``: the data position (`RowSampler.state`: step, epoch, batch in the epoch, seed, rows, global
  batch, or with ``data.streaming`` the cursor of every row slot) and a fingerprint of the rows (of the
  streamed files), so a resume on other data or another global batch is noticed;
- ``skipped_steps``: steps dropped for a NaN/Inf so far (``train.on_nonfinite: skip``);
- ``reason``: ``periodic``, ``final`` or ``preempted`` (a stop signal); with ``train.async_checkpoint``
  the periodic ones are written in the background (`AsyncCheckpointer`, one in flight at a time), the
  final and preempted ones are waited for;
- per rank (``rank_state``): the torch CPU (and CUDA) and Python RNG states, restored when the world
  size is the same. The data order never depends on them (it is a function of seed and step), so a
  resume on another world size sees the same batches; they matter for random ops such as dropout.

Resuming verifies the files against the checksums in the marker before loading anything; a corrupt
checkpoint stops the job with an error naming the file, or, with ``train.resume_fallback``, the next
older complete checkpoint is tried (with a warning).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_all.cli.progress import warn

if TYPE_CHECKING:
    from automodel_checkpoint import AsyncCheckpointer

__all__ = ["ResumePoint", "checkpoint_root", "resume_from_checkpoint", "rng_state", "save_checkpoint"]


def checkpoint_root(out: Path) -> Path:
    """Where a run's distributed checkpoints live."""
    return out / "checkpoints"


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA on ``device``, Python's ``random``)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value


def save_checkpoint(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    out: Path,
    *,
    step: int,
    data: dict[str, Any],
    skipped_steps: int,
    reason: str,
    device: torch.device,
    checkpointer: AsyncCheckpointer | None = None,
    hf_weights: str = "none",
    parts: list[nn.Module] | None = None,
) -> None:
    """Save a distributed checkpoint of step ``step`` (collective; every rank calls it).

    With ``checkpointer``, a ``periodic`` checkpoint is written in the background (published when it is
    complete; the next save, or the checkpointer's ``close``, waits for it); the others are waited for.
    ``hf_weights`` (``train.hf_checkpoints``) adds the weights as an ``hf/`` folder exported from
    ``parts``.

    Raises:
        ValueError: The model holds a NaN or Inf (nothing is written).
        CheckpointWriteError: A rank could not write this checkpoint or the one still in flight (a full
            disk); nothing of it is published and the previous checkpoints are intact.
    """
    from automodel_checkpoint import save_distributed_checkpoint

    args: tuple[Any, ...] = (module, optimizer, checkpoint_root(out) / f"step_{step:08d}")
    kwargs: dict[str, Any] = {
        "step": step,
        "extra_state": {"data": data, "skipped_steps": skipped_steps, "reason": reason},
        "rank_state": rng_state(device),
        "overwrite": True,
        "hf_weights": hf_weights,
        "parts": parts,
    }
    if checkpointer is None:
        save_distributed_checkpoint(*args, **kwargs)
        return
    checkpointer.save(*args, **kwargs)
    if reason != "periodic":
        checkpointer.wait()


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts."""

    step: int
    skipped_steps: int
    path: Path | None
    data: dict[str, Any] | None = None
    """The data position the checkpoint recorded (`automodel_all.cli.batches`)."""


def _check_data(extra: dict[str, Any], expected: dict[str, Any], path: Path) -> None:
    recorded = extra.get("data") or {}
    keys = ("fingerprint", "global_batch_size", "seed")
    differs = [key for key in keys if recorded.get(key) != expected.get(key)]
    if recorded and differs:
        then = ", ".join(f"{k}={recorded.get(k)!r}" for k in differs)
        now = ", ".join(f"{k}={expected.get(k)!r}" for k in differs)
        if dist.get_rank() == 0:
            warn(
                f"{path} was trained with other data or batches ({then} there, {now} now): the resumed "
                "run will not see the batches the interrupted one would have seen"
            )


def resume_from_checkpoint(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    out: Path,
    *,
    fallback: bool,
    data: dict[str, Any],
    device: torch.device,
    parts: list[nn.Module] | None = None,
) -> ResumePoint:
    """Load the newest complete checkpoint that passes verification (collective).

    Args:
        module: What the checkpoints hold (the model, or this rank's pipeline stages).
        parts: The model's parts, for a checkpoint whose weights are in its ``hf/`` folder only.
        optimizer: Its optimizer.
        out: The output folder.
        fallback: On a corrupt checkpoint, warn and try the next older one instead of raising.
        data: The current data position description (fingerprint, global batch, seed), to compare.
        device: For the CUDA RNG state.

    Returns:
        The step to continue from (0 and no path when there is no usable checkpoint).

    Raises:
        CorruptCheckpointError: The newest checkpoint fails verification and ``fallback`` is off (the
            message names the file), or every checkpoint fails it.
    """
    from automodel_checkpoint import (
        CorruptCheckpointError,
        complete_checkpoints,
        load_distributed_checkpoint,
    )

    candidates = complete_checkpoints(checkpoint_root(out), kind="dcp")
    for index, path in enumerate(candidates):
        try:
            info = load_distributed_checkpoint(module, optimizer, path, parts=parts)
        except CorruptCheckpointError as exc:
            if not fallback or index == len(candidates) - 1:
                hint = (
                    ""
                    if fallback
                    else "; rerun with --resume-fallback to resume from the previous checkpoint"
                )
                raise CorruptCheckpointError(exc.path, exc.problem + hint) from None
            if dist.get_rank() == 0:
                warn(f"{exc}; resuming from the previous checkpoint {candidates[index + 1]}")
            continue
        _check_data(dict(info.extra_state), data, path)
        if info.rank_state is not None and info.world_size == dist.get_world_size():
            _restore_rng(dict(info.rank_state), device)
        extra = dict(info.extra_state)
        recorded = extra.get("data")
        return ResumePoint(
            info.step or 0, int(extra.get("skipped_steps") or 0), path, dict(recorded) if recorded else None
        )
    return ResumePoint(0, 0, None)
