"""Calibrate the time model on one run measured on a lent GPU and predict the others measured there.

The issue's fifth item: ``tools/gpu_check.sh`` times automodel's training of Llama-3.1-8B widths (a few
blocks) on the lent GPU in several settings (``benchmarks/gpu/bench_h200.py``: eager, compiled,
compiled with float8, LoRA) and writes them to ``bench.json``. This plans each of those runs as the job
it is (`automodel_planner.published.run_plan` with the measured model's widths), scales the time
model's compute fractions until it reproduces the eager run's step (`calibrate_efficiency`, what
``automodel plan --calibrate`` does), and predicts the other runs with them: the table gives each
measured and predicted tokens/s and the error, before calibration (the committed fractions) and after.

Usage::

    python tools/gpu_calibration.py OUT/bench.json [--output calibration.md]

Raises a clear error when the bench ran on a device the planner's table does not hold (the CPU
rehearsal among them): there is nothing to calibrate against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

_OURS: dict[str, dict[str, Any]] = {
    # bench variant -> what its job sets beyond the measured layers, batch, sequence and checkpointing
    "FSDP2Manager": {},
    "FSDP2Manager + compile": {"compile": True},
    "FSDP2Manager + compile + FP8": {"compile": True, "fp8": True},
    "FSDP2Manager + LoRA": {"lora_dim": 16, "dtype": "bfloat16"},
}
"""The bench's runs of automodel (its other rows are other frameworks), with their settings."""

CALIBRATED_ON = "FSDP2Manager"


def measured_runs(bench: dict[str, Any]) -> list[Any]:
    """The bench's measured runs of automodel as `PublishedRun` rows on a one-GPU cluster of its device.

    Raises:
        ValueError: The bench's device is not in `automodel_planner.DEVICES` (or it ran on a CPU).
    """
    from automodel_planner.hardware import device_named
    from automodel_planner.published import PublishedRun

    device = device_named(str(bench.get("device_name", "")))
    if device is None:
        raise ValueError(
            f"bench.json: device_name {bench.get('device_name')!r} is not a GPU of "
            "automodel_planner.DEVICES; calibrate on a run measured on one of them"
        )
    checkpointing = bench.get("ac", "none")
    rows = []
    for name, settings in _OURS.items():
        row = bench.get(name)
        if not isinstance(row, dict) or "tokens_per_s" not in row:
            continue  # not run, skipped or failed: bench.log says why
        fields: dict[str, Any] = {
            "id": name,
            "source": "tools/gpu_check.sh bench.json",
            "role": "calibration" if name == CALIBRATED_ON else "evaluation",
            "shape": "llama3-8b",
            "cluster": f"1x{device.name}",
            "seq_len": int(row["seq"]),
            "local_batch": int(bench["batch"]),
            "micro_batch": int(bench["batch"]),
            "tokens_per_s_per_gpu": float(row["tokens_per_s"]),
            "checkpointing": False if checkpointing == "none" else checkpointing,
            "dtype": "float32",
        }
        rows.append(PublishedRun(**{**fields, **settings}))
    return rows


def calibrate(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measured run: measured and predicted tokens/s, before and after calibrating on the eager run.

    Raises:
        ValueError: No eager run to calibrate on, or the device is not in the table.
    """
    from automodel_planner.estimate import calibrate_efficiency, estimate_throughput
    from automodel_planner.published import run_plan, shape_config

    runs = measured_runs(bench)
    if not any(run.id == CALIBRATED_ON for run in runs):
        raise ValueError(f"bench.json: no measured {CALIBRATED_ON!r} run to calibrate on")
    config = shape_config("llama3-8b")
    config.num_hidden_layers = int(bench["layers"])  # the measured model keeps this many blocks
    plans = {run.id: (run, run_plan(run, config), run.hardware()) for run in runs}
    caches: dict[str, Any] = {run.id: {} for run in runs}  # a profile per model (LoRA adapts its own)
    run, plan, cluster = plans[CALIBRATED_ON]
    measured = run.seq_len * run.local_batch / run.tokens_per_s_per_gpu
    efficiency, factor = calibrate_efficiency(plan, cluster, measured, profile_cache=caches[run.id])
    out = []
    for run, plan, cluster in plans.values():
        cache = caches[run.id]
        before = estimate_throughput(plan, cluster, profile_cache=cache)
        after = estimate_throughput(plan, cluster, efficiency=efficiency, profile_cache=cache)
        out.append(
            {
                "run": run.id,
                "role": run.role,
                "measured": run.tokens_per_s_per_gpu,
                "before": before.tokens_per_s_per_gpu,
                "after": after.tokens_per_s_per_gpu,
                "factor": factor,
                "efficiency": dataclasses.asdict(efficiency),
            }
        )
    return out


def table(bench: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The markdown section: the device and shape, then one line per measured run."""
    lines = [
        f"Measured on one {bench['device_name']} ({bench['layers']} blocks of Llama-3.1-8B, batch "
        f"{bench['batch']}, checkpointing {bench['ac']}); the time model calibrated on the "
        f"{CALIBRATED_ON!r} run (compute fractions x {rows[0]['factor']:.3f}):",
        "",
        "| run | role | measured tokens/s | predicted before | error | predicted after | error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        measured, before, after = row["measured"], row["before"], row["after"]
        lines.append(
            f"| {row['run']} | {row['role']} | {measured:,.0f} | {before:,.0f} | "
            f"{before / measured - 1:+.1%} | {after:,.0f} | {after / measured - 1:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Read bench.json, calibrate, print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", help="bench.json of tools/gpu_check.sh")
    parser.add_argument("--output", default=None, help="write the table here too")
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text(encoding="utf-8"))
    try:
        text = table(bench, calibrate(bench))
    except ValueError as exc:
        print(f"gpu_calibration: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
