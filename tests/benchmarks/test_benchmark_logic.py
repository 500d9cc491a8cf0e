"""The logic of the planner, plan-time, pipeline and GPU benchmarks (``benchmarks/``), on CPU.

No timing is asserted.

- Every layout of the planner benchmark plans (no process started), and the estimates move the way
  each setting must move them: checkpointing and sequence parallelism shrink activations, HSDP
  shards parameters over half the ranks, LoRA leaves almost no optimizer state, PP holds fewer blocks.
- Both commands the plan-time benchmark times run: ``automodel plan`` of the 405B on 1,024 GPUs fits
  its layout and predicts a step; the baseline builds the model on the meta device.
- The pipeline replay gives the textbook idle for equal GPipe stages, and one late op (an op's own
  time in one step) idles exactly the ranks that wait for it.

The GPU check's rehearsal is in ``test_gpu_check.py`` (a file of its own: the e2e session's workers
take whole files, and the rehearsal is the longest test of the tier).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from automodel_testing.scripts import load_script

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _module(path: Path) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # the GPU script imports nothing from here, the others do
    return load_script(path)


def test_every_planner_benchmark_layout_plans_and_settings_move_the_estimate(tmp_path: Path) -> None:
    from automodel_all.cli.main import build_parser, job_from_args
    from automodel_all.cli.plan import plan_report

    bench = _module(BENCHMARKS / "bench_planner.py")
    moe = tmp_path / "moe"
    bench._write_moe(moe)
    estimates = {}
    for name in bench.LAYOUTS:
        args = build_parser().parse_args(["plan", *bench._argv(name, tmp_path / "out", moe)])
        estimates[name] = plan_report(job_from_args(args), world_size=bench.RANKS)["estimate"]
    lines = {name: e.lines for name, e in estimates.items()}
    fsdp = lines["FSDP2 dp_shard=4"]
    assert len(estimates) >= 8 and all(e.total > 0 for e in estimates.values())
    assert lines["AC full"]["activations"] < lines["AC selective"]["activations"] < fsdp["activations"]
    assert lines["TP=2 + SP"]["activations"] < lines["TP=2 (no SP)"]["activations"]
    assert lines["HSDP 2x2"]["parameters"] == pytest.approx(2 * fsdp["parameters"], rel=1e-6)
    assert lines["LoRA r=16"]["optimizer"] < fsdp["optimizer"] / 10
    assert "LoRA activations" in lines["LoRA r=16"]
    assert estimates["PP=2 1F1B"].rank.startswith("pp rank")
    assert "EP all-to-all" in estimates["EP=4 (MoE)"].communication
    assert "CP K/V all-gather" in estimates["CP=2"].communication
    # Every layout shards with FSDP2 and accumulates over micro-batches with the reduce-scatter deferred.
    assert all(e.buffers.get("FSDP all-gather / reduce-scatter", 0) > 0 for e in estimates.values())
    assert fsdp["accumulated gradients"] == pytest.approx(4 * fsdp["gradients"], rel=1e-6)
    assert "PP receive buffers" in estimates["PP=2 1F1B"].buffers


_TIMED = ("ours", "baseline")


def test_the_plan_time_benchmark_times_a_plan_that_answers(tmp_path: Path) -> None:
    bench = _module(BENCHMARKS / "bench_plan_time.py")
    timed = bench.commands(bench.write_model(tmp_path))
    # --suggest (the third command) ranks every layout of the 1,024 GPUs: 15 s; tests/cli covers it.
    results = {name: subprocess.run(timed[name], capture_output=True, text=True) for name in _TIMED}
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
    report = results["ours"].stdout
    assert "1024 x H100" in report and "tokens/s per GPU" in report, report[-2000:]
    assert ": fits," in report, report[-2000:]
    # Without the console script (a lent GPU machine's PYTHONPATH install) the plan runs as a module.
    assert list(bench.commands(tmp_path, suggest=False)) == ["ours", "baseline"]


def test_pipeline_replay_with_median_and_with_each_ops_own_time() -> None:
    bubble = _module(BENCHMARKS / "bench_pipeline_bubble.py")
    # GPipe, 2 stages on 2 ranks, 2 microbatches: all forwards, then all backwards.
    orders = [[(r, kind, mb) for kind in ("F", "B") for mb in (0, 1)] for r in (0, 1)]
    equal = {(0, "F"): 1.0, (1, "F"): 1.0, (0, "B"): 2.0, (1, "B"): 2.0}
    # Each rank waits one forward plus one backward: (p - 1) / m of its compute of 6.
    assert bubble._replay(orders, equal, 2, 0.0) == [3.0, 3.0]
    assert bubble._replay(orders, equal, 2, 0.5) == [4.0, 4.0]  # one message more in each dependency chain
    # Stage 1's second backward takes 4 in this step: rank 0 waits 2 more; rank 1 only works longer.
    late = {**equal, (1, "B", 1): 4.0}
    assert bubble._replay(orders, late, 2, 0.0) == [5.0, 3.0]
