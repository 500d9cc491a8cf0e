"""Run every benchmark and print ONE table: each figure as a ratio to a baseline measured in the same run.

    uv run --all-packages python benchmarks/run_all.py [--only SECTION ...] [--json results.json]

Sections (each one also runs alone as its own script, with more detail):

- ``pytorch``: step time of `FSDP2Manager` against hand-written ``fully_shard`` / ``parallelize_module``
  on the same model and mesh (`bench_fsdp2_manager.py`);
- ``transformers``: per-rank peak memory and time of load + one step with FSDP2 against plain
  ``from_pretrained`` in one process (`bench_checkpoint_load.py`);
- ``nemo``: the same job through NeMo AutoModel, installed from PyPI into a scratch environment
  (`bench_vs_nemo.py`); when it cannot be installed or run, its rows say why;
- ``imports``: ``import automodel_<x>`` against ``import torch`` (`bench_import_time.py`);
- ``readers``: our safetensors slice reader against ``safe_open(...).get_slice`` and DCP's
  ``HuggingFaceStorageReader`` (`bench_safetensors_reader.py`, which also runs the 1.2B checkpoint);
- ``schedules``: pipeline bubble against the schedules' theory, expert parallelism against replicated
  experts (`bench_pipeline_bubble.py`, `bench_moe_ep.py`);
- ``vlm``: per-rank bytes of a frozen vision tower under each ``multimodal.frozen_sharding`` against
  the unsharded tower (`bench_vlm_frozen.py`).

Ratios are ours / baseline: below 1 is better for time and memory. On a CPU host (gloo), times are
only meaningful as ratios between rows of the same run; they say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import bench_checkpoint_load
import bench_fsdp2_manager
import bench_import_time
import bench_moe_ep
import bench_pipeline_bubble
import bench_planner
import bench_safetensors_reader
import bench_vlm_frozen
import bench_vs_nemo

MiB = 2**20


@dataclass
class Row:
    """One line of the table: a figure of ours against its baseline from the same run."""

    section: str
    what: str
    ours: str
    baseline: str
    ratio: str
    note: str = ""


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}" if base else "-"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def section_pytorch() -> list[Row]:
    r = bench_fsdp2_manager.measure(steps=5, rounds=3)
    note = "Llama 25M, batch 2 x 128 per rank, AdamW; median step, alternating rounds"
    return [
        Row(
            "vs hand-written PyTorch",
            "step time, FSDP2 over 2 ranks: `FSDP2Manager` vs `fully_shard` by hand",
            _ms(r["fsdp2"]["ours"]),
            _ms(r["fsdp2"]["theirs"]),
            _ratio(r["fsdp2"]["ours"], r["fsdp2"]["theirs"]),
            note,
        ),
        Row(
            "vs hand-written PyTorch",
            "step time, TP 2: `FSDP2Manager` TP plan vs `parallelize_module` by hand",
            _ms(r["tp2"]["ours"]),
            _ms(r["tp2"]["theirs"]),
            _ratio(r["tp2"]["ours"], r["tp2"]["theirs"]),
            note,
        ),
    ]


def section_transformers() -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        path, size = bench_checkpoint_load.write_checkpoint(Path(tmp))
        base = bench_checkpoint_load.measure_baseline(path)
        what = f"Llama 125M ({size:.0f} MiB fp32)"
        for label, threshold in (
            ("glibc defaults, tune_host_allocator=False", None),
            ("FSDP2Manager default: 1 MiB mmap threshold", MiB),
        ):
            per_rank = bench_checkpoint_load.measure_ours(path, 2, threshold, 0)
            peak = max(r["peak"] for r in per_rank)
            rows.append(
                Row(
                    "vs plain transformers",
                    f"peak memory per rank, load + 1 SGD step, {what}: FSDP2 x 2 ranks ({label}) "
                    "vs `from_pretrained` in 1 process",
                    f"{peak:.0f} MiB",
                    f"{base['peak']:.0f} MiB",
                    _ratio(peak, base["peak"]),
                    "peak RSS growth (VmHWM) over load + step, max over ranks",
                )
            )
            if threshold is None:
                load = max(r["load_s"] for r in per_rank)
                rows.append(
                    Row(
                        "vs plain transformers",
                        f"load time, {what}: meta + `parallelize` + `load_hf_checkpoint` x 2 ranks "
                        "vs `from_pretrained`",
                        f"{load:.2f} s",
                        f"{base['load_s']:.2f} s",
                        _ratio(load, base["load_s"]),
                        "each rank reads only its slices "
                        f"({max(r['bytes_read'] for r in per_rank) / MiB:.0f} MiB)",
                    )
                )
    return rows


def section_readers() -> list[Row]:
    """Our safetensors slice reader against safe_open and DCP's HF reader (the 124.7M model, 4 ranks)."""
    with tempfile.TemporaryDirectory(prefix="bench-reader-") as tmp:
        rows = bench_safetensors_reader.run("small", 4, Path(tmp), 3)
    ours = next(r for r in rows if r["reader"] == "ours")
    out = []
    for row in rows:
        if row is ours:
            continue
        for what, key, unit in (("peak memory", "peak_mib", "MiB"), ("read time", "seconds", "s")):
            out.append(
                Row(
                    "safetensors reader",
                    f"{what} per rank, Llama 125M fp32, 4 ranks reading their Shard(0) rows: ours vs "
                    f"{row['reader']}",
                    f"{ours[key]:.2f} {unit}",
                    f"{row[key]:.2f} {unit}",
                    _ratio(ours[key], row[key]),
                    "worst rank; warm page cache; peak = VmHWM growth (mapped pages count)",
                )
            )
    return out


def section_nemo() -> list[Row]:
    section = "vs NeMo AutoModel (same job)"
    with tempfile.TemporaryDirectory(prefix="bench-nemo-") as tmp:
        try:
            r = bench_vs_nemo.measure(Path(tmp))
        except bench_vs_nemo.NemoUnavailable as exc:
            return [
                Row(
                    section,
                    "apply, step time and memory against nemo-automodel",
                    "-",
                    "-",
                    "-",
                    f"not run: {exc}",
                )
            ]
    ours, nemo = r["automodel"], r["nemo"]
    env = f"{bench_vs_nemo.NEMO_REQUIREMENT}, torch {r['torch']}, transformers {r['transformers']}"
    runs = ours["losses"] + nemo["losses"]
    same = all(run == runs[0] for run in runs)
    what = "Llama 33M, FSDP2 x 2 ranks, fp32, load from checkpoint"
    imports = r["imports"]
    jobs = "mean of 2 fresh jobs each (order A B B A)"
    return [
        Row(
            section,
            f"`apply_model_infrastructure` time, {what}",
            f"{ours['apply_s']:.2f} s",
            f"{nemo['apply_s']:.2f} s",
            _ratio(ours["apply_s"], nemo["apply_s"]),
            f"{jobs}; both in one scratch env: {env}",
        ),
        Row(
            section,
            "peak memory per rank, apply + first step",
            f"{ours['peak_mib']:.0f} MiB",
            f"{nemo['peak_mib']:.0f} MiB",
            _ratio(ours["peak_mib"], nemo["peak_mib"]),
            f"{jobs}; max over ranks",
        ),
        Row(
            section,
            "step time (SGD, batch 1 x 64 per rank), median of 5 steps",
            _ms(ours["step_s"]),
            _ms(nemo["step_s"]),
            _ratio(ours["step_s"], nemo["step_s"]),
            f"{jobs}; losses " + ("bit-identical at every step" if same else "DIFFER"),
        ),
        Row(
            section,
            "import of the orchestration module (`automodel_infra.infrastructure` vs "
            "`nemo_automodel._transformers.infrastructure`)",
            f"{imports['automodel']:.2f} CPU s",
            f"{imports['nemo']:.2f} CPU s",
            _ratio(imports["automodel"], imports["nemo"]),
            f"CPU time, smallest of 2 fresh processes; `import torch` alone: {imports['torch']:.2f} CPU s",
        ),
    ]


def section_imports() -> list[Row]:
    best = bench_import_time.measure(repeats=3)
    torch_s = best.pop("torch")
    return [
        Row(
            "import time",
            f"`import {module}` vs `import torch`",
            f"{seconds:.2f} CPU s",
            f"{torch_s:.2f} CPU s",
            _ratio(seconds, torch_s),
            "CPU time of the import, smallest of 3 fresh processes",
        )
        for module, seconds in best.items()
    ]


def section_schedules() -> list[Row]:
    rows = []
    bubble = bench_pipeline_bubble.summarize(pp=2, microbatches=8, seq_len=128, steps=3, warmup=1)
    for row in bubble:
        rows.append(
            Row(
                "pipeline and experts",
                f"pipeline bubble, {row['schedule']} (p 2, m 8, v {row['v']}): measured vs theory",
                f"{row['measured']:.3f}",
                f"{row['theory']:.3f}",
                _ratio(row["measured"], row["theory"]),
                f"step {row['step_s']:.2f} s ({row['step_s'] / bubble[0]['step_s']:.2f}x gpipe); "
                "measured idle includes P2P latency",
            )
        )
    moe = bench_moe_ep.measure()
    what = "Qwen3-30B-A3B widths, 2 layers, 32 experts top 2: ep 4 vs replicated experts (FSDP2), 4 ranks"
    rows.append(
        Row(
            "pipeline and experts",
            f"step time, {what}",
            _ms(moe["ep_s"]),
            _ms(moe["replicated_s"]),
            _ratio(moe["ep_s"], moe["replicated_s"]),
            "median of 3 SGD steps, max over ranks",
        )
    )
    rows.append(
        Row(
            "pipeline and experts",
            f"peak memory per rank, {what}",
            f"{moe['ep_mib']:.0f} MiB",
            f"{moe['replicated_mib']:.0f} MiB",
            _ratio(moe["ep_mib"], moe["replicated_mib"]),
            "VmHWM during the steps, max over ranks",
        )
    )
    return rows


def section_planner() -> list[Row]:
    rows = []
    for row in bench_planner.measure():
        rows.append(
            Row(
                "planner",
                f"estimated vs measured peak per rank, {row['layout']} ({bench_planner.RANKS} ranks)",
                f"{row['estimate_mib']:.0f} MiB",
                f"{row['measured_mib']:.0f} MiB",
                _ratio(row["estimate_mib"], row["measured_mib"]),
                f"`automodel plan` total vs VmHWM growth over setup + 1 AdamW step, max over ranks; "
                f"Llama 53M fp32, seq {bench_planner.SEQ}",
            )
        )
    return rows


def section_vlm() -> list[Row]:
    rows = []
    for sharding, row in bench_vlm_frozen.measure().items():
        full = row["full"] / MiB
        for key, what in (
            ("resident", "held after loading"),
            ("gathered", "most held whole at once in a forward"),
        ):
            rows.append(
                Row(
                    "vision-language",
                    f"frozen CLIP tower bytes per rank {what}, frozen_sharding={sharding} (2 ranks) vs "
                    "the unsharded tower",
                    f"{row[key] / MiB:.2f} MiB",
                    f"{full:.2f} MiB",
                    _ratio(row[key], row["full"]),
                    "LLaVA (CLIP hidden 256 x 4 layers, Llama), fp32; worst rank",
                )
            )
    return rows


SECTIONS: dict[str, Callable[[], list[Row]]] = {
    "pytorch": section_pytorch,
    "transformers": section_transformers,
    "nemo": section_nemo,
    "imports": section_imports,
    "readers": section_readers,
    "schedules": section_schedules,
    "planner": section_planner,
    "vlm": section_vlm,
}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores, no GPU used (gloo); Python {platform.python_version()}, "
        f"torch {torch.__version__}; load average {load:.1f} at start"
    )


def _print_table(rows: list[Row]) -> None:
    print("| section | benchmark | ours | baseline | ratio | note |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.section} | {r.what} | {r.ours} | {r.baseline} | {r.ratio} | {r.note} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine line here")
    args = parser.parse_args()
    machine = _machine()
    started = datetime.datetime.now(datetime.UTC)
    rows: list[Row] = []
    timings: dict[str, float] = {}
    failed = False
    for name in args.only or list(SECTIONS):
        start = time.perf_counter()
        print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
        try:
            rows += SECTIONS[name]()
        except Exception as exc:  # one broken benchmark must not hide the others' figures
            failed = True
            traceback.print_exc()
            rows.append(
                Row(name, "(section failed)", "-", "-", "-", f"{type(exc).__name__}: {str(exc)[:200]}")
            )
        timings[name] = time.perf_counter() - start
        print(f"[run_all] {name}: {timings[name]:.0f} s", file=sys.stderr, flush=True)
    total = sum(timings.values())
    print(f"\nautomodel benchmarks, {started:%Y-%m-%d %H:%M} UTC")
    print(f"machine: {machine}")
    print("ratio = ours / baseline, measured in the same run (below 1: ours is faster or smaller).")
    print("CPU timings are only meaningful as ratios; they say nothing about GPU speed.\n")
    _print_table(rows)
    print(f"\nwall time: {total:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ")")
    if args.json:
        payload = {"date": f"{started:%Y-%m-%d %H:%M} UTC", "machine": machine, "timings": timings}
        payload["rows"] = [asdict(r) for r in rows]
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
