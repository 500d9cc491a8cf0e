"""The prepared GPU check (``tools/gpu_check.sh``) rehearsed on CPU, and its benchmark's FLOP count.

- ``tools/gpu_check.sh --rehearse``: the GPU test tier is collected and skips, the GPU benchmark trains
  every variant that needs no CUDA on a tiny model (finite loss, tokens/s above zero), prints one
  "skipped: needs CUDA" line for each that does, the load comparison runs, and the calibration reads
  the bench.json it wrote.
- The GPU benchmark counts FLOPs as torchtitan does.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from automodel_testing.scripts import load_script

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_gpu_check_rehearses_on_cpu(tmp_path: Path) -> None:
    """``tools/gpu_check.sh --rehearse``: every step of the GPU check runs on CPU with a tiny model."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "MASTER_PORT": str(_free_port())}
    script = BENCHMARKS.parent / "tools" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script), "--rehearse"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "bench.json",
        "bench.log",
        "env.txt",
        "summary.txt",
        "tier.log",
        "tier.xml",
    ]
    summary = (tmp_path / "summary.txt").read_text()
    assert "tier: exit 0" in summary and "bench: exit 0" in summary, summary
    tier = ElementTree.parse(tmp_path / "tier.xml").getroot()
    suites = list(tier.iter("testsuite"))
    assert sum(int(s.get("tests", "0")) for s in suites) > 0
    assert sum(int(s.get("tests", "0")) - int(s.get("skipped", "0")) for s in suites) == 0  # no CUDA here
    results = json.loads((tmp_path / "bench.json").read_text())
    for name in (
        "transformers + autocast",
        "hand-written fully_shard",
        "FSDP2Manager",
        "FSDP2Manager + LoRA",
    ):
        row = results[name]
        assert "error" not in row, (name, row)
        assert row["tokens_per_s"] > 0 and math.isfinite(row["loss"]) and 0 < row["mfu"] < 1
    assert results["FSDP2Manager + LoRA"]["seq"] == 16
    printed = (tmp_path / "bench.log").read_text()
    for name in ("FSDP2Manager + compile", "FSDP2Manager + compile + FP8"):
        assert results[name] == {"skipped": "needs CUDA"}
        assert printed.count(f"{name}: skipped: needs CUDA") == 1, printed
    assert "12,473 tokens/s" in printed and "5,762 tokens/s/GPU" in printed
    assert results["load"]["ours_s"] > 0 and results["load"]["from_pretrained_s"] > 0
    # What a GPU run's bench.json feeds: tools/gpu_calibration.py reads this very file (as if measured on
    # an H200: on a CPU there is nothing to calibrate against) and plans each of automodel's runs.
    calibration = load_script(BENCHMARKS.parent / "tools" / "gpu_calibration.py")
    rows = calibration.calibrate({**results, "device_name": "NVIDIA H200"})
    assert [row["run"] for row in rows] == ["FSDP2Manager", "FSDP2Manager + LoRA"]
    assert rows[0]["after"] == pytest.approx(results["FSDP2Manager"]["tokens_per_s"], rel=1e-3)


def test_gpu_flop_count_is_torchtitans() -> None:
    bench = load_script(BENCHMARKS / "gpu" / "bench_h200.py")
    # The FLOP count as torchtitan's: 6 x parameters per token (the embedding excluded, the head
    # included) + 12 x layers x hidden x seq; LoRA's frozen base 4 x.
    config = bench.model_config(bench.TINY, 2)
    h, f, v = 64, 176, 512
    per_layer = 2 * h * h + 2 * h * 32 + 3 * h * f
    assert bench.flops_per_token(config, 32) == 6 * (2 * per_layer + h * v) + 12 * 2 * h * 32
    assert bench.flops_per_token(config, 32, lora=True) == 4 * (2 * per_layer + h * v) + 12 * 2 * h * 32
