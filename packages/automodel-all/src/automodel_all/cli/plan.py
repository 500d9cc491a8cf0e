"""``automodel plan``: a dry run on the meta device, with no process group and no worker.

It prints the mesh layout (`MeshContext.resolve`), the steps `apply_model_infrastructure` will apply in
order (`automodel_infra.infrastructure.APPLY_STEPS`), and the estimated peak memory of the largest
rank, line by line (`automodel_planner.estimate_peak`):
parameters, gradients, AdamW state, FSDP's gathered units, activations (profiled from the model's own
forward on fake tensors), LoRA / FP8 extras and communication buffers; with a device size, whether it
fits; with a cluster (``--cluster 8xH100``), the step time part by part, tokens/s per GPU and MFU
(`automodel_planner.estimate_throughput`); with ``suggest``, every valid layout of the world size
ranked by peak memory, then traffic, or, with a cluster, the layouts that fit ranked by throughput.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from automodel_all.cli.config import JobConfig, ResolvedJob, build_job, resolve_job
from automodel_all.cli.launch import nproc_per_node
from automodel_all.cli.model import adapt_experts_too, load_model_config
from automodel_all.cli.planning import plan_input, planning_model
from automodel_all.cli.yaml_source import ConfigError, RawJob
from automodel_distributed.fsdp2_units import frozen_towers
from automodel_infra.infrastructure import APPLY_STEPS
from automodel_infra.steps import PlannedJob, describe_steps
from automodel_planner import PeakEstimate, PlanInput, ProfileCache, device_memory_bytes, estimate_peak
from automodel_planner.estimate import calibrate_efficiency, estimate_throughput, with_allocator_reserve
from automodel_planner.hardware import Cluster, cluster_from_mapping, parse_cluster
from automodel_planner.runtime_memory import with_process_memory
from automodel_planner.step_time import DEFAULT_EFFICIENCY, StepTime

__all__ = [
    "cluster",
    "device_memory",
    "measured_step_seconds",
    "plan",
    "plan_input",
    "plan_report",
    "planned_job",
    "planned_steps",
    "suggest_layouts",
]

_MIB = 2**20


def device_memory(text: str) -> int:
    """Bytes of ``--device-memory``: a preset (``automodel_planner.DEVICE_PRESETS``) or a size (``80GiB``).

    Raises:
        ConfigError: Neither, naming the option.
    """
    try:
        return device_memory_bytes(text)
    except ValueError as exc:
        raise ConfigError(f"--device-memory {exc}") from None


def cluster(text: str) -> Cluster:
    """The hardware of ``--cluster``: ``NxDEVICE`` (``128xH100``) or a YAML file describing one's own.

    Raises:
        ConfigError: Neither, or a bad file, naming the option.
    """
    if text.endswith((".yaml", ".yml")):
        import yaml

        try:
            with open(text, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except OSError as exc:
            raise ConfigError(f"--cluster {text}: cannot read it ({exc.strerror})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--cluster {text}: expected a mapping (gpus, device, ...)")
        try:
            return cluster_from_mapping(data)
        except ValueError as exc:
            raise ConfigError(f"--cluster {text}: {exc}") from None
    try:
        return parse_cluster(text)
    except ValueError as exc:
        raise ConfigError(f"--cluster {exc}") from None


def measured_step_seconds(path: str) -> float:
    """The median step time of a run's ``train_log.jsonl`` (``--calibrate``), its first two steps left out.

    The first steps pay for compilation and the allocator's warm-up; the median is robust to the odd
    slow step (a checkpoint, an evaluation).

    Raises:
        ConfigError: Unreadable, or fewer than three steps with a time, naming the option.
    """
    import statistics

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"--calibrate {path}: cannot read it ({exc.strerror})") from None
    try:
        times = [
            float(record["seconds"]) for record in map(json.loads, filter(None, lines)) if "seconds" in record
        ]
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--calibrate {path}: not a train_log.jsonl of automodel train ({exc})") from None
    if len(times) < 3:
        raise ConfigError(
            f"--calibrate {path}: {len(times)} step(s) with a time; calibrating needs at least 3 (the first "
            "two are left out as warm-up)"
        )
    return statistics.median(times[2:])


def planned_job(job: JobConfig, resolved: ResolvedJob, model: nn.Module, adapted: int) -> PlannedJob:
    """What `apply_model_infrastructure`'s steps will see for this job (`automodel_infra.steps`)."""
    layout = resolved.layout
    blocks = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    stages = 0
    if resolved.pipeline is not None:
        stages = resolved.pipeline.stage_count(layout.pp, blocks) or layout.pp
    return PlannedJob(
        model=model,
        layout=layout,
        device_type=job.device_type,
        strategy=job.distributed,
        pipeline=resolved.pipeline,
        pipeline_stages=stages,
        peft=job.peft,
        adapted_layers=adapted,
        fp8=job.fp8,
        qat=job.qat,
        compile=job.compile,
        freeze=job.freeze_config,
        frozen_towers=tuple(fqn for fqn, _ in frozen_towers(model)),
        weights=_weights_source(job),
        loads_checkpoint=job.model.name_or_path is not None and job.model.load_weights,
    )


def planned_steps(job: JobConfig, resolved: ResolvedJob, model: nn.Module, adapted: int) -> list[str]:
    """What `apply_model_infrastructure` will do, in the order of its `APPLY_STEPS`."""
    return describe_steps(APPLY_STEPS, planned_job(job, resolved, model, adapted))


def _weights_source(job: JobConfig) -> str:
    if job.model.name_or_path is None:
        return "load the embedded default's initial weights (made once by the launcher, seeded)"
    if job.model.load_weights:
        return f"load {job.model.name_or_path}"
    return "initialise the weights randomly (model.load_weights is false)"


def _fmt(count: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return str(int(count))


def _params(model: nn.Module) -> Iterable[nn.Parameter]:
    return model.parameters()


_LAYOUT_KEYS = ("dp_replicate_size", "tp_size", "pp_size", "cp_size", "ep_size")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(world: int, moe: bool) -> list[dict[str, int]]:
    """Every (dp_replicate, tp, pp, cp, ep) whose dense product divides the world size."""
    out = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                for rep in _divisors(dp):
                    for ep in _divisors(world // pp) if moe else [1]:
                        out.append(
                            {
                                "dp_replicate_size": rep,
                                "tp_size": tp,
                                "pp_size": pp,
                                "cp_size": cp,
                                "ep_size": ep,
                            }
                        )
    return out


def _layout_name(sizes: dict[str, int]) -> str:
    parts = [f"{k.removesuffix('_size')}={v}" for k, v in sizes.items() if v > 1]
    return ", ".join(parts) or "dp_shard only"


def suggest_layouts(
    raw: RawJob,
    world: int,
    model: nn.Module,
    model_config: Any,
    *,
    limit: int = 5,
    base_weight_bits: int | None = None,
    hardware: Cluster | None = None,
    device_memory: int | None = None,
) -> list[dict[str, Any]]:
    """Every valid layout of ``world`` ranks for the job, best first.

    Without ``hardware``: lowest peak, then least traffic. With it: the layouts whose peak fits the
    device (``device_memory`` bytes, by default its own) first, fastest (predicted tokens/s per GPU)
    first, those within ``_TIED`` of the fastest by lowest peak, then those that do not fit. A layout is
    valid when `resolve_job` accepts it (sizes divide, heads and layers suffice, batch splits). The
    job's own layout settings are replaced; everything else is kept.
    """
    moe = _config_has_experts(model_config)
    cache: ProfileCache = {}
    memo: dict[str, Any] = {}  # what the planner derives from the model alone, for every layout
    ranked: list[tuple[Any, dict[str, Any]]] = []
    unranked: dict[int, Any] = {}  # layouts that do not fit: their time only if they are listed
    for sizes in _candidates(world, moe):
        trial = copy.deepcopy(raw)
        for key in _LAYOUT_KEYS:
            trial.set("parallelism", key, sizes[key], "--suggest")
        trial.sections.get("parallelism", {}).pop("dp_size", None)
        try:
            job = build_job(trial)
            resolved = resolve_job(job, world, model_config)
        except (ConfigError, ValueError):
            continue
        planned = plan_input(resolved, model, model_config, base_weight_bits, memo)
        estimate = estimate_peak(planned, profile_cache=cache)
        if hardware is not None:
            estimate = _on_gpus_estimate(estimate, planned, hardware)
        entry = {"layout": _layout_name(sizes), "sizes": sizes, **estimate.as_dict()}
        order: tuple[float, ...] = (estimate.total, estimate.communication_total)
        if hardware is not None:
            capacity = device_memory if device_memory is not None else hardware.device.memory_bytes
            entry["fits"] = estimate.total <= capacity
            if entry["fits"]:
                speed = estimate_throughput(planned, hardware, profile_cache=cache)
                entry["throughput"] = speed.as_dict()
                order = (0, -speed.tokens_per_s_per_gpu)
            else:  # ranked by peak: the time model runs only for those listed
                unranked[id(entry)] = resolved
                order = (1, estimate.total)
        ranked.append((order, entry))
    ranked.sort(key=lambda item: item[0])
    entries = [entry for _, entry in ranked]
    listed = (_ties_by_memory(entries) if hardware is not None else entries)[:limit]
    for entry in listed:
        if id(entry) in unranked and hardware is not None:
            planned = plan_input(unranked[id(entry)], model, model_config, base_weight_bits, memo)
            entry["throughput"] = estimate_throughput(planned, hardware, profile_cache=cache).as_dict()
    return listed


_TIED = 0.005
"""Predicted throughputs within this fraction of the fastest fitting layout's are a tie: finer than the
time model can tell apart (its error on published runs is several percent)."""


def _ties_by_memory(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` (fitting first, fastest first), those tied with the fastest ordered by peak, lowest first.

    Of layouts equally fast, the one with the most memory to spare is the better choice.
    """
    fitting = [entry for entry in entries if entry["fits"]]
    if not fitting:
        return entries
    fastest = fitting[0]["throughput"]["tokens_per_s_per_gpu"]
    tied = [e for e in fitting if e["throughput"]["tokens_per_s_per_gpu"] >= fastest * (1 - _TIED)]
    rest = [entry for entry in entries if all(entry is not t for t in tied)]
    return sorted(tied, key=lambda entry: entry["peak_bytes"]) + rest


def _on_gpus_estimate(estimate: PeakEstimate, planned: PlanInput, hardware: Cluster) -> PeakEstimate:
    """The peak on ``hardware``'s GPUs.

    torch's caching allocator holds more than the tensors, and the process holds its CUDA context and
    NCCL's buffers beside them.
    """
    return with_process_memory(with_allocator_reserve(estimate), planned.layout, hardware)


def _config_has_experts(config: Any) -> bool:
    return any(
        isinstance(getattr(config, name, None), int) and getattr(config, name) > 1
        for name in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def _memory_lines(estimate: PeakEstimate, device_memory: int | None) -> list[str]:
    lines = [f"estimated peak memory per rank ({estimate.rank} holds the most), one training step:"]
    for name, size in estimate.lines.items():
        note = estimate.notes.get(name)
        lines.append(f"  {name:<22}{size / _MIB:12.2f} MiB" + (f"  ({note})" if note else ""))
    lines.append(f"  {'total':<22}{estimate.total / _MIB:12.2f} MiB")
    if device_memory is not None:
        margin = device_memory - estimate.total
        verdict = "fits" if margin >= 0 else "does NOT fit"
        lines.append(
            f"  device {device_memory / _MIB:.0f} MiB: {verdict}, "
            f"{abs(margin) / _MIB:.0f} MiB {'to spare' if margin >= 0 else 'short'}"
        )
    lines.append("communication per rank and step:")
    for name, size in estimate.communication.items():
        lines.append(f"  {name:<26}{size / _MIB:12.2f} MiB")
    lines.append(f"  {'total':<26}{estimate.communication_total / _MIB:12.2f} MiB")
    return lines


def _throughput_lines(step: StepTime, hardware: Cluster) -> list[str]:
    lines = [f"predicted step on {hardware.describe()} (automodel_planner.estimate_throughput):"]
    for name, seconds in step.parts.items():
        lines.append(f"  {name:<34}{seconds * 1e3:12.1f} ms")
    lines.append(f"  {'step':<34}{step.step_seconds * 1e3:12.1f} ms")
    lines.append(
        f"  {step.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {step.mfu:.1%} of "
        f"{hardware.device.name}'s dense bf16 peak ({step.model_flops_per_token / 1e9:.1f} GFLOP per "
        "token, counted as torchtitan does)"
    )
    return lines


def plan_report(
    raw: RawJob,
    *,
    world_size: int | None = None,
    device_memory: int | None = None,
    suggest: bool = False,
    base_weight_bits: int | None = None,
    hardware: Cluster | None = None,
    calibrate: str | None = None,
    suggestions: int = 5,
) -> dict[str, Any]:
    """The dry run as data: layout, steps, model, the itemised peak per rank, fit, time and suggestions.

    With ``hardware``, the job is planned as the CUDA job the cluster runs (wherever the plan is made),
    the world size is its GPU count and the device memory its device's (unless given), and the report
    holds the step time (``throughput``, `automodel_planner.StepTime`); with ``calibrate`` (a measured
    run's ``train_log.jsonl`` of the same job on the same hardware), the fractions of peak are scaled to
    reproduce its step time first (``calibration``). With ``suggest``, the best ``suggestions`` layouts
    (`suggest_layouts`).

    Raises:
        ConfigError: A bad job or a layout that cannot work, or a world size the cluster contradicts,
            naming the setting.
    """
    if hardware is not None:
        raw = _on_gpus(raw)
    job = build_job(raw)
    if calibrate is not None and hardware is None:
        raise ConfigError("--calibrate needs --cluster: the hardware the log was measured on")
    if hardware is not None:
        if world_size is not None and world_size != hardware.count:
            raise ConfigError(
                f"--world-size {world_size} contradicts --cluster ({hardware.count} GPUs): give one of them"
            )
        world_size = hardware.count
        device_memory = device_memory if device_memory is not None else hardware.device.memory_bytes
    world = world_size if world_size is not None else job.launch.nnodes * nproc_per_node(job)
    model_config = load_model_config(job)
    job = adapt_experts_too(raw, job, model_config)
    resolved = resolve_job(job, world, model_config)
    model, adapted = planning_model(job, model_config)
    if job.peft is None and base_weight_bits is not None:
        raise ConfigError("--qlora-bits needs LoRA adapters (--lora): only a frozen base is quantized")
    planned = plan_input(resolved, model, model_config, base_weight_bits)
    cache: ProfileCache = {}
    try:
        estimate = estimate_peak(planned, profile_cache=cache)
    except ValueError as exc:  # the model or the job cannot be planned: say why, no traceback
        raise ConfigError(str(exc)) from None
    if hardware is not None:
        estimate = _on_gpus_estimate(estimate, planned, hardware)
    throughput, calibration = None, None
    if hardware is not None:
        try:
            efficiency = DEFAULT_EFFICIENCY
            if calibrate is not None:
                measured = measured_step_seconds(calibrate)
                efficiency, factor = calibrate_efficiency(planned, hardware, measured, profile_cache=cache)
                calibration = {"log": calibrate, "measured_step_seconds": measured, "factor": factor}
                calibration["efficiency"] = dataclasses.asdict(efficiency)
            throughput = estimate_throughput(planned, hardware, efficiency=efficiency, profile_cache=cache)
        except ValueError as exc:
            option = "--calibrate" if calibrate is not None else "--cluster"
            raise ConfigError(f"{option} ({hardware.describe()}): {exc}") from None
    report: dict[str, Any] = {
        "job": job,
        "resolved": resolved,
        "model": model,
        "world_size": world,
        "adapted": adapted,
        "steps": planned_steps(job, resolved, model, adapted),
        "estimate": estimate,
        "device_memory": device_memory,
        "fits": None if device_memory is None else estimate.total <= device_memory,
        "cluster": hardware,
        "throughput": throughput,
        "calibration": calibration,
    }
    if suggest:
        report["suggestions"] = suggest_layouts(
            raw,
            world,
            model,
            model_config,
            limit=suggestions,
            base_weight_bits=base_weight_bits,
            hardware=hardware,
            device_memory=device_memory,
        )
    return report


def _on_gpus(raw: RawJob) -> RawJob:
    """A copy of ``raw`` built as the CUDA job the cluster will run, wherever the plan is made.

    The device decides defaults that change the plan (FSDP2's bf16 mixed precision on GPUs; the
    model's dtype and a host runtime on CPU), so planning for ``--cluster`` on a laptop must not take
    the laptop's.

    Raises:
        ConfigError: ``launch.device`` is ``cpu``, which contradicts a cluster of GPUs.
    """
    device = raw.sections.get("launch", {}).get("device", "auto")
    if device == "cpu":
        raise ConfigError(
            f"{raw.where('launch', 'device')}: launch.device=cpu contradicts --cluster (a cluster of GPUs): "
            "drop the device setting or the cluster"
        )
    if device == "auto":
        raw = copy.deepcopy(raw)
        raw.set("launch", "device", "cuda", "--cluster")
    return raw


def _time_and_suggestion_lines(report: dict[str, Any], hardware: Cluster | None) -> list[str]:
    """The report's predicted step (with its calibration) and its suggested layouts, as text lines."""
    lines: list[str] = []
    throughput: StepTime | None = report["throughput"]
    if throughput is not None and hardware is not None:
        lines += ["", *_throughput_lines(throughput, hardware)]
        if report["calibration"] is not None:
            c = report["calibration"]
            lines.append(
                f"  calibrated on {c['log']}: measured step {c['measured_step_seconds'] * 1e3:.1f} ms, "
                f"fractions of peak scaled by {c['factor']:.3f}"
            )
    suggestions = report.get("suggestions")
    if suggestions is not None:
        order = "fitting first, fastest first" if hardware is not None else "lowest peak, then least traffic"
        lines += ["", f"suggested layouts for {report['world_size']} rank(s) ({order}):"]
        width = max((len(entry["layout"]) for entry in suggestions), default=0)  # one column for all
        for i, entry in enumerate(suggestions, start=1):
            biggest = max(entry["lines"], key=entry["lines"].get)
            speed = entry.get("throughput")
            rate = f"{speed['tokens_per_s_per_gpu']:10.0f} tokens/s/GPU, " if speed is not None else ""
            lines.append(
                f"  {i}. {entry['layout']:<{width}} {rate}peak {entry['peak_bytes'] / _MIB:10.2f} MiB, "
                f"traffic {entry['communication_total_bytes'] / _MIB:10.2f} MiB/step "
                f"(largest line: {biggest})"
            )
        if not suggestions:
            lines.append("  none: no layout of this world size is valid for the job")
    return lines


def plan(
    raw: RawJob,
    *,
    world_size: int | None = None,
    device_memory: int | None = None,
    suggest: bool = False,
    as_json: bool = False,
    base_weight_bits: int | None = None,
    hardware: Cluster | None = None,
    calibrate: str | None = None,
) -> str:
    """The dry-run report for the job in ``raw`` on ``world_size`` ranks (default: nnodes x nproc).

    Args:
        raw: The job.
        world_size: Ranks to plan for.
        device_memory: Bytes per device: the report says whether the peak fits and by how much.
        suggest: Also rank every valid layout of the world size (`suggest_layouts`).
        as_json: Return a JSON document instead of text.
        base_weight_bits: Quantize the frozen base to 4 or 8 bits (QLoRA; needs LoRA adapters).
        hardware: The cluster (``--cluster``): the step time, tokens/s per GPU and MFU on it.
        calibrate: A measured run's ``train_log.jsonl`` (``--calibrate``) to scale the fractions of peak.

    Raises:
        ConfigError: A bad job or a layout that cannot work, naming the setting.
    """
    report = plan_report(
        raw,
        world_size=world_size,
        device_memory=device_memory,
        suggest=suggest,
        base_weight_bits=base_weight_bits,
        hardware=hardware,
        calibrate=calibrate,
    )
    throughput: StepTime | None = report["throughput"]
    job, resolved, model = report["job"], report["resolved"], report["model"]
    estimate: PeakEstimate = report["estimate"]
    total = sum(p.numel() for p in _params(model))
    trainable = sum(p.numel() for p in _params(model) if p.requires_grad)
    if as_json:
        document = {
            "strategy": job.strategy,
            "world_size": report["world_size"],
            "layout": resolved.layout.describe().splitlines(),
            "parameters": total,
            "trainable_parameters": trainable,
            "steps": report["steps"],
            "peak": estimate.as_dict(),
            "device_memory_bytes": report["device_memory"],
            "fits": report["fits"],
            "cluster": hardware.describe() if hardware is not None else None,
            "throughput": throughput.as_dict() if throughput is not None else None,
            "calibration": report["calibration"],
            "suggestions": report.get("suggestions"),
        }
        return json.dumps(document, indent=2)
    train = job.train
    lines = [
        f"automodel plan: {job.strategy} on {report['world_size']} rank(s), {job.device_type}",
        "",
        "mesh layout (MeshContext.resolve):",
        *(f"  {line}" for line in resolved.layout.describe().splitlines()),
        "",
        f"model: {type(model).__name__} ({job.model.name_or_path or 'embedded default'}), "
        f"{_fmt(total)} parameters, {_fmt(trainable)} trainable, {job.model.dtype}",
        f"batch: {train.global_batch_size} rows x {job.data.seq_len} tokens per step = {resolved.dp_size} "
        f"data-parallel rank(s) x {resolved.rows_per_dp_rank} rows, in micro-batches of "
        f"{train.micro_batch_size}",
        "",
        "apply_model_infrastructure will, in order:",
        *(f"  {i}. {step}" for i, step in enumerate(report["steps"], start=1)),
        "",
        *_memory_lines(estimate, report["device_memory"]),
    ]
    lines += _time_and_suggestion_lines(report, hardware)
    return "\n".join(lines)
