"""Peak memory and communication volume per rank of a planned job, itemised (``automodel plan``).

Each line comes from the package that owns the piece: saved activations from the model's own forward
on fake tensors (`automodel_distributed.memory.profile_activations`), FSDP2's gathered units
(`automodel_distributed.memory.fsdp_buffer_bytes`) and their collective buffers
(`automodel_distributed.memory.fsdp_comm_buffer_bytes`), the in-flight micro-batches of a pipeline schedule
(`automodel_pipelining.schedules.in_flight_microbatches`), LoRA's extra activations
(`automodel_peft.memory`), 4-bit base weights and FP8 casts (`automodel_quant.memory`). Parameters,
gradients and AdamW state are counted per parameter by how the strategy shards it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel_all.cli.config import ResolvedJob, pipeline_stage_count
from automodel_all.cli.model import model_dtype
from automodel_all.cli.yaml_source import ConfigError
from automodel_distributed.config import default_mp_policy
from automodel_distributed.fsdp2 import frozen_towers

__all__ = ["DEVICE_PRESETS", "PeakEstimate", "estimate_peak", "parse_device_memory"]

_GIB = 2**30

DEVICE_PRESETS: dict[str, int] = {
    # Total memory as torch.cuda.get_device_properties reports it (MiB), not the marketing figure.
    "h100": 81_559 * 2**20,
    "h100-80g": 81_559 * 2**20,
    "h200": 143_771 * 2**20,
    "a100-40g": 40_536 * 2**20,
    "a100-80g": 81_251 * 2**20,
    "l40s": 46_068 * 2**20,
    "a10g": 22_731 * 2**20,
    "rtx4090": 24_217 * 2**20,
    "mi300x": 196_592 * 2**20,
}
"""``--device-memory`` presets: accelerator name -> bytes."""

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_device_memory(text: str) -> int:
    """Bytes of ``--device-memory``: a preset (`DEVICE_PRESETS`) or a size such as ``80GiB`` / ``40GB``.

    Raises:
        ConfigError: Neither a preset nor a size.
    """
    key = text.strip().lower()
    if key in DEVICE_PRESETS:
        return DEVICE_PRESETS[key]
    match = re.fullmatch(r"([\d.]+)\s*([a-z]*)", key)
    if match is None or match.group(2) not in _UNITS:
        raise ConfigError(
            f"--device-memory {text!r}: expected a size such as 80GiB or 40GB, or one of "
            f"{', '.join(sorted(DEVICE_PRESETS))}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@dataclass
class PeakEstimate:
    """The largest rank's memory, line by line, and the per-step communication volume of a rank."""

    rank: str
    """Which rank it is (``pp rank 0``, or ``every rank``)."""
    lines: dict[str, int] = field(default_factory=dict)
    """Name -> bytes, in the order printed."""
    notes: dict[str, str] = field(default_factory=dict)
    communication: dict[str, int] = field(default_factory=dict)
    """Collective -> bytes a rank sends per optimizer step."""
    buffers: dict[str, int] = field(default_factory=dict)
    """Mechanism -> bytes of the ``communication buffers`` line (`_communication_buffers`)."""

    @property
    def total(self) -> int:
        """The estimated peak: the sum of the lines."""
        return sum(self.lines.values())

    @property
    def communication_total(self) -> int:
        """Bytes sent per step, all collectives."""
        return sum(self.communication.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "peak_bytes": self.total,
            "lines": dict(self.lines),
            "notes": dict(self.notes),
            "communication_buffers_bytes": dict(self.buffers),
            "communication_bytes": dict(self.communication),
            "communication_total_bytes": self.communication_total,
        }


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _stage_blocks(counts: list[int], pp: int) -> list[list[int]]:
    """Blocks of each pipeline rank: ``counts[s]`` layers on stage ``s``, stages placed in loops."""
    owned: list[list[int]] = [[] for _ in range(pp)]
    layer = 0
    for stage, count in enumerate(counts):
        owned[stage % pp].extend(range(layer, layer + count))
        layer += count
    return owned


def _stage_layer_counts(model: nn.Module, num_layers: int, stages: int, balance: bool) -> list[int]:
    """Layers per stage as `AutoPipeline` splits them (``balance``: `PipelineConfig.balance_stages`)."""
    from automodel_pipelining import read_stage_costs, resolve_decoder_layout, split_layers_evenly

    if balance and 1 <= stages <= num_layers:
        return read_stage_costs(model, resolve_decoder_layout(model)).layer_counts(stages)
    return split_layers_evenly(num_layers, stages)


def _config_int(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _checkpointing(job: Any) -> Any:
    from automodel_distributed.activation_checkpointing import resolve_checkpointing_mode

    return resolve_checkpointing_mode(getattr(job.distributed, "activation_checkpointing", False)) or False


def _reshard_after_forward(job: Any, layout: Any) -> bool | int | None:
    """The ``reshard_after_forward`` FSDP2 applies: the strategy's, else the MoE config's under EP.

    `FSDP2Manager` takes it from the expert step where the strategy leaves it unset, and
    `MoEParallelizerConfig` defaults to False: every unit stays gathered from forward to backward.
    """
    setting = getattr(job.distributed, "reshard_after_forward", None)
    if setting is None and job.strategy == "fsdp2" and layout.ep > 1:
        from automodel_moe.config import MoEParallelizerConfig

        setting = (job.moe if job.moe is not None else MoEParallelizerConfig()).reshard_after_forward
    return setting


def estimate_peak(
    model: nn.Module,
    model_config: Any,
    resolved: ResolvedJob,
    *,
    profile_cache: dict[tuple[int, int, int], Any] | None = None,
    base_weight_bits: int | None = None,
) -> PeakEstimate:
    """Peak memory of the rank holding the most, for one training step with AdamW, and its traffic.

    Args:
        model: The meta model after adapters (its parameters' ``requires_grad`` tell what trains).
        model_config: Its transformers config.
        resolved: The job on its world size.
        profile_cache: Reused activation profiles keyed by (micro-batch, seq len, cp).
        base_weight_bits: 4 or 8 for a quantized frozen base (QLoRA), else None.

    Returns:
        The itemised estimate of the largest rank.
    """
    from automodel_distributed.memory import activation_bytes, fsdp_buffer_bytes, profile_activations
    from automodel_peft.memory import lora_activation_bytes
    from automodel_quant.memory import fp8_transient_bytes, quantized_weight_bytes

    job, layout = resolved.job, resolved.layout
    dtype = model_dtype(job)
    element = torch.empty((), dtype=dtype).element_size()
    num_layers = _config_int(model_config, "num_hidden_layers")
    pp, tp, cp = layout.pp, layout.tp, layout.cp
    pipeline = resolved.pipeline
    stages = pp
    if pipeline is not None:
        stages = pipeline_stage_count(pipeline, pp, num_layers) or pp
    balance = pipeline is not None and pipeline.balance_stages
    owned = _stage_blocks(_stage_layer_counts(model, num_layers, max(stages, 1), balance), pp)
    fsdp = job.strategy in ("fsdp2", "megatron_fsdp")
    dense_shard = layout.dp_shard * cp * tp if fsdp else 1
    expert_shard = layout.ep * layout.ep_shard * tp if layout.ep > 1 else dense_shard
    zero = getattr(job.distributed, "zero_dp_strategy", 3)
    multimodal = getattr(job.distributed, "multimodal", None)
    whole = (
        tuple(fqn + "." for fqn, _ in frozen_towers(model))
        if job.strategy == "fsdp2" and getattr(multimodal, "frozen_sharding", None) == "replicate"
        else ()
    )
    # A frozen tower kept out of FSDP (frozen_sharding="replicate") is whole on every rank.
    policy = getattr(job.distributed, "mp_policy", None) or default_mp_policy()
    # Experts on a one-rank ep_shard mesh stay out of FSDP unless their dtype is cast for compute
    # (automodel_distributed.one_rank_units): then nothing of theirs is gathered.
    experts_gathered = (
        job.strategy != "fsdp2" or layout.ep_shard > 1 or policy.param_dtype not in (None, dtype)
    )

    # Parameters, gradients, optimizer state and FSDP units, per pipeline rank.
    params = [0.0] * pp
    grads = [0.0] * pp
    accumulated = [0.0] * pp
    states = [0.0] * pp
    units: list[dict[tuple[int, str], float]] = [{} for _ in range(pp)]
    unit_grads: list[dict[tuple[int, str], float]] = [{} for _ in range(pp)]
    linear_shapes: list[tuple[int, int]] = []
    adapted_inputs: dict[int, list[int]] = {}
    owner = {block: rank for rank, blocks in enumerate(owned) for block in blocks}
    first = "model.embed_tokens"
    outer_units = _outer_units(model)
    freed = _always_resharded(model)
    fsdp_axis = layout.dp_shard * cp
    for name, param in model.named_parameters():
        index = _layer_index(name)
        rank = owner.get(index, 0) if index is not None else (0 if name.startswith(first) else pp - 1)
        if pp == 1:
            rank = 0
        experts = ".experts." in name
        shard = expert_shard if experts else dense_shard
        # Ranks of the FSDP axis the parameter is sharded over (what FSDP gathers and reduce-scatters).
        gathered_over = (layout.ep_shard if experts else fsdp_axis) if fsdp else 1
        if whole and name.startswith(whole):
            shard, gathered_over = 1, 1
        p_div = g_div = o_div = float(shard)
        if job.strategy == "megatron_fsdp":
            p_div = shard if zero >= 3 else tp
            g_div = shard if zero >= 2 else tp
            o_div = shard if zero >= 1 else tp
        size = float(param.numel() * param.element_size())
        if (
            base_weight_bits is not None
            and not param.requires_grad
            and param.dim() == 2
            and index is not None
        ):
            size = float(quantized_weight_bytes(param.numel(), bits=base_weight_bits))
        params[rank] += size / p_div
        # Its FSDP unit, in forward order: the root (gathered first), the embedding, each block and
        # then its experts (a unit of their own on the ep_shard mesh, when FSDP shards them), the head.
        if index is not None:
            unit = (2 + 2 * index + (1 if experts else 0), f"block{index}" + (".experts" if experts else ""))
        else:
            unit = next(
                ((order, fqn) for order, fqn in outer_units if name.startswith(fqn + ".")), (0, "root")
            )
        if gathered_over > 1 or (experts and experts_gathered):
            local = size / (shard / gathered_over)  # this rank's part, unsharded over the FSDP axis
            units[rank][unit] = units[rank].get(unit, 0.0) + local
            if param.requires_grad:
                unit_grads[rank][unit] = unit_grads[rank].get(unit, 0.0) + local
                accumulated[rank] += local
        if param.requires_grad:
            grads[rank] += param.numel() * param.element_size() / g_div
            states[rank] += param.numel() * 8 / o_div
        if param.dim() == 2 and index is not None and "lora_" not in name and name.endswith("weight"):
            out_features, in_features = param.shape
            linear_shapes.append((max(out_features // tp, 1), in_features))
        if "lora_A" in name and index is not None:
            adapted_inputs.setdefault(index, []).append(int(param.shape[1]))

    # Activations: one micro-batch profiled from the model's own forward, scaled to this layout.
    if pipeline is not None:
        micro_batch = pipeline.pp_microbatch_size
        n_micro = pipeline.n_microbatches
    else:
        micro_batch = job.train.micro_batch_size or resolved.rows_per_dp_rank
        n_micro = 1
    # Micro-batches one optimizer step runs on a rank (gradient accumulation, or the pipeline's).
    accumulation = n_micro if pipeline is not None else max(resolved.rows_per_dp_rank // micro_batch, 1)
    # FSDP2 keeps each micro-batch's gradients unsharded and unreduced until the last one
    # (defer_fsdp_grad_sync, also under pipelining): a full-size copy of the trainable parameters.
    deferred = (
        job.strategy == "fsdp2"
        and accumulation > 1
        and bool(getattr(job.distributed, "defer_fsdp_grad_sync", True))
    )
    # Units keep their parameters gathered after forward under pipelining (until the last
    # micro-batch's backward) or with reshard_after_forward=False.
    reshard_setting = _reshard_after_forward(job, layout)
    reshard = reshard_setting is not False and not (pipeline is not None and reshard_setting is None)
    seq_len = job.data.seq_len
    key = (micro_batch, seq_len, cp)
    cache = profile_cache if profile_cache is not None else {}
    if key not in cache:
        cache[key] = profile_activations(
            model_config,
            micro_batch=micro_batch,
            seq_len=seq_len,
            dtype=dtype,
            cp=cp,
            attn_implementation=job.model.attn_implementation,
        )
    profile = cache[key]
    mode = _checkpointing(job)
    sp = bool(getattr(job.distributed, "sequence_parallel", False)) and tp > 1
    spec = None
    if pipeline is not None:
        from automodel_pipelining.schedules import in_flight_microbatches, resolve_schedule

        spec = resolve_schedule(pipeline.pp_schedule, pipeline.pp_schedule_csv)
    tokens = profile.tokens
    best: PeakEstimate | None = None
    for rank in range(pp):
        blocks = owned[rank] if pp > 1 else list(range(len(profile.blocks)))
        stages_here = max(stages // pp, 1)
        in_flight = 1.0
        if pipeline is not None:
            units_held = in_flight_microbatches(
                spec, pp_size=pp, rank=rank, n_microbatches=n_micro, stages_per_rank=stages_here
            )
            in_flight = units_held / stages_here
        acts = activation_bytes(
            profile,
            checkpointing=mode,
            blocks=[b for b in blocks if b < len(profile.blocks)],
            in_flight=in_flight,
            tp=tp,
            sequence_parallel=sp,
            first_stage=rank == 0,
            last_stage=rank == pp - 1,
        )
        estimate = PeakEstimate(rank=f"pp rank {rank}" if pp > 1 else "every rank")
        lines = estimate.lines
        lines["parameters"] = int(params[rank])
        lines["gradients"] = int(grads[rank])
        lines["optimizer"] = int(states[rank])
        estimate.notes["optimizer"] = "AdamW: 2 fp32 states per trainable parameter"
        if deferred and accumulated[rank]:
            lines["accumulated gradients"] = int(accumulated[rank])
            estimate.notes["accumulated gradients"] = (
                f"unsharded, unreduced over {accumulation} micro-batches (defer_fsdp_grad_sync)"
            )
        ordered = [units[rank][key] for key in sorted(units[rank])]
        if fsdp:
            lines["gathered units"] = fsdp_buffer_bytes(
                [int(v) for v in ordered],
                shard=fsdp_axis,
                unit_grad_bytes=[int(unit_grads[rank].get(key, 0)) for key in sorted(units[rank])],
                reshard=reshard,
                always_resharded=[pipeline is None and key[1] in freed for key in sorted(units[rank])],
            )
            estimate.notes["gathered units"] = (
                "the 2 largest FSDP units unsharded + 1 unit's full-size gradient"
                if reshard
                else "every FSDP unit of the rank stays unsharded (pipelining / reshard_after_forward=False; "
                "outside a pipeline an untied embedding is freed after forward)"
            )
        lines["activations"] = acts
        estimate.notes["activations"] = (
            f"{len(blocks)} block(s), {mode or 'no'} checkpointing, {in_flight:g} micro-batch(es) in flight, "
            f"{tokens} tokens/micro-batch, tp={tp}{' +SP' if sp else ''}, cp={cp}"
        )
        lora_inputs = [w for b in blocks for w in adapted_inputs.get(b, [])]
        if lora_inputs and job.peft is not None:
            lines["LoRA activations"] = int(
                in_flight
                * lora_activation_bytes(
                    lora_inputs,
                    rank=job.peft.dim,
                    tokens=tokens,
                    element_size=element,
                    dropout=job.peft.dropout,
                )
            )
        if job.fp8 is not None and job.fp8.enabled:
            lines["FP8 casts"] = fp8_transient_bytes(linear_shapes, tokens)
        buffers = _communication_buffers(
            resolved, model_config, fsdp_units=ordered if fsdp else [], trainable_shard=grads[rank],
            tokens=tokens, element=element, n_micro=n_micro, stages=stages_here, first_stage=rank == 0,
            last_stage=rank == pp - 1,
        )  # fmt: skip
        estimate.buffers = buffers
        if buffers:
            lines["communication buffers"] = sum(buffers.values())
            estimate.notes["communication buffers"] = ", ".join(buffers)
        estimate.communication = _communication(
            resolved, model_config, unsharded=sum(units[rank].values()), trainable_shard=grads[rank],
            blocks=len(blocks), tokens=tokens, element=element, n_micro=n_micro, reshard=reshard,
        )  # fmt: skip
        if best is None or estimate.total > best.total:
            best = estimate
    assert best is not None
    return best


def _always_resharded(model: nn.Module) -> set[str]:
    """FQNs of the units `plan_fsdp_units` reshards after forward even when told not to (no pipeline)."""
    from automodel_distributed.fsdp2 import plan_fsdp_units

    try:
        return {p.fqn for p in plan_fsdp_units(model, reshard_after_forward=False) if p.reshard_after_forward}
    except ValueError:
        return set()


def _outer_units(model: nn.Module) -> list[tuple[int, str]]:
    """(forward order, FQN) of the FSDP units outside the blocks: `plan_fsdp_units`' embedding and head."""
    from automodel_distributed.fsdp2 import plan_fsdp_units
    from automodel_distributed.layers import find_transformer_blocks

    try:
        blocks = {fqn for fqn, _ in find_transformer_blocks(model)}
        planned = plan_fsdp_units(model, reshard_after_forward=None)
    except ValueError:
        return []
    seen_block = False
    ordered: list[tuple[int, str]] = []
    for plan in planned:
        seen_block = seen_block or plan.fqn in blocks
        if plan.fqn not in blocks:
            ordered.append((1 << 30 if seen_block else 1, plan.fqn))  # before or after the blocks
    return ordered


def _communication_buffers(
    resolved: ResolvedJob,
    model_config: Any,
    *,
    fsdp_units: list[float],
    trainable_shard: float,
    tokens: int,
    element: int,
    n_micro: int,
    stages: int,
    first_stage: bool,
    last_stage: bool,
) -> dict[str, int]:
    """Bytes of the buffers a rank's collectives hold at the peak, by mechanism (one micro-batch).

    FSDP2's all-gather outputs and reduce-scatter inputs (`fsdp_comm_buffer_bytes`; pooled from
    step to step on CPU), DDP's gradient buckets, the hidden states TP gathers or reduces, the K/V
    blocks CP's ring sends and receives, the pipeline stage's receive buffers (one per micro-batch,
    forward inputs and backward gradients, made once by torch's ``PipelineStage``) and the tokens
    an expert-parallel all-to-all sends and receives.
    """
    from automodel_distributed.memory import fsdp_comm_buffer_bytes

    job, layout = resolved.job, resolved.layout
    hidden = _config_int(model_config, "hidden_size")
    out: dict[str, int] = {}
    fsdp = fsdp_comm_buffer_bytes([int(v) for v in fsdp_units], shard=layout.dp_shard * layout.cp)
    if fsdp:
        out["FSDP all-gather / reduce-scatter"] = fsdp
    if job.strategy == "ddp" and resolved.world_size > 1:
        out["DDP gradient buckets"] = int(trainable_shard)  # a second copy of the gradients
    if layout.tp > 1:
        out["TP gathered hidden states"] = tokens * hidden * element
    if layout.cp > 1:
        kv = _config_int(model_config, "num_key_value_heads", "num_attention_heads")
        heads = _config_int(model_config, "num_attention_heads", default=1)
        head_dim = _config_int(model_config, "head_dim", default=hidden // max(heads, 1))
        out["CP ring K/V send + receive"] = 2 * 2 * tokens * kv * head_dim * element
    if layout.pp > 1:
        # Forward-input receive buffers on every stage but the first, gradient ones on every stage but
        # the last, one per micro-batch each, for each of the rank's stages.
        kinds = 2 * stages - (1 if first_stage else 0) - (1 if last_stage else 0)
        out["PP receive buffers"] = kinds * n_micro * tokens * hidden * element
    if layout.ep > 1:
        topk = _config_int(model_config, "num_experts_per_tok", "top_k", default=1)
        out["EP all-to-all send + receive"] = 2 * tokens * topk * hidden * element
    return out


def _communication(
    resolved: ResolvedJob,
    model_config: Any,
    *,
    unsharded: float,
    trainable_shard: float,
    blocks: int,
    tokens: int,
    element: int,
    n_micro: int,
    reshard: bool,
) -> dict[str, int]:
    """Bytes one rank sends per step, per collective, with ring-algorithm factors.

    ``reshard``: whether FSDP units free their parameters after forward (and gather them again in
    backward).
    """
    job, layout = resolved.job, resolved.layout
    out: dict[str, int] = {}
    hidden = _config_int(model_config, "hidden_size")
    shard = layout.dp_shard * layout.cp
    if job.strategy == "ddp":
        world = resolved.world_size
        if world > 1:
            out["all-reduce gradients (DDP)"] = int(2 * (world - 1) / world * trainable_shard)
        return out
    if shard > 1:
        # All-gather in forward, again in backward when units reshard after forward; reduce-scatter
        # gradients.
        trainable_full = trainable_shard * shard
        gathers = 2 if reshard else 1
        out[f"FSDP all-gather x{gathers}"] = int(gathers * (shard - 1) / shard * unsharded)
        out["FSDP reduce-scatter"] = int((shard - 1) / shard * trainable_full)
    if layout.dp_replicate > 1:
        r = layout.dp_replicate
        out["HSDP all-reduce"] = int(2 * (r - 1) / r * trainable_shard)
    if layout.tp > 1:
        tp = layout.tp
        out["TP all-reduce (or AG+RS)"] = int(
            4 * 2 * (tp - 1) / tp * tokens * hidden * element * blocks * n_micro
        )
    if layout.cp > 1:
        kv = _config_int(model_config, "num_key_value_heads", "num_attention_heads")
        heads = _config_int(model_config, "num_attention_heads", default=1)
        head_dim = _config_int(model_config, "head_dim", default=hidden // heads)
        out["CP ring K/V"] = int(
            3 * (layout.cp - 1) * 2 * tokens * kv * head_dim * element * blocks * n_micro
        )
    if layout.pp > 1:
        out["PP send/recv"] = int(2 * tokens * hidden * element * n_micro)
    if layout.ep > 1:
        topk = _config_int(model_config, "num_experts_per_tok", "top_k", default=1)
        ep = layout.ep
        out["EP all-to-all"] = int(4 * (ep - 1) / ep * tokens * topk * hidden * element * blocks * n_micro)
    return out
