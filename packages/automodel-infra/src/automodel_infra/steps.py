"""The order of operations of `apply_model_infrastructure`, as data: what each step does, why it sits there.

`automodel_infra.infrastructure.APPLY_STEPS` is the one list: `apply_model_infrastructure` runs it in
order (each `Step.run` on the `ApplyState` of one call), ``automodel plan`` prints it for a job
(`Step.describe` on a `PlannedJob`: the same configs and sizes, no process group), and
``docs/concepts.md`` shows it (`render_steps`, checked by a test). This module holds the data types and
the descriptions; the runners live next to the documented functions they call.

A description asks the leaf package that owns a step what it will do (a strategy config's
``loads_before_sharding`` / ``describe_sharding`` / ``describe_compile``), so the dry run and the run
cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from torch import nn

    from automodel_distributed.config import CompileConfig, DistributedConfig
    from automodel_distributed.multimodal import FreezeConfig
    from automodel_mesh import MeshLayout

__all__ = ["PlannedJob", "Step", "describe_steps", "render_steps"]

_State = TypeVar("_State")


@dataclass(frozen=True, kw_only=True)
class PlannedJob:
    """What a dry run knows of a job: the configs, the validated sizes and the model on the meta device.

    Built by ``automodel plan`` (``automodel_all``) from its job; nothing here needs a process group.
    """

    model: nn.Module
    """The model on the meta device, after ``freeze_config`` and the adapters (as step 4 sees it)."""
    layout: MeshLayout
    """The validated sizes (``MeshContext.resolve``)."""
    device_type: str
    """``cuda`` or ``cpu``."""
    strategy: DistributedConfig | None = None
    pipeline: Any = None
    """The ``automodel_pipelining.PipelineConfig``, or None without pipeline parallelism."""
    pipeline_stages: int = 0
    """Stages the layers are split into (several per rank for looped schedules)."""
    peft: Any = None
    """The ``automodel_peft.PeftConfig``, or None."""
    adapted_layers: int = 0
    """Linear layers the adapters wrap."""
    fp8: Any = None
    """The ``automodel_quant.fp8.FP8Config``, or None."""
    qat: Any = None
    """The ``automodel_quant.qat.QATConfig``, or None."""
    compile: CompileConfig | None = None
    freeze: FreezeConfig | None = None
    frozen_towers: Sequence[str] = ()
    """The towers ``freeze_config`` freezes (``automodel_distributed.fsdp2_units.frozen_towers``)."""
    weights: str = "initialise the weights"
    """Where the weights come from, as a verb phrase (``load path/to/checkpoint``)."""
    loads_checkpoint: bool = False


@dataclass(frozen=True)
class Step(Generic[_State]):
    """One step of `apply_model_infrastructure`."""

    name: str
    """Short name (``shard``)."""
    what: str
    """What it does, in one line."""
    why: str
    """Why it sits where it does in the order."""
    run: Callable[[_State], None]
    """Runs the step on the state of one call (mutates it)."""
    describe: Callable[[PlannedJob], list[str]]
    """What it will do for a planned job, one line per action; empty when it does nothing there."""


def describe_steps(steps: Sequence[Step[Any]], job: PlannedJob) -> list[str]:
    """The actions of every step for ``job``, in the order they run."""
    return [line for step in steps for line in step.describe(job)]


def render_steps(steps: Sequence[Step[Any]]) -> str:
    """The steps as the Markdown list ``docs/concepts.md`` shows (generated; a test compares the two)."""
    return "\n".join(f"{i}. **{step.what}** ({step.name}). {step.why}" for i, step in enumerate(steps))


# ------------------------------------------------------------------------------------------ descriptions


def describe_check(job: PlannedJob) -> list[str]:
    """Step 0: the arguments, and the checkpoint from its metadata."""
    if job.loads_checkpoint:
        return ["check the arguments, and the checkpoint's files, keys and shapes against the model"]
    return ["check the arguments"]


def describe_lower_precision(job: PlannedJob) -> list[str]:
    """Step 1: adapters, FP8, QAT, and the context-parallel attention hooks."""
    lines = []
    if job.peft is not None:
        kind = "DoRA" if job.peft.use_dora else "LoRA"
        lines.append(
            f"add {kind} adapters (rank {job.peft.dim}, alpha {job.peft.alpha}) to {job.adapted_layers} "
            "linear layers"
        )
    if job.fp8 is not None and job.fp8.enabled:
        lines.append(
            f"convert linear layers to float8 training (recipe {job.fp8.recipe_name or 'tensorwise'})"
        )
    if job.qat is not None:
        lines.append(f"prepare quantization-aware training ({job.qat.quantizer_type})")
    if job.layout.cp > 1:
        lines.append(f"context-parallel attention hooks for cp={job.layout.cp}")
    return lines


def loads_before_sharding(job: PlannedJob) -> bool:
    """Whether the job's strategy (or one device without any) loads the weights before sharding."""
    adapters = job.peft is not None
    if job.strategy is None:
        return not adapters and not job.layout.shards_parameters
    return job.strategy.loads_before_sharding(job.layout, adapters=adapters)


def describe_load_first(job: PlannedJob) -> list[str]:
    """Step 2: materialise and load the whole model, where the strategy needs real tensors first."""
    if not loads_before_sharding(job):
        return []
    return [f"materialise the whole model and {job.weights} before sharding it"]


def describe_freeze(job: PlannedJob) -> list[str]:
    """Step 3: ``freeze_config``, and the base under PEFT."""
    lines = []
    if job.freeze is not None:
        towers = ", ".join(job.frozen_towers) or "no tower"
        lines.append(f"freeze {towers} (freeze_config)")
    if job.peft is not None:
        lines.append("freeze the base model (its parameters get no gradients)")
    return lines


def describe_shard(job: PlannedJob) -> list[str]:
    """Step 4: the pipeline split, then the strategy's own steps on the model or each stage."""
    lines = []
    if job.pipeline is not None:
        schedule = job.pipeline.pp_schedule_csv or job.pipeline.pp_schedule
        lines.append(
            f"split into {job.pipeline_stages} pipeline stages over pp={job.layout.pp} (schedule {schedule}, "
            f"{job.pipeline.n_microbatches} microbatches of {job.pipeline.pp_microbatch_size} rows); "
            "each stage is parallelized as follows"
        )
    if job.strategy is not None:
        lines += job.strategy.describe_sharding(job.layout, job.model)
    elif job.layout.ep > 1:
        lines.append(f"expert parallelism over ep={job.layout.ep} (automodel_moe.parallelize_model)")
    return lines


def describe_compile(job: PlannedJob) -> list[str]:
    """Step 5: ``torch.compile`` as the strategy does it, and the default loss with ``compile_loss``."""
    if job.strategy is not None:
        lines = job.strategy.describe_compile(job.compile)
    elif job.compile is not None and job.compile.enabled:
        lines = ["torch.compile the whole model"]
    else:
        lines = []
    if job.compile is not None and job.compile.enabled and job.compile.compile_loss:
        lines.append("torch.compile the default loss (MaskedCrossEntropy: no fp32 copy of the logits)")
    return lines


def describe_materialise(job: PlannedJob) -> list[str]:
    """Step 6: the shards get storage, then the checkpoint (each rank reads its slices)."""
    if loads_before_sharding(job):
        return []
    return [
        f"materialise the meta parameters on {job.device_type}; {job.weights} straight into the shards "
        "(each rank reads only its slices)"
    ]


def describe_finish(job: PlannedJob) -> list[str]:
    """Step 7: adapters alone train; unsharded models move to the device."""
    return ["freeze every parameter but the adapters"] if job.peft is not None else []
