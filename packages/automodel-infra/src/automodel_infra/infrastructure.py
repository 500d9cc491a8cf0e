"""Infrastructure instantiation and application: the documented orchestration functions.

Two phases, as in NeMo AutoModel (``nemo_automodel._transformers.infrastructure``):

1. `instantiate_infrastructure` turns config objects (a strategy config, `PipelineConfig`, `QATConfig`,
   `MoEParallelizerConfig`) and a `MeshContext` into runtime objects: ``(model_wrapper, autopipeline,
   parallelize_fn, qat_quantizer)``.
2. `apply_model_infrastructure` applies them to a model, usually built on the meta device, in a fixed
   order (docs/concepts.md explains each step and why): adapters, FP8 and QAT on meta; load first only
   when nothing will be sharded; the loss fallback; sharding (pipeline stages, EP + FSDP, or the
   manager's ``parallelize``); compile; materialise and load the checkpoint straight into the shards;
   freeze everything but the adapters; move to the device.

Every step is one call into a leaf package: the strategy manager meets this module through the typed
`automodel_distributed.strategy.StrategyManager` protocol (shard, load before sharding or not, the init
device, compile, placement), adapters through `automodel_peft` (create, initialise once, freeze), so no
step asks ``isinstance`` or ``getattr`` what a manager is. Optional packages (pipelining, MoE,
quantization, PEFT) are imported only when the step that needs them runs; a missing one raises
`ImportError` naming the distribution to install. Nothing here knows a model family.

Differences from the reference system, on purpose: caller configs are never mutated (copies are made);
FP8 and QAT failures raise instead of being logged and skipped; a QAT model that is not bfloat16 raises
`ValueError` (a user error) rather than ``NotImplementedError``; a meta model is always materialised
(never returned on meta); ``compile_config`` is honoured under FSDP2 (per block, in place) and pipeline
parallelism instead of being ignored; a ``loss_fn`` the caller gives is never replaced (the pipeline
stages always hand it logits; `MaskedCrossEntropy` is the default only when it is None, compiled when
``compile_config`` is, unless its ``compile_loss`` is off); under expert
parallelism the FSDP2 manager's own ``parallelize`` runs with the expert step plugged in, so every
`FSDP2Config` setting (prefetch, checkpointing scope, mixed precision) holds there too.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from automodel_distributed.config import (
    CompileConfig,
    DDPConfig,
    DistributedConfig,
    FSDP2Config,
    MegatronFSDPConfig,
)
from automodel_distributed.loss import MaskedCrossEntropy
from automodel_distributed.strategy import StrategyManager, as_strategy
from automodel_infra import steps
from automodel_infra._optional import import_component
from automodel_infra.steps import Step
from automodel_mesh import MeshContext, MeshKind

if TYPE_CHECKING:
    from automodel_distributed.ddp import DDPManager
    from automodel_distributed.fsdp2 import ExpertParallelism, FSDP2Manager
    from automodel_distributed.megatron_fsdp import MegatronFSDPManager
    from automodel_moe.config import MoEParallelizerConfig
    from automodel_pipelining.autopipeline import AutoPipeline
    from automodel_pipelining.config import PipelineConfig
    from automodel_quant.qat import QATConfig

    Manager = FSDP2Manager | MegatronFSDPManager | DDPManager

__all__ = [
    "APPLY_STEPS",
    "ApplyState",
    "Infrastructure",
    "_apply_peft_and_lower_precision",
    "_instantiate_distributed",
    "_instantiate_pipeline",
    "_instantiate_qat",
    "_shard_ep_fsdp",
    "_shard_pp",
    "apply_model_infrastructure",
    "instantiate_infrastructure",
    "logger",
    "parallelize_for_pp",
]

logger = logging.getLogger(__name__)

_LEGACY_WARNED = False
_REFERENCE_ONLY_KWARGS = ("inject_te_attention", "freeze_config")


class Infrastructure(NamedTuple):
    """What `instantiate_infrastructure` returns; unpacks as the documented 4-tuple."""

    model_wrapper: Any
    """`FSDP2Manager`, `MegatronFSDPManager`, `DDPManager`, or ``None``."""
    autopipeline: Any
    """`AutoPipeline` when the mesh has ``pp > 1``, else ``None``."""
    parallelize_fn: Callable[..., Any] | None
    """`parallelize_for_pp` bound to the manager (pipelining), the MoE parallelizer (``ep > 1`` without a
    strategy config), or None (the manager shards: under ``ep > 1`` it runs the expert step first)."""
    qat_quantizer: Any
    """A torchao QAT quantizer, or ``None``."""


# --------------------------------------------------------------------------------------------- helpers


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _count_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; works on meta (``numel`` needs no storage)."""
    trainable = total = 0
    for param in model.parameters():
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return trainable, total


def _warn_legacy(names: list[str]) -> None:
    global _LEGACY_WARNED
    if _LEGACY_WARNED:
        return
    _LEGACY_WARNED = True
    warnings.warn(
        f"instantiate_infrastructure({', '.join(f'{n}=' for n in names)}) is deprecated: pass "
        "mesh=MeshContext.build(strategy_config, ParallelismSizes(...)) (or MeshContext.from_meshes(...))",
        FutureWarning,
        stacklevel=3,
    )


def _effective_activation_checkpointing(
    config: DistributedConfig | None, activation_checkpointing: bool | str
) -> tuple[DistributedConfig | None, bool | str]:
    """Merge the flag into (a copy of) the strategy config; return it and the effective setting.

    The flag turns checkpointing on (``True``/``"full"``/``"selective"``); ``False`` leaves the
    strategy config's own setting. The caller's config object is never modified.
    """
    if activation_checkpointing not in (False, True, "full", "selective"):
        raise ValueError(
            f"activation_checkpointing={activation_checkpointing!r}; use False, True, 'full' or 'selective'"
        )
    own = getattr(config, "activation_checkpointing", False) if config is not None else False

    def mode(value: object) -> object:  # True and "full" mean the same (configs normalise to "full")
        return "full" if value is True else value

    if activation_checkpointing and config is not None and mode(own) != mode(activation_checkpointing):
        if own not in (False, None):
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} contradicts "
                f"{type(config).__name__}.activation_checkpointing={own!r}; set one of them"
            )
        config = dataclasses.replace(config, activation_checkpointing=cast(Any, activation_checkpointing))
        own = activation_checkpointing
    return config, own or activation_checkpointing


# --------------------------------------------------------------------------------------------- steps


def _apply_peft_and_lower_precision(
    model: nn.Module,
    tp_size: int,
    autopipeline: AutoPipeline | None,
    peft_config: Any,
    quantization_config: Any,
    fp8_config: Any,
    qat_quantizer: Any,
) -> nn.Module:
    """Add LoRA adapters, then convert to FP8 training, then prepare QAT, in place.

    Runs before any sharding (so tensor-parallel plans see the adapted and converted module types) and
    works on the meta device. Adapters are added without freezing the base: freezing happens after the
    checkpoint is loaded, when every parameter exists.

    Args:
        model: The unsharded model; mutated (modules swapped, adapters added).
        tp_size: Tensor-parallel degree (logged; LoRA layers get LoRA-aware TP styles later).
        autopipeline: The pipeline, if any (logged).
        peft_config: `automodel_peft.PeftConfig`, a ``peft.LoraConfig`` or a dict, or None.
        quantization_config: Quantized base weights for QLoRA (bitsandbytes), or None.
        fp8_config: `automodel_quant.fp8.FP8Config` (or its dict), or None.
        qat_quantizer: A torchao QAT quantizer from `_instantiate_qat`, or None.

    Returns:
        ``model``.

    Raises:
        ImportError: automodel-peft / automodel-quant is not installed.
        ValueError: QAT with ``tp_size > 1``; from the leaf packages: a bad PEFT config, QAT on a model
            that is not bfloat16, FP8 on hardware without float8 support.
    """
    if peft_config is not None:
        peft = import_component("automodel_peft", "peft_config")
        if tp_size > 1 or autopipeline is not None:
            logger.info(
                "LoRA with %s", "tensor parallelism (LoRA-aware TP styles)" if tp_size > 1 else "pipelining"
            )
        count = peft.apply_lora_to_linear_modules(
            model, peft_config, quantization_config=quantization_config, skip_freeze=True
        )
        logger.info("LoRA: %d linear modules adapted", count)
    elif quantization_config is not None:
        raise ValueError(
            "quantization_config (quantized base weights) is only used with peft_config (QLoRA); "
            "pass a peft_config or drop quantization_config"
        )
    if fp8_config is not None:
        fp8 = import_component("automodel_quant.fp8", "fp8_config")
        model = fp8.apply_fp8_to_model(model, config=fp8_config)
    if qat_quantizer is not None and tp_size > 1:
        # torch's TP styles partition every submodule of a matched linear, torchao's fake quantizers
        # included, and per-group weight scales would be computed on shards: refuse rather than guess.
        raise ValueError(
            f"QAT with tensor parallelism (tp_size={tp_size}) is not supported; use tp_size=1 and shard the "
            "QAT model with FSDP2/HSDP or pipeline parallelism, or drop qat_config"
        )
    if qat_quantizer is not None:
        qat = import_component("automodel_quant.qat", "qat_quantizer")
        model, mode = qat.prepare_qat_model(model, qat_quantizer)
        logger.info("QAT prepared (mode %s)", mode)
    return model


def _shard_pp(
    autopipeline: AutoPipeline,
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor] | None,
    parallelize_fn: Any,
) -> nn.Module | AutoPipeline:
    """Split ``model`` into this rank's pipeline stages and parallelize each (`AutoPipeline.build`).

    Records ``trainable_params_before_pp`` / ``total_params_before_pp`` on ``autopipeline`` first (the
    build moves the model's modules into the stages).

    Mesh axes: ``pp`` for stage placement; ``parallelize_fn`` uses the others.

    Returns:
        ``autopipeline`` (its ``parts`` are this rank's stage modules), or ``model`` unchanged in a
        single-process run.
    """
    trainable, total = _count_params(model)
    autopipeline.trainable_params_before_pp = trainable
    autopipeline.total_params_before_pp = total
    if _world_size() == 1:
        logger.info("pipeline parallelism skipped: one process")
        return model
    return autopipeline.build(model, loss_fn=loss_fn, parallelize_fn=parallelize_fn)


def _shard_ep_fsdp(model: nn.Module, model_wrapper: Any, parallelize_fn: Any, mesh: MeshContext) -> nn.Module:
    """Apply EP + FSDP sharding (non-PP path).

    With a ``parallelize_fn`` (the caller's own, or the MoE parallelizer when expert parallelism has no
    strategy config) and several ranks it is called in place with the meshes and
    `MeshContext.parallelize_axis_kwargs`, as in the reference system; otherwise the manager shards
    (`StrategyManager.shard`: under expert parallelism the FSDP2 manager runs its expert step first).
    With neither, nothing happens.

    Returns:
        The sharded (possibly wrapped) model.
    """
    if parallelize_fn is not None and mesh.world_size > 1:
        result = parallelize_fn(
            model, world_mesh=mesh.device_mesh, moe_mesh=mesh.moe_mesh, **mesh.parallelize_axis_kwargs()
        )
        return result if isinstance(result, nn.Module) else model  # None: changed in place
    return as_strategy(model_wrapper, mesh).shard(model)


def _instantiate_distributed(config: DistributedConfig | None, mesh: MeshContext) -> Manager | None:
    """Instantiate the appropriate distributed manager from config.

    Args:
        config: Distributed config (FSDP2Config, MegatronFSDPConfig, or DDPConfig).
        mesh: MeshContext holding device_mesh and moe_mesh references; the manager keeps this object.

    Returns:
        The instantiated manager, or None if config is None.

    Raises:
        ValueError: If device_mesh is required but not provided, the mesh is laid out for another
            strategy (e.g. a tensor-parallel mesh for DDP), or the config is of an unknown type.
        RuntimeError: `DDPConfig` without an initialised process group.
    """
    return _build_manager(config, mesh, None)


def _build_manager(
    config: DistributedConfig | None, mesh: MeshContext, experts: ExpertParallelism | None
) -> Manager | None:
    """`_instantiate_distributed`, with the expert-parallel step an `FSDP2Manager` runs first (or None)."""
    if config is None:
        return None
    if mesh.kind is not None and isinstance(config, FSDP2Config | MegatronFSDPConfig | DDPConfig):
        wanted = config.mesh_kind()
        if mesh.kind is not wanted:
            raise ValueError(
                f"{type(config).__name__} needs a {wanted.value} mesh, but the mesh is laid out for "
                f"{mesh.kind.value} (axes {mesh.axis_names()}); build it with "
                f"MeshContext.build({type(config).__name__}(...), ParallelismSizes(...))"
            )
    if isinstance(config, FSDP2Config):
        if mesh.device_mesh is None and _world_size() > 1:
            raise ValueError(
                "device_mesh is required for FSDP2Config: pass mesh=MeshContext.build(FSDP2Config(...), "
                "ParallelismSizes(...))"
            )
        from automodel_distributed.fsdp2 import FSDP2Manager

        return FSDP2Manager(config, mesh=mesh, experts=experts)
    if isinstance(config, MegatronFSDPConfig):
        if mesh.device_mesh is None:
            raise ValueError(
                "device_mesh is required for MegatronFSDPConfig: pass "
                "mesh=MeshContext.build(MegatronFSDPConfig(...), ParallelismSizes(...))"
            )
        from automodel_distributed.megatron_fsdp import MegatronFSDPManager

        return MegatronFSDPManager(config, mesh)
    if isinstance(config, DDPConfig):
        from automodel_distributed.ddp import DDPManager

        return DDPManager(config, mesh=mesh if mesh.kind is MeshKind.DDP else None)
    raise ValueError(
        f"Unknown distributed config type: {type(config).__name__}; use FSDP2Config, MegatronFSDPConfig or "
        "DDPConfig (from automodel_distributed.config)"
    )


def _instantiate_pipeline(
    config: PipelineConfig | None,
    mesh: MeshContext,
    device: torch.device | None = None,
    strategy_config: DistributedConfig | None = None,
) -> AutoPipeline | None:
    """Instantiate AutoPipeline from config.

    Args:
        config: Pipeline config. If None or pp_size <= 1, returns None.
        mesh: MeshContext holding device_mesh, moe_mesh, and axis names.
        device: Target device for pipeline computation.
        strategy_config: The strategy config; its ``defer_fsdp_grad_sync`` also governs gradient
            reduction across microbatches (one knob for both), and its mixed precision is the dtype the
            stages send (`FSDP2Config.activation_dtype`).

    Returns:
        AutoPipeline instance, or None if pipeline parallelism is not enabled.

    Raises:
        ImportError: automodel-pipelining is not installed.
    """
    if config is None or mesh.device_mesh is None or mesh.pp_size <= 1:
        return None
    pipelining = import_component("automodel_pipelining.autopipeline", "pipeline_config")
    # Pipeline axes exist only in the FSDP2 layout; its defer_fsdp_grad_sync governs the microbatches too,
    # and its mixed precision sets the dtype the stages send.
    fsdp2 = strategy_config if isinstance(strategy_config, FSDP2Config) else None
    autopipeline: AutoPipeline = pipelining.AutoPipeline.from_config(
        config,
        mesh,
        defer_fsdp_grad_sync=bool(fsdp2.defer_fsdp_grad_sync) if fsdp2 is not None else True,
        device=device,
        activation_dtype=fsdp2.activation_dtype() if fsdp2 is not None else None,
    )
    return autopipeline


def _instantiate_qat(config: QATConfig | None) -> Any:
    """The torchao QAT quantizer of ``config`` (``config.create_quantizer()``), or None."""
    if config is None:
        return None
    return config.create_quantizer()


def parallelize_for_pp(model: nn.Module, *, model_wrapper: Manager | None = None, **kwargs: Any) -> nn.Module:
    """Parallelize model for pipeline parallelism (non-MoE case).

    This function adapts the pipeline parallelism interface to use model_wrapper.parallelize(). For MoE
    models, use ``automodel_moe.parallelizer.parallelize_model`` directly.

    Args:
        model: The model (a pipeline stage) to parallelize; mutated in place.
        model_wrapper: Distributed manager instance.
        **kwargs: Additional arguments (world_mesh, moe_mesh, axis names) passed by AutoPipeline but
            unused for non-MoE parallelization (the manager has its own mesh).

    Returns:
        The parallelized model.
    """
    del kwargs
    if model_wrapper is None:
        return model
    return as_strategy(model_wrapper, model_wrapper.mesh).shard(model)


def _moe_config(moe_config: MoEParallelizerConfig | None) -> MoEParallelizerConfig:
    moe_cfg_module = import_component("automodel_moe.config", "expert parallelism (ep_size > 1)")
    return moe_config if moe_config is not None else moe_cfg_module.MoEParallelizerConfig()


def _expert_parallel(moe_config: MoEParallelizerConfig | None) -> ExpertParallelism:
    """The expert-parallel step an `FSDP2Manager` runs first, from the MoE config."""
    moe_parallelizer = import_component("automodel_moe.parallelizer", "expert parallelism (ep_size > 1)")
    step: ExpertParallelism = moe_parallelizer.ExpertParallel(_moe_config(moe_config))
    return step


def _moe_parallelize_fn(
    moe_config: MoEParallelizerConfig | None, activation_checkpointing: bool | str
) -> Callable[..., Any]:
    """The MoE parallelizer (the reference's ``parallelize_model``), for EP without a strategy config.

    Its own defaults (no mixed precision) apply.
    """
    moe_parallelizer = import_component("automodel_moe.parallelizer", "expert parallelism (ep_size > 1)")
    kwargs = _moe_config(moe_config).to_dict()
    return partial(
        moe_parallelizer.parallelize_model, activation_checkpointing=activation_checkpointing, **kwargs
    )


def instantiate_infrastructure(
    *,
    distributed_config: DistributedConfig | None = None,
    pipeline_config: PipelineConfig | None = None,
    qat_config: QATConfig | None = None,
    moe_config: MoEParallelizerConfig | None = None,
    activation_checkpointing: bool = False,
    device: torch.device | None = None,
    mesh: MeshContext | None = None,
    device_mesh: Any = None,
    moe_mesh: Any = None,
    ep_size: int = 1,
) -> Infrastructure:
    """Instantiate infrastructure objects from config classes.

    Converts config objects into the runtime objects `apply_model_infrastructure` needs. Nothing is
    communicated and no config object is modified.

    Args:
        distributed_config: Distributed training config (FSDP2Config, MegatronFSDPConfig, or DDPConfig).
        pipeline_config: Pipeline parallelism config (used when the mesh has ``pp > 1``).
        qat_config: Quantization-aware training config.
        moe_config: MoE parallelizer config (for expert parallel models, used when ``ep > 1``).
        activation_checkpointing: Enable activation checkpointing for transformer blocks (``True``,
            ``"full"`` or ``"selective"``). ``False`` keeps the strategy config's own setting.
        device: Target device for the model (pipeline activations live there).
        mesh: MeshContext holding device meshes, sizes, and axis names. If None, built from the legacy
            device_mesh / moe_mesh params.
        device_mesh: (deprecated) Device mesh for distributed operations.
        moe_mesh: (deprecated) Optional MOE mesh for expert parallelism.
        ep_size: (deprecated) Expert parallelism size; checked against ``moe_mesh``. Ignored when
            mesh is provided.

    Returns:
        ``Infrastructure(model_wrapper, autopipeline, parallelize_fn, qat_quantizer)``, a 4-tuple:
        the manager (or None; with ``ep_size > 1`` it runs the expert step first); the `AutoPipeline`
        (or None); the parallelization function (`parallelize_for_pp` bound to the manager under PP; the
        MoE parallelizer for ``ep_size > 1`` without a strategy config; else None, since the manager's
        own `StrategyManager.shard` is the route); the QAT quantizer (or None).

    Raises:
        ValueError: An unknown config type, a mesh that the strategy cannot use, a pipeline axis without
            a ``pipeline_config``, contradicting activation-checkpointing settings, or both ``mesh`` and
            the deprecated mesh parameters.
        ImportError: An optional component the configs need is not installed.
    """
    legacy = [n for n, v in (("device_mesh", device_mesh), ("moe_mesh", moe_mesh)) if v is not None]
    if ep_size != 1:
        legacy.append("ep_size")
    if legacy:
        _warn_legacy(legacy)
    if mesh is not None:
        if device_mesh is not None or moe_mesh is not None:
            raise ValueError("pass mesh= or the deprecated device_mesh= / moe_mesh=, not both")
        if not isinstance(mesh, MeshContext):
            raise ValueError(f"mesh must be an automodel_mesh.MeshContext, got {type(mesh).__name__}")
    else:
        mesh = MeshContext.from_meshes(device_mesh, moe_mesh)
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"ep_size must be an int >= 1, got {ep_size!r}")
        if ep_size != 1 and ep_size != mesh.ep_size:
            raise ValueError(
                f"ep_size={ep_size} but moe_mesh gives ep={mesh.ep_size}; pass "
                "mesh=MeshContext.build(FSDP2Config(...), ParallelismSizes(ep_size=...))"
            )
    if distributed_config is not None and not isinstance(
        distributed_config, FSDP2Config | MegatronFSDPConfig | DDPConfig
    ):
        raise ValueError(
            f"Unknown distributed config type: {type(distributed_config).__name__}; use FSDP2Config, "
            "MegatronFSDPConfig or DDPConfig (from automodel_distributed.config)"
        )
    distributed_config, ac = _effective_activation_checkpointing(distributed_config, activation_checkpointing)
    ep_enabled = mesh.ep_size > 1
    if ac and distributed_config is None and not ep_enabled:
        raise ValueError(
            "activation_checkpointing needs a distributed_config to apply it (e.g. FSDP2Config() or "
            "DDPConfig()); pass one or drop activation_checkpointing"
        )
    if mesh.pp_size > 1 and pipeline_config is None:
        raise ValueError(
            f"the mesh has pp_size={mesh.pp_size} but pipeline_config is None; pass a PipelineConfig "
            "(automodel_pipelining.config) or build the mesh with pp_size=1"
        )
    if pipeline_config is not None and mesh.pp_size <= 1:
        warnings.warn("pipeline_config ignored: the mesh has pp_size=1", stacklevel=2)
    if moe_config is not None and not ep_enabled:
        warnings.warn(
            "moe_config ignored: the mesh has ep_size=1 (the strategy shards the MoE model like a dense one)",
            stacklevel=2,
        )

    # Under expert parallelism the FSDP2 manager runs the expert step first: one applier, every setting,
    # and the manager's own `shard` is the route (no parallelize_fn) unless stages need one.
    experts = _expert_parallel(moe_config) if ep_enabled and distributed_config is not None else None
    model_wrapper = _build_manager(distributed_config, mesh, experts)
    autopipeline = _instantiate_pipeline(pipeline_config, mesh, device, distributed_config)
    parallelize_fn: Callable[..., Any] | None = None
    if model_wrapper is None and ep_enabled:
        parallelize_fn = _moe_parallelize_fn(moe_config, ac)
    elif model_wrapper is not None and autopipeline is not None:
        parallelize_fn = partial(parallelize_for_pp, model_wrapper=model_wrapper)
    qat_quantizer = _instantiate_qat(qat_config)
    return Infrastructure(model_wrapper, autopipeline, parallelize_fn, qat_quantizer)


# --------------------------------------------------------------------------------------------- apply


def _check_apply_inputs(
    model: nn.Module,
    is_meta_device: object,
    load_base_model: object,
    pretrained_model_name_or_path: object,
    compile_config: object,
    extra: Mapping[str, Any],
) -> None:
    """Reject bad inputs before anything is modified or communicated (identically on every rank)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(is_meta_device, bool):
        raise ValueError(f"is_meta_device must be a bool, got {is_meta_device!r}")
    if not isinstance(load_base_model, bool):
        raise ValueError(f"load_base_model must be a bool, got {load_base_model!r}")
    if load_base_model and not pretrained_model_name_or_path:
        raise ValueError(
            "load_base_model=True needs pretrained_model_name_or_path (a checkpoint folder or a cached "
            "hub id)"
        )
    if compile_config is not None and not isinstance(compile_config, CompileConfig | Mapping):
        raise ValueError(
            f"compile_config must be an automodel_distributed.CompileConfig (or its dict), got "
            f"{type(compile_config).__name__}"
        )
    if extra.get("inject_te_attention"):
        raise ValueError(
            "inject_te_attention=True: Transformer Engine attention is not supported by automodel; drop it"
        )
    if extra.get("freeze_config") is not None:
        from automodel_distributed.multimodal import FreezeConfig

        FreezeConfig.coerce(extra["freeze_config"])  # a bad key or value fails here, before any change
    unknown = sorted(set(extra) - {*_REFERENCE_ONLY_KWARGS, "weights_already_loaded"})
    if unknown:
        warnings.warn(f"apply_model_infrastructure ignores the keyword(s) {unknown}", stacklevel=3)


@dataclass
class ApplyState:
    """What the steps of one `apply_model_infrastructure` call read and write (see `APPLY_STEPS`)."""

    model: nn.Module
    """The model as the steps left it so far (replaced by step 1 when a conversion returns a new one)."""
    mesh: MeshContext
    strategy: StrategyManager
    device: torch.device | str
    is_meta_device: bool
    autopipeline: AutoPipeline | None
    parallelize_fn: Callable[..., Any] | None
    peft_config: Any
    quantization_config: Any
    fp8_config: Any
    qat_quantizer: Any
    loss_fn: Callable[..., torch.Tensor] | None
    compile_config: CompileConfig | None
    need_load: bool
    path: str
    cache_dir: str | None
    freeze_config: Any
    peft: Any = None
    """``automodel_peft`` when there are adapters (their owner: initialise, freeze), else None."""
    loaded: bool = False
    result: Any = None
    """The sharded model, or the `AutoPipeline` whose ``parts`` are this rank's stages."""
    parts: list[nn.Module] = field(default_factory=list)
    pipelined: bool = False


def _load_or_init(state: ApplyState, part: nn.Module, device: torch.device | str, *, pipelined: bool) -> None:
    """Materialise ``part`` and load the checkpoint into it (or initialise it), in place.

    Adapters are initialised once, by their owner (``init_adapters``: `automodel_peft.init_adapter_weights`),
    after the base weights are final: DoRA magnitudes are the row norms of the loaded weights, and random
    A matrices come from one rank so every rank agrees.
    """
    from automodel_checkpoint import load_base_model

    load_base_model(
        part,
        device,
        state.cache_dir,
        state.path,
        load_base_model=state.need_load,
        # A pipeline stage holds part of the checkpoint; every tensor it has must still be found.
        allow_unexpected=pipelined,
        init_adapters=state.peft.adapter_initializer(state.peft_config) if state.peft is not None else None,
        process_group=state.mesh.process_group,
    )


def _run_check(state: ApplyState) -> None:
    state.strategy.check(state.model)
    if state.need_load:
        from automodel_checkpoint import check_hf_checkpoint

        check_hf_checkpoint(state.model, state.path, cache_dir=state.cache_dir)


def _run_lower_precision(state: ApplyState) -> None:
    state.model = _apply_peft_and_lower_precision(
        state.model,
        state.mesh.tp_size,
        state.autopipeline,
        state.peft_config,
        state.quantization_config,
        state.fp8_config,
        state.qat_quantizer,
    )
    if state.peft_config is not None:
        state.peft = import_component("automodel_peft", "peft_config")
    if state.mesh.cp_size > 1:
        from automodel_distributed.context_parallel import apply_context_parallel

        apply_context_parallel(state.model)


def _run_load_first(state: ApplyState) -> None:
    adapters = state.peft is not None
    if state.strategy.loads_before_sharding(adapters=adapters) and (state.is_meta_device or state.need_load):
        _load_or_init(state, state.model, state.device, pipelined=False)
        state.loaded = True


def _run_freeze(state: ApplyState) -> None:
    if state.freeze_config is not None:
        from automodel_distributed.multimodal import apply_freeze_config

        apply_freeze_config(state.model, state.freeze_config)
    if state.peft is not None:
        state.peft.freeze_base(state.model)
    if state.loss_fn is None:  # a pipeline's configured loss, else the masked cross-entropy
        configured = state.autopipeline.config.loss_fn if state.autopipeline is not None else None
        state.loss_fn = (
            configured if configured is not None else MaskedCrossEntropy(compiled=_compiles_loss(state))
        )


def _compiles_loss(state: ApplyState) -> bool:
    """Whether the default loss is compiled: ``compile_config`` enabled with ``compile_loss``."""
    config = state.compile_config
    return config is not None and config.enabled and config.compile_loss


def _run_shard(state: ApplyState) -> None:
    if state.autopipeline is not None:
        state.result = _shard_pp(state.autopipeline, state.model, state.loss_fn, state.parallelize_fn)
    else:
        state.result = _shard_ep_fsdp(state.model, state.strategy, state.parallelize_fn, state.mesh)
    state.pipelined = state.autopipeline is not None and state.result is state.autopipeline
    state.parts = list(state.result.parts) if state.pipelined else [state.result]
    _warn_fp8_gather_without_fsdp(state.fp8_config, state.parts)


def _warn_fp8_gather_without_fsdp(fp8_config: Any, parts: list[nn.Module]) -> None:
    """Name ``enable_fsdp_float8_all_gather`` when no FSDP2 unit gathers the converted weights."""
    from torch.distributed.fsdp import FSDPModule

    def setting(name: str) -> bool:
        value = fp8_config.get(name) if isinstance(fp8_config, Mapping) else getattr(fp8_config, name, None)
        return bool(value)

    if fp8_config is None or not (setting("enabled") and setting("enable_fsdp_float8_all_gather")):
        return
    if not any(isinstance(module, FSDPModule) for part in parts for module in part.modules()):
        warnings.warn(
            "FP8Config.enable_fsdp_float8_all_gather ignored: no FSDP2 unit gathers this model's weights "
            "(the strategy is not FSDP2, or it had nothing to shard); set it only under FSDP2",
            stacklevel=4,
        )


def _run_compile(state: ApplyState) -> None:
    if state.pipelined:
        state.parts = [state.strategy.compile(p, state.compile_config, in_place=True) for p in state.parts]
    else:
        state.result = state.strategy.compile(state.result, state.compile_config, in_place=False)
        state.parts = [state.result]


def _run_materialise(state: ApplyState) -> None:
    if state.loaded or not (state.is_meta_device or state.need_load):
        return
    for part in state.parts:
        _load_or_init(state, part, state.strategy.init_device(state.device), pipelined=state.pipelined)


def _run_finish(state: ApplyState) -> None:
    if state.peft is not None:
        for part in state.parts:
            state.peft.freeze_base(part)
    if not state.pipelined:
        state.strategy.place(state.result, state.device)
    for part in state.parts:
        trainable, total = _count_params(part)
        logger.info("%s: %d trainable of %d parameters on this rank", type(part).__name__, trainable, total)


APPLY_STEPS: tuple[Step[ApplyState], ...] = (
    Step(
        "check",
        "Check the arguments, the strategy's refusals and the checkpoint against the unsharded model",
        "A user error must leave the model as it was and be raised on every rank before the first "
        "collective; the checkpoint is read from its metadata only (files, keys, shapes).",
        _run_check,
        steps.describe_check,
    ),
    Step(
        "adapters and precision",
        "LoRA adapters, then FP8 training, then QAT fake quantization; context-parallel attention hooks",
        "Before sharding, on meta when the model is: tensor-parallel plans and FSDP units key on the "
        "final module types, and swapping modules after sharding would replace sharded parameters.",
        _run_lower_precision,
        steps.describe_lower_precision,
    ),
    Step(
        "load first",
        "Materialise and load the whole model, only where the strategy needs real tensors to shard",
        "Loading into unsharded tensors costs a full copy per rank, which sharding exists to avoid; "
        "DDP (and one device without adapters) needs the real weights before wrapping.",
        _run_load_first,
        steps.describe_load_first,
    ),
    Step(
        "freeze",
        "Freeze the parts freeze_config names and, under PEFT, the base; the pipeline's loss",
        "FSDP2 places frozen towers by what is frozen when it wraps, and DDP decides at wrap time "
        "which parameters get gradients.",
        _run_freeze,
        steps.describe_freeze,
    ),
    Step(
        "shard",
        "The pipeline split, then the strategy on the model or each stage",
        "Inside the strategy: the expert step, the tensor-parallel plan, activation checkpointing, then "
        "fully_shard of each unit and the root (checkpoint wrappers must exist before FSDP hooks them).",
        _run_shard,
        steps.describe_shard,
    ),
    Step(
        "compile",
        "torch.compile, as the strategy compiles (each block in place under FSDP2 and for stages)",
        "After sharding, so compiled code sees the sharded parameters and their names are kept.",
        _run_compile,
        steps.describe_compile,
    ),
    Step(
        "materialise and load",
        "Materialise the meta parameters on the shards, then read the checkpoint straight into them",
        "Each rank reads only the bytes of the slices it holds: peak memory stays near the shard size; "
        "adapters are initialised once the base weights are final.",
        _run_materialise,
        steps.describe_materialise,
    ),
    Step(
        "finish",
        "Freeze everything but the adapters again; move what is unsharded to the device",
        "Parameters created while sharding or loading start trainable.",
        _run_finish,
        steps.describe_finish,
    ),
)
"""The order of operations, as data: `apply_model_infrastructure` runs it, ``automodel plan`` prints it,
``docs/concepts.md`` shows it (`automodel_infra.steps`)."""


def apply_model_infrastructure(
    model: nn.Module,
    *,
    is_meta_device: bool,
    device: torch.device | str,
    model_wrapper: Any = None,
    mesh: MeshContext | None = None,
    peft_config: Any = None,
    quantization_config: Any = None,
    fp8_config: Any = None,
    qat_quantizer: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    autopipeline: AutoPipeline | None = None,
    parallelize_fn: Callable[..., Any] | None = None,
    compile_config: CompileConfig | Mapping[str, Any] | None = None,
    load_base_model: bool = False,
    cache_dir: str | None = None,
    pretrained_model_name_or_path: str = "",
    **_kwargs: Any,
) -> Any:
    """Apply sharding, PEFT, quantization, and checkpoint loading to a model.

    Runs `APPLY_STEPS` in order on one `ApplyState` (docs/concepts.md lists them with their reasons):
    check; adapters, FP8 and QAT (on meta) and the context-parallel hooks; load first where the strategy
    needs real tensors; freeze (``freeze_config``, the base under PEFT) and the pipeline's loss; shard
    (the pipeline split, or ``parallelize_fn``, or `StrategyManager.shard`); compile; materialise the
    shards and load the checkpoint into them; freeze everything but the adapters and place. Each step is
    one call into a leaf package (the manager through `StrategyManager`, adapters through
    `automodel_peft`).

    Preconditions: the process group and the mesh exist (`MeshContext.build`); every rank calls this
    with the same arguments. Collectives: those of sharding (mesh axes of the strategy) and of loading
    (a failure flag is all-reduced, so a bad checkpoint raises on every rank instead of hanging).

    Args:
        model: The model to apply infrastructure to; mutated in place (and moved into pipeline stages
            under PP; use the returned object afterwards).
        is_meta_device: Whether model was initialized on meta device.
        device: Target device for model.
        model_wrapper: Model wrapper (FSDP2Manager, DDPManager, etc.). Default: None
        mesh: MeshContext with parallelism sizes and mesh references. Default: None (the manager's own
            mesh, else single-device defaults).
        peft_config: PEFT/LoRA configuration (`automodel_peft.PeftConfig`, ``peft.LoraConfig`` or dict).
        quantization_config: Quantized base weights for QLoRA. Default: None
        fp8_config: FP8 configuration. Default: None
        qat_quantizer: QAT quantizer instance. Default: None
        loss_fn: Loss function for the last pipeline stage (None: MaskedCrossEntropy).
        autopipeline: AutoPipeline instance for pipeline parallelism. Default: None
        parallelize_fn: Function to apply parallelization (EP + FSDP2). Default: None
        compile_config: Compilation configuration (`automodel_distributed.CompileConfig`). Default: None
        load_base_model: Whether to load base model weights (True for from_pretrained). Default: False
        cache_dir: Hugging Face cache directory for hub ids. Default: None
        pretrained_model_name_or_path: Checkpoint folder or cached hub id. Default: ""
        **_kwargs: ``weights_already_loaded=True`` skips loading (the weights are real and loaded);
            ``freeze_config`` freezes parts of a multimodal model before sharding (step 3); other
            keywords are ignored with a warning; the reference system's ``inject_te_attention=True``
            raises `ValueError` (not supported).

    Returns:
        The model with all infrastructure applied: an ``nn.Module`` (possibly a DDP wrapper), or the
        `AutoPipeline` (whose ``parts`` are this rank's stages) under pipeline parallelism.

    Raises:
        ValueError: Bad arguments (before anything is modified), or a leaf package's error (a TP plan
            that does not fit, QAT on fp32 weights, a checkpoint of another architecture, ...).
        FileNotFoundError: The checkpoint does not exist (before anything is modified).
        CheckpointMismatchError: The checkpoint's keys or shapes do not fit the model (a ValueError,
            raised before anything is modified or communicated).
        ImportError: An optional component is needed but not installed.
    """
    _check_apply_inputs(
        model, is_meta_device, load_base_model, pretrained_model_name_or_path, compile_config, _kwargs
    )
    if isinstance(compile_config, Mapping):
        compile_config = CompileConfig.from_dict(compile_config)
    if compile_config is not None and compile_config.enabled:
        from automodel_distributed.compile import compile_kwargs

        compile_kwargs(compile_config)  # a mode with options is refused here, before anything runs
    if mesh is None:
        mesh = model_wrapper.mesh if model_wrapper is not None else MeshContext()
    state = ApplyState(
        model=model,
        mesh=mesh,
        strategy=as_strategy(model_wrapper, mesh),
        device=device,
        is_meta_device=is_meta_device,
        autopipeline=autopipeline,
        parallelize_fn=parallelize_fn,
        peft_config=peft_config,
        quantization_config=quantization_config,
        fp8_config=fp8_config,
        qat_quantizer=qat_quantizer,
        loss_fn=loss_fn,
        compile_config=compile_config,
        need_load=load_base_model and not bool(_kwargs.get("weights_already_loaded", False)),
        path=str(pretrained_model_name_or_path or ""),
        cache_dir=cache_dir,
        freeze_config=_kwargs.get("freeze_config"),
    )
    for step in APPLY_STEPS:
        step.run(state)
    return state.result
