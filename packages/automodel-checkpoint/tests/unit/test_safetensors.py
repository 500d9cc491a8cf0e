"""Safetensors headers, byte-range reads and the streaming writer, against the safetensors library."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from automodel_checkpoint.safetensors_io import (
    CorruptCheckpointError,
    SafetensorsStreamWriter,
    read_box,
    read_safetensors_header,
)
from automodel_checkpoint.slices import Box


@pytest.fixture
def sample(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "matrix": torch.randn(7, 5, generator=g),
        "cube": torch.randn(3, 4, 6, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
    }
    path = tmp_path / "sample.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def _read(path: Path, name: str, start: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor) -> int:
    header = read_safetensors_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_box(fd, path, header.entries[name], Box(start, (0,) * len(start), shape), out)
    finally:
        os.close(fd)


def test_header_matches_safetensors(sample: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = sample
    header = read_safetensors_header(path)
    assert set(header.entries) == set(tensors)
    assert header.metadata == {"format": "pt"}
    for name, t in tensors.items():
        entry = header.entries[name]
        assert entry.dtype == t.dtype and entry.shape == tuple(t.shape)
        assert entry.end - entry.begin == t.numel() * t.element_size()


@pytest.mark.parametrize(
    ("name", "start", "shape"),
    [
        ("matrix", (0, 0), (7, 5)),  # whole tensor: one run
        ("matrix", (2, 0), (3, 5)),  # rows (FSDP / colwise TP): one run
        ("matrix", (1, 2), (4, 2)),  # columns (rowwise TP): one run per row
        ("cube", (1, 1, 0), (2, 2, 6)),
        ("cube", (0, 1, 3), (3, 3, 3)),
        ("ids", (4,), (3,)),
        ("scalar", (), ()),
        ("mask", (1,), (2,)),
    ],
)
def test_read_box_direct_and_staged(
    sample: tuple[Path, dict[str, torch.Tensor]], name: str, start: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    path, tensors = sample
    expected = tensors[name][tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))]
    direct = torch.empty(shape, dtype=expected.dtype)
    nbytes = _read(path, name, start, shape, direct)
    assert torch.equal(direct, expected)
    assert nbytes == expected.numel() * expected.element_size()  # exactly the slice's bytes
    # A non-contiguous destination of another dtype goes through the staging buffer.
    if expected.dtype.is_floating_point and expected.dim() == 2:
        wide = torch.zeros((shape[1], shape[0]), dtype=torch.float64).t()
        _read(path, name, start, shape, wide)
        assert torch.equal(wide, expected.to(torch.float64))


def test_read_box_rejects_wrong_destination(sample: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = sample
    with pytest.raises(ValueError, match="does not match the box"):
        _read(path, "matrix", (0, 0), (2, 5), torch.empty(3, 5))


def _write_raw(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "message"),
    [
        (b"", b"", 0, "not valid UTF-8 JSON"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"1234", None, "truncated"),
        ({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"12345678", None, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"12345678", None, "needs 12"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"", None, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"", None, "invalid data_offsets"),
        ({"a": [1, 2]}, b"", None, "not an object"),
        ([1, 2], b"", None, "JSON list"),
        ({"__metadata__": [1]}, b"", None, "__metadata__"),
        ({}, b"", 10**12, "claims"),
    ],
)
def test_corrupt_headers_name_the_file(
    tmp_path: Path, header: object, data: bytes, length: int | None, message: str
) -> None:
    path = _write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        read_safetensors_header(path)
    assert str(path) in str(info.value) and info.value.path == path


def test_short_and_missing_files(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(CorruptCheckpointError, match="fewer than the 8-byte"):
        read_safetensors_header(short)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_safetensors_header(tmp_path / "nope.safetensors")


def test_truncated_real_file(sample: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = sample
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_safetensors_header(path)


def test_stream_writer_output_reads_back_with_safetensors(tmp_path: Path) -> None:
    tensors = {
        "b": torch.randn(3, 4).to(torch.bfloat16),
        "a": torch.arange(5, dtype=torch.int32),
        "s": torch.tensor(1.5),
        "e": torch.zeros(0),
    }
    path = tmp_path / "out.safetensors"
    layout = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with SafetensorsStreamWriter(path, layout) as writer:
        for k, t in tensors.items():
            writer.write(k, t)
    assert (path.stat().st_size - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]) >= 0
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0  # data is 8-byte aligned
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t)
    assert set(read_safetensors_header(path).entries) == set(tensors)


def test_stream_writer_casts_and_checks_order(tmp_path: Path) -> None:
    path = tmp_path / "cast.safetensors"
    writer = SafetensorsStreamWriter(path, [("x", torch.bfloat16, (2,)), ("y", torch.float32, (1,))])
    with pytest.raises(ValueError, match="expected tensor 'x' next"):
        writer.write("y", torch.ones(1))
    with pytest.raises(ValueError, match="declared"):
        writer.write("x", torch.ones(3))
    writer.write("x", torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="never written"):
        writer.close()
