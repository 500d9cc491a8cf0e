"""Training data: sources read through HF datasets, record formats and their loss masks, row layouts.

The tokenizer is the embedded default's (trained here on the built-in corpus, with its chat template).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel_all.cli.chat_data import CHAT_TEMPLATE, builtin_chat
from automodel_all.cli.data import RowSampler, prepare_data
from automodel_all.cli.default_job import builtin_corpus, train_tokenizer
from automodel_all.cli.encode import Document, RecordKeys, encode_records, resolve_format
from automodel_all.cli.packing import IGNORE_INDEX, pack_documents
from automodel_all.cli.sections import DataSection
from automodel_all.cli.sources import read_records

RECORDS = [{"prompt": f"Question {i}?", "completion": f"Answer {i}.", "id": i} for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = train_tokenizer(builtin_corpus(), tmp_path_factory.mktemp("tokenizer"))
    return AutoTokenizer.from_pretrained(folder)


def _write_all_formats(folder: Path) -> dict[str, Path]:
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(RECORDS)
    paths = {
        "jsonl": folder / "data.jsonl",
        "json": folder / "data.json",
        "parquet": folder / "data.parquet",
        "csv": folder / "data.csv",
        "arrow": folder / "arrow" / "data.arrow",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    paths["json"].write_text(json.dumps(RECORDS))
    table.to_parquet(str(paths["parquet"]))
    table.to_csv(str(paths["csv"]), index=False)
    saved = folder / "saved"
    table.save_to_disk(str(saved))
    paths["arrow"] = next(saved.glob("*.arrow"))
    paths["save_to_disk"] = saved
    return paths


def test_every_file_kind_and_save_to_disk_give_the_same_records(tmp_path: Path) -> None:
    paths = _write_all_formats(tmp_path / "files")
    for kind, path in paths.items():
        records = [dict(r) for r in read_records(str(path), "train", tmp_path / "cache")]
        assert [(r["prompt"], r["completion"]) for r in records] == [
            (r["prompt"], r["completion"]) for r in RECORDS
        ], kind


def test_folders_infer_splits_and_text_files_are_one_record_each(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "chat"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in builtin_chat()[:5]))
    (folder / "validation.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in builtin_chat("validation")[:3])
    )
    assert len(list(read_records(str(folder), "train", tmp_path / "cache"))) == 5
    assert len(list(read_records(str(folder), "validation", tmp_path / "cache"))) == 3
    with pytest.raises(ValueError, match=r"has the splits \['train', 'validation'\], not 'test'"):
        read_records(str(folder), "test", tmp_path / "cache")
    texts = tmp_path / "texts"
    (texts / "b").mkdir(parents=True)
    (texts / "a.txt").write_text("first document\nstill the first")
    (texts / "b" / "c.md").write_text("second")
    assert sorted(r["text"] for r in read_records(str(texts), "train", tmp_path / "cache")) == [
        "first document\nstill the first",
        "second",
    ]
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:4]), "test": datasets.Dataset.from_list(RECORDS[4:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert [r["id"] for r in read_records(str(tmp_path / "dict"), "test", tmp_path / "cache")] == [4, 5]


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(str(tmp_path / "missing"), "train", tmp_path)
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"unsupported file type '\.bin'"):
        read_records(str(tmp_path / "x.bin"), "train", tmp_path)
    with pytest.raises(ValueError, match="not an embedded data source"):
        read_records("builtin:poems", "train", tmp_path)
    with pytest.raises(ValueError, match="splits"):
        read_records("builtin:chat", "dev", tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: datasets could not read it"):
        read_records(str(tmp_path / "bad.jsonl"), "train", tmp_path / "cache")


def test_the_format_is_found_from_the_fields() -> None:
    keys = RecordKeys()
    assert resolve_format("auto", ["messages", "id"], keys, "x") == "messages"
    assert resolve_format("auto", ["prompt", "completion"], keys, "x") == "prompt_completion"
    assert resolve_format("auto", ["text"], keys, "x") == "text"
    with pytest.raises(
        ValueError, match=r"the records have the fields \['body'\]; none of data.messages_key"
    ):
        resolve_format("auto", ["body"], keys, "x")
    with pytest.raises(ValueError, match=r"data.format=messages needs the field\(s\) \['messages'\]"):
        resolve_format("messages", ["text"], keys, "x")


def test_prompt_completion_trains_on_the_completion_and_eos_only(tokenizer: Any) -> None:
    [doc] = encode_records(RECORDS[:1], tokenizer, fmt="prompt_completion", keys=RecordKeys(), where="x")
    prompt = tokenizer("Question 0?")["input_ids"]
    answer = tokenizer("Answer 0.", add_special_tokens=False)["input_ids"]
    assert doc.ids == [*prompt, *answer, tokenizer.eos_token_id]
    assert doc.targets == [False] * len(prompt) + [True] * (len(answer) + 1)


def _assistant_text(tokenizer: Any, doc: Document) -> str:
    return str(tokenizer.decode([t for t, keep in zip(doc.ids, doc.targets, strict=True) if keep]))


def test_conversations_train_on_the_assistant_turns_only(tokenizer: Any) -> None:
    conversation = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "2 plus 3 is 5."},
            {"role": "user", "content": "Spell the word red."},
            {"role": "assistant", "content": "R-E-D"},
        ]
    }
    [marked] = encode_records([conversation], tokenizer, fmt="messages", keys=RecordKeys(), where="x")
    eos = tokenizer.eos_token
    assert _assistant_text(tokenizer, marked).replace(" ", "") == f"2plus3is5.{eos}R-E-D{eos}".replace(
        " ", ""
    )
    assert "User" not in _assistant_text(tokenizer, marked) and "System" not in _assistant_text(
        tokenizer, marked
    )
    # A template without {% generation %} markers: the turns are found by rendering prefixes. The same
    # tokens, plus what the template writes after each answer inside the turn (here a newline).
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        [found] = encode_records([conversation], tokenizer, fmt="messages", keys=RecordKeys(), where="x")
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert found.ids == marked.ids
    assert all(f or not m for f, m in zip(found.targets, marked.targets, strict=True))
    extra = [t for t, f, m in zip(found.ids, found.targets, marked.targets, strict=True) if f and not m]
    assert len(extra) == 2 and tokenizer.decode(extra) == "\n\n"


def test_bad_records_name_the_record(tokenizer: Any) -> None:
    keys = RecordKeys()
    with pytest.raises(ValueError, match=r"data\.jsonl record 1: the conversation has no assistant message"):
        encode_records(
            [builtin_chat()[0], {"messages": [{"role": "user", "content": "hi"}]}],
            tokenizer,
            fmt="messages",
            keys=keys,
            where="data.jsonl",
        )
    with pytest.raises(ValueError, match=r"record 0: message 0 needs string 'role' and 'content'"):
        encode_records([{"messages": [{"role": "user"}]}], tokenizer, fmt="messages", keys=keys, where="d")
    with pytest.raises(ValueError, match="record 1: field 'text' is not a string"):
        encode_records([{"text": "a"}, {"text": 3}], tokenizer, fmt="text", keys=keys, where="d")


def _docs(lengths: list[int], prompt: int = 0) -> list[Document]:
    start = 1
    docs = []
    for length in lengths:
        docs.append(
            Document(list(range(start, start + length)), [False] * prompt + [True] * (length - prompt))
        )
        start += length
    return docs


def test_concat_is_a_stream_of_rows_without_padding() -> None:
    rows = pack_documents(_docs([3, 6]), 3, "concat", pad_id=0)  # 9 tokens: 2 rows of seq_len + 1, 1 dropped
    assert rows.input_ids.tolist() == [[1, 2, 3], [5, 6, 7]]
    assert rows.labels.tolist() == [[2, 3, 4], [6, 7, 8]]  # across the document boundary (4 starts doc 2)
    assert rows.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    prompts = pack_documents(_docs([4, 4], prompt=2), 3, "concat", pad_id=0)
    assert prompts.labels.tolist() == [[IGNORE_INDEX, 3, 4], [IGNORE_INDEX, 7, 8]]
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_documents(_docs([2]), 8, "concat", pad_id=0)


def test_packed_rows_keep_each_document_whole_with_its_own_positions() -> None:
    docs = _docs([5, 3, 6, 2, 4], prompt=1)
    rows = pack_documents(docs, 8, "packed", pad_id=0)
    seen = []
    for row in range(len(rows)):
        positions = rows.position_ids[row].tolist()
        starts = [i for i, p in enumerate(positions[: int(rows.tokens[row])]) if p == 0]
        for begin, end in zip(starts, [*starts[1:], int(rows.tokens[row])], strict=True):
            assert positions[begin:end] == list(range(end - begin))
            seen.append(rows.input_ids[row, begin:end].tolist())
        pad = int(rows.tokens[row])
        assert (rows.labels[row, pad:] == IGNORE_INDEX).all()
        assert positions[pad:] == list(range(positions[pad - 1] + 1, positions[pad - 1] + 1 + 8 - pad))
    assert sorted(seen) == sorted(d.ids[:-1] for d in docs)  # every document once, inputs ids[:-1]
    assert len(rows) == 2 and rows.report.fill == pytest.approx(15 / 16)  # 15 slots, best fit
    # Labels: the next token where it is a target (the first token after the prompt is not predicted
    # from an empty prefix, so the one-token prompt masks nothing but the first slot's own position).
    first = next(d for d in docs if d.ids[0] == int(rows.input_ids[0, 0]))
    assert rows.labels[0, : len(first.ids) - 1].tolist() == first.ids[1:]


def test_padded_rows_hold_one_document_and_long_ones_are_split_or_truncated() -> None:
    rows = pack_documents(_docs([5, 3]), 6, "padded", pad_id=0)
    assert rows.tokens.tolist() == [4, 2] and rows.position_ids.tolist() == [list(range(6))] * 2
    text = pack_documents(_docs([20]), 6, "packed", pad_id=0)  # plain text: cut into row-sized pieces
    assert text.report.split == 1 and int(text.tokens.sum()) == 19  # every label exactly once
    chat = pack_documents(_docs([20], prompt=2), 6, "packed", pad_id=0)  # an answer: truncated
    assert chat.report.truncated == 1 and len(chat) == 1 and int(chat.tokens.sum()) == 6
    with pytest.raises(ValueError, match="none of the 1 records has a token to learn from"):
        pack_documents(_docs([20], prompt=10), 6, "packed", pad_id=0)  # truncated to its prompt


def test_prepare_data_writes_train_and_eval_rows(tmp_path: Path, tokenizer: Any) -> None:
    data = DataSection(path="builtin:chat", eval_split="validation", seq_len=64)
    prepared = prepare_data(data, tokenizer, tmp_path)
    assert (prepared.format, prepared.packing) == ("messages", "packed")
    assert prepared.eval is not None and len(prepared.eval) < len(prepared.train)
    assert (tmp_path / "data" / "train.pt").is_file() and (tmp_path / "data" / "eval.pt").is_file()
    labels = prepared.train.labels
    assert 0.2 < float((labels != IGNORE_INDEX).float().mean()) < 0.8  # prompts are masked out
    again = prepare_data(data, tokenizer, tmp_path)
    assert torch.equal(again.train.input_ids, prepared.train.input_ids)  # deterministic
    # One record per row when asked (packed rows are exact under context parallelism too).
    padded = prepare_data(dataclasses.replace(data, packing="padded"), tokenizer, tmp_path / "padded")
    assert padded.packing == "padded" and len(padded.train) > len(prepared.train)
    assert bool((padded.train.position_ids == torch.arange(64)).all())  # no position restarts in a row


def test_data_parallel_ranks_split_exactly_the_global_batch_of_one_process() -> None:
    sampler = RowSampler(num_rows=50, global_batch_size=8, seed=3)
    for step in (0, 5, 6, 13):  # 6 steps per epoch: steps 6 and 13 are in later epochs
        whole = sampler.indices(step, 0, 1)
        shares = [sampler.indices(step, rank, 4) for rank in range(4)]
        assert torch.equal(torch.cat(shares), whole)
    first_epoch = torch.cat([sampler.indices(s, 0, 1) for s in range(6)])
    assert len(set(first_epoch.tolist())) == 48  # no row twice within an epoch
    assert not torch.equal(sampler.indices(0, 0, 1), sampler.indices(6, 0, 1))  # reshuffled
    assert sampler.state(13) == {
        "step": 13, "epoch": 2, "batch_in_epoch": 1, "seed": 3, "num_rows": 50, "global_batch_size": 8
    }  # fmt: skip


def test_the_builtin_corpora_ship_with_the_package() -> None:
    docs = builtin_corpus()
    assert len(docs) > 50
    assert sum(map(len, docs)) > 200_000
    chat = builtin_chat()
    assert len(chat) == 2000 and all(m["messages"][-1]["role"] == "assistant" for m in chat)
    assert builtin_chat() == chat  # generated from a fixed seed
