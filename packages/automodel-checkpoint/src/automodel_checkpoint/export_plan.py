"""What a consolidated export writes and who writes it, agreed by every rank before any tensor moves.

Each rank lists the on-disk tensors its model parts hold (the whole model, or its pipeline stages);
the lists are exchanged once (``all_gather_object``). Ranks holding the same tensors form a *holder
group*: every rank without pipeline parallelism, one pipeline stage's ranks (each rank of a stage holds
a shard of each of the stage's tensors). Keys are ordered group by group (the group of the lowest rank
first), each group's in its ranks' state-dict order, then cut into files of at most ``max_shard_size``
bytes as transformers names them, never across two groups, so each file is gathered and written inside
one group: its files are shared out among its ranks by bytes (`parallel_export.assign_files`).

Without pipeline parallelism this is the layout ``save_pretrained`` writes, the same for any number of
ranks and writers; with it, files also end where a stage ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.convert import DiskPiece, DiskTensor, disk_layout
from automodel_checkpoint.keys import KeyRules, collect_tensor_slots
from automodel_checkpoint.materialize import initializable_hf_model
from automodel_checkpoint.parallel_export import assign_files
from automodel_checkpoint.ranks import rank_of, world_of

__all__ = ["ExportPlan", "plan_export", "plan_shards"]

_Declared = tuple[str, torch.dtype, tuple[int, ...]]


def plan_shards(
    sizes: Sequence[tuple[str, int]],
    max_shard_size: int,
    prefix: str = "model",
    breaks: frozenset[str] = frozenset(),
) -> list[tuple[str, list[str]]]:
    """Group keys (in order) into files of at most ``max_shard_size`` bytes, named as transformers does.

    A tensor bigger than the limit gets a file of its own; a key in ``breaks`` starts a new file.

    Returns:
        ``[(file name, keys)]``; a single ``<prefix>.safetensors`` when everything fits in one.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, nbytes in sizes:
        if current and (used + nbytes > max_shard_size or key in breaks):
            groups.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [(f"{prefix}.safetensors", groups[0])]
    n = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors", keys) for i, keys in enumerate(groups)]


@dataclass(frozen=True)
class ExportPlan:
    """An export: the files (the same on every rank) and this rank's part in them.

    Attributes:
        files: Each file's name and on-disk keys, in order.
        layouts: Each file's declared tensors (key, on-disk dtype, shape), in order.
        owner: Each file's writer (rank in the process group).
        held: The files whose tensors this rank holds (it takes part in their gathers).
        disk: This rank's on-disk keys, each as boxes of its model tensors.
        tensors: This rank's model tensors by model key (DTensors where sharded).
        model: The transformers model that computes the on-disk tensors that are no boxes
            (`convert.compute_disk_tensors`); None when there are none.
    """

    files: list[tuple[str, list[str]]]
    layouts: dict[str, list[_Declared]]
    owner: dict[str, int]
    held: set[str]
    disk: dict[str, DiskTensor]
    tensors: dict[str, torch.Tensor]
    model: nn.Module | None = None

    @property
    def total_size(self) -> int:
        """Bytes of tensor data over all files."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for layout in self.layouts.values()
            for _, dtype, shape in layout
        )


def _saved_key(keys: Sequence[str], tied_targets: set[str]) -> str:
    """The key a tied tensor is saved under: the first that is not a tie target (as transformers)."""
    return next((k for k in keys if k not in tied_targets), keys[0])


def _local(
    parts: Sequence[nn.Module], dtype: torch.dtype | None, rules: KeyRules
) -> tuple[list[_Declared], dict[str, DiskTensor], dict[str, torch.Tensor], nn.Module | None]:
    """This rank's on-disk tensors (declared, in order), their boxes and the model tensors they read.

    Also the transformers model that computes the on-disk tensors that are no boxes (None: none are).
    """
    declared: list[_Declared] = []
    disk: dict[str, DiskTensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    computing: nn.Module | None = None
    for part in parts:
        hf = initializable_hf_model(part)
        tied_targets = set((getattr(hf, "all_tied_weights_keys", None) or {}).keys())
        own = {_saved_key(slot.keys, tied_targets): slot.tensor for slot in collect_tensor_slots(part, rules)}
        # transformers' on-disk names (per-expert MoE weights, fused qkv), as save_pretrained writes them
        shapes = {k: tuple(t.shape) for k, t in own.items()}
        layout = disk_layout(hf, shapes) or [
            DiskTensor(k, shape, (DiskPiece(k, None, (0,) * len(shape), shape),))
            for k, shape in shapes.items()
        ]
        for entry in layout:
            source = own[entry.model_keys[0]]
            cast = dtype if dtype is not None and source.dtype.is_floating_point else source.dtype
            declared.append((entry.key, cast, entry.shape))
            disk[entry.key] = entry
            computing = hf if entry.computed else computing
        tensors.update(own)
    return declared, disk, tensors, computing


def _exchange(
    declared: list[_Declared], failure: ValueError | None, group: dist.ProcessGroup | None
) -> list[list[_Declared]]:
    """Every rank's declared tensors (one ``all_gather_object``; no collective on one rank).

    Raises:
        ValueError: Some rank could not describe its tensors (``failure``): on every rank, so that no
            rank waits in a gather the failed one never joins.
    """
    if world_of(group) == 1:
        if failure is not None:
            raise failure
        return [declared]
    gathered: list[tuple[list[_Declared], str | None] | None] = [None] * world_of(group)
    dist.all_gather_object(gathered, (declared, None if failure is None else str(failure)), group=group)
    if failure is not None:
        raise failure
    failed = [(rank, item[1]) for rank, item in enumerate(gathered) if item is not None and item[1]]
    if failed:
        raise ValueError(f"exporting failed on rank(s) {[r for r, _ in failed]}: {failed[0][1]}")
    return [item[0] if item is not None else [] for item in gathered]


def plan_export(
    parts: Sequence[nn.Module],
    max_shard_size: int,
    dtype: torch.dtype | None,
    rules: KeyRules,
    writers: int,
    group: dist.ProcessGroup | None = None,
) -> ExportPlan:
    """Plan the export of the model held by ``parts`` over the ranks of ``group`` (collective).

    Args:
        parts: This rank's model parts (the model; or its pipeline stages).
        max_shard_size: Largest file size in bytes.
        dtype: On-disk dtype of floating-point tensors (None: the model's).
        rules: Model-name rewrites.
        writers: Ranks per holder group that write files (at most the group's size).
        group: The ranks exporting together. Collectives over it: one ``all_gather_object``.

    Raises:
        ValueError: Some rank's parts hold a tensor that cannot be written in transformers' layout (on
            every rank, before any tensor moves).
    """
    failure: ValueError | None = None
    try:
        declared, disk, tensors, computing = _local(parts, dtype, rules)
    except ValueError as exc:  # a conversion we cannot write (UnsupportedConversionError), on this rank
        failure, (declared, disk, tensors, computing) = exc, ([], {}, {}, None)
    per_rank = _exchange(declared, failure, group)
    holders: dict[tuple[str, ...], list[int]] = {}
    for rank, entries in enumerate(per_rank):
        holders.setdefault(tuple(key for key, _, _ in entries), []).append(rank)
    order: list[_Declared] = []
    group_of: dict[str, tuple[int, ...]] = {}
    for ranks in holders.values():  # in order of each group's lowest rank (dicts keep insertion order)
        for entry in per_rank[ranks[0]]:
            if entry[0] not in group_of:  # a tensor two groups hold is written by the first
                group_of[entry[0]] = tuple(ranks)
                order.append(entry)
    sizes = {key: math.prod(shape) * cast.itemsize for key, cast, shape in order}
    breaks = frozenset(key for prev, key in pairwise(sizes) if group_of[key] != group_of[prev])
    files = plan_shards(list(sizes.items()), max_shard_size, breaks=breaks)
    by_key = {entry[0]: entry for entry in order}
    layouts = {name: [by_key[k] for k in keys] for name, keys in files}
    owner = dict.fromkeys((name for name, _ in files), 0)  # a file that declares nothing: rank 0
    per_group: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for name, keys in files:
        if keys:
            per_group.setdefault(group_of[keys[0]], []).append((name, sum(sizes[k] for k in keys)))
    for holding, group_files in per_group.items():
        for name, index in assign_files(group_files, min(writers, len(holding))).items():
            owner[name] = holding[index]
    me = rank_of(group)
    held = {name for name, keys in files if keys and me in group_of[keys[0]]}
    return ExportPlan(files, layouts, owner, held, disk, tensors, computing)
