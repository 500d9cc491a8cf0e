"""The files of a consolidated export written by several ranks at once, each write overlapping the gathers.

`save_hf_checkpoint` plans its safetensors files first (names, keys, sizes: the same whatever the world
size). Here the files are shared out among ``W`` writer ranks by bytes (`assign_files`: largest file
first onto the least-loaded writer), so each writes about ``1/W`` of the export. The gather units are
taken in an order that takes turns between the writers (`gather_order`), in rounds of units with
distinct writers; each round moves every unit's tensors onto its writer alone, at once
(`owner_gather.gather_round`), so each rank receives about ``1/W`` of the export's bytes. The writer
hands its host copies to a thread (`FileWriter`) that streams them into the file while the ranks go on
to the next round: writes overlap each other and the gathers.

Memory per rank: its shards, the whole tensors of its unit in the current round (on their device; the
largest unit is the bound) and at most ``QUEUE_DEPTH + 1`` on-disk tensors on their way to disk (host
memory). The files' bytes are the serial writer's: the same layout, each file written in its declared
order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.convert import DiskTensor, compute_disk_tensors
from automodel_checkpoint.owner_gather import gather_round, rounds
from automodel_checkpoint.ranks import global_rank, rank_of
from automodel_checkpoint.safetensors_io import SafetensorsStreamWriter

__all__ = ["QUEUE_DEPTH", "FileWriter", "GatherUnit", "assign_files", "gather_order", "write_files"]

QUEUE_DEPTH = 2
"""On-disk tensors a rank's writer thread may have waiting (host memory: at most this many + 1 in hand)."""

_Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def assign_files(sizes: Sequence[tuple[str, int]], writers: int) -> dict[str, int]:
    """Each file's writer rank (``0 .. writers - 1``): largest file first onto the least-loaded writer.

    Deterministic (ties go to the lower rank, equal sizes in name order), so every rank computes the
    same assignment without a collective.
    """
    assert writers >= 1
    load = [0] * writers
    owner: dict[str, int] = {}
    for name, nbytes in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(writers), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += nbytes
    return owner


@dataclass(frozen=True)
class GatherUnit:
    """Consecutive on-disk tensors of one file that read the same model tensors (gathered once).

    Attributes:
        file: The file they go to.
        keys: Their on-disk keys, in file order.
        model_keys: The model tensors they read, in order of first use.
    """

    file: str
    keys: tuple[str, ...]
    model_keys: tuple[str, ...]


def _units(files: Sequence[tuple[str, list[str]]], disk: Mapping[str, DiskTensor]) -> list[GatherUnit]:
    """The gather units of every file, in file order (the experts of a fused tensor form one unit)."""
    units: list[GatherUnit] = []
    for name, keys in files:
        run: list[str] = []
        reads: dict[str, None] = {}
        for key in keys:
            needed = disk[key].model_keys
            if run and not reads.keys() & set(needed):
                units.append(GatherUnit(name, tuple(run), tuple(reads)))
                run, reads = [], {}
            run.append(key)
            reads.update(dict.fromkeys(needed))
        if run:
            units.append(GatherUnit(name, tuple(run), tuple(reads)))
    return units


def gather_order(
    files: Sequence[tuple[str, list[str]]], disk: Mapping[str, DiskTensor], owner: Mapping[str, int]
) -> list[GatherUnit]:
    """Every gather unit once, taking turns between the writers (each writer's files stay in order)."""
    per_writer: dict[int, list[GatherUnit]] = {}
    for unit in _units(files, disk):
        per_writer.setdefault(owner[unit.file], []).append(unit)
    queues = [per_writer[rank][::-1] for rank in sorted(per_writer)]
    order: list[GatherUnit] = []
    while queues:
        for pending in queues:
            order.append(pending.pop())
        queues = [pending for pending in queues if pending]
    return order


class FileWriter:
    """A thread streaming this rank's files: tensors arrive through a bounded queue, in file order.

    The first error stops the writing, not the consuming (the producer, in collectives with the other
    ranks, must never block on a full queue); `finish` returns it. Every file is closed (flushed and
    fsynced) when its last declared tensor is written; `finish` also creates the files that declare
    none. Each file's checksum is computed as it is written (`checksums`), so the publish need not
    read the files back.
    """

    def __init__(
        self,
        staging: Path,
        layouts: Mapping[str, _Layout],
        write_hook: Callable[[str], None] | None = None,
    ) -> None:
        self._staging = staging
        self._layouts = layouts
        self._hook = write_hook
        self._queue: queue.Queue[tuple[str, str, torch.Tensor] | None] = queue.Queue(maxsize=QUEUE_DEPTH)
        self._open: dict[str, SafetensorsStreamWriter] = {}
        self._left = {name: len(layout) for name, layout in layouts.items()}
        self.error: BaseException | None = None
        self.checksums: dict[str, dict[str, Any]] = {}
        """Size and SHA-256 of each file closed (`integrity.file_checksums` takes them as known)."""
        self._thread = threading.Thread(target=self._run, name="automodel-export-writer", daemon=True)
        self._thread.start()

    def put(self, file: str, key: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (a host tensor in its on-disk dtype) as ``key`` of ``file``."""
        self._queue.put((file, key, tensor))

    def _write(self, file: str, key: str, tensor: torch.Tensor) -> None:
        stream = self._open.get(file)
        if stream is None:
            stream = self._open[file] = SafetensorsStreamWriter(
                self._staging / file, self._layouts[file], {"format": "pt"}
            )
        stream.write(key, tensor)
        if self._hook is not None:
            self._hook(key)
        self._left[file] -= 1
        if self._left[file] == 0:
            self._close(file, self._open.pop(file))

    def _close(self, file: str, stream: SafetensorsStreamWriter) -> None:
        stream.close()
        self.checksums[file] = stream.checksum

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is None:
                try:
                    self._write(*item)
                except Exception as exc:  # reported by finish; keep consuming
                    self.error = exc

    def finish(self) -> BaseException | None:
        """Wait for the queued writes, close what is open; the first error (None if all went well)."""
        self._queue.put(None)
        self._thread.join()
        try:
            for name, layout in self._layouts.items():
                if not layout and self.error is None:  # a file that declares nothing still exists
                    self._close(name, SafetensorsStreamWriter(self._staging / name, layout, {"format": "pt"}))
            for stream in self._open.values():  # only after an error: close raises on missing tensors
                stream.close()
        except Exception as exc:
            self.error = self.error or exc
        self._open.clear()
        return self.error


def _assemble(
    disk: DiskTensor, full: Mapping[str, torch.Tensor], computed: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The on-disk tensor ``disk`` from the full model tensors it reads (a view when it is one box).

    A tensor that transformers' converters compute comes from ``computed`` (the unit's, computed once).
    """
    if disk.computed:
        return computed[disk.key]
    whole = disk.whole
    if whole is not None:
        return full[whole]
    if len(disk.pieces) == 1:
        (piece,) = disk.pieces
        assert piece.index is not None
        return full[piece.model_key][piece.index]
    first = full[disk.pieces[0].model_key]
    out = torch.empty(disk.shape, dtype=first.dtype, device=first.device)
    for piece in disk.pieces:
        source = full[piece.model_key]
        box = tuple(slice(s, s + n) for s, n in zip(piece.start, piece.shape, strict=True))
        out[box] = source if piece.index is None else source[piece.index]
    return out


def _put_unit(
    writer: FileWriter,
    unit: GatherUnit,
    full: Mapping[str, torch.Tensor],
    disk: Mapping[str, DiskTensor],
    dtypes: Mapping[str, torch.dtype],
    model: nn.Module | None,
) -> None:
    """Queue the on-disk tensors of ``unit`` (host copies in their on-disk dtype) from its whole tensors."""
    computed = {}
    if any(disk[key].computed for key in unit.keys):
        assert model is not None, "computed on-disk tensors without the model that computes them"
        computed = compute_disk_tensors(model, full)
    for key in unit.keys:
        host = _assemble(disk[key], full, computed).to(device="cpu", dtype=dtypes[key]).contiguous()
        writer.put(unit.file, key, host)


def write_files(
    staging: Path,
    order: Sequence[GatherUnit],
    layouts: Mapping[str, _Layout],
    disk: Mapping[str, DiskTensor],
    tensors: Mapping[str, torch.Tensor],
    owner: Mapping[str, int],
    group: dist.ProcessGroup | None = None,
    write_hook: Callable[[str], None] | None = None,
    model: nn.Module | None = None,
) -> tuple[BaseException | None, dict[str, dict[str, Any]]]:
    """Gather every unit of ``order`` onto its file's writer (all ranks) and write this rank's files.

    Args:
        staging: The folder the files go to.
        order: The gather units, in the order every rank gathers them (`gather_order`).
        layouts: Each file's declared tensors (key, on-disk dtype, shape), in order.
        disk: Each on-disk key's boxes of model tensors.
        tensors: The model tensors by model key (DTensors where sharded).
        owner: Each file's writer (rank in ``group``).
        group: The ranks exporting together. Collectives: those of `owner_gather.gather_round`, once
            per round of units with distinct writers (`owner_gather.rounds`).
        write_hook: Called with each key after it is written (tests kill a rank mid-save with it).
        model: The transformers model that computes the on-disk tensors marked ``computed``.

    Returns:
        This rank's first error in assembling or writing (None if all went well), and the checksums
        of the files it wrote (`FileWriter.checksums`). An error stops this rank's writing, never its
        gathering, so the other ranks are never left waiting in a collective.
    """
    dtypes = {key: dtype for layout in layouts.values() for key, dtype, _ in layout}
    mine = {name for name, rank in owner.items() if rank == rank_of(group)}
    writers = [global_rank(group, owner[unit.file]) for unit in order]
    me = rank_of(None)  # the sends and receives name global ranks
    writer = FileWriter(staging, {name: layouts[name] for name in mine}, write_hook)
    failed: BaseException | None = None
    try:
        for turn, run in enumerate(rounds(writers)):
            needs = [(writers[i], order[i].model_keys) for i in run]
            for index, full in gather_round(needs, tensors, me, group, turn).items():
                if failed is None and writer.error is None:
                    try:
                        _put_unit(writer, order[run[index]], full, disk, dtypes, model)
                    except Exception as exc:  # reported after the gathers, which go on
                        failed = exc
    finally:
        error = writer.finish()
    return failed or error, writer.checksums
