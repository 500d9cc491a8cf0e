"""``automodel plan``: a dry run on the meta device, with no process group and no worker.

It prints the mesh layout (`MeshContext.resolve`), the steps `apply_model_infrastructure` will apply in
order, and an estimate of the largest rank's memory for parameters, gradients and AdamW state given how
the strategy shards them. Activations and temporary buffers (all-gathers, the logits) are not included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from automodel_all.cli.config import JobConfig, ResolvedJob, build_job, pipeline_stage_count, resolve_job
from automodel_all.cli.launch import nproc_per_node
from automodel_all.cli.model import build_meta_model, load_model_config
from automodel_all.cli.yaml_source import RawJob
from automodel_distributed.config import normalize_activation_checkpointing

__all__ = ["MemoryEstimate", "estimate_memory", "plan", "planned_steps"]

_MIB = 2**20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the largest rank."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        """Sum of the three."""
        return self.parameters + self.gradients + self.optimizer


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _pp_rank_of(name: str, layer_owner: dict[int, int], pp: int, first: str) -> int:
    index = _layer_index(name)
    if index is not None:
        return layer_owner.get(index, 0)
    return 0 if name.startswith(first) else pp - 1  # embeddings first; norm and head last


def _layer_owners(num_layers: int, pp: int, stages: int) -> dict[int, int]:
    """Layer -> pipeline rank: layers spread over stages (remainder first), stages placed in loops."""
    owners: dict[int, int] = {}
    per, extra = divmod(num_layers, stages)
    layer = 0
    for stage in range(stages):
        for _ in range(per + (1 if stage < extra else 0)):
            owners[layer] = stage % pp
            layer += 1
    return owners


def estimate_memory(model: nn.Module, resolved: ResolvedJob) -> MemoryEstimate:
    """Bytes of the rank holding the most: parameters, gradients, AdamW state.

    Gradients are counted for trainable parameters in the parameter dtype, AdamW state as 2 fp32 values
    per trainable parameter. ``model`` is the (meta) model after adapters.
    """
    job, layout = resolved.job, resolved.layout
    pp = layout.pp
    stages = pp
    num_layers = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    if resolved.pipeline is not None:
        stages = pipeline_stage_count(resolved.pipeline, pp, num_layers) or pp
    owners = _layer_owners(num_layers, pp, max(stages, 1))
    dense_shard = layout.dp_shard * layout.cp * layout.tp
    expert_shard = layout.ep * layout.ep_shard * layout.tp if layout.ep > 1 else dense_shard
    zero = getattr(job.distributed, "zero_dp_strategy", 3)
    per_rank = [[0.0, 0.0, 0.0] for _ in range(pp)]
    for name, param in model.named_parameters():
        shard = expert_shard if ".experts." in name else dense_shard
        if job.strategy == "ddp":
            shard = 1
        p_div = g_div = o_div = shard
        if job.strategy == "megatron_fsdp":
            p_div = shard if zero >= 3 else layout.tp
            g_div = shard if zero >= 2 else layout.tp
            o_div = shard if zero >= 1 else layout.tp
        rank = _pp_rank_of(name, owners, pp, "model.embed_tokens") if pp > 1 else 0
        size = param.numel() * param.element_size()
        per_rank[rank][0] += size / p_div
        if param.requires_grad:
            per_rank[rank][1] += size / g_div
            per_rank[rank][2] += param.numel() * 8 / o_div
    worst = max(per_rank, key=sum)
    return MemoryEstimate(int(worst[0]), int(worst[1]), int(worst[2]))


def planned_steps(job: JobConfig, resolved: ResolvedJob, model: nn.Module, adapted: int) -> list[str]:
    """What `apply_model_infrastructure` (and the worker) will do, in order."""
    layout = resolved.layout
    steps: list[str] = []
    if job.peft is not None:
        kind = "DoRA" if job.peft.use_dora else "LoRA"
        steps.append(
            f"add {kind} adapters (rank {job.peft.dim}, alpha {job.peft.alpha}) to {adapted} linear layers"
        )
    if job.fp8 is not None and job.fp8.enabled:
        steps.append(
            f"convert linear layers to float8 training (recipe {job.fp8.recipe_name or 'tensorwise'})"
        )
    if job.qat is not None:
        steps.append(f"prepare quantization-aware training ({job.qat.quantizer_type})")
    sharded = layout.pp > 1 or layout.tp > 1 or layout.ep > 1 or layout.dp_shard_cp > 1
    source = _weights_source(job)
    if job.strategy == "ddp" or not sharded:
        steps.append(f"materialise the whole model and {source} before wrapping it (nothing is sharded)")
    # False, "full" or "selective" (a config keeps True as given, as in NeMo AutoModel).
    ac = normalize_activation_checkpointing(getattr(job.distributed, "activation_checkpointing", False))
    blocks = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    if resolved.pipeline is not None:
        stages = pipeline_stage_count(resolved.pipeline, layout.pp, blocks) or layout.pp
        steps.append(
            f"split into {stages} pipeline stages over pp={layout.pp} (schedule "
            f"{resolved.pipeline.pp_schedule_csv or resolved.pipeline.pp_schedule}, "
            f"{resolved.pipeline.n_microbatches} microbatches of "
            f"{resolved.pipeline.pp_microbatch_size} rows); "
            "each stage is parallelized as follows"
        )
    if job.strategy == "fsdp2":
        if layout.tp > 1:
            sp = " with sequence parallelism" if getattr(job.distributed, "sequence_parallel", False) else ""
            steps.append(f"tensor-parallel plan over tp={layout.tp}{sp}")
        if layout.ep > 1:
            steps.append(
                f"expert parallelism over ep={layout.ep}; experts sharded over ep_shard={layout.ep_shard}"
            )
        if ac:
            steps.append(f"activation checkpointing ({ac}) of each transformer block")
        hsdp = (
            f", replicated over dp_replicate={layout.dp_replicate} (HSDP)" if layout.dp_replicate > 1 else ""
        )
        steps.append(
            f"fully_shard each of {blocks} transformer blocks, then the root, over "
            f"dp_shard_cp={layout.dp_shard_cp}{hsdp}"
        )
    elif job.strategy == "ddp":
        if ac:
            steps.append(f"activation checkpointing ({ac}) of each transformer block")
        steps.append(f"wrap in DistributedDataParallel over {resolved.world_size} ranks")
    else:
        zero = getattr(job.distributed, "zero_dp_strategy", 3)
        steps.append(f"Megatron-FSDP (ZeRO-{zero}) over dp_cp={layout.dp_cp}, tp={layout.tp}")
    compile_on = (job.compile is not None and job.compile.enabled) or getattr(
        job.distributed, "enable_compile", False
    )
    if compile_on:
        steps.append("torch.compile each transformer block (after sharding)")
    if sharded and job.strategy != "ddp":
        steps.append(
            f"materialise the meta parameters on {job.device_type}; {source} straight into the shards "
            "(each rank reads only its slices)"
        )
    if job.peft is not None:
        steps.append("freeze every parameter but the adapters")
    if layout.cp > 1:
        steps.append(f"context parallelism: ring attention, sequences sharded over cp={layout.cp}")
    return steps


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


def plan(raw: RawJob, *, world_size: int | None = None) -> str:
    """The dry-run report for the job in ``raw`` on ``world_size`` ranks (default: nnodes x nproc).

    Raises:
        ConfigError: A bad job or a layout that cannot work, naming the setting.
    """
    job = build_job(raw)
    world = world_size if world_size is not None else job.launch.nnodes * nproc_per_node(job)
    model_config = load_model_config(job)
    resolved = resolve_job(job, world, model_config)
    model = build_meta_model(job, model_config)
    adapted = 0
    if job.peft is not None:
        from automodel_peft import apply_lora_to_linear_modules

        adapted = apply_lora_to_linear_modules(model, job.peft)  # on meta: free; freezes the base
    total = sum(p.numel() for p in _params(model))
    trainable = sum(p.numel() for p in _params(model) if p.requires_grad)
    memory = estimate_memory(model, resolved)
    train = job.train
    lines = [
        f"automodel plan: {job.strategy} on {world} rank(s), {job.device_type}",
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
        *(f"  {i}. {step}" for i, step in enumerate(planned_steps(job, resolved, model, adapted), start=1)),
        "",
        "estimated memory of the largest rank (activations not included):",
        f"  parameters  {memory.parameters / _MIB:10.2f} MiB",
        f"  gradients   {memory.gradients / _MIB:10.2f} MiB",
        f"  optimizer   {memory.optimizer / _MIB:10.2f} MiB  (AdamW: 2 fp32 states per trainable parameter)",
        f"  total       {memory.total / _MIB:10.2f} MiB",
    ]
    return "\n".join(lines)
