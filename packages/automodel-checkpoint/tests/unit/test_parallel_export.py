"""The parallel export's plan (files per writer, gather order) and its writer thread, on one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from automodel_checkpoint import save_hf_checkpoint
from automodel_checkpoint.convert import DiskPiece, DiskTensor
from automodel_checkpoint.integrity import file_checksums
from automodel_checkpoint.owner_gather import _chunk, rounds
from automodel_checkpoint.parallel_export import FileWriter, assign_files, gather_order
from automodel_checkpoint.safetensors_io import SafetensorsStreamWriter
from automodel_testing import build_tiny_model, safetensors_differences


def test_files_are_shared_out_by_bytes() -> None:
    sizes = [("a", 10), ("b", 70), ("c", 30), ("d", 30), ("e", 20)]
    owner = assign_files(sizes, 2)
    load = [sum(n for name, n in sizes if owner[name] == rank) for rank in (0, 1)]
    assert owner["b"] == 0 and load == [80, 80]  # largest first onto the least loaded
    assert assign_files(sizes, 1) == dict.fromkeys("abcde", 0)
    assert assign_files(list(reversed(sizes)), 2) == owner  # the same on every rank, whatever the order
    assert set(assign_files(sizes, 8).values()) == {0, 1, 2, 3, 4}  # more writers than files: some idle


def _whole(key: str, model_key: str | None = None) -> DiskTensor:
    return DiskTensor(key, (2,), (DiskPiece(model_key or key, None, (0,), (2,)),))


def _expert(key: str, fused: str, e: int) -> DiskTensor:
    return DiskTensor(key, (2,), (DiskPiece(fused, e, (0,), (2,)),))


def test_gather_order_takes_turns_and_gathers_a_fused_tensor_once() -> None:
    disk = {k: _whole(k) for k in ("a", "b", "c", "d")}
    disk.update({f"x.{e}": _expert(f"x.{e}", "x", e) for e in range(3)})
    files = [("f1", ["a", "b"]), ("f2", ["x.0", "x.1", "x.2", "c"]), ("f3", ["d"])]
    owner = {"f1": 0, "f2": 1, "f3": 0}
    order = gather_order(files, disk, owner)
    assert [(u.file, u.keys) for u in order] == [
        ("f1", ("a",)),
        ("f2", ("x.0", "x.1", "x.2")),  # the experts of one fused tensor: one gather
        ("f1", ("b",)),
        ("f2", ("c",)),
        ("f3", ("d",)),
    ]
    assert order[1].model_keys == ("x",)


def test_the_writer_reports_its_first_error_and_keeps_consuming(tmp_path: Path) -> None:
    layouts = {"f.safetensors": [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]}
    writer = FileWriter(tmp_path, layouts)
    writer.put("f.safetensors", "b", torch.ones(2))  # out of the declared order
    for _ in range(5):  # more than the queue holds: never blocks after an error
        writer.put("f.safetensors", "a", torch.ones(2))
    error = writer.finish()
    assert isinstance(error, ValueError) and "expected tensor 'a' next" in str(error)


def test_a_file_that_declares_nothing_is_still_written(tmp_path: Path) -> None:
    assert FileWriter(tmp_path, {"model.safetensors": []}).finish() is None
    with SafetensorsStreamWriter(tmp_path / "ref.safetensors", []):
        pass
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_one_process_export_equals_save_pretrained(tmp_path: Path) -> None:
    model = build_tiny_model("llama", seed=5)
    model.save_pretrained(tmp_path / "hf")
    save_hf_checkpoint(model, tmp_path / "ours", max_shard_size="30KB")
    assert safetensors_differences(tmp_path / "ours", tmp_path / "hf") == []
    with pytest.raises(ValueError, match="writers=2: give between 1 and the 1 rank"):
        save_hf_checkpoint(model, tmp_path / "two", writers=2)


@pytest.mark.parametrize("model_type", ["sarvam_moe", "lara_mini"])
def test_tensors_transformers_computes_on_saving_are_exported(tmp_path: Path, model_type: str) -> None:
    """Converters that are not slices (Sarvam-MoE's attention projections, Lara-Mini's linear-attention
    projections): their on-disk tensors are computed from the full model tensors, as on saving."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from automodel_checkpoint.convert import disk_layout
    from automodel_testing.tiny import derive_tiny_config

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(derive_tiny_config(model_type))
    layout = disk_layout(model, {k: tuple(t.shape) for k, t in model.state_dict().items()})
    assert layout is not None and any(entry.computed for entry in layout)
    model.save_pretrained(tmp_path / "hf")
    save_hf_checkpoint(model, tmp_path / "ours", max_shard_size="100KB")
    assert safetensors_differences(tmp_path / "ours", tmp_path / "hf") == []


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8, 13])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_blocks_are_the_pieces_torch_chunk_makes(size: int, parts: int) -> None:
    pieces = torch.arange(size).chunk(parts)
    for index in range(parts):
        start, length = _chunk(10, size, parts, index)
        expected = pieces[index].tolist() if index < len(pieces) else []
        assert list(range(start - 10, start - 10 + length)) == expected


def test_rounds_hold_units_of_distinct_writers() -> None:
    assert rounds([0, 1, 2, 3, 0, 1, 0, 0]) == [range(0, 4), range(4, 6), range(6, 7), range(7, 8)]
    assert rounds([]) == []


def test_checksums_computed_while_writing_are_the_files_and_are_not_read_back(tmp_path: Path) -> None:
    layout = [("a", torch.float32, (3,)), ("b", torch.bfloat16, (2, 2))]
    writer = FileWriter(tmp_path, {"one.safetensors": layout})
    writer.put("one.safetensors", "a", torch.ones(3))
    writer.put("one.safetensors", "b", torch.zeros(2, 2, dtype=torch.bfloat16))
    assert writer.finish() is None
    (tmp_path / "config.json").write_text("{}")
    read_back = file_checksums(tmp_path)
    assert writer.checksums == {"one.safetensors": read_back["one.safetensors"]}
    # A known checksum is taken as it is (not read again) when the size matches; else the file is hashed.
    fake = {"size": read_back["one.safetensors"]["size"], "sha256": "0" * 64}
    assert file_checksums(tmp_path, known={"one.safetensors": fake})["one.safetensors"] == fake
    stale = {"size": 1, "sha256": "0" * 64}
    assert file_checksums(tmp_path, known={"one.safetensors": stale}) == read_back
