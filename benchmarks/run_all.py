"""Run every benchmark and print ONE table: each figure as a ratio to a baseline measured in the same run.

    uv run --all-packages python benchmarks/run_all.py [--only SECTION ...] [--json run.json] [--publish]

``--json`` writes the run's sections (rows with their provenance: date, commit, machine, load average
before and after, wall time) as the JSON that ``tools/benchmark_report.py`` reads; ``--publish`` merges
them into ``docs/benchmarks.json`` (replacing only the sections run) and regenerates the table of
``docs/benchmarks.md`` from it. Nobody edits that table by hand.

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
- ``schedules``: pipeline idle per step against the textbook bubble of the same compute, expert
  parallelism against replicated experts (`bench_pipeline_bubble.py`, `bench_moe_ep.py`);
- ``plan_time``: the wall time of ``automodel plan`` for a 405B model on 1,024 GPUs against
  transformers building the same model on the meta device, fresh processes (`bench_plan_time.py`);
- ``vlm``: per-rank bytes of a frozen vision tower under each ``multimodal.frozen_sharding`` against
  the unsharded tower (`bench_vlm_frozen.py`);
- ``checkpoints``: asynchronous DCP saves against synchronous ones and against the bare copy to host
  memory, step time with a save in flight, and the HF export every rank writes against one writer
  (`bench_checkpoint_save.py`);
- ``long_context``: peak memory per rank and step time of 8k- and 32k-token rows on 4 ranks, CP 4 vs
  no CP, ring vs all-to-all attention, packed vs unpacked rows, the planner's estimate beside each
  (`bench_long_context.py`);
- ``streaming``: ``automodel train --streaming`` on a 4.2 GB corpus: resident memory per rank late in
  the run against earlier, and over a whole pass of the corpus; the losses after a SIGTERM and a
  resume on another world size against an uninterrupted run (`bench_streaming.py`);
- ``scale``: per-rank peak memory of load + one step at real widths (Llama-3.2-1B shape, Qwen3-30B-A3B
  widths with 64 experts under EP 4), 4 ranks against transformers in one process on the same global
  batch (`bench_scale.py`).

A figure that depends on a setting of ours (the workers' malloc, ``launch.host_allocator``, and the
CPU runtime, ``FSDP2Config.host_runtime``, for every CPU row that trains through `FSDP2Manager`) is
measured under each of `_launch.HOST_SETTINGS`, in the same run, and shown as one row per setting (the
planner's measured peaks run under the defaults only: each layout in fresh ranks on mimalloc). Ratios are
ours / baseline: below 1 is better for time and memory. On a CPU host (gloo), times are only
meaningful as ratios between rows of the same run; they say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import bench_checkpoint_load
import bench_checkpoint_save
import bench_fsdp2_manager
import bench_import_time
import bench_long_context
import bench_moe_ep
import bench_pipeline_bubble
import bench_plan_time
import bench_planner
import bench_safetensors_reader
import bench_scale
import bench_streaming
import bench_vlm_frozen
import bench_vs_nemo
from _launch import HOST_SETTINGS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import benchmark_report  # noqa: E402  (tools/ is not a package; the report module lives there)
from benchmark_report import Provenance, Row, Section  # noqa: E402

MiB = 2**20


def section_pytorch() -> list[Row]:
    r = bench_fsdp2_manager.measure()
    rows = []
    for layout, what in (
        ("fsdp2", "step time, FSDP2 over 2 ranks: `FSDP2Manager` vs `fully_shard` by hand"),
        ("tp2", "step time, TP 2: `FSDP2Manager` TP plan vs `parallelize_module` by hand"),
    ):
        for setting in HOST_SETTINGS:
            ours = r[layout]["ours"][setting.label]
            same = r[layout]["theirs_same_job"].get(setting.label)
            if same is None:
                how = "ours alone in its jobs (glibc's settings are process-wide)"
            else:
                how = f"hand-written in the same jobs: {same * 1e3:.0f} ms (ours / it: {ours / same:.3f})"
            rows.append(
                Row(
                    section="vs hand-written PyTorch",
                    name=what,
                    ours=ours * 1e3,
                    baseline=r[layout]["theirs"] * 1e3,
                    unit="ms",
                    settings=setting.label,
                    spread=_spread(r[layout]["ours_runs"][setting.label], r[layout]["theirs_runs"]),
                    notes="Llama 25M, batch 2 x 128 per rank, AdamW; per job the median over "
                    f"{bench_fsdp2_manager.ROUNDS // 2} alternating rounds of {bench_fsdp2_manager.STEPS} "
                    "steps (the slower rank's median step in a round), 2 jobs per setting (order: "
                    "settings, then reversed), mean of the 2; baseline: hand-written under glibc's "
                    f"defaults; {how}",
                )
            )
    return rows


def section_transformers() -> list[Row]:
    section = "vs plain transformers"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        path, size = bench_checkpoint_load.write_checkpoint(Path(tmp))
        base = bench_checkpoint_load.measure_baseline(path)
        what = f"Llama 125M ({size:.0f} MiB fp32)"
        for setting in HOST_SETTINGS:
            per_rank = bench_checkpoint_load.measure_ours(path, 2, setting)
            rows.append(
                Row(
                    section=section,
                    name=f"peak memory per rank, load + 1 SGD step, {what}: FSDP2 x 2 ranks vs "
                    "`from_pretrained` in 1 process",
                    ours=max(r["peak"] for r in per_rank),
                    baseline=base["peak"],
                    unit="MiB",
                    settings=setting.label,
                    notes="peak RSS growth (VmHWM) over load + step, max over ranks; baseline on glibc",
                )
            )
            rows.append(
                Row(
                    section=section,
                    name=f"load time, {what}: meta + `parallelize` + `load_hf_checkpoint` x 2 ranks "
                    "vs `from_pretrained`",
                    ours=max(r["load_s"] for r in per_rank),
                    baseline=base["load_s"],
                    unit="s",
                    settings=setting.label,
                    notes="each rank reads only its slices "
                    f"({max(r['bytes_read'] for r in per_rank) / MiB:.0f} MiB)",
                )
            )
    return rows


def section_scale() -> list[Row]:
    """Peak memory per rank at real widths (`bench_scale.py`): ours on 4 ranks vs transformers alone."""
    rows = []
    for r in bench_scale.measure(settings=HOST_SETTINGS[:2]):
        spec, base = bench_scale.MODELS[r.model], r.baseline
        for label, per_rank in r.ours.items():
            worst = max(per_rank, key=lambda x: x["peak"])
            loss = sum(x["loss"] for x in per_rank) / len(per_rank)
            rows.append(
                Row(
                    section="memory at real widths",
                    name=f"peak memory per rank, load + 1 {r.optimizer.upper()} step, {spec.label} vs "
                    f"`from_pretrained` + the same step in 1 process",
                    ours=worst["peak"],
                    baseline=base["peak"],
                    unit="MiB",
                    settings=label,
                    notes=f"bf16 checkpoint {r.checkpoint_mib:.0f} MiB; global batch {bench_scale.RANKS} x "
                    f"{bench_scale.SEQ} tokens (1 row per rank); growth by phase (MiB), ours: "
                    f"{bench_scale.phases_text(worst['phases'])}; transformers: "
                    f"{bench_scale.phases_text(base['phases'])}; loss {loss:.4f} (mean of ranks) vs "
                    f"{base['loss']:.4f}; load {max(x['load_s'] for x in per_rank):.1f} s vs "
                    f"{base['load_s']:.1f} s",
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
                    section="safetensors reader",
                    name=f"{what} per rank, Llama 125M fp32, 4 ranks reading their Shard(0) rows: ours vs "
                    f"{row['reader']}",
                    ours=ours[key],
                    baseline=row[key],
                    unit=unit,
                    notes="worst rank; warm page cache; peak = VmHWM growth (mapped pages count)",
                )
            )
    return out


def section_nemo() -> list[Row]:
    section = "vs NeMo AutoModel (same job)"
    with tempfile.TemporaryDirectory(prefix="bench-nemo-") as tmp:
        try:
            r = bench_vs_nemo.measure(Path(tmp), settings=HOST_SETTINGS)
        except bench_vs_nemo.NemoUnavailable as exc:
            return [
                Row(
                    section=section,
                    name="apply, step time and memory against nemo-automodel",
                    ours=None,
                    baseline=None,
                    notes=f"not run: {exc}",
                )
            ]
    nemo = r["nemo"]
    env = f"{bench_vs_nemo.NEMO_REQUIREMENT}, torch {r['torch']}, transformers {r['transformers']}"
    what = "Llama 33M, FSDP2 x 2 ranks, fp32, load from checkpoint"
    jobs = f"mean of 2 fresh jobs each (order {r['order']}; NeMo on glibc's malloc)"
    rows = []
    for setting in HOST_SETTINGS:
        label = setting.label
        ours = r["automodel"][label]
        runs = ours["losses"] + nemo["losses"]
        same = all(run == runs[0] for run in runs)
        for name, key, unit, scale, note in (
            (f"`apply_model_infrastructure` time, {what}", "apply_s", "s", 1.0, f"one scratch env: {env}"),
            ("peak memory per rank, apply + first step", "peak_mib", "MiB", 1.0, "max over ranks"),
            (
                "step time (SGD, batch 1 x 64 per rank), median of 5 steps",
                "step_s",
                "ms",
                1e3,
                "losses " + ("bit-identical at every step" if same else "DIFFER"),
            ),
        ):
            rows.append(
                Row(
                    section=section,
                    name=name,
                    ours=ours[key] * scale,
                    baseline=nemo[key] * scale,
                    unit=unit,
                    settings=label,
                    notes=f"{jobs}; {note}",
                    spread=_spread(ours[key + "_runs"], nemo[key + "_runs"]),
                )
            )
    imports = r["imports"]
    rows.append(
        Row(
            section=section,
            name="import of the orchestration module (`automodel_infra.infrastructure` vs "
            "`nemo_automodel._transformers.infrastructure`)",
            ours=imports["automodel"],
            baseline=imports["nemo"],
            unit="CPU s",
            notes="CPU time, smallest of 2 fresh processes; `import torch` alone: "
            f"{imports['torch']:.2f} CPU s",
        )
    )
    return rows


def _spread(ours: list[float], theirs: list[float]) -> tuple[float, float] | None:
    """Smallest and largest ratio over the pairs of jobs (job i of ours against job i of theirs)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b]
    return (min(ratios), max(ratios)) if len(ratios) > 1 else None


def section_imports() -> list[Row]:
    best = bench_import_time.measure(repeats=3)
    torch_s = best.pop("torch")
    return [
        Row(
            section="import time",
            name=f"`import {module}` vs `import torch`",
            ours=seconds,
            baseline=torch_s,
            unit="CPU s",
            notes="CPU time of the import, smallest of 3 fresh processes",
        )
        for module, seconds in best.items()
    ]


def section_schedules() -> list[Row]:
    section = "pipeline and experts"
    rows = []
    bubble = bench_pipeline_bubble.summarize(pp=2, microbatches=8, seq_len=128, steps=3, warmup=1)
    for row in bubble["schedules"]:

        def ms(key: str, row: dict = row) -> str:
            return "/".join(f"{value * 1e3:.0f}" for value in row[key])

        rows.append(
            Row(
                section=section,
                name=f"pipeline idle per step, {row['schedule']} (p 2, m 8, v {row['v']}): measured vs the "
                f"textbook bubble ((p - 1) / (v m) of compute)",
                ours=sum(row["idle_s"]) / len(row["idle_s"]) * 1e3,
                baseline=sum(row["theory_s"]) / len(row["theory_s"]) * 1e3,
                unit="ms",
                notes=f"idle = step - own compute, mean of ranks; per rank (ms): compute {ms('compute_s')}, "
                f"idle {ms('idle_s')} = p2p wait {ms('wait_s')} + p2p post {ms('post_s')} + other "
                f"{ms('other_s')}; replay of the op order with measured op times {ms('model_s')} "
                f"(without the {row['message_s'] * 1e3:.2f} ms messages {ms('model_no_comm_s')}), with "
                f"each step's own op times {ms('model_own_s')}; "
                f"step {row['step_s']:.2f} s",
            )
        )
    balance = bubble["balance"]
    heavy = bench_pipeline_bubble.HEAVY_HEAD_MODEL
    rows.append(
        Row(
            section=section,
            name=f"1F1B step (p 2, m 8) with a {heavy['vocab_size']}-token LM head (2.4 layers of work): "
            "layers split by cost (`balance_stages`) vs evenly",
            ours=balance["step_balanced_s"] * 1e3,
            baseline=balance["step_even_s"] * 1e3,
            unit="ms",
            notes=f"{heavy['num_hidden_layers']} layers per rank {balance['layers_even']} (even) vs "
            f"{balance['layers_balanced']} (by cost); the two pipelines' steps alternate, median of "
            f"{bench_pipeline_bubble.BALANCE_STEPS}",
        )
    )
    moe = bench_moe_ep.measure()
    what = "Qwen3-30B-A3B widths, 2 layers, 32 experts top 2: ep 4 vs replicated experts (FSDP2), 4 ranks"
    rows.append(
        Row(
            section=section,
            name=f"step time, {what}",
            ours=moe["ep_s"] * 1e3,
            baseline=moe["replicated_s"] * 1e3,
            unit="ms",
            notes="median of 3 SGD steps, max over ranks; the MoE parallelizer leaves the allocator alone",
        )
    )
    rows.append(
        Row(
            section=section,
            name=f"peak memory per rank, {what}",
            ours=moe["ep_mib"],
            baseline=moe["replicated_mib"],
            unit="MiB",
            notes="VmHWM during the steps, max over ranks",
        )
    )
    return rows


def section_planner() -> list[Row]:
    return [
        Row(
            section="planner",
            name=f"estimated vs measured peak per rank, {row['layout']} ({bench_planner.RANKS} ranks)",
            ours=row["estimate_mib"],
            baseline=row["measured_mib"],
            unit="MiB",
            notes="`automodel plan` total vs VmHWM growth over setup + 1 steady-state AdamW step, max over "
            f"ranks; {bench_planner.MODEL_LABEL}, seq {bench_planner.SEQ}; each layout in fresh ranks under "
            f"{row['allocator']}; by phase (MiB): "
            + ", ".join(f"{k} {v:.0f}" for k, v in row["phases_mib"].items()),
        )
        for row in bench_planner.measure()
    ]


def section_plan_time() -> list[Row]:
    result = bench_plan_time.measure(repeats=5)
    base = result["baseline"]
    rows = []
    named = {"ours": "`automodel plan` (TP 8 + SP x PP 8)", "suggest": "`automodel plan --suggest`"}
    for key, command in named.items():
        ours = result[key]
        walls = ", ".join(f"{w:.2f}" for w in ours["walls"])
        rows.append(
            Row(
                section="plan time",
                name=f"{command}, {bench_plan_time.LABEL}, vs transformers building the model on meta",
                ours=ours["wall_s"],
                baseline=base["wall_s"],
                unit="s",
                notes=f"wall time of a fresh process, median of 5 interleaved rounds ({walls}); CPU "
                f"{ours['cpu_s']:.2f} vs {base['cpu_s']:.2f} s"
                + ("; the issue's budget is 5 s" if key == "ours" else "; every layout of the 1,024 GPUs"),
            )
        )
    return rows


def section_checkpoints() -> list[Row]:
    section = "checkpoints"
    rows = []
    for ranks in (1, bench_checkpoint_save.RANKS):
        r = bench_checkpoint_save.measure_async(ranks)
        where = f"Llama 125M + AdamW, FSDP2 x {ranks} ({r['bytes'] / MiB:.0f} MiB per checkpoint)"
        free = "a free core" if ranks == 1 else "no free core"
        rows += [
            Row(
                section=section,
                name=f"blocking time per save, asynchronous vs synchronous, {where}",
                ours=r["async"],
                baseline=r["sync"],
                unit="s",
                notes="median of 3 saves, slowest rank: `AsyncCheckpointer.save` vs "
                "`save_distributed_checkpoint`",
            ),
            Row(
                section=section,
                name=f"blocking time per save vs the bare copy to host memory, {where}",
                ours=r["async"],
                baseline=r["staging"],
                unit="s",
                notes="baseline: DCP's staging alone, just before each save (goal: ratio <= 1.2)",
            ),
            Row(
                section=section,
                name=f"step time with a save in flight vs none, {where}",
                ours=r["busy_step"],
                baseline=r["idle_step"],
                unit="s",
                notes=f"{r['busy_steps_per_save']:.1f} steps per save; on 2 cores the background write has "
                f"{free} (goal <= 1.10)",
            ),
        ]
    for r in bench_checkpoint_save.measure_exports().values():
        rows += [
            Row(
                section=section,
                name=f"HF export, every rank writing vs one writer, {r['label']}",
                ours=r["parallel"],
                baseline=r["serial"],
                unit="s",
                notes=f"{r['bytes'] / MiB:.0f} MiB bf16 in files of {bench_checkpoint_save.SHARD} on 4 gloo "
                "ranks, median of 2 alternated (goal <= 0.35)",
            ),
            Row(
                section=section,
                name=f"HF export, peak growth per rank vs the largest tensor, {r['label']}",
                ours=r["parallel_peak"] / MiB,
                baseline=r["largest"] / MiB,
                unit="MiB",
                notes="VmHWM growth over the rank's resident shards during the export",
            ),
        ]
    return rows


def section_vlm() -> list[Row]:
    rows = []
    for sharding, row in bench_vlm_frozen.measure().items():
        for key, what in (
            ("resident", "held after loading"),
            ("gathered", "most held whole at once in a forward"),
        ):
            rows.append(
                Row(
                    section="vision-language",
                    name=f"frozen CLIP tower bytes per rank {what}, frozen_sharding={sharding} (2 ranks) vs "
                    "the unsharded tower",
                    ours=row[key] / 1024,
                    baseline=row["full"] / 1024,
                    unit="KiB",
                    notes="LLaVA (CLIP hidden 256 x 4 layers, Llama), fp32; worst rank; tensor bytes",
                )
            )
    return rows


def section_long_context() -> list[Row]:
    section = "long context"
    rows = bench_long_context.measure()
    by = {(r["case"], r["seq"]): r for r in rows}
    pairs = (
        ("CP 4 ring", "no CP", "peak_mib",
         "peak memory per rank, CP 4 (ring) vs no CP (one whole row per rank)"),
        ("CP 4 all-to-all", "CP 4 ring", "peak_mib",
         "peak memory per rank, CP 4: all-to-all vs ring attention"),
        ("CP 4 all-to-all", "CP 4 ring", "step_s", "step time, CP 4: all-to-all vs ring attention"),
        ("CP 4 packed", "CP 4 all-to-all", "peak_mib", "peak memory per rank, CP 4: packed vs unpacked rows"),
        ("CP 4 packed", "CP 4 all-to-all", "step_s", "step time, CP 4: packed vs unpacked rows"),
        ("CP 4 packed, gathered keys (6 heads)", "CP 4 ring, 6 heads", "peak_mib",
         "peak memory per rank, CP 4, 6 heads: packed rows over gathered keys vs unpacked (ring)"),
    )  # fmt: skip
    out = []
    for ours, base, key, what in pairs:
        for seq in bench_long_context.LENGTHS:
            if (ours, seq) not in by or (base, seq) not in by:
                continue
            mine, theirs = by[(ours, seq)], by[(base, seq)]
            time_like = key == "step_s"
            out.append(
                Row(
                    section=section,
                    name=f"{what}, {seq // 1024}k tokens per row",
                    ours=mine[key] * (1e3 if time_like else 1),
                    baseline=theirs[key] * (1e3 if time_like else 1),
                    unit="ms" if time_like else "MiB",
                    notes=f"4 CPU ranks; planner's estimate {mine['estimate_mib']:.0f} vs "
                    f"{theirs['estimate_mib']:.0f} MiB (measured {mine['peak_mib']:.0f} vs "
                    f"{theirs['peak_mib']:.0f}); steps {mine['step_s']:.1f} vs {theirs['step_s']:.1f} s",
                )
            )
    return out


def section_streaming() -> list[Row]:
    section = "streaming"
    found = bench_streaming.measure()
    size = f"{found['corpus_bytes'] / 1e9:.1f} GB corpus ({found['records']} records)"
    first, last = found["pass_rss"][0], found["pass_rss"][-1]
    resumed, expected = found["last_loss"]
    return [
        Row(
            section=section,
            name="resident memory per worker, last quarter of the steps vs second quarter",
            ours=found["rss_last_quarter"] / MiB,
            baseline=found["rss_second_quarter"] / MiB,
            unit="MiB",
            notes=f"{size}; 2 CPU workers, global batch {bench_streaming.SLOTS}, seq_len 512, "
            f"{bench_streaming.STEPS} steps; worst worker's VmRSS",
        ),
        Row(
            section=section,
            name="resident memory streaming 1 of 64 row slots through the whole corpus: end vs first tenth",
            ours=last[1] / MiB,
            baseline=first[1] / MiB,
            unit="MiB",
            notes=f"{size}; one process; the pass took {found['pass_s']:.0f} s",
        ),
        Row(
            section=section,
            name=f"loss at step {bench_streaming.STEPS}: SIGTERM at step {found['stopped_at']} on 2 workers, "
            "resumed on 1, vs uninterrupted on 2",
            ours=resumed,
            baseline=expected,
            unit="",
            notes=f"largest difference over all {found['steps_compared']} steps "
            f"{found['max_loss_difference']:.1e}",
        ),
    ]


SECTIONS: dict[str, Callable[[], list[Row]]] = {
    "pytorch": section_pytorch,
    "transformers": section_transformers,
    "nemo": section_nemo,
    "imports": section_imports,
    "readers": section_readers,
    "schedules": section_schedules,
    "planner": section_planner,
    "plan_time": section_plan_time,
    "vlm": section_vlm,
    "checkpoints": section_checkpoints,
    "scale": section_scale,
    "long_context": section_long_context,
    "streaming": section_streaming,
}


def _print_table(sections: list[Section]) -> None:
    print(benchmark_report.render(sections))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("--json", type=Path, help="write the run's sections here (benchmark_report reads it)")
    parser.add_argument(
        "--publish",
        action="store_true",
        help="merge the sections into docs/benchmarks.json and regenerate docs/benchmarks.md's table",
    )
    args = parser.parse_args()
    machine = benchmark_report.machine_description(torch.__version__) + ", no GPU used (gloo)"
    sections: list[Section] = []
    broken: set[str] = set()
    for name in args.only or list(SECTIONS):
        load_before = benchmark_report.load_average()
        start = time.perf_counter()
        print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
        try:
            rows = SECTIONS[name]()
        except Exception as exc:  # one broken benchmark must not hide the others' figures
            broken.add(name)
            traceback.print_exc()
            rows = [Row(section=name, name="(section failed)", ours=None, baseline=None,
                        notes=f"{type(exc).__name__}: {str(exc)[:200]}")]  # fmt: skip
        wall = time.perf_counter() - start
        sections.append(Section(key=name, provenance=Provenance.now(machine, load_before, wall), rows=rows))
        print(f"[run_all] {name}: {wall:.0f} s", file=sys.stderr, flush=True)
    print("ratio = ours / baseline, measured in the same run (below 1: ours is faster or smaller).")
    print("CPU timings are only meaningful as ratios; they say nothing about GPU speed.\n")
    _print_table(sections)
    if args.json:
        benchmark_report.dump_sections(sections, args.json)
    if args.publish:
        # A failed section keeps its previous figures; the others are published.
        done = [s for s in sections if s.key not in broken]
        merged = benchmark_report.merge_sections(benchmark_report.load_sections(), done)
        benchmark_report.dump_sections(merged)
        page = benchmark_report.PAGE.read_text()
        benchmark_report.PAGE.write_text(benchmark_report.update_page(page, merged))
        print(f"[run_all] published {[s.key for s in done]} to {benchmark_report.PAGE}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
