"""Predict every published run (``automodel_planner/published_runs.toml``) and write docs/throughput.md.

Usage::

    python tools/throughput_doc.py [docs/throughput.md] [--fit] [--json out.json]

Plans each row as a job (`automodel_planner.published.run_plan`) and predicts its step on its cluster with
the committed efficiencies (`automodel_planner.step_time.DEFAULT_EFFICIENCY`). ``--fit`` first fits the
efficiencies on the calibration rows (`fit_efficiency`) and prints them (paste them into
``DEFAULT_EFFICIENCY`` to adopt them); the page is written from the committed ones either way, so what it
shows is what ``automodel plan`` predicts. Each row gives the published and predicted tokens/s per GPU,
the error, and the largest parts of the predicted step; then what ``automodel plan --suggest`` picks for
each run's cluster and batch beside the published layout (every valid layout of 512 GPUs is planned: a
few minutes in all); then two of the runs planned from 8 to 1,024 GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _largest_parts(step: Any) -> dict[str, float]:
    """The three largest parts of a predicted step, as shares of it."""
    parts = sorted(step.parts.items(), key=lambda item: -item[1])[:3]
    return {name: seconds / step.step_seconds for name, seconds in parts}


def _parts_text(parts: dict[str, float]) -> str:
    """``compute 85%, recompute 14%, ...``."""
    return ", ".join(f"{name} {share:.0%}" for name, share in parts.items())


def predictions() -> list[dict[str, Any]]:
    """One entry per published run: the row, the prediction and its error."""
    from automodel_planner.published import predict, predict_memory, published_runs

    rows = []
    for run in published_runs():
        start = time.perf_counter()
        step = predict(run)
        predicted = step.tokens_per_s_per_gpu
        rows.append(
            {
                "id": run.id,
                "role": run.role,
                "source": run.source,
                "cluster": run.cluster
                + (f" ({run.network_gbps:g} Gb/s per GPU)" if run.network_gbps is not None else ""),
                "device": run.hardware().device.name,
                "published": run.tokens_per_s_per_gpu,
                "predicted": predicted,
                "error": predicted / run.tokens_per_s_per_gpu - 1,
                "mfu": step.mfu,
                "step_seconds": step.step_seconds,
                "parts": _largest_parts(step),
                "plan_seconds": time.perf_counter() - start,
                **_memory(predict_memory(run) if run.memory_gib is not None else None, run.memory_gib),
            }
        )
    return rows


def suggestions() -> list[dict[str, Any]]:
    """Per published run: the layouts ``automodel plan --cluster ... --suggest`` ranks, the published one too.

    Each run is planned as the job a user would write for it (`automodel_all.cli.published_jobs`), so
    what is ranked is exactly what the command ranks.
    """
    import tempfile

    from automodel_all.cli.plan import plan_report
    from automodel_all.cli.published_jobs import published_job
    from automodel_planner.published import published_runs

    out = []
    for run in published_runs():
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            report = plan_report(
                published_job(run, folder),
                hardware=run.hardware(),
                suggest=True,
                suggestions=10**6,
            )
        ranked = report["suggestions"]
        published = {f"{axis}_size": 1 for axis in ("dp_replicate", "tp", "pp", "cp", "ep")}
        published |= {f"{axis}_size": size for axis, size in run.sizes.items() if axis != "dp_shard"}
        own = next(i for i, entry in enumerate(ranked) if entry["sizes"] == published)
        out.append(
            {
                "id": run.id,
                "layouts": len(ranked),
                "fitting": sum(bool(entry["fits"]) for entry in ranked),
                "rank": own + 1,
                "published": ranked[own],
                "pick": ranked[0],
                "seconds": time.perf_counter() - start,
            }
        )
    return out


SCALING: tuple[tuple[str, dict[str, Any]], ...] = (
    ("torchtitan 8B, 128 GPUs, FSDP", {}),
    ("llm-foundry MPT-1b, 512 H100s, seq 2048, micro-batch 12 x 1", {"local_batch": 2, "micro_batch": 2}),
)
"""Published runs replanned from 8 to 1,024 GPUs (`scaling`): the row's id and what changes in it."""
SCALING_GPUS = (8, 64, 256, 1024)


def scaling() -> list[dict[str, Any]]:
    """Each `SCALING` run at each of `SCALING_GPUS`, sharded over every GPU (FSDP) or within a node (HSDP).

    The same job per GPU (batch, sequence, settings) on H100 nodes of 8; what grows is the groups its
    collectives span, and with them NCCL's latency per operation.
    """
    from automodel_planner.published import predict, published_runs

    runs = {run.id: run for run in published_runs()}
    out = []
    for run_id, changes in SCALING:
        base = dataclasses.replace(runs[run_id], **changes)
        for gpus in SCALING_GPUS:
            layouts = {"FSDP": {"dp_shard": gpus}}
            if gpus > 8:
                layouts["HSDP (8 x replicas)"] = {"dp_shard": 8, "dp_replicate": gpus // 8}
            for layout, sizes in layouts.items():
                run = dataclasses.replace(base, cluster=f"{gpus}xH100", sizes=sizes, network_gbps=None)
                step = predict(run)
                out.append(
                    {
                        "model": f"{run.shape}, micro-batch {run.micro_batch} x {run.seq_len}",
                        "gpus": gpus,
                        "layout": layout,
                        "tokens_per_s_per_gpu": step.tokens_per_s_per_gpu,
                        "parts": _largest_parts(step),
                    }
                )
    return out


def _scaling_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## From 8 to 1,024 GPUs",
        "",
        "Two of the published jobs (the same batch, sequence and settings per GPU) planned on 8 to 1,024 "
        "H100s (8 per node), sharded over every GPU (FSDP) or inside each node and replicated across "
        "them (HSDP). Each NCCL operation pays the latency NCCL's own tuner gives its ring or tree "
        "(`automodel_planner.hardware.NCCL_ALGORITHMS`): a ring all-gather over 1,024 GPUs runs 1,023 "
        "steps, 127 of them across the network, for each FSDP unit in each pass, while HSDP's "
        "all-gathers stay inside a node and its all-reduce crosses the network once per unit per step, "
        "as a tree.",
        "",
        "| model | GPUs | layout | predicted tokens/s/GPU | largest parts |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    for row in rows:
        parts = _parts_text(row["parts"])
        lines.append(
            f"| {row['model']} | {row['gpus']:,} | {row['layout']} | {row['tokens_per_s_per_gpu']:,.0f} "
            f"| {parts} |"
        )
    return lines


def _scale_out_table(rows: list[dict[str, Any]]) -> list[str]:
    """The published pairs of one job at two cluster sizes: the change of tokens/s per GPU, both ways."""
    from automodel_planner.published import published_runs, scale_out_pairs

    by_id = {row["id"]: row for row in rows}
    lines = [
        "",
        "## One job at two scales",
        "",
        "The rows that publish one job on two cluster sizes (`automodel_planner.published.scale_out_pairs`: "
        "the same page, device, model, sequence, micro-batch, model-parallel sizes and settings; more "
        "data-parallel replicas, and the batch each takes per step as its source ran it), each larger one "
        "beside its group's smallest: how tokens/s per GPU changes, published and predicted. It sets aside "
        "what one cluster size cannot tell (the achievable fractions of a page's software) and checks what "
        "the model says grows with the cluster: the collectives' groups, links and NCCL latency, and the SMs "
        "their kernels hold while compute runs beside them. llm-foundry's pairs from 8 to 128 or more "
        "GPUs span its two H100 tables, run three months apart (attention kernel and all).",
        "",
        "| run | GPUs | published tokens/s/GPU | published change | predicted change | error of the change |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    errors = []
    for small, large in scale_out_pairs(published_runs()):
        before, after = by_id[small.id], by_id[large.id]
        published = after["published"] / before["published"]
        predicted = after["predicted"] / before["predicted"]
        errors.append(predicted / published - 1)
        lines.append(
            f"| {large.id} | {small.hardware().count:,} -> {large.hardware().count:,} "
            f"| {before['published']:,.0f} -> {after['published']:,.0f} | {published - 1:+.1%} "
            f"| {predicted - 1:+.1%} | {errors[-1]:+.1%} |"
        )
    lines += [
        "",
        f"{sum(abs(e) <= 0.10 for e in errors)} of {len(errors)} pairs within 10%; median error of the "
        f"change {statistics.median(errors):+.1%} (the model keeps more of a small cluster's speed than "
        "the published runs do where it is positive).",
    ]
    return lines


def _suggestion_table(rows: list[dict[str, Any]]) -> list[str]:
    """The `--suggest` section: its first pick for each run, beside the published layout."""
    lines = [
        "",
        "## `--suggest` against the published layouts",
        "",
        "Each run as the job a user would write for it (`automodel_all.cli.published_jobs`: the same model, "
        "batch per step, sequence, checkpointing, compile, float8 and adapters), given to `automodel plan "
        "--cluster ... --suggest`, which ranks every valid layout of the cluster's GPUs: those whose "
        "predicted peak fits the device first, fastest first (those within 0.5% of the fastest, closer "
        "than the model can tell apart, by lowest peak). The table gives its first pick beside the "
        "published layout, that layout's place in the ranking, and, where the pick differs, why: the parts "
        "of the predicted step that differ most between the two.",
        "",
        "| run | published layout | predicted tokens/s/GPU | its rank (fitting / valid) | `--suggest` "
        "picks | predicted tokens/s/GPU | reason |",
        "| --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    for row in rows:
        own, pick = row["published"], row["pick"]
        own_speed = own["throughput"]["tokens_per_s_per_gpu"]
        pick_speed = pick["throughput"]["tokens_per_s_per_gpu"]
        if row["rank"] == 1:
            reason, name = "the published layout", "the same"
        else:
            reason, name = _reason(own, pick), pick["layout"]
        fits = "" if own["fits"] else " (does not fit)"
        lines.append(
            f"| {row['id']} | {own['layout']}{fits} | {own_speed:,.0f} | {row['rank']} "
            f"({row['fitting']} / {row['layouts']}) | {name} | {pick_speed:,.0f} "
            f"({pick_speed / own_speed - 1:+.1%}) | {reason} |"
        )
    same = sum(row["rank"] == 1 for row in rows)
    lines += ["", f"`--suggest` picks the published layout for {same} of {len(rows)} runs."]
    return lines


def _reason(own: dict[str, Any], pick: dict[str, Any]) -> str:
    """The two parts of the predicted step that differ most between the published layout and the pick."""
    before, after = own["throughput"]["breakdown_seconds"], pick["throughput"]["breakdown_seconds"]
    changes = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in {*before, *after}}
    largest = sorted(changes.items(), key=lambda item: -abs(item[1]))[:2]
    return ", ".join(f"{name} {delta:+.2f} s" for name, delta in largest)


def _memory(peak: Any, published_gib: float | None) -> dict[str, Any]:
    """The memory prediction of a row that publishes its memory: GiB, error and its largest lines."""
    if peak is None or published_gib is None:
        return {}
    gib = peak.total / 2**30
    lines = sorted(peak.lines.items(), key=lambda item: -item[1])[:3]
    return {
        "memory_published_gib": published_gib,
        "memory_predicted_gib": gib,
        "memory_error": gib / published_gib - 1,
        "memory_lines": {name: size / 2**30 for name, size in lines},
    }


def _memory_table(rows: list[dict[str, Any]]) -> list[str]:
    """The memory section: every row that publishes its memory, the prediction and the error."""
    from automodel_planner.runtime_memory import CUDA_CONTEXT_BYTES, NCCL_CONNECTION_BYTES

    lines = [
        "",
        "## Memory against the published figures",
        "",
        "The memory model's peak (`automodel plan`'s estimate, the rank holding the most) beside each "
        "published peak. It counts the job as our trainer would run it: the row's parameter dtype "
        "(torchtitan's fp32 shards, bf16 all-gathers and fp32 reduce-scatters: FSDP2's mixed precision), "
        "the logits kept sharded over TP by the vocabulary-parallel loss, on a pipeline's last stage too (as "
        "torchtitan's loss parallel), each rank's slice of the sequence between pipeline stages under SP, "
        "and, as the published peaks are torch's reserved memory, the caching allocator's reserve over the "
        "live tensors (`ALLOCATOR_RESERVE`, one fraction fitted on the calibration rows: "
        "`fit_allocator_reserve`). Nothing else is fitted. The CUDA context and NCCL's buffers are "
        "outside torch's allocator and the published peaks, so they are not in this comparison; "
        "`automodel plan` adds them to a GPU job's peak before it says whether the job fits "
        "(`automodel_planner.runtime_memory`: a context of "
        f"{CUDA_CONTEXT_BYTES / 1e6:.0f} MB, and {NCCL_CONNECTION_BYTES / 2**20:.2f} MiB per channel "
        "and peer of each communicator, the channels per device below).",
        "",
        "| run | published GiB | predicted GiB | error | largest lines (GiB) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    errors = []
    for row in rows:
        if "memory_error" not in row:
            continue
        errors.append(abs(row["memory_error"]))
        parts = ", ".join(f"{name} {size:.1f}" for name, size in row["memory_lines"].items())
        lines.append(
            f"| {row['id']} | {row['memory_published_gib']:.1f} | {row['memory_predicted_gib']:.1f} | "
            f"{row['memory_error']:+.1%} | {parts} |"
        )
    if errors:
        within = sum(e <= 0.10 for e in errors)
        lines += ["", f"{within} of {len(errors)} rows within 10%, largest error {max(errors):.1%}."]
    return lines


def _model_description() -> list[str]:
    """The time model's own description: its module docstring after the first line."""
    from automodel_planner import step_time

    text = (step_time.__doc__ or "").split("\n", 1)[1].strip()
    return text.splitlines()


def _page(source: str) -> str:
    """``owner/repo file`` of a GitHub address."""
    parts = source.split("/")
    return f"{parts[3]}/{parts[4]} {parts[-1]}" if "github.com" in source else source


def _by_source(rows: list[dict[str, Any]]) -> list[str]:
    """The evaluation rows' errors per benchmark page and device: where the model holds and where not."""
    groups: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if row["role"] == "evaluation":
            key = (row["source"].split(" ")[0], row["device"])
            groups.setdefault(key, []).append(row["error"])
    lines = [
        "",
        "Evaluation rows by benchmark page and device. The pages' software differs: llm-foundry's MPT "
        "sweep (2023) ran torch 2.1's FSDP, eager kernels and flash-attn's Triton attention; torchtitan's "
        "and NeMo AutoModel's runs (2024-2026) FSDP2, torch.compile or Transformer Engine, and "
        "FlashAttention-2 or cuDNN attention. The achievable fractions are fitted on the latter's "
        "calibration rows.",
        "",
        "| page | device | rows | within 10% | median error | RMS log error |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for (source, device), errors in groups.items():
        rms = math.sqrt(sum(math.log1p(e) ** 2 for e in errors) / len(errors))
        lines.append(
            f"| [{_page(source)}]({source}) | {device} | {len(errors)} "
            f"| {sum(abs(e) <= 0.10 for e in errors)} | {statistics.median(errors):+.1%} | {rms:.3f} |"
        )
    return lines


def render(
    rows: list[dict[str, Any]], efficiency: Any, suggested: list[dict[str, Any]], scaled: list[dict[str, Any]]
) -> str:
    """The page."""
    from automodel_planner.hardware import DEVICES

    lines = [
        "# Planning time: step time, tokens/s per GPU and MFU",
        "",
        "<!-- Generated by tools/throughput_doc.py; do not edit by hand. -->",
        "",
        f"Generated {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC at commit `{_commit()}` "
        "(no GPU: predictions from shapes, layouts and datasheets, checked against the published figures).",
        "",
        "`automodel plan --cluster 8xH100` adds the predicted step to the plan "
        "(`automodel_planner.estimate_throughput`; `--json` under `throughput`). The model is described "
        "in `automodel_planner.step_time`; its only free parameters are the achievable fractions below, "
        "fitted on the calibration rows only.",
        "",
        "## The model (`automodel_planner.step_time`)",
        "",
        *_model_description(),
        "",
        "## Published runs",
        "",
        "| run | role | cluster | published tokens/s/GPU | predicted | error | predicted MFU "
        "| largest parts |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        parts = _parts_text(row["parts"])
        lines.append(
            f"| [{row['id']}]({row['source'].split(' ')[0]}) | {row['role']} | {row['cluster']} | "
            f"{row['published']:,.0f} | {row['predicted']:,.0f} | {row['error']:+.1%} | {row['mfu']:.1%} "
            f"| {parts} |"
        )
    for role in ("calibration", "evaluation"):
        errors = [abs(r["error"]) for r in rows if r["role"] == role]
        if errors:
            within = sum(e <= 0.10 for e in errors)
            rms = math.sqrt(sum(math.log1p(e) ** 2 for e in errors) / len(errors))
            lines.append("")
            lines.append(
                f"{role.capitalize()} rows: {within} of {len(errors)} within 10%, largest error "
                f"{max(errors):.1%}, RMS log error {rms:.3f}."
            )
    lines += _by_source(rows)
    lines += _scale_out_table(rows)
    lines += _memory_table(rows)
    lines += _suggestion_table(suggested)
    lines += _scaling_table(scaled)
    lines += [
        "",
        "## Achievable fractions (`automodel_planner.step_time.DEFAULT_EFFICIENCY`)",
        "",
        "What fraction of a device's rate each kind of op reaches (the matmuls' of its best matmul rate, "
        "the measured share of its peak in the devices' table below; the others' of its peaks); each "
        "field's meaning is in the API reference (`automodel_planner.step_time.Efficiency`).",
        "",
        "| field | value |",
        "| --- | ---: |",
    ]
    for field in dataclasses.fields(efficiency):
        lines.append(f"| `{field.name}` | {getattr(efficiency, field.name):.3f} |")
    from automodel_planner.estimate import ALLOCATOR_RESERVE

    lines += [
        "",
        f"The memory model's one fitted number: `automodel_planner.estimate.ALLOCATOR_RESERVE` = "
        f"{ALLOCATOR_RESERVE:.3f} (the caching allocator's reserve over the live tensors).",
        "",
        "## Devices (`automodel_planner.hardware.DEVICES`)",
        "",
        "The best matmul's share of the peak is measured (stas00/ml-engineering's maximum achievable "
        "matmul FLOPS: the best of a sweep of large GEMM shapes); a Hopper part without a measurement of "
        "its own takes the H100 SXM's bf16 share and the H200's fp8 share.",
        "",
        "| device | dense bf16 TFLOP/s | dense fp8 TFLOP/s | best matmul, share of peak (bf16, fp8) "
        "| HBM TB/s | memory GiB "
        "| NVLink GB/s per direction | network GB/s per GPU | NCCL channels per peer in a node | SMs "
        "| source |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for device in DEVICES.values():
        fp8 = f"{device.fp8_flops / 1e12:,.0f}" if device.fp8_flops else "-"
        shares = f"{device.matmul_share:.1%}" + (
            f", {device.fp8_matmul_share:.1%}" if device.fp8_flops else ""
        )
        lines.append(
            f"| {device.name} | {device.bf16_flops / 1e12:,.0f} | {fp8} | {shares} "
            f"| {device.hbm_bytes_per_s / 1e12:.2f} | "
            f"{device.memory_bytes / 2**30:.1f} | {device.intra_node_bytes_per_s / 1e9:.0f} | "
            f"{device.inter_node_bytes_per_s / 1e9:.0f} | {device.nccl_channels} | {device.sm_count} "
            f"| {device.source} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Predict, print, write the page (and the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default=str(ROOT / "docs" / "throughput.md"))
    parser.add_argument(
        "--fit", action="store_true", help="fit the efficiencies on the calibration rows first"
    )
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    from automodel_planner.published import fit_allocator_reserve, fit_efficiency, published_runs
    from automodel_planner.step_time import DEFAULT_EFFICIENCY

    if args.fit:
        fitted, error = fit_efficiency(published_runs("calibration"))
        print(f"fitted on the calibration rows (RMS log error {error:.4f}):\n  {fitted}")
        reserve = fit_allocator_reserve(published_runs("calibration"))
        print(f"  ALLOCATOR_RESERVE = {reserve:.3f}")
    rows = predictions()
    for row in rows:
        print(
            f"{row['error']:+7.1%}  {row['published']:8,.0f} {row['predicted']:8,.0f}  {row['id']}  "
            f"({row['plan_seconds']:.1f} s)"
        )
    suggested = suggestions()
    for entry in suggested:
        print(f"rank {entry['rank']:3d} of {entry['layouts']:4d}  {entry['id']}  ({entry['seconds']:.1f} s)")
    scaled = scaling()
    Path(args.output).write_text(render(rows, DEFAULT_EFFICIENCY, suggested, scaled), encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
