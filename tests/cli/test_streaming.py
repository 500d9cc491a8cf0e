"""Streamed training data (``data.streaming``): rows packed on the fly per row slot, exact positions.

In one process, against the prepared path: a single slot streams the rows `pack_documents` lays out
(``concat``, ``padded``); slot ``j`` of ``G`` reads exactly the records ``j mod G``; ``packed`` rows keep
every record whole and in order; cursors taken after any row restart every slot at its next row, also
when the slots are regrouped over another number of ranks and across the end of the source (a new
pass); bad sources and records fail with errors naming the option, the file or the record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel_all.cli.batches import stream_spec
from automodel_all.cli.data import prepare_stream
from automodel_all.cli.default_job import builtin_corpus, train_tokenizer
from automodel_all.cli.encode import RecordKeys, encode_records
from automodel_all.cli.packing import IGNORE_INDEX, TokenRows, pack_documents
from automodel_all.cli.sections import DataSection
from automodel_all.cli.streaming import SlotCursor, StreamingRows, StreamSpec

KEYS = RecordKeys("text", "prompt", "completion", "messages")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = train_tokenizer(builtin_corpus(), tmp_path_factory.mktemp("tokenizer"))
    return AutoTokenizer.from_pretrained(folder)


def _texts(count: int) -> list[dict[str, Any]]:
    """Records of varied length (some blank: they give no document)."""
    return [
        {"text": "" if i % 7 == 3 else " ".join(f"word{i} item{k}" for k in range(i % 11 + 1))}
        for i in range(count)
    ]


def _pairs(count: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"Question {i}? " * (i % 5 + 1), "completion": f"Answer {i}. " * (i % 9 + 1)}
        for i in range(count)
    ]


def _write(folder: Path, records: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _spec(path: Path, tokenizer: Any, *, fmt: str, packing: str, slots: int, seq_len: int = 24) -> StreamSpec:
    data = DataSection(path=str(path), format=fmt, packing=packing, seq_len=seq_len)  # type: ignore[arg-type]
    return stream_spec(data, tokenizer, slots, path.parent / "cache")


def _take(rows: StreamingRows, steps: int) -> list[TokenRows]:
    return [rows.next_rows() for _ in range(steps)]


def _row(rows: TokenRows, index: int) -> tuple[list[int], list[int], list[int]]:
    return (rows.input_ids[index].tolist(), rows.labels[index].tolist(), rows.position_ids[index].tolist())


@pytest.mark.parametrize("packing", ["concat", "padded"])
def test_one_slot_streams_the_rows_the_prepared_path_lays_out(
    tmp_path: Path, tokenizer: Any, packing: str
) -> None:
    records = _texts(60)
    path = _write(tmp_path, records)
    docs = encode_records(records, tokenizer, fmt="text", keys=KEYS, where="test")
    prepared = pack_documents(docs, 24, packing, int(tokenizer.pad_token_id or tokenizer.eos_token_id))
    streamed = _take(
        StreamingRows(_spec(path, tokenizer, fmt="text", packing=packing, slots=1), tokenizer, range(1)),
        len(prepared),
    )
    for index, row in enumerate(streamed):
        assert _row(row, 0) == _row(prepared, index), index
        assert int(row.tokens[0]) == int(prepared.tokens[index])


def test_slot_j_of_g_reads_the_records_j_mod_g(tmp_path: Path, tokenizer: Any) -> None:
    records = _pairs(48)
    every = _take(
        StreamingRows(
            _spec(
                _write(tmp_path / "all", records),
                tokenizer,
                fmt="prompt_completion",
                packing="packed",
                slots=4,
            ),
            tokenizer,
            range(4),
        ),
        5,
    )
    for slot in range(4):
        alone = _write(tmp_path / f"slot{slot}", records[slot::4])
        single = _take(
            StreamingRows(
                _spec(alone, tokenizer, fmt="prompt_completion", packing="packed", slots=1),
                tokenizer,
                range(1),
            ),
            5,
        )
        for step in range(5):
            assert _row(every[step], slot) == _row(single[step], 0), (slot, step)


def test_packed_rows_hold_whole_records_in_order(tmp_path: Path, tokenizer: Any) -> None:
    records = _pairs(30)
    path = _write(tmp_path, records)
    docs = encode_records(records, tokenizer, fmt="prompt_completion", keys=KEYS, where="test")
    assert max(len(doc.ids) for doc in docs) <= 97  # none truncated
    rows = StreamingRows(
        _spec(path, tokenizer, fmt="prompt_completion", packing="packed", slots=1, seq_len=96),
        tokenizer,
        range(1),
    )
    seen: list[list[int]] = []
    while len(seen) < len(docs):
        row = rows.next_rows()
        ids, positions = row.input_ids[0].tolist(), row.position_ids[0].tolist()
        starts = [i for i in range(int(row.tokens[0])) if positions[i] == 0]
        for begin, end in zip(starts, [*starts[1:], int(row.tokens[0])], strict=True):
            seen.append(ids[begin:end])
        assert int(row.tokens[0]) <= 96
    assert seen[: len(docs)] == [doc.ids[:-1] for doc in docs]  # whole, in source order (next-fit)


@pytest.mark.parametrize("packing", ["concat", "packed"])
def test_cursors_restart_every_slot_exactly_on_another_grouping_and_across_passes(
    tmp_path: Path, tokenizer: Any, packing: str
) -> None:
    path = _write(tmp_path, _texts(40))  # 10 records per slot: several passes in 30 steps
    spec = _spec(path, tokenizer, fmt="text", packing=packing, slots=4, seq_len=16)
    whole = StreamingRows(spec, tokenizer, range(4))
    reference = _take(whole, 30)
    assert min(c.passes for c in whole.cursors().values()) >= 1  # every slot wrapped around the source
    for stop in (1, 7, 19):
        first = StreamingRows(spec, tokenizer, range(4))
        _take(first, stop)
        cursors = first.cursors()
        # Resumed as two ranks of two slots each.
        halves = [StreamingRows(spec, tokenizer, range(r * 2, r * 2 + 2), cursors) for r in (0, 1)]
        for step in range(stop, 30):
            parts = [half.next_rows() for half in halves]
            resumed = torch.cat([p.input_ids for p in parts]), torch.cat([p.labels for p in parts])
            assert torch.equal(resumed[0], reference[step].input_ids), (stop, step)
            assert torch.equal(resumed[1], reference[step].labels), (stop, step)


def test_stream_errors_name_the_slot_the_record_and_the_option(tmp_path: Path, tokenizer: Any) -> None:
    # A slot whose records have nothing to learn from (every 2nd record blank, 2 slots).
    path = _write(tmp_path / "blank", [{"text": "some words here" if i % 2 == 0 else " "} for i in range(8)])
    with pytest.raises(ValueError, match=r"row slot 1 .*train.global_batch_size=2.* no token to learn"):
        StreamingRows(_spec(path, tokenizer, fmt="text", packing="concat", slots=2), tokenizer, range(2))
    # A record that does not fit the format, met in the stream: named by its index in the source.
    bad = _write(tmp_path / "bad", [{"text": "fine"}] * 5 + [{"text": 3}] + [{"text": "fine"}] * 4)
    rows = StreamingRows(
        _spec(bad, tokenizer, fmt="text", packing="concat", slots=2, seq_len=4), tokenizer, range(1, 2)
    )
    with pytest.raises(ValueError, match=r"record 5: field 'text' is not a string \(data.text_key\)"):
        _take(rows, 20)


def test_prepare_stream_checks_the_first_records(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "few", _pairs(3))
    data = DataSection(path=str(path), streaming=True)
    with pytest.raises(ValueError, match=r"holds 3 records, fewer than train.global_batch_size=4"):
        prepare_stream(data, tokenizer, tmp_path / "out", 4)
    prepared = prepare_stream(data, tokenizer, tmp_path / "out", 2)
    assert (prepared.format, prepared.packing, prepared.train) == ("prompt_completion", "packed", None)
    assert 0 < prepared.largest_id < len(tokenizer)
    broken = tmp_path / "broken" / "train.jsonl"
    broken.parent.mkdir()
    broken.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"datasets could not read it"):
        prepare_stream(DataSection(path=str(broken), streaming=True), tokenizer, tmp_path / "out", 2)
    pictures = _write(
        tmp_path / "images",
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "url": "a.png"}, {"type": "text", "text": "What?"}],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
                ]
            }
        ]
        * 2,
    )
    with pytest.raises(ValueError, match=r"data.streaming does not read records with images"):
        prepare_stream(DataSection(path=str(pictures), streaming=True), tokenizer, tmp_path / "out", 2)


def test_a_cursor_is_the_record_and_offset_of_the_next_row(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path, _texts(12))
    rows = StreamingRows(
        _spec(path, tokenizer, fmt="text", packing="concat", slots=3, seq_len=8), tokenizer, range(3)
    )
    assert rows.cursors()[1] == SlotCursor(0, 1, 0)
    rows.next_rows()
    cursor = rows.cursors()[1]
    assert cursor.record % 3 == 1 and (cursor.record, cursor.offset) != (1, 0)
    assert all(label == IGNORE_INDEX or label >= 0 for label in rows.next_rows().labels.flatten().tolist())
