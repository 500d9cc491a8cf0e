"""Each rank's rows of a step, from the prepared rows or from streams (``data.streaming``).

Both sources give the loop the same three things per step (`StepRows`): this rank's rows as model
inputs, and the label and document tokens of the whole global batch (the loss normaliser and the
throughput). Both describe themselves for checkpoints: `identity` (compared on resume) and `position`
(the data position a checkpoint records, from which a resumed run continues).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from automodel_all.cli.data import RowSampler, fingerprint
from automodel_all.cli.encode import RecordKeys
from automodel_all.cli.packing import IGNORE_INDEX, TokenRows
from automodel_all.cli.progress import warn
from automodel_all.cli.sections import DataSection
from automodel_all.cli.streaming import SlotCursor, StreamingRows, StreamSpec

__all__ = ["PreparedBatches", "StepRows", "StreamedBatches", "stream_spec", "streamed_identity"]


@dataclass(frozen=True)
class StepRows:
    """One step's data on one rank."""

    batch: dict[str, torch.Tensor]
    """This rank's rows as model inputs (`TokenRows.batch`)."""
    labels: int
    """Label tokens of the whole global batch."""
    tokens: int
    """Document tokens (not padding) of the whole global batch."""


class PreparedBatches:
    """Steps from the rows the launcher prepared (every rank holds them all; no collective).

    Args:
        rows: The training rows.
        global_batch_size: Rows per step.
        seed: Seed of the per-epoch order.
        dp_rank: This rank's data-parallel index.
        dp_size: The data-parallel size.
    """

    def __init__(
        self, rows: TokenRows, global_batch_size: int, seed: int, dp_rank: int, dp_size: int
    ) -> None:
        self.rows = rows
        self.sampler = RowSampler(len(rows), global_batch_size, seed)
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def step(self, step: int, device: torch.device) -> StepRows:
        """Step ``step``'s rows (0-based)."""
        every = self.sampler.indices(step, 0, 1)
        labels = int((self.rows.labels[every] != IGNORE_INDEX).sum())
        mine = self.sampler.indices(step, self.dp_rank, self.dp_size)
        return StepRows(self.rows.batch(mine, device), labels, int(self.rows.tokens[every].sum()))

    def position(self, step: int) -> dict[str, Any]:
        """The data position after ``step`` steps."""
        return {**self.sampler.state(step), "fingerprint": fingerprint(self.rows)}


def stream_spec(data: DataSection, tokenizer: Any, global_batch_size: int, cache_dir: Any) -> StreamSpec:
    """The `StreamSpec` of a job whose ``data.format`` and ``data.packing`` the launcher resolved."""
    assert data.format != "auto" and data.packing is not None, "resolved by the launcher"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    keys = RecordKeys(data.text_key, data.prompt_key, data.completion_key, data.messages_key)
    return StreamSpec(
        path=data.path,
        split=data.split,
        cache_dir=cache_dir,
        fmt=data.format,
        packing=data.packing,
        seq_len=data.seq_len,
        keys=keys,
        pad_id=int(pad or 0),
        slots=global_batch_size,
    )


def streamed_identity(spec: StreamSpec, seed: int) -> dict[str, Any]:
    """What a resume of a streamed run compares with the checkpoint's record."""
    return {"fingerprint": spec.fingerprint(), "global_batch_size": spec.slots, "seed": seed}


class StreamedBatches:
    """Steps from streams: this rank's slots (`automodel_all.cli.streaming`).

    Collective per step: one ``all_reduce`` of two integers over ``group`` (the global batch's counts);
    per checkpoint, one ``all_gather_object`` of the cursors over ``group``.

    Args:
        spec: The streams.
        tokenizer: The text tokenizer.
        seed: ``train.seed`` (recorded; the streams are in source order).
        dp_rank: This rank's data-parallel index.
        dp_size: The data-parallel size; divides ``spec.slots``.
        group: The data-parallel process group (None: the world, under DDP).
        first_step: The step the run starts at.
        recorded: The data position of the checkpoint resumed from (None: from the start).
    """

    def __init__(
        self,
        spec: StreamSpec,
        tokenizer: Any,
        *,
        seed: int,
        dp_rank: int,
        dp_size: int,
        group: dist.ProcessGroup | None,
        first_step: int,
        recorded: dict[str, Any] | None,
    ) -> None:
        share = spec.slots // dp_size
        self._next_step = first_step
        self.spec, self.seed, self.group, self.dp_size = spec, seed, group, dp_size
        cursors = self._cursors(recorded)
        self.rows = StreamingRows(spec, tokenizer, range(dp_rank * share, (dp_rank + 1) * share), cursors)

    def _cursors(self, recorded: dict[str, Any] | None) -> dict[int, SlotCursor] | None:
        if not recorded:
            return None
        slots = recorded.get("slots")
        if isinstance(slots, list) and len(slots) == self.spec.slots:
            return {j: SlotCursor(*cursor) for j, cursor in enumerate(slots)}
        if dist.get_rank() == 0:
            warn(
                f"the checkpoint records no stream positions for {self.spec.slots} row slots "
                f"(train.global_batch_size); the data streams start again from the beginning"
            )
        return None

    def step(self, step: int, device: torch.device) -> StepRows:
        """Step ``step``'s rows: the streams' next rows (steps come in order)."""
        assert step == self._next_step, (step, self._next_step)
        self._next_step += 1
        rows = self.rows.next_rows()
        counts = torch.tensor(
            [int((rows.labels != IGNORE_INDEX).sum()), int(rows.tokens.sum())],
            dtype=torch.int64,
            device=device,
        )
        dist.all_reduce(counts, group=self.group)
        return StepRows(
            rows.batch(torch.arange(len(rows), device="cpu"), device), int(counts[0]), int(counts[1])
        )

    def position(self, step: int) -> dict[str, Any]:
        """The data position after ``step`` steps: every slot's cursor (collective over ``group``)."""
        mine = {j: cursor.as_list() for j, cursor in self.rows.cursors().items()}
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, mine, group=self.group)
        every = {j: cursor for part in gathered for j, cursor in part.items()}
        slots = [every[j] for j in range(self.spec.slots)]
        return {"step": step, **streamed_identity(self.spec, self.seed), "streaming": True, "slots": slots}
