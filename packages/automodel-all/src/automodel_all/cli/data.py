"""Training data: read text, tokenize, pack into fixed-length rows, and give each rank its rows.

Documents are tokenized, joined with the EOS token between them, and cut into rows of ``seq_len + 1``
tokens (inputs are ``row[:-1]``, labels ``row[1:]``, so every position has a label and no padding is
needed). The order of rows is a seeded permutation per epoch; the global batch of step ``s`` is the
next ``global_batch_size`` rows of that stream, and data-parallel rank ``r`` takes the ``r``-th equal
slice of it. Everything is a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["RowSampler", "pack_rows", "read_documents"]

_SUFFIXES = (".txt", ".jsonl", ".md")


def _read_file(path: Path, text_key: str) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON record ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise ValueError(
                    f"{path}:{number}: the record has no string field {text_key!r} (data.text_key)"
                )
            docs.append(record[text_key])
        return docs
    return [path.read_text(encoding="utf-8")]


def read_documents(path: str | Path, text_key: str = "text") -> list[str]:
    """The documents under ``path``.

    A ``.txt``/``.md`` file is one document, a ``.jsonl`` file one per record; a folder is read
    recursively, its files sorted by path.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: A folder without such files, a bad JSONL record, or no text at all.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data.path {root} does not exist")
    files = (
        sorted(p for p in root.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        if root.is_dir()
        else [root]
    )
    if not files:
        raise ValueError(f"data.path {root} holds no {', '.join(_SUFFIXES)} files")
    docs = [doc for file in files for doc in _read_file(file, text_key) if doc.strip()]
    if not docs:
        raise ValueError(f"data.path {root} holds no text")
    return docs


def pack_rows(documents: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """Tokenize, join with EOS, and cut into ``[num_rows, seq_len + 1]`` int64 rows (the tail is dropped).

    Raises:
        ValueError: Fewer tokens than one row.
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoded in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        if eos is not None:
            ids.append(eos)
    width = seq_len + 1
    rows = len(ids) // width
    if rows == 0:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than one row of seq_len + 1 = {width}")
    return torch.tensor(ids[: rows * width], dtype=torch.int64).view(rows, width)


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
            self._cache = (epoch, torch.randperm(self.num_rows, generator=generator))
        return self._cache[1]

    def indices(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Row indices of ``dp_rank``'s share of step ``step``'s global batch (0-based step)."""
        epoch, position = divmod(step, self._steps_per_epoch)
        start = position * self.global_batch_size
        batch = self._permutation(epoch)[start : start + self.global_batch_size]
        share = self.global_batch_size // dp_size
        return batch[dp_rank * share : (dp_rank + 1) * share]
