"""Training rows packed on the fly from a stream of records (``data.streaming: true``).

For data larger than memory: nothing is read whole. A step's global batch has ``G`` rows
(``train.global_batch_size``), and row ``j`` of every step comes from **slot** ``j``: the stream of the
records whose index in the source is ``j`` modulo ``G``, tokenized as the slot reaches them and packed
into its rows (``concat``: the slot's tokens cut into rows; ``packed``: whole records placed in order
until the next one does not fit, next-fit where the prepared path uses best-fit over all records;
``padded``: one record per row). At the end of the source a slot starts over (its next pass).

Data-parallel rank ``r`` of ``D`` holds slots ``r*G/D .. (r+1)*G/D - 1`` (the share of a global batch
`automodel_all.cli.data.RowSampler` gives it). Each slot reads the source on its own, a block of
records at a time (``datasets`` streaming, Arrow tables), and turns only its own records into Python
and tokens: a rank parses the source ``G/D`` times per pass and tokenizes ``1/D`` of it. Memory is a
block per slot, flat over the run.

A slot's position is a `SlotCursor` (pass, record, how much of that record is used); the cursors of all
``G`` slots are the data position every checkpoint records. Slots do not depend on the world size, so
``--resume`` on any number of ranks with the same global batch gives every row the stream it would
have had.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel_all.cli.encode import Document, RecordKeys, encode_records
from automodel_all.cli.packing import (
    IGNORE_INDEX,
    PackReport,
    TokenRows,
    concat_rows,
    document_pieces,
    fill_row,
    trainable,
)
from automodel_all.cli.sources import BUILTIN_SOURCES, stream_records

__all__ = ["SlotCursor", "StreamSpec", "StreamingRows", "read_slot"]

_BLOCK_ROWS = 1024
"""Records per Arrow table read from the stream (a slot holds one table at a time)."""


@dataclass(frozen=True)
class StreamSpec:
    """What every slot needs to read and pack its records (the job's resolved ``data`` section).

    Args:
        path: ``data.path``.
        split: ``data.split``.
        cache_dir: ``datasets``' cache folder (``<output_dir>/data/cache``).
        fmt: The resolved ``data.format`` (not ``auto``; never ``image_messages``).
        packing: The resolved ``data.packing``.
        seq_len: Slots per row.
        keys: The records' field names.
        pad_id: Token id of padding.
        slots: ``train.global_batch_size``: the number of slots.
    """

    path: str | None
    split: str
    cache_dir: Path
    fmt: str
    packing: str
    seq_len: int
    keys: RecordKeys
    pad_id: int
    slots: int

    @property
    def where(self) -> str:
        """The source as messages name it."""
        return f"data {self.path or 'builtin:text'} (split {self.split})"

    def fingerprint(self) -> str:
        """A digest of the source's files (names and sizes) and the row layout, recorded in checkpoints."""
        digest = hashlib.sha256(f"{self.fmt}|{self.packing}|{self.seq_len}|{self.split}".encode())
        if self.path is None or self.path in BUILTIN_SOURCES:
            digest.update((self.path or "builtin:text").encode())
        else:
            root = Path(self.path)
            for file in sorted(root.rglob("*")) if root.is_dir() else [root]:
                if file.is_file():
                    digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}|".encode())
                    digest.update(f"{file.stat().st_size}|".encode())
        return digest.hexdigest()[:16]


@dataclass
class SlotCursor:
    """Where a slot is: the record holding its next unused token (``concat``) or piece, and how far."""

    passes: int
    """Passes over the source the slot has finished."""
    record: int
    """Index in the source of that record."""
    offset: int = 0
    """Tokens (``concat``) or pieces (``packed``, ``padded``) of that record already in rows."""

    def as_list(self) -> list[int]:
        """The cursor as checkpoints record it."""
        return [self.passes, self.record, self.offset]


def read_slot(dataset: Any, slot: int, every: int, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(index, record)`` of the records ``index >= start`` with ``index % every == slot``, in order.

    Reads ``dataset`` (a ``datasets.IterableDataset``) a block at a time as Arrow tables and converts
    only the chosen records to Python.
    """
    from datasets import Features

    seen = 0
    for table in dataset.with_format("arrow").iter(batch_size=_BLOCK_ROWS):
        rows = table.num_rows
        first = max(start, seen)
        first += (slot - first) % every
        if first < seen + rows:
            # Decoded as the dataset's own rows are (a JSON column of mixed records is stored as text).
            features = dataset.features or Features.from_arrow_schema(table.schema)
            chosen = table.take(list(range(first - seen, rows, every)))
            for number, record in enumerate(chosen.to_pylist()):
                yield first + number * every, features.decode_example(record)
        seen += rows


class _Slot:
    """One slot's stream of records, turned into rows of ``spec.seq_len`` tokens."""

    def __init__(self, spec: StreamSpec, tokenizer: Any, slot: int, cursor: SlotCursor) -> None:
        self.spec, self.tokenizer, self.slot = spec, tokenizer, slot
        self.cursor = SlotCursor(cursor.passes, cursor.record, cursor.offset)
        self.report = PackReport()
        self._records: Iterator[tuple[int, dict[str, Any]]] | None = None
        self._from_start = False  # whether the open reader began at the start of the source
        self._found = False  # whether the open reader gave a usable record
        self._units: list[Document] = []  # the head record's document (concat) or pieces
        self._load_head(keep_offset=True)

    def _open(self, start: int) -> None:
        dataset = stream_records(self.spec.path, self.spec.split, self.spec.cache_dir)
        self._records = read_slot(dataset, self.slot, self.spec.slots, start)
        self._from_start, self._found = start == self.slot, False

    def _next_record(self) -> tuple[int, dict[str, Any]]:
        """The slot's next record, starting a new pass at the end of the source."""
        if self._records is None:
            self._open(self.cursor.record)
        while True:
            assert self._records is not None
            try:
                return next(self._records)
            except StopIteration:
                pass
            except Exception as exc:  # datasets and Arrow raise their own types for unreadable files
                problem = f"{type(exc).__name__}: {exc}"
                raise ValueError(f"{self.spec.where}: datasets could not read it ({problem})") from None
            if self._from_start and not self._found:
                raise ValueError(
                    f"{self.spec.where}: the records of row slot {self.slot} (index {self.slot} modulo "
                    f"train.global_batch_size={self.spec.slots}) hold no token to learn from; lower "
                    "train.global_batch_size or add data"
                )
            self.cursor.passes += 1
            self._open(self.slot)

    def _units_of(self, index: int, record: dict[str, Any]) -> list[Document]:
        spec = self.spec
        docs = encode_records(
            [record], self.tokenizer, fmt=spec.fmt, keys=spec.keys, where=spec.where, first_index=index
        )
        assert len(docs) <= 1, "a record is at most one document"
        if spec.packing == "concat":
            return docs
        pieces = [p for doc in docs for p in document_pieces(doc, spec.seq_len + 1, self.report)]
        return [p for p in pieces if trainable(p)]

    def _load_head(self, *, keep_offset: bool = False) -> None:
        """Make the next record with something to train on the head (the cursor points at it)."""
        while True:
            index, record = self._next_record()
            units = self._units_of(index, record)
            if units:
                break
        self._found = True
        if not (keep_offset and index == self.cursor.record):
            self.cursor.offset = 0
        self.cursor.record, self._units = index, units

    def _advance(self, used: int) -> None:
        """Mark ``used`` more units of the head used, moving to the next record when it is spent."""
        self.cursor.offset += used
        total = len(self._units[0].ids) if self.spec.packing == "concat" else len(self._units)
        if self.cursor.offset >= total:
            self._load_head()

    def row(self) -> TokenRows:
        """The slot's next row (one row of ``seq_len`` slots)."""
        return self._concat_row() if self.spec.packing == "concat" else self._packed_row()

    def _concat_row(self) -> TokenRows:
        need = self.spec.seq_len + 1
        ids: list[int] = []
        targets: list[bool] = []
        while len(ids) < need:
            doc, at = self._units[0], self.cursor.offset
            take = min(need - len(ids), len(doc.ids) - at)
            ids += doc.ids[at : at + take]
            targets += doc.targets[at : at + take]
            self._advance(take)
        return concat_rows(ids, targets, self.spec.seq_len, PackReport())

    def _packed_row(self) -> TokenRows:
        seq_len = self.spec.seq_len
        chosen: list[Document] = []
        used = 0
        while True:
            piece = self._units[self.cursor.offset]
            slots = len(piece.ids) - 1
            if chosen and (self.spec.packing == "padded" or used + slots > seq_len):
                break
            chosen.append(piece)
            used += slots
            self._advance(1)
        input_ids = torch.full((1, seq_len), self.spec.pad_id, dtype=torch.int32, device="cpu")
        labels = torch.full((1, seq_len), IGNORE_INDEX, dtype=torch.int32, device="cpu")
        positions = torch.empty((1, seq_len), dtype=torch.int32, device="cpu")
        tokens = fill_row(input_ids[0], labels[0], positions[0], chosen)
        return TokenRows(
            input_ids, labels, positions, torch.tensor([tokens], dtype=torch.int32, device="cpu")
        )


class StreamingRows:
    """The rows of one data-parallel rank's slots, a step at a time.

    Args:
        spec: The stream's description.
        tokenizer: The text tokenizer.
        slots: The slots this rank holds (consecutive).
        cursors: Their positions (a resumed run's; default: the start of the source).
    """

    def __init__(
        self, spec: StreamSpec, tokenizer: Any, slots: range, cursors: dict[int, SlotCursor] | None = None
    ) -> None:
        cursors = cursors or {}
        self._slots = [_Slot(spec, tokenizer, j, cursors.get(j, SlotCursor(0, j))) for j in slots]

    def next_rows(self) -> TokenRows:
        """One row from each slot, in slot order."""
        rows = [slot.row() for slot in self._slots]
        return TokenRows(
            torch.cat([r.input_ids for r in rows]),
            torch.cat([r.labels for r in rows]),
            torch.cat([r.position_ids for r in rows]),
            torch.cat([r.tokens for r in rows]),
        )

    def cursors(self) -> dict[int, SlotCursor]:
        """The position of each slot (its next row starts there)."""
        return {slot.slot: SlotCursor(**vars(slot.cursor)) for slot in self._slots}
