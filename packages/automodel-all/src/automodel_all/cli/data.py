"""Training data: read records, tokenize them, lay them out in rows, and give each rank its rows.

The launcher prepares the rows once (`prepare_data`: `sources` -> `encode` -> `packing`) and saves them
under ``<output_dir>/data``; every worker loads them (`load_data`). Errors in the data therefore stop
the job before any worker starts, naming the file and record.

The order of rows is a seeded permutation per epoch; the global batch of step ``s`` is the next
``global_batch_size`` rows of that stream, and data-parallel rank ``r`` takes the ``r``-th equal slice
of it (`RowSampler`). The data position is therefore a pure function of (seed, step): a resumed run, on
any world size, sees exactly the batches an uninterrupted run would have seen. Checkpoints record it
(`RowSampler.state`) with a fingerprint of the rows, so a resume on other data is noticed.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel_all.cli.encode import RecordKeys, encode_records, resolve_format
from automodel_all.cli.image_data import encode_image_records, has_image_parts
from automodel_all.cli.packing import PackReport, TokenRows, pack_documents
from automodel_all.cli.sections import DataSection
from automodel_all.cli.sources import image_root, read_records, stream_records
from automodel_all.cli.streaming import read_slot

__all__ = [
    "PreparedData",
    "RowSampler",
    "data_folder",
    "fingerprint",
    "load_data",
    "prepare_data",
    "prepare_stream",
    "resolve_packing",
]


def data_folder(output_dir: str | Path) -> Path:
    """Where the launcher writes the prepared rows (and ``datasets`` its cache)."""
    return Path(output_dir) / "data"


def resolve_packing(data: DataSection, fmt: str) -> str:
    """``data.packing``, or its default (``concat``, ``packed`` or ``padded``, by the format).

    ``concat`` for text, ``padded`` for conversations with images, else ``packed`` (exact under context
    parallelism too: attention is masked per record over the gathered keys).
    """
    if data.packing is not None:
        return data.packing
    if fmt == "image_messages":
        return "padded"
    return "concat" if fmt == "text" else "packed"


def fingerprint(rows: TokenRows) -> str:
    """A short digest of the rows' contents (recorded in checkpoints)."""
    digest = hashlib.sha256()
    for tensor in (rows.input_ids, rows.labels, rows.position_ids):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class PreparedData:
    """What `prepare_data` (or `prepare_stream`) wrote."""

    format: str
    packing: str
    train: TokenRows | None
    """The training rows; None when streamed."""
    eval: TokenRows | None
    largest_id: int
    """The largest token id seen in the training data (of the records checked, when streamed)."""


def _where(path: str | None, split: str) -> str:
    return f"data {path or 'builtin:text'} (split {split})"


def _format_of(data: DataSection, first: dict[str, Any], where: str) -> str:
    """``data.format`` resolved from the first record (``image_messages`` for pictures in it)."""
    keys = _keys(data)
    fmt = resolve_format(data.format, first.keys(), keys, where)
    if fmt == "messages" and data.format == "auto" and has_image_parts(first.get(keys.messages)):
        fmt = "image_messages"
    return fmt


def _keys(data: DataSection) -> RecordKeys:
    return RecordKeys(data.text_key, data.prompt_key, data.completion_key, data.messages_key)


def _rows(
    data: DataSection,
    path: str | None,
    split: str,
    tokenizer: Any,
    cache: Path,
    fmt: str | None,
) -> tuple[str, TokenRows]:
    where = _where(path, split)
    records = read_records(path, split, cache)
    records = records if isinstance(records, list) else list(records)
    if not records:
        raise ValueError(f"{where} holds no records")
    keys = _keys(data)
    fmt = fmt or _format_of(data, records[0], where)
    if fmt == "image_messages":
        packing = resolve_packing(data, fmt)
        if packing != "padded":
            raise ValueError(
                f"{where}: data.packing={packing} cannot hold records with images (their image tokens must "
                "stay whole with their pixels); use data.packing: padded"
            )
        root = image_root(path, cache)
        rows = encode_image_records(
            records, tokenizer, messages_key=keys.messages, root=root, seq_len=data.seq_len, where=where
        )
        return fmt, rows
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text formats use its tokenizer
    docs = encode_records(records, tokenizer, fmt=fmt, keys=keys, where=where)
    if not docs:
        raise ValueError(f"{where} holds no text")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = pack_documents(docs, data.seq_len, resolve_packing(data, fmt), int(pad or 0))
    _warn_losses(where, rows.report, data.seq_len)
    return fmt, rows


def _warn_losses(where: str, report: PackReport, seq_len: int) -> None:
    if report.truncated:
        warnings.warn(
            f"{where}: {report.truncated} of {report.documents} records are longer than data.seq_len + 1 = "
            f"{seq_len + 1} tokens and were truncated; raise data.seq_len to keep them whole",
            stacklevel=3,
        )
    if report.dropped:
        warnings.warn(
            f"{where}: {report.dropped} records (or pieces) have no token to learn from (for example an "
            "answer truncated away) and were left out",
            stacklevel=3,
        )


def prepare_data(data: DataSection, tokenizer: Any, output_dir: str | Path) -> PreparedData:
    """Read, tokenize and lay out the training (and evaluation) rows; save them for the workers.

    Writes ``<output_dir>/data/train.pt`` (and ``eval.pt``), each through a rename, so a worker never
    reads half a file. Deterministic: the same data and tokenizer give the same rows.

    Raises:
        FileNotFoundError: A data path does not exist.
        ValueError: The data cannot be read or does not fit the format, naming the file and record.
    """
    folder = data_folder(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    fmt, train = _rows(data, data.path, data.split, tokenizer, folder / "cache", None)
    evaluation = _prepare_eval(data, tokenizer, folder, fmt)
    train.save(folder / "train.pt")
    largest = max(int(train.input_ids.max()), int(train.labels.max()))
    return PreparedData(fmt, resolve_packing(data, fmt), train, evaluation, largest)


def _prepare_eval(data: DataSection, tokenizer: Any, folder: Path, fmt: str) -> TokenRows | None:
    """The evaluation rows, written to ``eval.pt`` (an old one removed when there are none)."""
    if data.eval_path is None and data.eval_split is None:
        (folder / "eval.pt").unlink(missing_ok=True)
        return None
    source = data.eval_path if data.eval_path is not None else data.path
    _, evaluation = _rows(data, source, data.eval_split or "train", tokenizer, folder / "cache", fmt)
    evaluation.save(folder / "eval.pt")
    return evaluation


def prepare_stream(
    data: DataSection, tokenizer: Any, output_dir: str | Path, global_batch_size: int
) -> PreparedData:
    """Check streamed training data by its first records; prepare the evaluation rows (``data.streaming``).

    Reads the first ``global_batch_size`` records (every row slot of a batch needs one,
    `automodel_all.cli.streaming`), resolves the format and packing from them and tokenizes them, so a
    source that cannot be read or does not fit the format stops the job here. A later record that does
    not fit stops the worker that reaches it, naming it.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: Unreadable data, too few records, records that do not fit the format, or images.
    """
    folder = data_folder(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    where = _where(data.path, data.split)
    dataset = stream_records(data.path, data.split, folder / "cache")
    try:
        records = [record for _, record in itertools.islice(read_slot(dataset, 0, 1, 0), global_batch_size)]
    except Exception as exc:  # datasets and Arrow raise their own types
        raise ValueError(f"{where}: datasets could not read it ({type(exc).__name__}: {exc})") from None
    if len(records) < global_batch_size:
        raise ValueError(
            f"{where} holds {len(records)} records, fewer than train.global_batch_size={global_batch_size}: "
            "with data.streaming every row of a batch streams its own records; lower the global batch "
            "or set data.streaming: false"
        )
    fmt = _format_of(data, records[0], where)
    if fmt == "image_messages":
        raise ValueError(
            f"{where}: data.streaming does not read records with images (their pixels are prepared with "
            "the rows); set data.streaming: false"
        )
    text = getattr(tokenizer, "tokenizer", tokenizer)
    docs = encode_records(records, text, fmt=fmt, keys=_keys(data), where=where)
    (folder / "train.pt").unlink(missing_ok=True)  # workers must never read rows of an earlier job
    evaluation = _prepare_eval(data, tokenizer, folder, fmt)
    largest = max((max(doc.ids) for doc in docs if doc.ids), default=0)
    return PreparedData(fmt, resolve_packing(data, fmt), None, evaluation, largest)


def load_data(
    output_dir: str | Path, *, streaming: bool = False
) -> tuple[TokenRows | None, TokenRows | None]:
    """The rows the launcher saved: training rows (None when streamed), and evaluation rows if any."""
    folder = data_folder(output_dir)
    train = None if streaming else TokenRows.load(folder / "train.pt")
    evaluation = TokenRows.load(folder / "eval.pt") if (folder / "eval.pt").is_file() else None
    return train, evaluation


class RowSampler:
    """Which rows a data-parallel rank trains on at each step (a pure function of seed and step).

    Args:
        num_rows: Rows in the packed data.
        global_batch_size: Rows per step over all data-parallel ranks.
        seed: Seed of the per-epoch permutations.
    """

    def __init__(self, num_rows: int, global_batch_size: int, seed: int) -> None:
        if num_rows < global_batch_size:
            raise ValueError(
                f"the data packs into {num_rows} rows, fewer than "
                f"train.global_batch_size={global_batch_size}; add data, or lower global_batch_size or "
                "data.seq_len"
            )
        self.num_rows = num_rows
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._steps_per_epoch = num_rows // global_batch_size
        self._cache: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._cache is None or self._cache[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._cache = (epoch, torch.randperm(self.num_rows, generator=generator, device="cpu"))
        return self._cache[1]

    def indices(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Row indices of ``dp_rank``'s share of step ``step``'s global batch (0-based step)."""
        epoch, position = divmod(step, self._steps_per_epoch)
        start = position * self.global_batch_size
        batch = self._permutation(epoch)[start : start + self.global_batch_size]
        share = self.global_batch_size // dp_size
        return batch[dp_rank * share : (dp_rank + 1) * share]

    def state(self, step: int) -> dict[str, int]:
        """The data position after ``step`` steps, as recorded in a checkpoint."""
        epoch, position = divmod(step, self._steps_per_epoch)
        return {
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "global_batch_size": self.global_batch_size,
        }
