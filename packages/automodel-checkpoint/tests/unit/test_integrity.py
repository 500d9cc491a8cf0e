"""Checkpoint integrity: checksums in the marker, verification at load, NaN refusal, a write that fails.

Single process (DCP without a process group). The failing write is real: a child process saves with
``RLIMIT_FSIZE`` below the size of a shard file (and SIGXFSZ ignored), so the kernel refuses the write
with ``EFBIG``; the multi-rank, full-disk version (a small tmpfs) is in ``tests/faults``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from automodel_checkpoint import (
    COMPLETE_MARKER,
    AsyncCheckpointer,
    CorruptCheckpointError,
    complete_checkpoints,
    load_distributed_checkpoint,
    read_marker,
    save_distributed_checkpoint,
    verify_checkpoint,
)
from automodel_testing import build_tiny_model


def _saved(tmp_path: Path, name: str = "step_1", step: int = 1) -> tuple[torch.nn.Module, Path]:
    model = build_tiny_model("llama", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_distributed_checkpoint(
        model, opt, tmp_path / name, step=step, rank_state={"rng": torch.get_rng_state(), "n": 3}
    )
    return model, path


def test_the_marker_records_every_file_and_a_load_verifies_them(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    files = read_marker(path)["files"]
    on_disk = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER
    )
    assert sorted(files) == on_disk and "rank_state/rank_00000.pt" in files
    assert all(len(entry["sha256"]) == 64 and entry["size"] > 0 for entry in files.values())
    verify_checkpoint(path, files, exclude=frozenset({COMPLETE_MARKER}))
    info = load_distributed_checkpoint(model, torch.optim.AdamW(model.parameters()), path)
    assert info.step == 1 and info.rank_state is not None and info.rank_state["n"] == 3
    assert torch.equal(info.rank_state["rng"], torch.get_rng_state())


def test_a_flipped_byte_is_an_error_naming_the_file_and_nothing_loads(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # so a load would show
    with pytest.raises(
        CorruptCheckpointError, match=rf"{shard.name} is corrupt: its SHA-256 differs"
    ) as info:
        load_distributed_checkpoint(model, None, path)
    assert info.value.path == shard
    assert all(torch.equal(p, before[n] + 1.0) for n, p in model.named_parameters())  # untouched
    load_distributed_checkpoint(model, None, path, verify=False)  # the caller may opt out


def test_missing_and_added_files_are_errors(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    files = read_marker(path)["files"]
    (path / "stray.bin").write_bytes(b"x")
    with pytest.raises(CorruptCheckpointError, match=r"stray\.bin is corrupt: not recorded"):
        verify_checkpoint(path, files, exclude=frozenset({COMPLETE_MARKER}))
    (path / "stray.bin").unlink()
    (path / "rank_state" / "rank_00000.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"rank_00000\.pt is corrupt: missing"):
        verify_checkpoint(path, files, exclude=frozenset({COMPLETE_MARKER}))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_holding_nan_or_inf_is_never_saved(tmp_path: Path, bad: float, dtype: torch.dtype) -> None:
    _, previous = _saved(tmp_path, "step_1", 1)
    model = build_tiny_model("llama", seed=0).to(dtype)
    model.register_buffer("empty", torch.empty(0))  # no minimum or maximum: skipped, not an error
    with AsyncCheckpointer() as checkpointer:
        for save in (save_distributed_checkpoint, checkpointer.save):
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[3, 5] = bad
            with pytest.raises(
                ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds NaN or Inf values on rank 0"
            ):
                save(model, None, tmp_path / "step_2", step=2)
            assert not (tmp_path / "step_2").exists() and not any(tmp_path.glob(".step_2*"))
            assert complete_checkpoints(tmp_path) == [previous]
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[3, 5] = 0.0
        checkpointer.save(model, None, tmp_path / "step_3", step=3)  # finite again: saved


_SAVE_WITH_SMALL_FILE_LIMIT = r"""
import resource, signal, sys
import torch
from automodel_checkpoint import (
    AsyncCheckpointer, CheckpointWriteError, save_distributed_checkpoint, save_hf_checkpoint,
)
from automodel_testing import build_tiny_model
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
model = build_tiny_model("llama", seed=0)
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))  # below one shard file
try:
    if sys.argv[2] == "hf":  # the export's writer thread meets the limit
        save_hf_checkpoint(model, sys.argv[1], max_shard_size="200KB")
    elif sys.argv[2] == "async":
        with AsyncCheckpointer() as checkpointer:
            checkpointer.save(model, None, sys.argv[1], step=2)
            print("STAGED")  # the write fails in the background; wait() (here: close) raises it
    else:
        save_distributed_checkpoint(model, None, sys.argv[1], step=2)
except CheckpointWriteError as exc:
    print("ERROR", exc.errno, exc)
"""


@pytest.mark.parametrize("mode", ["sync", "async", "hf"])
def test_a_write_that_fails_publishes_nothing_and_removes_its_staging_folder(
    tmp_path: Path, mode: str
) -> None:
    _, previous = _saved(tmp_path, "step_1", 1)
    before = json.dumps(read_marker(previous), sort_keys=True)
    result = subprocess.run(
        [sys.executable, "-c", _SAVE_WITH_SMALL_FILE_LIMIT, str(tmp_path / "step_2"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kind = "Hugging Face" if mode == "hf" else "distributed"
    assert f"ERROR 27 [Errno 27] saving the {kind} checkpoint {tmp_path / 'step_2'}" in result.stdout, (
        result.stdout + result.stderr[-2000:]
    )
    assert "File too large" in result.stdout and "the previous checkpoints are intact" in result.stdout
    assert ("STAGED" in result.stdout) == (mode == "async")
    assert not (tmp_path / "step_2").exists() and not any(tmp_path.glob(".step_2*"))
    assert complete_checkpoints(tmp_path) == [previous]
    assert json.dumps(read_marker(previous), sort_keys=True) == before
    verify_checkpoint(previous, read_marker(previous)["files"], exclude=frozenset({COMPLETE_MARKER}))
