"""A job: the YAML file and the options, mapped onto the components' own config dataclasses.

Sections (each optional) and the dataclass each maps onto:

=================== ==========================================================================
``model``           `ModelSection`
``data``            `DataSection`
``train``           `TrainSection`
``report``          `ReportSection`
``launch``          `LaunchSection`
``distributed``     ``strategy: fsdp2 | ddp | megatron_fsdp`` plus the fields of `FSDP2Config`,
                    `DDPConfig` or `MegatronFSDPConfig`
``parallelism``     `ParallelismSizes` (``dp_size``, ``dp_replicate_size``, ``tp_size``, ``pp_size``,
                    ``cp_size``, ``ep_size``)
``pipeline``        `PipelineConfig` (its batch sizes come from ``train``)
``peft``            `PeftConfig` (the section's presence turns LoRA on)
``qat``             `QATConfig` (presence turns QAT on)
``fp8``             `FP8Config`
``compile``         `CompileConfig`
``moe``             `MoEParallelizerConfig`
``freeze_config``   `FreezeConfig` (presence freezes the parts it names before sharding)
=================== ==========================================================================

`build_job` checks each section on its own; `resolve_job` checks how they fit together for a world
size (the mesh layout, batch divisibility, the model's shape), so a launcher can reject a job before
it starts any process.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from automodel_all.cli.schema import build_dataclass
from automodel_all.cli.sections import DataSection, LaunchSection, ModelSection, ReportSection, TrainSection
from automodel_all.cli.yaml_source import ConfigError, RawJob
from automodel_distributed import FreezeConfig
from automodel_distributed.config import (
    CompileConfig,
    DDPConfig,
    DistributedConfig,
    FSDP2Config,
    MegatronFSDPConfig,
)
from automodel_distributed.host_runtime import HostRuntime
from automodel_mesh import MeshContext, ParallelismSizes
from automodel_mesh.layout import MeshLayout
from automodel_moe.config import MoEParallelizerConfig
from automodel_peft import PeftConfig
from automodel_pipelining.config import PipelineConfig
from automodel_quant.fp8 import FP8Config
from automodel_quant.qat import QATConfig

__all__ = [
    "SECTIONS",
    "STRATEGIES",
    "JobConfig",
    "ResolvedJob",
    "build_job",
    "inert_settings",
    "resolve_job",
    "warn_inert_settings",
]

STRATEGIES: dict[str, type[Any]] = {
    "fsdp2": FSDP2Config,
    "ddp": DDPConfig,
    "megatron_fsdp": MegatronFSDPConfig,
}
"""``distributed.strategy`` values and their config classes."""

SECTIONS: dict[str, type[Any]] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "report": ReportSection,
    "launch": LaunchSection,
    "distributed": FSDP2Config,
    "parallelism": ParallelismSizes,
    "pipeline": PipelineConfig,
    "peft": PeftConfig,
    "qat": QATConfig,
    "fp8": FP8Config,
    "compile": CompileConfig,
    "moe": MoEParallelizerConfig,
    "freeze_config": FreezeConfig,
}
"""Every section a job file may have, and the dataclass it maps onto."""


@dataclass
class JobConfig:
    """Every section of a job, as config objects. ``None`` for an optional feature that is off."""

    raw: RawJob
    model: ModelSection
    data: DataSection
    train: TrainSection
    report: ReportSection
    launch: LaunchSection
    strategy: str
    distributed: DistributedConfig
    parallelism: ParallelismSizes
    pipeline: PipelineConfig | None
    peft: PeftConfig | None
    qat: QATConfig | None
    fp8: FP8Config | None
    compile: CompileConfig | None
    moe: MoEParallelizerConfig | None
    freeze_config: FreezeConfig | None
    """Parts of a multimodal model to freeze before sharding (the section's presence turns it on)."""
    host_runtime: HostRuntime | None = None
    """The CPU runtime of a CPU job (``automodel_cpu.CPURuntime``), given to the FSDP2 strategy and the
    context-parallel region; ``None`` on GPUs (`build_job`)."""

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu`` (``auto`` resolved by what this process sees)."""
        if self.launch.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.launch.device


@dataclass(frozen=True)
class ResolvedJob:
    """A job checked for a world size, with the sizes derived from it."""

    job: JobConfig
    layout: MeshLayout
    """The validated mesh layout (`MeshContext.resolve`)."""
    world_size: int
    dp_size: int
    """Data-parallel replicas (``dp_replicate x dp_shard``; the world size under DDP)."""
    rows_per_dp_rank: int
    """Rows each data-parallel rank processes per optimizer step."""
    grad_accumulation_steps: int
    """Forward/backward passes per step outside pipelining (microbatches under pipelining)."""
    pipeline: PipelineConfig | None
    """The pipeline config with its batch sizes filled in (``None`` when ``pp_size == 1``)."""


def _optional(cls: type[Any], raw: RawJob, section: str) -> Any:
    return build_dataclass(cls, raw, section) if section in raw.sections else None


def _distributed(raw: RawJob, device_type: str) -> tuple[str, DistributedConfig]:
    values = dict(raw.sections.get("distributed", {}))
    strategy = values.get("strategy", "fsdp2")
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"{raw.where('distributed', 'strategy')}: distributed.strategy: expected one of "
            f"{list(STRATEGIES)}, got {strategy!r}"
        )
    if strategy == "fsdp2" and "mp_policy" not in values and device_type == "cpu":
        # On CPU, bf16 matmuls are slow and buy nothing: default to the model's own dtype.
        dtype = str(raw.sections.get("model", {}).get("dtype", "float32"))
        values["mp_policy"] = {"param_dtype": dtype, "reduce_dtype": "float32"}
    if "host_runtime" in values:
        raise ConfigError(
            f"{raw.where('distributed', 'host_runtime')}: distributed.host_runtime cannot be set in a job: "
            "the automodel command gives CPU jobs automodel_cpu.CPURuntime() (and GPU jobs none)"
        )
    return strategy, build_dataclass(
        STRATEGIES[strategy], raw, "distributed", values=values, skip=("strategy",)
    )


def _host_runtime(device_type: str) -> HostRuntime | None:
    """The CPU runtime a CPU job runs with (pooled FSDP2 host buffers, CPU ring attention); None on GPUs."""
    if device_type != "cpu":
        return None
    from automodel_cpu import CPURuntime

    return CPURuntime()


def build_job(raw: RawJob) -> JobConfig:
    """Turn every section into its config object; nothing is resolved against a world size yet.

    Raises:
        ConfigError: An unknown section or key, a wrong type, or a value a config rejects; the message
            names the key and the file line (or the option) it came from.
    """
    for section in raw.sections:
        if section not in SECTIONS:
            known = ", ".join(SECTIONS)
            raise ConfigError(f"{raw.where(section)}: unknown section '{section}'; known sections: {known}")
    if "qat" in raw.sections and "dtype" not in raw.sections.get("model", {}):
        # torchao's QAT quantizers work on bfloat16 weights; choose it rather than fail.
        raw.set("model", "dtype", "bfloat16", raw.where("qat"))
    launch = build_dataclass(LaunchSection, raw, "launch")
    model = build_dataclass(ModelSection, raw, "model")  # first: the CPU mixed precision uses its dtype
    device_type = (
        launch.device if launch.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    strategy, distributed = _distributed(raw, device_type)
    host_runtime = _host_runtime(device_type)
    if isinstance(distributed, FSDP2Config):
        distributed = dataclasses.replace(distributed, host_runtime=host_runtime)
    train = build_dataclass(TrainSection, raw, "train")
    report = build_dataclass(ReportSection, raw, "report")
    if train.plot is True and "jsonl" not in report.to:
        raise ConfigError(
            f"{raw.where('train', 'plot')}: train.plot=true draws the curve from train_log.jsonl, which "
            f"report.to ({raw.where('report', 'to')}) leaves out; add jsonl to report.to, or drop train.plot"
        )
    return JobConfig(
        raw=raw,
        model=model,
        data=build_dataclass(DataSection, raw, "data"),
        train=train,
        report=report,
        launch=launch,
        strategy=strategy,
        distributed=distributed,
        parallelism=build_dataclass(ParallelismSizes, raw, "parallelism"),
        pipeline=_optional(PipelineConfig, raw, "pipeline"),
        peft=_optional(PeftConfig, raw, "peft"),
        qat=_optional(QATConfig, raw, "qat"),
        fp8=_optional(FP8Config, raw, "fp8"),
        compile=_optional(CompileConfig, raw, "compile"),
        moe=_optional(MoEParallelizerConfig, raw, "moe"),
        freeze_config=_optional(FreezeConfig, raw, "freeze_config"),
        host_runtime=host_runtime,
    )


def inert_settings(job: JobConfig) -> list[str]:
    """The settings the job file or the options give that would act on nothing, each with why.

    Only keys that were given count (the defaults never do). One line each: ``where: section.key
    ignored: why``. The launcher warns with them once (`warn_inert_settings`), not every worker.
    """
    raw, launch, train, data = job.raw, job.launch, job.train, job.data

    def given(section: str, *keys: str) -> list[str]:
        return [key for key in keys if key in raw.sections.get(section, {})]

    inert: list[tuple[str, str, str]] = []
    if launch.rdzv_endpoint:
        why = "launch.rdzv_endpoint is set, and the nodes meet through it"
        inert += [("launch", key, why) for key in given("launch", "master_addr", "master_port")]
    else:
        why = "it acts only with launch.rdzv_endpoint (a c10d rendezvous)"
        inert += [("launch", key, why) for key in given("launch", "rdzv_backend", "rdzv_id")]
    if given("train", "eval_every") and data.eval_path is None and data.eval_split is None:
        inert.append(("train", "eval_every", "there is no evaluation data (data.eval_path, data.eval_split)"))
    if (
        given("train", "resume_fallback")
        and train.resume_fallback
        and not train.resume
        and not launch.max_restarts
    ):
        why = "nothing resumes: set train.resume (or launch.max_restarts, whose restarted workers resume)"
        inert.append(("train", "resume_fallback", why))
    inert += [("report", key, why) for key, why in _inert_report(job.report, given("report", *_TRACKER_KEYS))]
    return [f"{raw.where(section, key)}: {section}.{key} ignored: {why}" for section, key, why in inert]


_TRACKER_KEYS = ("project", "run_name", "wandb_mode", "mlflow_tracking_uri")


def _inert_report(report: ReportSection, given: list[str]) -> list[tuple[str, str]]:
    """The trackers' settings given for a tracker that ``report.to`` leaves out."""
    users = {
        "project": ("wandb", "mlflow"),
        "run_name": ("wandb", "mlflow"),
        "wandb_mode": ("wandb",),
        "mlflow_tracking_uri": ("mlflow",),
    }
    return [
        (key, f"report.to has none of {', '.join(users[key])}")
        for key in given
        if not set(users[key]) & set(report.to)
    ]


def warn_inert_settings(job: JobConfig) -> None:
    """Warn once per `inert_settings` line."""
    for line in inert_settings(job):
        warnings.warn(line, stacklevel=2)


def _divisible(raw: RawJob, section: str, key: str, value: int, by: int, what: str) -> None:
    if by <= 0 or value % by:
        raise ConfigError(f"{raw.where(section, key)}: {section}.{key}={value} is not divisible by {what}")


def _pipeline(resolved_rows: int, job: JobConfig) -> PipelineConfig:
    raw, train = job.raw, job.train
    base = job.pipeline or PipelineConfig()
    given = raw.sections.get("pipeline", {})
    for key, value in (("pp_batch_size", resolved_rows), ("pp_microbatch_size", train.micro_batch_size)):
        if key in given and given[key] != value:
            raise ConfigError(
                f"{raw.where('pipeline', key)}: pipeline.{key}={given[key]} but the train section gives "
                f"{value} (pp_batch_size = global_batch_size / data-parallel size, pp_microbatch_size = "
                "micro_batch_size); drop the pipeline key or change train"
            )
    return dataclasses.replace(base, pp_batch_size=resolved_rows, pp_microbatch_size=train.micro_batch_size)


def _check_schedule(raw: RawJob, pipeline: PipelineConfig, pp_size: int) -> None:
    from automodel_pipelining.schedules import check_microbatches, resolve_schedule

    spec = resolve_schedule(pipeline.pp_schedule, pipeline.pp_schedule_csv)
    stages = pipeline.stage_count(pp_size)
    if spec is None or stages is None:
        return
    try:
        check_microbatches(spec, n_microbatches=pipeline.n_microbatches, num_stages=stages, pp_size=pp_size)
    except ValueError as exc:
        raise ConfigError(
            f"{raw.where('train', 'micro_batch_size')}: pipeline: {exc} (pp_batch_size = "
            f"train.global_batch_size / data-parallel size, pp_microbatch_size = train.micro_batch_size)"
        ) from None


def _default_micro_batch(job: JobConfig, layout: MeshLayout, dp: int) -> int:
    """The micro-batch when none is given.

    The largest divisor of the rows per data-parallel rank that is at most the default
    ``TrainSection.micro_batch_size`` and, under pipelining, still gives every stage a microbatch.
    """
    rows = max(1, job.train.global_batch_size // dp)
    stages = 1
    if layout.pp > 1:
        stages = (job.pipeline or PipelineConfig()).stage_count(layout.pp) or layout.pp
    cap = job.train.micro_batch_size
    fitting = [m for m in range(1, min(rows, cap) + 1) if rows % m == 0 and rows // m >= stages]
    return max(fitting) if fitting else 1


def _check_model_shape(job: JobConfig, layout: MeshLayout, model_config: Any) -> None:
    raw = job.raw
    where = raw.where("parallelism")
    model_config = model_config.get_text_config()  # a vision-language model's language model is sharded
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    layers = getattr(model_config, "num_hidden_layers", None)
    if layout.tp > 1:
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if isinstance(count, int) and count % layout.tp:
                raise ConfigError(
                    f"{where}: tp_size={layout.tp} does not divide the model's {name}={count}; choose a "
                    "tensor-parallel size that divides it"
                )
    ulysses = job.parallelism.cp_ulysses_degree
    if ulysses > 1 and isinstance(heads, int) and heads % ulysses:
        raise ConfigError(
            f"{raw.where('parallelism', 'cp_ulysses_degree')}: all-to-all context parallelism over "
            f"{ulysses} ranks splits the model's {heads} attention heads; choose a cp_size that divides "
            "them, or cp_ulysses_degree 1 (ring attention)"
        )
    if layout.pp > 1 and isinstance(layers, int) and layers < layout.pp:
        raise ConfigError(
            f"{where}: pp_size={layout.pp} exceeds the model's num_hidden_layers={layers}; every pipeline "
            "stage needs at least one layer"
        )
    if layout.ep > 1:
        experts = getattr(model_config, "num_experts", None) or getattr(
            model_config, "num_local_experts", None
        )
        if not isinstance(experts, int):
            raise ConfigError(
                f"{where}: ep_size={layout.ep} needs a mixture-of-experts model; this one has none"
            )
        if experts % layout.ep:
            raise ConfigError(f"{where}: ep_size={layout.ep} does not divide the model's {experts} experts")


def resolve_job(job: JobConfig, world_size: int, model_config: Any = None) -> ResolvedJob:
    """Check that the sections fit together on ``world_size`` ranks, without creating any process group.

    Checks: the mesh layout (`MeshContext.resolve`); that the global batch splits over data-parallel
    ranks and micro-batches; pipeline batch sizes; context-parallel sequence length; strategies that
    need CUDA; and, given ``model_config``, that heads, layers and experts divide by tp, pp and ep.

    Raises:
        ConfigError: The first problem found, with where the offending setting came from.
    """
    raw, train = job.raw, job.train
    try:
        layout = MeshContext.resolve(job.distributed, job.parallelism, world_size)
    except ValueError as exc:
        raise ConfigError(f"{raw.where('parallelism')}: layout for {world_size} rank(s): {exc}") from None
    if job.strategy == "megatron_fsdp" and job.device_type != "cuda":
        raise ConfigError(
            f"{raw.where('distributed', 'strategy')}: distributed.strategy=megatron_fsdp needs CUDA GPUs "
            "(Megatron-FSDP hard-codes CUDA streams); use fsdp2 on CPU"
        )
    if getattr(job.distributed, "enable_async_tensor_parallel", False) and job.device_type != "cuda":
        raise ConfigError(
            f"{raw.where('distributed', 'enable_async_tensor_parallel')}: "
            "distributed.enable_async_tensor_parallel=true needs CUDA GPUs (its collectives run on "
            "symmetric memory); leave it off on CPU"
        )
    dp = layout.dp
    if "micro_batch_size" not in raw.sections.get("train", {}):
        job.train = dataclasses.replace(train, micro_batch_size=_default_micro_batch(job, layout, dp))
        train = job.train
    _divisible(raw, "train", "global_batch_size", train.global_batch_size, dp, f"the data-parallel size {dp}")
    rows = train.global_batch_size // dp
    _divisible(
        raw, "train", "global_batch_size", rows, train.micro_batch_size,
        f"micro_batch_size={train.micro_batch_size} after splitting over {dp} data-parallel rank(s) "
        f"({rows} rows each)",
    )  # fmt: skip
    pipeline = _pipeline(rows, job) if layout.pp > 1 else None
    if pipeline is not None:
        _check_schedule(raw, pipeline, layout.pp)
    if job.pipeline is not None and layout.pp == 1:
        raise ConfigError(
            f"{raw.where('pipeline')}: a pipeline section is given but parallelism.pp_size is 1; set "
            "pp_size > 1 or drop the section"
        )
    if job.data.format == "image_messages" and (layout.cp > 1 or layout.pp > 1):
        raise ConfigError(
            f"{raw.where('parallelism')}: data with images (data.format=image_messages) needs cp_size 1 and "
            f"pp_size 1 (got cp_size={layout.cp}, pp_size={layout.pp}): the vision tower runs on whole "
            "rows in one stage; use data parallelism (FSDP2, HSDP) and tp_size"
        )
    if layout.cp > 1:
        _divisible(raw, "data", "seq_len", job.data.seq_len, 2 * layout.cp, f"2 * cp_size = {2 * layout.cp}")
        if job.model.attn_implementation not in (None, "sdpa"):  # None: sdpa where the family has it
            raise ConfigError(f"{raw.where('model', 'attn_implementation')}: context parallelism needs sdpa")
        if layout.pp > 1 and job.data.packing == "packed":
            raise ConfigError(
                f"{raw.where('data', 'packing')}: packed rows under context parallelism attend per "
                "document over whole rows, which a pipeline's microbatches would split; with pp_size > 1 "
                "use data.packing: concat or padded"
            )
    if model_config is not None:
        _check_model_shape(job, layout, model_config)
    return ResolvedJob(
        job=job,
        layout=layout,
        world_size=world_size,
        dp_size=dp,
        rows_per_dp_rank=rows,
        grad_accumulation_steps=rows // train.micro_batch_size,
        pipeline=pipeline,
    )
