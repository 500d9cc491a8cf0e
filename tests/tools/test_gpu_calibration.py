"""tools/gpu_calibration.py: the time model calibrated on one run of a lent GPU predicts the others.

The bench.json below has the fields and shape ``benchmarks/gpu/bench_h200.py`` writes; its timings are
made up (no GPU has been lent yet), so only the arithmetic is checked, not the model's accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from automodel_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _bench(device_name: str = "NVIDIA H200") -> dict[str, Any]:
    def row(tokens_per_s: float, seq: int = 1024) -> dict[str, Any]:
        return {"tokens_per_s": tokens_per_s, "step_s": 2 * seq / tokens_per_s, "seq": seq}

    return {
        "device": "cuda:0",
        "device_name": device_name,
        "layers": 2,
        "seq": 1024,
        "batch": 2,
        "ac": "selective",
        "transformers + autocast": row(60_000.0),  # another framework's row: not planned
        "FSDP2Manager": row(50_000.0),
        "FSDP2Manager + compile": row(58_000.0),
        "FSDP2Manager + compile + FP8": {"skipped": "needs CUDA"},
        "FSDP2Manager + LoRA": row(70_000.0, seq=512),
    }


def test_calibrating_on_the_eager_run_reproduces_it_and_predicts_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tool = load_script(ROOT / "tools" / "gpu_calibration.py")
    bench = _bench()
    rows = {row["run"]: row for row in tool.calibrate(bench)}
    assert set(rows) == {"FSDP2Manager", "FSDP2Manager + compile", "FSDP2Manager + LoRA"}
    eager = rows["FSDP2Manager"]
    assert eager["role"] == "calibration" and eager["after"] == pytest.approx(50_000.0, rel=1e-4)
    # One factor scales every compute fraction: each run moves the same way, and by less than the
    # factor's inverse (the collectives and the optimizer are not scaled; one GPU has none of the former).
    for row in rows.values():
        assert (row["after"] > row["before"]) == (eager["after"] > eager["before"])
        assert row["after"] / row["before"] == pytest.approx(eager["factor"], rel=0.1)

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert tool.main([str(path), "--output", str(tmp_path / "calibration.md")]) == 0
    text = capsys.readouterr().out
    assert "Measured on one NVIDIA H200 (2 blocks of Llama-3.1-8B" in text
    assert "| FSDP2Manager + compile | evaluation | 58,000 |" in text
    assert (tmp_path / "calibration.md").read_text() == text

    path.write_text(json.dumps(_bench("cpu")))  # the CPU rehearsal: nothing to calibrate against
    assert tool.main([str(path)]) == 2
    assert "device_name 'cpu' is not a GPU of automodel_planner.DEVICES" in capsys.readouterr().err
