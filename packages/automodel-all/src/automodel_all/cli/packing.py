"""Token documents -> fixed-length training rows, in one of three layouts (``data.packing``).

Every layout gives, per row of ``seq_len`` slots, ``input_ids``, ``labels`` (the target of each slot,
already shifted; ``-100`` where nothing is predicted) and ``position_ids``:

- ``concat``: the documents are joined into one stream and cut into rows of ``seq_len + 1`` tokens
  (inputs ``row[:-1]``, labels ``row[1:]``); positions run ``0 .. seq_len - 1`` and attention crosses
  document boundaries, as in pre-training on a corpus. No padding.
- ``packed``: whole documents are placed into rows (best-fit decreasing), each with its own positions
  ``0, 1, ...``. transformers sees the position restarts and builds a block-diagonal causal mask
  (``masking_utils.find_packed_sequence_indices``), so attention never crosses documents and each
  document's loss is what it would be alone. A document of ``L`` tokens takes ``L - 1`` slots (inputs
  ``ids[:-1]``, labels ``ids[1:]``). The tail of a row is padding that continues the last document's
  positions: it comes after that document's tokens, so causal attention keeps them apart, and its labels
  are ``-100``.
- ``padded``: one document per row, padded at the end, positions ``0 .. seq_len - 1``: exact under any
  causal attention without a mask. (``packed`` rows are exact under context parallelism too: its
  region masks attention per document, `automodel_distributed.cp_document_attention`.)

A document longer than a row is split into row-sized pieces when every token is a target (plain text),
and truncated otherwise (a conversation's answer means nothing without its prompt); `PackReport` counts
both, and the documents left with nothing to predict.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from automodel_all.cli.encode import Document

__all__ = [
    "IGNORE_INDEX",
    "PACKINGS",
    "ROWS_SUFFIX",
    "PackReport",
    "TokenRows",
    "concat_rows",
    "document_pieces",
    "fill_row",
    "model_inputs",
    "pack_documents",
    "take_rows",
    "trainable",
]

IGNORE_INDEX = -100
"""Label of slots without a target (the loss ignores them)."""

PACKINGS = ("concat", "packed", "padded")
"""Values of ``data.packing``."""


@dataclass
class PackReport:
    """What packing did to the documents."""

    documents: int = 0
    split: int = 0
    """Documents longer than a row cut into several (plain text)."""
    truncated: int = 0
    """Documents longer than a row cut at the row's end (prompt/completion, conversations)."""
    dropped: int = 0
    """Documents (or pieces) with no target token left, not used."""
    rows: int = 0
    fill: float = 0.0
    """Fraction of slots holding document tokens (1.0: no padding)."""


@dataclass
class TokenRows:
    """Training rows: ``input_ids``, ``labels``, ``position_ids`` of shape ``[rows, seq_len]``.

    Stored as int32 (half the memory of int64); `batch` returns int64 tensors.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    tokens: torch.Tensor
    """``[rows]`` slots holding document tokens (not padding), for throughput figures."""
    report: PackReport = field(default_factory=PackReport)
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    """Other model inputs of shape ``[rows, seq_len]`` (a processor's ``token_type_ids``, say)."""
    media: list[dict[str, torch.Tensor]] | None = None
    """Per row, the processor's image inputs (``pixel_values``, ``image_grid_thw``, ...), each counted
    along its first dimension (images or patches); ``None`` for text rows."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Slots per row."""
        return int(self.input_ids.shape[1])

    def batch(self, rows: torch.Tensor, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The rows ``rows`` as model inputs on ``device``.

        int64 ``input_ids``, ``labels``, ``position_ids`` and the `per_token` fields; and the rows'
        `media` concatenated, each with its per-row counts under ``<name>`` + `ROWS_SUFFIX` (so
        `take_rows` can cut micro-batches). Rows of data with media are one record each (positions
        ``0 .. seq_len - 1``) and their model computes its own positions (multimodal rotary positions,
        say), so they have no ``position_ids``.
        """
        names = ("input_ids", "labels") if self.media is not None else ("input_ids", "labels", "position_ids")
        out = {name: getattr(self, name)[rows].to(device=device, dtype=torch.int64) for name in names}
        for name, tensor in self.per_token.items():
            out[name] = tensor[rows].to(device=device, dtype=torch.int64)
        if self.media is not None:
            chosen = [self.media[int(i)] for i in rows.reshape(-1)]
            for name in sorted({n for row in chosen for n in row}):
                present = [row[name] for row in chosen if name in row]
                out[name] = torch.cat(present).to(device)
                counts = [row[name].shape[0] if name in row else 0 for row in chosen]
                out[name + ROWS_SUFFIX] = torch.tensor(counts, dtype=torch.int64, device=device)
        return out

    def save(self, path: Path) -> None:
        """Write the rows to ``path`` (``torch.save``; written beside it, then renamed into place)."""
        staging = path.with_name(f".{path.name}.{os.getpid()}.partial")  # nodes may share the folder
        state = {name: getattr(self, name) for name in ("input_ids", "labels", "position_ids", "tokens")}
        extra = {"per_token": self.per_token, "media": self.media}
        torch.save({**state, **extra, "report": vars(self.report)}, staging)
        staging.replace(path)

    @classmethod
    def load(cls, path: Path) -> TokenRows:
        """Read rows written by `save`."""
        state = torch.load(path, weights_only=True)
        report = PackReport(**state.pop("report"))
        return cls(**state, report=report)


ROWS_SUFFIX = ".rows"
"""Batch key suffix of a media input's per-row counts (see `TokenRows.batch`)."""


def take_rows(batch: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    """Rows ``part`` of a `TokenRows.batch`: per-row tensors sliced, media cut by their per-row counts."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in batch.items():
        if name.endswith(ROWS_SUFFIX):
            continue
        counts = batch.get(name + ROWS_SUFFIX)
        if counts is None:
            out[name] = tensor[part]
            continue
        start, stop = int(counts[: part.start].sum()), int(counts[: part.stop].sum())
        if stop > start:
            out[name] = tensor[start:stop]
            out[name + ROWS_SUFFIX] = counts[part]
    return out


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs of the model's forward for a batch (labels and per-row counts left out)."""
    return {name: t for name, t in batch.items() if name != "labels" and not name.endswith(ROWS_SUFFIX)}


def document_pieces(doc: Document, width: int, report: PackReport) -> list[Document]:
    """``doc`` cut to at most ``width`` tokens: split when all are targets, else truncated."""
    if len(doc.ids) <= width:
        return [doc]
    if all(doc.targets):
        report.split += 1
        step = width - 1  # consecutive pieces share one token, so every token is a label exactly once
        return [
            Document(doc.ids[i : i + width], doc.targets[i : i + width])
            for i in range(0, len(doc.ids) - 1, step)
        ]
    report.truncated += 1
    return [Document(doc.ids[:width], doc.targets[:width])]


def _slots(doc: Document) -> tuple[list[int], list[int]]:
    """A document's slots: inputs ``ids[:-1]``, labels ``ids[1:]`` where a target, else -100."""
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(doc.ids[1:], doc.targets[1:], strict=True)]
    return doc.ids[:-1], labels


def concat_rows(ids: Sequence[int], targets: Sequence[bool], seq_len: int, report: PackReport) -> TokenRows:
    """Consecutive rows of ``seq_len + 1`` tokens of one token stream (a shorter tail is left out).

    Inputs are ``row[:-1]``, labels ``row[1:]`` (``-100`` where not a target), positions
    ``0 .. seq_len - 1``; ``report`` gets the rows and a fill of 1.0.
    """
    width = seq_len + 1
    count = len(ids) // width
    stream = torch.tensor(ids[: count * width], dtype=torch.int32, device="cpu").view(count, width)
    keep = torch.tensor(targets[: count * width], dtype=torch.bool, device="cpu").view(count, width)
    labels = torch.where(keep[:, 1:], stream[:, 1:], torch.full_like(stream[:, 1:], IGNORE_INDEX))
    positions = torch.arange(seq_len, dtype=torch.int32, device="cpu").expand(count, seq_len).contiguous()
    report.rows, report.fill = count, 1.0
    return TokenRows(
        stream[:, :-1].contiguous(), labels, positions, torch.full((count,), seq_len, device="cpu"), report
    )


def _concat(docs: Sequence[Document], seq_len: int, report: PackReport) -> TokenRows:
    ids = [t for d in docs for t in d.ids]
    if len(ids) < seq_len + 1:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than one row of seq_len + 1 = {seq_len + 1}")
    return concat_rows(ids, [k for d in docs for k in d.targets], seq_len, report)


def trainable(piece: Document) -> bool:
    """Whether a piece has a token to learn from (a target after its first token)."""
    return len(piece.ids) >= 2 and any(piece.targets[1:])


def _best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of document indices: best-fit decreasing (each document into the fullest row it fits)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free slots, bin index), sorted
    for index in order:
        need = lengths[index]
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            bins.append([index])
            bisect.insort(free, (capacity - need, len(bins) - 1))
            continue
        room, target = free.pop(at)
        bins[target].append(index)
        bisect.insort(free, (room - need, target))
    return bins


def fill_row(
    input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, pieces: Sequence[Document]
) -> int:
    """Write ``pieces`` one after another into one row (``[seq_len]`` views, mutated); return the tokens.

    Precondition: ``input_ids`` is already padding and ``labels`` `IGNORE_INDEX`; the pieces fit
    (``sum(len(p.ids) - 1) <= seq_len``) and each has at least two tokens.
    """
    seq_len = int(input_ids.shape[0])
    at = 0
    for piece in pieces:
        inputs, targets = _slots(piece)
        end = at + len(inputs)
        input_ids[at:end] = torch.tensor(inputs, dtype=torch.int32, device="cpu")
        labels[at:end] = torch.tensor(targets, dtype=torch.int32, device="cpu")
        positions[at:end] = torch.arange(len(inputs), dtype=torch.int32, device="cpu")
        at = end
    assert 0 < at <= seq_len, (at, seq_len)
    # Padding continues the last document's positions: it follows that document, so causal attention
    # keeps the document from seeing it, and no extra segment (mask block) is needed.
    last = int(positions[at - 1])
    positions[at:] = torch.arange(last + 1, last + 1 + seq_len - at, dtype=torch.int32, device="cpu")
    return at


def pack_documents(docs: Sequence[Document], seq_len: int, packing: str, pad_id: int) -> TokenRows:
    """Lay the documents out in rows of ``seq_len`` slots (see the module docstring).

    Args:
        docs: The encoded records, in order.
        seq_len: Slots per row.
        packing: One of `PACKINGS`.
        pad_id: Token id of padding slots (never attended to by a document token, never a label).

    Raises:
        ValueError: Nothing is left to train on (no row, or no document with a target).
    """
    assert packing in PACKINGS, packing
    report = PackReport(documents=len(docs))
    if packing == "concat":
        return _concat(docs, seq_len, report)
    pieces = []
    for doc in docs:
        for piece in document_pieces(doc, seq_len + 1, report):
            if trainable(piece):
                pieces.append(piece)
            else:
                report.dropped += 1
    if not pieces:
        raise ValueError(
            f"none of the {len(docs)} records has a token to learn from (all masked or too short)"
        )
    bins = (
        [[i] for i in range(len(pieces))]
        if packing == "padded"
        else _best_fit([len(p.ids) - 1 for p in pieces], seq_len)
    )
    count = len(bins)
    input_ids = torch.full((count, seq_len), pad_id, dtype=torch.int32, device="cpu")
    labels = torch.full((count, seq_len), IGNORE_INDEX, dtype=torch.int32, device="cpu")
    positions = torch.empty((count, seq_len), dtype=torch.int32, device="cpu")
    tokens = torch.empty(count, dtype=torch.int32, device="cpu")
    for row, members in enumerate(bins):
        tokens[row] = fill_row(input_ids[row], labels[row], positions[row], [pieces[i] for i in members])
    report.rows = count
    report.fill = float(tokens.sum()) / (count * seq_len)
    return TokenRows(input_ids, labels, positions, tokens, report)
