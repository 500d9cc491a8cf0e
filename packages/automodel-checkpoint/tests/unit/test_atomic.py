"""Atomic publish: staging folder, completion marker written last, latest-checkpoint selection."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from automodel_checkpoint.atomic import (
    COMPLETE_MARKER,
    is_complete_checkpoint,
    latest_checkpoint,
    prepare_staging_dir,
    publish_staging_dir,
    read_marker,
    staging_dir_for,
)


def _save(final: Path, step: int | None, *, overwrite: bool = False, content: str = "x") -> Path:
    staging = prepare_staging_dir(final, overwrite=overwrite)
    assert staging == staging_dir_for(final) and staging.is_dir()
    assert overwrite or not final.exists()
    (staging / "weights").write_text(content)
    return publish_staging_dir(staging, final, kind="dcp", step=step, extra_state={"k": 1})


def test_publish_writes_marker_and_renames(tmp_path: Path) -> None:
    final = _save(tmp_path / "step_1", 1)
    assert (final / "weights").read_text() == "x"
    marker = read_marker(final)
    assert marker["format"] == "dcp" and marker["step"] == 1 and marker["extra_state"] == {"k": 1}
    assert marker["world_size"] == 1
    assert not staging_dir_for(final).exists()
    assert is_complete_checkpoint(final)


def test_existing_folder_needs_overwrite(tmp_path: Path) -> None:
    final = _save(tmp_path / "ck", 1)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        prepare_staging_dir(final, overwrite=False)
    _save(final, 2, overwrite=True, content="new")
    assert (final / "weights").read_text() == "new" and read_marker(final)["step"] == 2
    assert not (tmp_path / ".ck.old").exists()


def test_failed_write_publishes_nothing(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    staging = prepare_staging_dir(final, overwrite=False)
    (staging / "half").write_text("partial")
    with pytest.raises(OSError, match="disk full"):
        publish_staging_dir(staging, final, kind="hf", write_error=OSError("disk full"))
    assert not final.exists() and not is_complete_checkpoint(staging)
    # The next save to the same path starts from a clean staging folder.
    staging = prepare_staging_dir(final, overwrite=False)
    assert list(staging.iterdir()) == []


def test_latest_ignores_incomplete_and_hidden(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nothing") is None
    _save(tmp_path / "step_2", 2)
    time.sleep(0.01)
    _save(tmp_path / "step_1", 1)  # newer on disk, older by step
    (tmp_path / "step_9").mkdir()  # no marker: an interrupted copy
    (tmp_path / "step_9" / "weights").write_text("x")
    staging = prepare_staging_dir(tmp_path / "step_5", overwrite=False)  # an interrupted save
    (staging / COMPLETE_MARKER).write_text(json.dumps({"step": 5}))  # even with a marker: hidden
    bad = tmp_path / "step_7"
    bad.mkdir()
    (bad / COMPLETE_MARKER).write_text("{truncated")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert latest_checkpoint(tmp_path, kind="hf") is None
    assert not is_complete_checkpoint(tmp_path / "step_9")
    assert not is_complete_checkpoint(staging)
    with pytest.raises(FileNotFoundError, match="completion marker"):
        read_marker(tmp_path / "step_9")
