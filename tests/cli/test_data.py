"""Training data: documents from files, packing into rows, and each data-parallel rank's share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from automodel_all.cli.data import RowSampler, pack_rows, read_documents
from automodel_all.cli.default_job import builtin_corpus


def test_a_folder_of_text_and_jsonl_files_is_read_in_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b" / "c.jsonl").write_text(
        json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third", "id": 3}) + "\n"
    )
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    assert read_documents(tmp_path) == ["first document", "second", "third"]


def test_a_bad_jsonl_record_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:2: the record has no string field 'text'"):
        read_documents(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_documents(tmp_path / "missing")


def test_rows_are_packed_without_padding() -> None:
    class Chars:  # a stand-in tokenizer: one id per character, EOS = 0
        eos_token_id = 0

        def __call__(self, docs: list[str], add_special_tokens: bool) -> dict[str, list[list[int]]]:
            return {"input_ids": [[ord(c) for c in doc] for doc in docs]}

    rows = pack_rows(["abcd", "efg"], Chars(), seq_len=3)
    assert rows.tolist() == [[97, 98, 99, 100], [0, 101, 102, 103]]  # the trailing EOS is dropped
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_rows(["ab"], Chars(), seq_len=8)


def test_data_parallel_ranks_split_exactly_the_global_batch_of_one_process() -> None:
    sampler = RowSampler(num_rows=50, global_batch_size=8, seed=3)
    for step in (0, 5, 6, 13):  # 6 steps per epoch: steps 6 and 13 are in later epochs
        whole = sampler.indices(step, 0, 1)
        shares = [sampler.indices(step, rank, 4) for rank in range(4)]
        assert torch.equal(torch.cat(shares), whole)
    first_epoch = torch.cat([sampler.indices(s, 0, 1) for s in range(6)])
    assert len(set(first_epoch.tolist())) == 48  # no row twice within an epoch
    assert not torch.equal(sampler.indices(0, 0, 1), sampler.indices(6, 0, 1))  # reshuffled


def test_the_builtin_corpus_ships_with_python() -> None:
    docs = builtin_corpus()
    assert len(docs) > 50
    assert sum(map(len, docs)) > 200_000
