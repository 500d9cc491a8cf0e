"""The files of a consolidated export written by several ranks at once, each write overlapping the gathers.

`save_hf_checkpoint` plans its safetensors files first (names, keys, sizes: the same whatever the world
size). Here the files are shared out among ``W`` writer ranks by bytes (`assign_files`: largest file
first onto the least-loaded writer), so each writes about ``1/W`` of the export. Every rank still takes
part in every gather, since a sharded tensor's ``full_tensor()`` is a collective over its mesh, but in
an order that takes turns between the writers' files (`gather_order`); the rank that owns a tensor's
file hands its host copy to a writer thread (`FileWriter`) that streams it into the file while all ranks
go on to gather the next. Writes therefore overlap each other and the gathers, instead of one rank
writing every byte while the others wait in the next collective.

Memory per rank: its shards, the model tensors of the current gather (on their device; the largest is
the bound) and at most ``QUEUE_DEPTH + 1`` on-disk tensors on their way to disk (host memory). The
files' bytes are the serial writer's: the same layout, each file written in its declared order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from automodel_checkpoint.convert import DiskTensor, compute_disk_tensors
from automodel_checkpoint.safetensors_io import SafetensorsStreamWriter
from automodel_modules import is_dtensor

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
    none.
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
            self._open.pop(file).close()

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
                    SafetensorsStreamWriter(self._staging / name, layout, {"format": "pt"}).close()
            for stream in self._open.values():  # only after an error: close raises on missing tensors
                stream.close()
        except Exception as exc:
            self.error = self.error or exc
        self._open.clear()
        return self.error


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``full_tensor()`` for a DTensor (a collective over its mesh), else itself."""
    return t.full_tensor() if is_dtensor(t) else t


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


def write_files(
    staging: Path,
    order: Sequence[GatherUnit],
    layouts: Mapping[str, _Layout],
    disk: Mapping[str, DiskTensor],
    tensors: Mapping[str, torch.Tensor],
    mine: set[str],
    write_hook: Callable[[str], None] | None = None,
    model: nn.Module | None = None,
) -> BaseException | None:
    """Gather every unit of ``order`` (all ranks, collectives) and write the tensors of this rank's files.

    Args:
        staging: The folder the files go to.
        order: The gather units, in the order every rank gathers them (`gather_order`).
        layouts: Each file's declared tensors (key, on-disk dtype, shape), in order.
        disk: Each on-disk key's boxes of model tensors.
        tensors: The model tensors by model key (DTensors are gathered with ``full_tensor()``).
        mine: The files this rank writes.
        write_hook: Called with each key after it is written (tests kill a rank mid-save with it).
        model: The transformers model that computes the on-disk tensors marked ``computed``.

    Returns:
        This rank's first write error, or None. A write error stops the writing, never the gathering,
        so the other ranks are never left waiting in a collective.
    """
    dtypes = {key: dtype for layout in layouts.values() for key, dtype, _ in layout}
    writer = FileWriter(staging, {name: layouts[name] for name in mine}, write_hook)
    try:
        for unit in order:
            with torch.no_grad():
                full = {k: _full(tensors[k]) for k in unit.model_keys}
                if unit.file not in mine:
                    continue
                computed = {}
                if any(disk[key].computed for key in unit.keys):
                    assert model is not None, "computed on-disk tensors without the model that computes them"
                    computed = compute_disk_tensors(model, full)
                for key in unit.keys:
                    host = (
                        _assemble(disk[key], full, computed).to(device="cpu", dtype=dtypes[key]).contiguous()
                    )
                    writer.put(unit.file, key, host)
    finally:
        error = writer.finish()
    return error
