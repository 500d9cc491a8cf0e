"""Published training runs as data (``published_runs.toml``), planned and predicted like any job.

`published_runs` reads the rows; `run_plan` builds each row's `PlanInput` (the model's published widths
on the meta device, its layout, adapters, pipeline, float8 and compile settings); `predict` gives the
time model's `StepTime` for it on the row's cluster, `predict_memory` the memory model's peak.
`fit_efficiency` fits the time model's achievable fractions (`automodel_planner.step_time.Efficiency`)
on the calibration rows only, by least squares (Gauss-Newton) on the log error of tokens/s; the
evaluation rows never move them. `scale_out_pairs` finds the rows that publish one job at two cluster
sizes. No process group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import torch

from automodel_planner.estimate import (
    ALLOCATOR_RESERVE,
    PeakEstimate,
    ProfileCache,
    estimate_peak,
    estimate_throughput,
    with_allocator_reserve,
)
from automodel_planner.hardware import Cluster, cluster_from_mapping, parse_cluster
from automodel_planner.inputs import PlanInput
from automodel_planner.step_time import DEFAULT_EFFICIENCY, Efficiency, StepTime

__all__ = [
    "PublishedRun",
    "as_automodel_job",
    "fit_allocator_reserve",
    "fit_efficiency",
    "predict",
    "predict_memory",
    "published_runs",
    "run_plan",
    "scale_out_pairs",
    "shape_config",
]


@dataclass(frozen=True)
class PublishedRun:
    """One row of a published benchmark (see ``published_runs.toml`` for the fields' meaning)."""

    id: str
    source: str
    role: str
    """``calibration`` (the efficiencies are fitted on it) or ``evaluation``."""
    shape: str
    cluster: str
    seq_len: int
    local_batch: int
    micro_batch: int
    tokens_per_s_per_gpu: float
    pipeline_runs: int = 1
    """The source runs its pipeline schedule this many times per optimizer step, on ``local_batch /
    pipeline_runs`` rows each (`PlanInput.pipeline_runs`: NeMo AutoModel's gradient accumulation)."""
    sizes: Mapping[str, int] = field(default_factory=dict)
    sequence_parallel: bool = False
    async_tp: bool = False
    pp_schedule: str | None = None
    layers_per_stage: int | None = None
    checkpointing: Literal[False, "full", "selective"] = False
    attention_kernel: str | None = None
    """The attention kernel where the source's is not FlashAttention-2 (`PlanInput.attention_kernel`)."""
    attn_implementation: str = "sdpa"
    """The transformers attention implementation of the source's model (``flex_attention``:
    FlexAttention, which computes a sliding window's band only)."""
    repeat_kv: bool = False
    """The source's model repeats the key/value heads to the query heads before attention
    (`PlanInput.attention_kv_heads`)."""
    expert_dispatch: Literal["per_expert", "per_rank"] = "per_expert"
    """The source's expert-parallel exchange (`automodel_moe.memory.ExpertExchange.dispatch`):
    ``per_rank`` for DeepEP's."""
    expert_routing: Literal["uniform", "consecutive"] = "uniform"
    """Where the source's router sends a token's experts (`ExpertExchange.routing`): ``consecutive``
    for NeMo AutoModel's ``FakeBalancedGate``."""
    selective_save_ops: str | None = None
    """The ``[selective_save_ops]`` list naming the ops the source's selective checkpointing saves
    (`PlanInput.selective_save_ops`); None: automodel's."""
    compile: bool = False
    compile_loss: bool = False
    """The loss is compiled too (``CompileConfig.compile_loss``)."""
    fp8: bool = False
    lora_dim: int | None = None
    memory_gib: float | None = None
    dtype: str = "bfloat16"
    """The parameters' dtype as stored (computation follows FSDP2Config's bf16 mixed precision)."""
    strategy: Mapping[str, Any] = field(default_factory=dict)
    """Further `FSDP2Config` settings the source's job file states (``defer_fsdp_grad_sync``, ...)."""
    network_gbps: float | None = None
    """Each GPU's inter-node network in Gb/s where the source states one other than the device's
    (`Device.inter_node_bytes_per_s`): a RoCE fabric of 1,600 Gb/s per node of 8 is 200."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Config fields of the row's model beyond its shape's (an MPT's learned position table:
    ``n_positions``, the row's sequence length)."""
    fp8_config: Mapping[str, Any] = field(default_factory=dict)
    """Further `FP8Config` settings of a ``fp8`` row (``enable_fsdp_float8_all_gather``, ...)."""
    moe: Mapping[str, Any] = field(default_factory=dict)
    """`MoEParallelizerConfig` settings the source's sharding amounts to (``wrap_outer_model``, ...)."""

    def hardware(self) -> Cluster:
        """The row's cluster: ``cluster`` (``NxDEVICE``), on ``network_gbps`` where the source states it."""
        cluster = parse_cluster(self.cluster)
        if self.network_gbps is None:
            return cluster
        return cluster_from_mapping(
            {"gpus": cluster.count, "device": cluster.device.name, "inter_node_gbps": self.network_gbps}
        )


def as_automodel_job(run: PublishedRun) -> PublishedRun:
    """``run`` without the implementation details of its source that a job of ours does not have.

    Those are its model's repeated K/V heads, its checkpointing save list, its attention kernel, its
    expert exchange and router and its pipeline runs per step; the rest is what ``automodel plan``
    plans for the row's settings (`automodel_all.cli.published_jobs`).
    """
    return dataclasses.replace(
        run,
        repeat_kv=False,
        selective_save_ops=None,
        attention_kernel=None,
        expert_dispatch="per_expert",
        expert_routing="uniform",
        pipeline_runs=1,
    )


_SCALE = frozenset({"id", "source", "role", "cluster", "sizes", "local_batch", "pipeline_runs"})
"""What may differ between two rows of one job at two scales (besides what they publish): the cluster
size and with it the data-parallel degrees, and the batch each replica takes per step."""
_PUBLISHED = frozenset({"tokens_per_s_per_gpu", "memory_gib"})


def scale_out_pairs(runs: Sequence[PublishedRun]) -> list[tuple[PublishedRun, PublishedRun]]:
    """``(smallest, larger)`` pairs of rows of one benchmark page that run one job on two cluster sizes.

    One job: the same device, model, sequence, micro-batch, model-parallel sizes (``tp``, ``pp``, ``cp``,
    ``ep``) and every setting; only the GPU count, the data-parallel degrees and the batch per replica
    (``local_batch``, ``pipeline_runs``) differ. Each larger row is paired with the group's smallest, so
    that the published change of tokens/s per GPU between them can be set beside the predicted one.
    """

    def job(run: PublishedRun) -> str:
        same = {
            f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name not in _SCALE | _PUBLISHED
        }
        model_parallel = sorted((k, v) for k, v in run.sizes.items() if not k.startswith("dp_"))
        return repr((run.source.split(" ")[0], run.hardware().device.name, model_parallel, same))

    groups: dict[str, list[PublishedRun]] = {}
    for run in runs:
        groups.setdefault(job(run), []).append(run)
    pairs = []
    for group in groups.values():
        smallest = min(group, key=lambda r: r.hardware().count)
        count = smallest.hardware().count
        pairs += [(smallest, r) for r in group if r.hardware().count > count]
    return pairs


@functools.cache
def _data() -> dict[str, Any]:
    text = resources.files("automodel_planner").joinpath("published_runs.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def published_runs(role: str | None = None) -> list[PublishedRun]:
    """The rows of ``published_runs.toml`` (those of ``role`` when given), in file order."""
    rows = [PublishedRun(**row) for row in _data()["run"]]
    return [r for r in rows if role is None or r.role == role]


def shape_config(shape: str, **overrides: Any) -> Any:
    """The transformers config of ``shape`` (a ``[shapes.*]`` table: the published model's widths).

    ``overrides`` (a row's `PublishedRun.config`) are set over the shape's fields.
    """
    from transformers import AutoConfig

    fields = dict(_data()["shapes"][shape]) | overrides
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _build(shape: str, dtype: str = "bfloat16", config: Any = None) -> tuple[torch.nn.Module, Any]:
    """A causal LM of ``config`` (default: ``shape``'s widths) in ``dtype`` on meta, and the config."""
    from transformers import AutoModelForCausalLM

    config = config if config is not None else shape_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model, config


_meta_model = functools.cache(_build)
"""`_build`, shared by the runs that do not change the model (no adapters)."""


def run_plan(run: PublishedRun, model_config: Any = None) -> PlanInput:
    """The job of ``run`` as the planner sees it (a fresh meta model when the run adapts it).

    ``model_config`` replaces the widths of ``run.shape`` (a measured run of a cut-down model:
    ``tools/gpu_calibration.py``).
    """
    from automodel_distributed.config import FSDP2Config
    from automodel_mesh import MeshKind, ParallelismSizes, resolve_layout

    if model_config is None and run.config:
        model_config = shape_config(run.shape, **run.config)
    if model_config is None:
        model, config = _meta_model(run.shape, run.dtype)
    else:
        model, config = _build(run.shape, run.dtype, model_config)
    peft = None
    if run.lora_dim is not None:
        from automodel_peft import PeftConfig, apply_lora_to_linear_modules

        model, _ = _build(run.shape, run.dtype, config)
        peft = PeftConfig(target_modules=["*_proj"], dim=run.lora_dim, alpha=2 * run.lora_dim)
        apply_lora_to_linear_modules(model, peft)
    world = run.hardware().count
    # dp_shard is what the other sizes leave of the world (resolve_layout infers it).
    sizes = {f"{k}_size": v for k, v in run.sizes.items() if k != "dp_shard"}
    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(**sizes), world)
    strategy = FSDP2Config(
        activation_checkpointing=run.checkpointing,
        sequence_parallel=run.sequence_parallel,
        enable_async_tensor_parallel=run.async_tp,
        enable_compile=run.compile,
        **run.strategy,
    )
    pipeline = None
    if run.pp_schedule is not None:
        from automodel_pipelining.config import PipelineConfig

        pipeline = PipelineConfig(
            pp_schedule=run.pp_schedule,
            pp_batch_size=run.local_batch // run.pipeline_runs,
            pp_microbatch_size=run.micro_batch,
            layers_per_stage=run.layers_per_stage,
        )
    fp8 = None
    if run.fp8:
        from automodel_quant.fp8 import FP8Config

        fp8 = FP8Config(enabled=True, **run.fp8_config)
    moe = None
    if run.moe:
        from automodel_moe.config import MoEParallelizerConfig

        moe = MoEParallelizerConfig(**run.moe)
    exchange = None
    if run.expert_dispatch != "per_expert":
        from automodel_moe import find_experts
        from automodel_moe.memory import ExpertExchange

        experts = find_experts(model)[0].num_experts  # the model's own experts modules say how many
        exchange = ExpertExchange(run.expert_dispatch, run.expert_routing, experts)
    return PlanInput(
        model=model,
        model_config=config,
        layout=layout,
        strategy=strategy,
        dtype=torch.bfloat16,
        seq_len=run.seq_len,
        micro_batch_size=run.micro_batch,
        accumulation=max(run.local_batch // run.micro_batch, 1),
        pipeline=pipeline,
        pipeline_runs=run.pipeline_runs,
        peft=peft,
        fp8=fp8,
        moe=moe,
        expert_exchange=exchange,
        attn_implementation=run.attn_implementation,
        attention_kernel=run.attention_kernel,
        compile=run.compile,
        compiled_loss=run.compile_loss,
        attention_kv_heads=config.num_attention_heads if run.repeat_kv else None,
        selective_save_ops=(
            tuple(_data()["selective_save_ops"][run.selective_save_ops]) if run.selective_save_ops else None
        ),
    )


_PROFILES: dict[str, ProfileCache] = {}
"""Fake-forward profiles per shape: rows of one model at the same batch, length and cp share one."""


def predict(run: PublishedRun, efficiency: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """The time model's step for ``run`` on its cluster."""
    cache = _PROFILES.setdefault(run.shape, {})
    return estimate_throughput(run_plan(run), run.hardware(), efficiency=efficiency, profile_cache=cache)


def predict_memory(run: PublishedRun, reserve: float = ALLOCATOR_RESERVE) -> PeakEstimate:
    """The memory model's peak for ``run`` on its GPUs (the rank holding the most), beside ``memory_gib``."""
    tensors = estimate_peak(run_plan(run), profile_cache=_PROFILES.setdefault(run.shape, {}))
    return with_allocator_reserve(tensors, reserve)


def fit_allocator_reserve(runs: Sequence[PublishedRun]) -> float:
    """`ALLOCATOR_RESERVE` fitted on ``runs`` (the calibration rows that publish their peak).

    The published peak is torch's reserved memory; the fraction is the geometric mean of its excess
    over the predicted live tensors.
    """
    ratios = [run.memory_gib * 2**30 / predict_memory(run, 0.0).total for run in runs if run.memory_gib]
    if not ratios:
        raise ValueError("fit_allocator_reserve needs rows that publish their peak memory (memory_gib)")
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) - 1


_FITTED = ("matmul", "fp8_matmul", "memory", "compiled_traffic")
"""``attention`` and ``network`` are not fitted (`automodel_planner.step_time.Efficiency`)."""


def fit_efficiency(
    runs: Sequence[PublishedRun], start: Efficiency = DEFAULT_EFFICIENCY, iterations: int = 8
) -> tuple[Efficiency, float]:
    """Fit the achievable fractions on ``runs`` (the calibration rows); return them and the RMS log error.

    Least squares on the log errors of tokens/s by Gauss-Newton: each iteration measures how every
    row's log error moves with each fitted field (a 0.1% step) and solves for the step that zeroes them
    in the least-squares sense, each field kept in (0, 1]; the best point seen is returned. With as
    many rows as fitted fields (the four calibration rows) the fit is exact where a solution exists.
    ``network`` and ``attention`` stay at their defaults: the calibration rows are single-node, and
    attention is too small a part of their step to be told apart from the matmuls (the default is
    measured).
    """
    plans = [(run_plan(r), r.hardware(), r.tokens_per_s_per_gpu) for r in runs]
    caches = [_PROFILES.setdefault(r.shape, {}) for r in runs]

    def log_errors(eff: Efficiency) -> torch.Tensor:
        predicted = [
            estimate_throughput(plan, cluster, efficiency=eff, profile_cache=cache).tokens_per_s_per_gpu
            for (plan, cluster, _), cache in zip(plans, caches, strict=True)
        ]
        published = [p for _, _, p in plans]
        return torch.tensor(
            [math.log(a / b) for a, b in zip(predicted, published, strict=True)], device="cpu"
        )

    def rms(errors: torch.Tensor) -> float:
        return float(errors.square().mean().sqrt())

    current, errors = start, log_errors(start)
    best, best_error = current, rms(errors)
    for _ in range(iterations):
        columns = []
        for name in _FITTED:
            delta = getattr(current, name) * 1e-3
            moved = log_errors(dataclasses.replace(current, **{name: getattr(current, name) + delta}))
            columns.append((moved - errors) / delta)
        jacobian = torch.stack(columns, dim=1).double()
        step = torch.linalg.lstsq(jacobian, -errors.double().unsqueeze(1)).solution.squeeze(1)
        current = dataclasses.replace(
            current,
            **{
                n: min(max(getattr(current, n) + float(d), 1e-3), 1.0)
                for n, d in zip(_FITTED, step, strict=True)
            },
        )
        errors = log_errors(current)
        if rms(errors) < best_error:
            best, best_error = current, rms(errors)
    return best, best_error
