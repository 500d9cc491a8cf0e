"""``automodel train --streaming``: SIGTERM mid-run, then ``--resume`` on another world size, continues
at the exact next rows of every stream.

Three launches of the embedded default model on a generated prompt/completion folder (120 records: each
of the 8 row slots reads 15, so every stream wraps around the source within the run):

1. the reference: 16 uninterrupted steps on 2 workers;
2. the same job, SIGTERM to the launcher once step 5 is logged: the workers finish the step, save a
   checkpoint that records all 8 stream cursors, and exit 0;
3. ``--resume`` on ONE worker: it holds all 8 slots (it held 4 before), continues from the cursors,
   and every later loss equals the reference's (1e-5: the reduction order changes with the world size).

The checkpoints' data records are checked too: one cursor per slot, slot ``j`` at a record ``j mod 8``;
the final cursors of the resumed run equal the reference's, past the end of the source.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.extended, pytest.mark.timeout(600)]

STEPS = 16
SLOTS = 8
_ARGS = [
    "--steps", str(STEPS), "--checkpoint-every", "100", "--seq-len", "48", "--global-batch-size", str(SLOTS),
    "--micro-batch-size", "2", "--warmup-steps", "2", "--lr", "0.005", "--device", "cpu", "--streaming",
    "--set", "train.keep_checkpoints=0", "--set", "train.sample_tokens=0", "--set", "train.plot=false",
    "--set", "model.config_overrides={num_hidden_layers: 1}",
]  # fmt: skip


def _records(count: int) -> str:
    lines = []
    for i in range(count):
        prompt = f"Question {i}: what is {i % 13} times {i % 7}? " * (1 + i % 3)
        lines.append(
            json.dumps({"prompt": prompt, "completion": f"It is {(i % 13) * (i % 7)}. " * (1 + i % 4)})
        )
    return "\n".join(lines) + "\n"


def _command(output: Path, data: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "automodel_all.cli", "train", *_ARGS, "--data", str(data),
        "--output-dir", str(output), *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _losses(output: Path) -> dict[int, float]:
    path = output / "train_log.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _run(command: list[str]) -> str:
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def _sigterm_after(command: list[str], output: Path, step: int) -> str:
    """Run ``command``; SIGTERM the launcher once ``step`` is logged; return its output (exit 0)."""
    process = subprocess.Popen(
        command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 500
    while process.poll() is None and time.monotonic() < deadline:
        if max(_losses(output), default=0) >= step:
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out[-6000:]
    return out


def test_streamed_run_resumes_after_sigterm_on_another_world_size(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(_records(120))

    reference = tmp_path / "reference"
    _run(_command(reference, data, "--nproc-per-node", "2"))
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert expected[STEPS] < expected[1] - 0.3, expected  # it learns

    output = tmp_path / "run"
    out = _sigterm_after(_command(output, data, "--nproc-per-node", "2"), output, 5)
    stopped = max(_losses(output))
    assert 5 <= stopped < STEPS, (stopped, out[-3000:])
    marker = output / "checkpoints" / f"step_{stopped:08d}" / ".automodel_complete.json"
    extra = json.loads(marker.read_text())["extra_state"]
    recorded = extra["data"]
    assert extra["reason"] == "preempted"
    assert recorded["streaming"] and recorded["step"] == stopped and len(recorded["slots"]) == SLOTS
    assert all(record % SLOTS == slot for slot, (_, record, _) in enumerate(recorded["slots"]))

    out = _run(_command(output, data, "--nproc-per-node", "1", "--resume"))
    assert f"(step {stopped})" in out, out[-3000:]
    resumed = _losses(output)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-5), (step, resumed[step], expected[step])
    final = [_slots(run) for run in (reference, output)]
    assert final[0] == final[1] and all(passes >= 1 for passes, _, _ in final[0]), final


def _slots(output: Path) -> list[list[int]]:
    marker = output / "checkpoints" / f"step_{STEPS:08d}" / ".automodel_complete.json"
    return json.loads(marker.read_text())["extra_state"]["data"]["slots"]
