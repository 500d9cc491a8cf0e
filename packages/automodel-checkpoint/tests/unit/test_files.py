"""Finding a checkpoint's files: folder formats, index parsing, hub ids in the local cache, cross-checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from automodel_checkpoint import CorruptCheckpointError, resolve_checkpoint
from automodel_checkpoint.files import parse_index
from automodel_checkpoint.reader import open_checkpoint


def _sharded(root: Path, parts: dict[str, dict[str, torch.Tensor]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for name, tensors in parts.items():
        save_file(tensors, root / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_format_preference(tmp_path: Path) -> None:
    save_file({"x": torch.ones(1)}, tmp_path / "model.safetensors")
    torch.save({"x": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    files = resolve_checkpoint(tmp_path)
    assert files.format == "safetensors" and files.files == (tmp_path / "model.safetensors",)
    (tmp_path / "model.safetensors").unlink()
    files = resolve_checkpoint(tmp_path)
    assert files.format == "bin" and files.files == (tmp_path / "pytorch_model.bin",)
    single = resolve_checkpoint(tmp_path / "pytorch_model.bin")  # a file path is accepted
    assert single.files == (tmp_path / "pytorch_model.bin",)


def test_sharded_index(tmp_path: Path) -> None:
    root = _sharded(
        tmp_path / "ck", {"a.safetensors": {"x": torch.ones(2)}, "b.safetensors": {"y": torch.ones(3)}}
    )
    files = resolve_checkpoint(root)
    assert files.index == root / "model.safetensors.index.json"
    assert files.weight_map == {"x": root / "a.safetensors", "y": root / "b.safetensors"}
    reader = open_checkpoint(files)
    assert {k: v.shape for k, v in reader.tensors.items()} == {"x": (2,), "y": (3,)}
    reader.close()


def test_missing_shard_is_listed(tmp_path: Path) -> None:
    root = _sharded(
        tmp_path / "ck", {"a.safetensors": {"x": torch.ones(2)}, "b.safetensors": {"y": torch.ones(3)}}
    )
    (root / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"\['b.safetensors'\]"):
        resolve_checkpoint(root)


def test_index_that_disagrees_with_files(tmp_path: Path) -> None:
    root = _sharded(
        tmp_path / "ck", {"a.safetensors": {"x": torch.ones(2)}, "b.safetensors": {"y": torch.ones(3)}}
    )
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["y"] = "a.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"y \(index: a.safetensors\)"):
        open_checkpoint(resolve_checkpoint(root))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"weight_map": [1]}), json.dumps([1])])
def test_unreadable_index(tmp_path: Path, content: str) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors\.index\.json"):
        parse_index(index)


def test_nothing_found_lists_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="looked for") as info:
        resolve_checkpoint(tmp_path)
    assert "model-00001-of-00002.safetensors" in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint("./relative/missing")


def test_hub_id_from_local_cache_only(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    save_file({"x": torch.ones(1)}, snapshot / "model.safetensors")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    files = resolve_checkpoint("org/tiny", cache_dir=cache)
    assert files.files == (snapshot / "model.safetensors",)
    with pytest.raises(FileNotFoundError, match="Hugging Face cache") as info:
        resolve_checkpoint("org/not-downloaded", cache_dir=cache)
    assert str(cache) in str(info.value) and "never downloads" in str(info.value)


def test_bin_checkpoint_and_corrupt_bin(tmp_path: Path) -> None:
    torch.save({"x": torch.arange(6.0).reshape(2, 3)}, tmp_path / "pytorch_model.bin")
    reader = open_checkpoint(resolve_checkpoint(tmp_path))
    assert reader.tensors["x"].shape == (2, 3) and reader.tensors["x"].entry is None
    reader.close()
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError, match=r"pytorch_model\.bin"):
        open_checkpoint(resolve_checkpoint(tmp_path))
