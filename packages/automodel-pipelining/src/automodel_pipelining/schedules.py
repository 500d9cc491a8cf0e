"""Pipeline schedules as data: names, stage placement, microbatch rules, and CSV schedule files.

Everything here is pure Python (no ``torch.distributed.pipelining`` import): schedule classes are named
by their torch attribute name and looked up only when `AutoPipeline.build` creates the schedule.

Placement styles:

- ``single``: one stage per rank; stage ``r`` on rank ``r`` (GPipe, 1F1B).
- ``loop``: ``v`` stages per rank, stage ids ``r, r + W, r + 2W, ...`` (Interleaved 1F1B, Looped BFS,
  Interleaved Zero Bubble).
- ``v``: two stages per rank in a V: ``r`` and ``2W - 1 - r`` (ZBV zero bubble, DualPipeV); more stages
  per rank continue the zigzag.
- ``csv``: read from the schedule file: rank ``r`` holds the stages that appear in row ``r``.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "SCHEDULES",
    "CsvSchedule",
    "ScheduleSpec",
    "check_microbatches",
    "in_flight_microbatches",
    "normalize_schedule_name",
    "peak_over_order",
    "peak_with_gradients",
    "read_csv_schedule",
    "resolve_schedule",
    "stage_ids_this_rank",
    "stage_to_rank",
]

PlacementStyle = Literal["single", "loop", "v", "csv"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What `AutoPipeline` needs to know about one schedule before building it."""

    name: str
    """Canonical name (the key of `SCHEDULES`)."""
    torch_class: str
    """Attribute of ``torch.distributed.pipelining.schedules`` that implements it."""
    style: PlacementStyle
    """Stage placement (see the module docstring)."""
    default_stages_per_rank: int
    """Stages per rank when ``layers_per_stage`` is not given."""
    exact_stages_per_rank: int | None = None
    """The only stage count per rank the schedule accepts (``None``: any count allowed by ``style``)."""
    min_microbatches_per_stage: bool = False
    """Needs ``n_microbatches >= number of stages``."""
    rounds_must_divide: bool = False
    """Needs ``n_microbatches`` to be a multiple of ``max(1, n_microbatches // pp_size)`` (torch's rounds)."""
    split_backward: bool = False
    """Splits backward into input and weight passes (zero-bubble schedules)."""

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule runs several stages per rank."""
        return self.style != "single"


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", "ScheduleGPipe", "single", 1),
        ScheduleSpec("1f1b", "Schedule1F1B", "single", 1, min_microbatches_per_stage=True),
        ScheduleSpec("interleaved1f1b", "ScheduleInterleaved1F1B", "loop", 2, rounds_must_divide=True),
        ScheduleSpec("loopedbfs", "ScheduleLoopedBFS", "loop", 2),
        ScheduleSpec(
            "interleavedzerobubble",
            "ScheduleInterleavedZeroBubble",
            "loop",
            2,
            rounds_must_divide=True,
            split_backward=True,
        ),
        ScheduleSpec("zbvzerobubble", "ScheduleZBVZeroBubble", "v", 2, 2, split_backward=True),
        ScheduleSpec(
            "dualpipev",
            "ScheduleDualPipeV",
            "v",
            2,
            2,
            min_microbatches_per_stage=True,
            split_backward=True,
        ),
    )
}
"""Canonical schedule name -> spec. Names are matched after `normalize_schedule_name`."""

_ALIASES = {
    "zerobubble": "interleavedzerobubble",
    "zb": "interleavedzerobubble",
    "zbv": "zbvzerobubble",
}

CSV_SPEC_NAME = "csv"


def normalize_schedule_name(name: str) -> str:
    """Return the canonical name of a schedule (case, ``_``, ``-`` and a ``schedule`` prefix ignored).

    Raises:
        ValueError: An unknown name; the message lists the known ones.
    """
    key = re.sub(r"[\s_\-]", "", str(name)).lower()
    key = _ALIASES.get(key, key)
    if key.startswith("schedule") and key[len("schedule") :] in SCHEDULES:
        key = key[len("schedule") :]
    if key not in SCHEDULES:
        known = ", ".join(sorted(SCHEDULES))
        raise ValueError(f"unknown pipeline schedule {name!r}; known schedules: {known} (or a CSV file)")
    return key


@dataclass(frozen=True)
class CsvSchedule:
    """Stage placement read from a compute-only CSV schedule."""

    path: str
    stages_by_rank: tuple[tuple[int, ...], ...]
    """Row ``r``: the sorted stage ids that rank ``r`` runs."""
    split_backward: bool
    """Whether the file uses separate input (``I``) and weight (``W``) backward actions."""

    @property
    def num_stages(self) -> int:
        """Total number of stages in the file."""
        return 1 + max(s for row in self.stages_by_rank for s in row)


_ACTION = re.compile(r"^\s*(\d+)([A-Z_]+)(\d*)\s*$")


def read_csv_schedule(path: str, pp_size: int) -> CsvSchedule:
    """Read the stage placement of a compute-only CSV schedule (one row per pipeline rank).

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: The row count is not ``pp_size``, an action is malformed, a stage appears on two
            ranks, stage ids are not ``0 .. n-1``, or ranks hold different numbers of stages.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"PipelineConfig.pp_schedule_csv: no such file {path!r}")
    rows: list[tuple[int, ...]] = []
    kinds: set[str] = set()
    owner: dict[int, int] = {}
    with open(path, newline="") as handle:
        for rank, row in enumerate(csv.reader(handle)):
            stages: set[int] = set()
            for cell in row:
                if not cell.strip():
                    continue
                match = _ACTION.match(cell)
                if match is None:
                    raise ValueError(
                        f"{path}: row {rank} has a malformed action {cell!r} (expected e.g. 0F1)"
                    )
                stage, kind = int(match.group(1)), match.group(2)
                kinds.add(kind)
                if owner.setdefault(stage, rank) != rank:
                    raise ValueError(f"{path}: stage {stage} appears on ranks {owner[stage]} and {rank}")
                stages.add(stage)
            rows.append(tuple(sorted(stages)))
    if len(rows) != pp_size:
        raise ValueError(f"{path} has {len(rows)} rows but the pipeline has pp_size={pp_size} ranks")
    all_stages = sorted(owner)
    if not all_stages or all_stages != list(range(len(all_stages))):
        raise ValueError(f"{path}: stage ids must be 0..n-1, got {all_stages}")
    counts = {len(row) for row in rows}
    if len(counts) != 1:
        raise ValueError(f"{path}: ranks hold different numbers of stages: {[len(r) for r in rows]}")
    return CsvSchedule(path, tuple(rows), split_backward=bool(kinds & {"I", "W"}))


def resolve_schedule(pp_schedule: str | None, pp_schedule_csv: str | None) -> ScheduleSpec | None:
    """The spec of a named schedule, or ``None`` when a CSV file is used."""
    if pp_schedule_csv is not None:
        return None
    if pp_schedule is None:
        raise ValueError("a pipeline needs pp_schedule or pp_schedule_csv; both are None")
    return SCHEDULES[normalize_schedule_name(pp_schedule)]


def stage_ids_this_rank(
    pp_rank: int, pp_size: int, num_stages: int, style: PlacementStyle
) -> tuple[int, ...]:
    """The stage ids that pipeline rank ``pp_rank`` runs, in increasing order.

    Args:
        pp_rank: This rank's index along the pipeline axis.
        pp_size: Number of pipeline ranks.
        num_stages: Total number of stages; a multiple of ``pp_size``.
        style: ``single``, ``loop`` or ``v`` (see the module docstring).

    Raises:
        ValueError: ``num_stages`` is not a multiple of ``pp_size``, or ``single`` with more stages than
            ranks.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, {pp_size})")
    if num_stages % pp_size:
        raise ValueError(f"{num_stages} stages do not divide over pp_size={pp_size} ranks")
    per_rank = num_stages // pp_size
    if style == "single":
        if per_rank != 1:
            raise ValueError(f"a single-stage schedule needs one stage per rank, got {per_rank}")
        return (pp_rank,)
    if style == "loop":
        return tuple(pp_rank + k * pp_size for k in range(per_rank))
    if style == "v":
        # Even "columns" of the zigzag go down the ranks, odd ones come back up.
        ids = [k * pp_size + (pp_rank if k % 2 == 0 else pp_size - 1 - pp_rank) for k in range(per_rank)]
        return tuple(sorted(ids))
    raise ValueError(f"unknown placement style {style!r}")


def stage_to_rank(pp_size: int, num_stages: int, style: PlacementStyle) -> dict[int, int]:
    """Stage id -> pipeline rank for every stage (the inverse of `stage_ids_this_rank`)."""
    out: dict[int, int] = {}
    for rank in range(pp_size):
        for stage in stage_ids_this_rank(rank, pp_size, num_stages, style):
            out[stage] = rank
    return out


def check_microbatches(
    spec: ScheduleSpec | None, *, n_microbatches: int, num_stages: int, pp_size: int
) -> list[str]:
    """Check the microbatch count against the schedule's rules.

    Returns:
        Warnings (e.g. fewer microbatches than stages: a large pipeline bubble).

    Raises:
        ValueError: The schedule cannot run with this many microbatches; the message says how many it needs.
    """
    warnings: list[str] = []
    name = spec.name if spec is not None else "the CSV schedule"
    if spec is not None and spec.min_microbatches_per_stage and n_microbatches < num_stages:
        raise ValueError(
            f"schedule {name!r} needs at least as many microbatches as stages: n_microbatches="
            f"{n_microbatches} (pp_batch_size / pp_microbatch_size) < {num_stages} stages; raise "
            "pp_batch_size or lower pp_microbatch_size"
        )
    if spec is not None and spec.rounds_must_divide:
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise ValueError(
                f"schedule {name!r} runs microbatches in rounds of pp_size={pp_size}: n_microbatches="
                f"{n_microbatches} must be <= pp_size or a multiple of {rounds} (n_microbatches // pp_size); "
                f"use e.g. {math.ceil(n_microbatches / pp_size) * pp_size}"
            )
    if n_microbatches < num_stages:
        warnings.append(
            f"{name}: n_microbatches={n_microbatches} is smaller than the number of stages ({num_stages}); "
            "most of each step will be pipeline bubble"
        )
    return warnings


def in_flight_microbatches(
    spec: ScheduleSpec | None, *, pp_size: int, rank: int, n_microbatches: int, stages_per_rank: int
) -> int:
    """Stage micro-batches whose activations pipeline rank ``rank`` holds at once, at its peak.

    One unit is the activations of one of the rank's stages for one micro-batch. GPipe and looped BFS
    run every forward first (``n_microbatches`` per stage); 1F1B warms up with ``pp_size - rank``
    forwards; interleaved schedules (torch's warm-up) with ``(v - 1) * pp_size + 2 * (pp_size - 1 -
    rank) + 1`` for ``v`` stages per rank, never more than all of them. A CSV schedule (``spec=None``)
    is counted as holding everything, the bound that cannot be exceeded.

    Args:
        spec: The schedule (`resolve_schedule`), or None for a CSV schedule.
        pp_size: Pipeline ranks.
        rank: This pipeline rank (0 holds the most under 1F1B-style schedules).
        n_microbatches: Micro-batches per step.
        stages_per_rank: Stages this rank runs (``v``).
    """
    everything = n_microbatches * stages_per_rank
    if spec is None or spec.name in ("gpipe", "loopedbfs"):
        return everything
    if not spec.multi_stage:
        return min(n_microbatches, pp_size - rank)
    warmup = (stages_per_rank - 1) * pp_size + 2 * (pp_size - 1 - rank) + 1
    return min(everything, warmup)


_ORDERED = ("interleaved1f1b", "loopedbfs")
"""Looped schedules whose op order `peak_with_gradients` follows; others are bounded by the sum."""


def peak_with_gradients(
    spec: ScheduleSpec | None,
    *,
    pp_size: int,
    rank: int,
    n_microbatches: int,
    activations: Sequence[float],
    gradients: Sequence[float],
) -> float:
    """The most a pipeline rank holds at once of its stages' activations and accumulated gradients.

    ``activations[c]`` is one micro-batch's saved activations of the rank's ``c``-th stage,
    ``gradients[c]`` that stage's unsharded gradients, which FSDP2 makes at the stage's first backward
    and frees at its last (the one micro-batch whose backward reduces them). A looped schedule of
    torch's (`_ORDERED`) runs forwards in rounds, each stage in turn (``pp_size`` micro-batches a round
    for interleaved 1F1B, all of them for looped BFS), then backwards the same way from the last stage;
    after its warm-up (`in_flight_microbatches`) it alternates one backward and one forward. So the
    later stage's activations are partly freed, and its gradients reduced, before the earlier stage's
    gradients exist: the peak is less than the sum of both peaks. Any other schedule (one stage per
    rank: the gradients come at the first backward, with the warm-up's activations; GPipe; CSV) gives
    that sum, its bound.
    """
    stages = len(activations)
    assert stages == len(gradients) and stages >= 1, "one activation and one gradient size per stage"
    held = in_flight_microbatches(
        spec, pp_size=pp_size, rank=rank, n_microbatches=n_microbatches, stages_per_rank=stages
    )
    if spec is None or spec.name not in _ORDERED or stages == 1:
        return held / stages * sum(activations) + sum(gradients)
    per_round = n_microbatches if spec.name == "loopedbfs" else min(pp_size, n_microbatches)
    return _looped_peak(per_round, held, n_microbatches, activations, gradients)


def _looped_peak(
    per_round: int, held: int, n_microbatches: int, activations: Sequence[float], gradients: Sequence[float]
) -> float:
    """`peak_over_order` of a looped schedule's order, computed in closed form over tensors.

    The order: forwards in rounds of ``per_round`` micro-batches (round by round, stage by stage,
    micro-batch by micro-batch), backwards the same from the last stage; ``held`` forwards first,
    then one backward and one forward in turn. Before the ``i``-th backward the rank holds the
    activations of ``min(held + i, every)`` forwards less those of ``i`` backwards, and the gradients of
    every stage between its first backward and its last (its last micro-batch's). ``automodel plan
    --suggest`` prices thousands of such orders, some of tens of thousands of ops: a Python walk of each
    was most of its time.
    """
    cpu = torch.device("cpu")
    stages, every = len(activations), len(activations) * n_microbatches
    micro = torch.arange(n_microbatches, device=cpu)
    start = micro // per_round * per_round  # each micro-batch's round, by its first micro-batch
    size = torch.clamp(n_microbatches - start, max=per_round)  # the round's micro-batches
    stage = torch.arange(stages, device=cpu).unsqueeze(1)
    base = start * stages + micro - start  # the round's block begins after every earlier round's ops
    forward_at = (base + stage * size).flatten()
    backward_at = base + (stages - 1 - stage) * size  # [stage, micro]: the later stages go first
    sizes = torch.tensor(activations, dtype=torch.float64, device=cpu).repeat_interleave(n_microbatches)

    def done(at: torch.Tensor) -> torch.Tensor:
        """Activations of the first ``k`` ops, for every ``k`` (the ops' sizes placed at ``at``)."""
        placed = torch.zeros(every + 1, dtype=torch.float64, device=cpu)
        placed[1:].index_copy_(0, at, sizes)
        return placed.cumsum(0)

    step = torch.arange(every, device=cpu)
    alive = done(forward_at)[torch.clamp(held + step, max=every)] - done(backward_at.flatten())[step]
    grads = torch.tensor(gradients, dtype=torch.float64, device=cpu)
    change = torch.zeros(every + 1, dtype=torch.float64, device=cpu)
    change.index_add_(0, backward_at[:, 0], grads)  # made at the stage's first backward
    change.index_add_(0, backward_at[:, -1] + 1, -grads)  # reduced and freed after its last
    return float((alive + change.cumsum(0)[:-1]).max())


def peak_over_order(
    order: Sequence[tuple[str, tuple[int, int]]],
    n_microbatches: int,
    activations: Sequence[float],
    gradients: Sequence[float],
) -> float:
    """`peak_with_gradients` over an explicit op order of one rank: ``("F" or "B", (stage, micro))``."""
    # The gradients held are a running total: summing the accumulating stages at every backward made
    # the walk quadratic in the stages.
    alive, accumulating, held, peak = 0.0, set(), 0.0, 0.0
    for kind, (stage, micro) in order:
        if kind == "F":
            alive += activations[stage]
            continue
        if stage not in accumulating:
            accumulating.add(stage)
            held += gradients[stage]
        peak = max(peak, alive + held)
        alive -= activations[stage]
        if micro == n_microbatches - 1:
            accumulating.discard(stage)  # its last backward reduces and frees them
            held -= gradients[stage]
    return peak
