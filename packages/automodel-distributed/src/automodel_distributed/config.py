"""Strategy configs of automodel-distributed: FSDP2, Megatron-FSDP, DDP, and compile.

Field names and defaults follow NeMo AutoModel, so configs written for it work here. Configs are
validated when they are built (errors name the field) and never mutated by the code that uses them;
this module imports nothing heavy (the FSDP2 policy defaults are built lazily).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

import torch

from automodel_distributed.host_runtime import HostRuntime
from automodel_mesh import MeshKind
from automodel_mesh.config_dict import ConfigDict

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from automodel_mesh import MeshLayout

__all__ = [
    "ACTIVATION_CHECKPOINTING_SCOPES",
    "ActivationCheckpointingMode",
    "CompileConfig",
    "DDPConfig",
    "DistributedConfig",
    "FSDP2Config",
    "FrozenSharding",
    "MegatronFSDPConfig",
    "MultimodalDistributedConfig",
    "default_mp_policy",
    "normalize_activation_checkpointing",
    "normalize_activation_checkpointing_scope",
]

ActivationCheckpointingMode: TypeAlias = bool | Literal["full", "selective"]
"""``False`` (off), ``True`` or ``"full"`` (recompute whole blocks), ``"selective"`` (save matmuls)."""

FrozenSharding: TypeAlias = Literal["root", "per_layer", "replicate"]
"""Where FSDP2 puts a frozen multimodal tower (`MultimodalDistributedConfig.frozen_sharding`)."""

ACTIVATION_CHECKPOINTING_SCOPES: tuple[str, ...] = ("all", "language", "vision", "audio", "multimodal")
"""Which layer groups activation checkpointing applies to."""

_SCOPE_ALIASES = {"default": "all", "auto": "all"}


def normalize_activation_checkpointing(value: object, *, field_name: str = "activation_checkpointing") -> Any:
    """Return ``False``, ``"full"`` or ``"selective"`` for an activation-checkpointing setting.

    Raises:
        ValueError: ``value`` is not a bool, ``"full"`` or ``"selective"``.
    """
    if isinstance(value, bool):
        return "full" if value else False
    if isinstance(value, str) and value.lower() in ("full", "selective"):
        return value.lower()
    raise ValueError(f"{field_name}={value!r} is not valid; use False, True, 'full' or 'selective'")


def _checked_activation_checkpointing(value: object, field_name: str) -> Any:
    """Validate a config's ``activation_checkpointing`` and keep it as given.

    A bool stays a bool, as in the reference system; a string is lower-cased.
    """
    normalized = normalize_activation_checkpointing(value, field_name=field_name)
    return value if isinstance(value, bool) else normalized


def normalize_activation_checkpointing_scope(
    value: object, *, field_name: str = "activation_checkpointing_scope"
) -> tuple[str, ...]:
    """Normalise a scope (``"all"``, ``"language+vision"``, ``"language,audio"`` or a list) to a tuple.

    ``None`` and an empty scope mean ``("all",)``, as in the reference system.

    Raises:
        ValueError: An unknown scope, or ``"all"`` combined with another scope.
    """
    if value is None:
        return ("all",)
    if isinstance(value, str):
        parts = [p.strip() for p in value.replace("+", ",").split(",")]
    elif isinstance(value, Iterable):
        parts = [str(p).strip() for p in value]
    else:
        raise ValueError(f"{field_name}={value!r} must be a string or a list of strings")
    scopes: list[str] = []
    for part in parts:
        if not part:
            continue
        name = _SCOPE_ALIASES.get(part.lower(), part.lower())
        if name not in ACTIVATION_CHECKPOINTING_SCOPES:
            raise ValueError(
                f"{field_name} has unknown scope {part!r}; "
                f"known scopes: {list(ACTIVATION_CHECKPOINTING_SCOPES)} "
                f"(aliases {sorted(_SCOPE_ALIASES)})"
            )
        if name not in scopes:
            scopes.append(name)
    if not scopes:
        return ("all",)
    if "all" in scopes and len(scopes) > 1:
        raise ValueError(f"{field_name}={value!r}: 'all' cannot be combined with other scopes")
    return tuple(scopes)


def default_mp_policy() -> MixedPrecisionPolicy:
    """bf16 parameters and outputs, fp32 gradient reduction, inputs cast (the FSDP2Config default)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.bfloat16,
        cast_forward_inputs=True,
    )


def _warn_scope_without_checkpointing(config: FSDP2Config | DDPConfig) -> None:
    """A checkpointing scope other than ``all`` (normalised) acts on nothing without checkpointing."""
    if not config.activation_checkpointing and config.activation_checkpointing_scope != ("all",):
        config.warn_unused(
            ["activation_checkpointing_scope"], "activation_checkpointing is off", stacklevel=5
        )


def _check_bool(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ValueError(f"{type(obj).__name__}.{name} must be a bool, got {value!r}")


def _check_dtype(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if value is not None and not isinstance(value, torch.dtype):
        raise ValueError(f"{type(obj).__name__}.{name} must be a torch.dtype or None, got {value!r}")


@dataclass(kw_only=True)
class MultimodalDistributedConfig(ConfigDict):
    """How frozen multimodal towers are sharded by FSDP2 (`automodel_distributed.fsdp2.apply_fsdp2`)."""

    frozen_sharding: FrozenSharding = "root"
    """``root``: frozen towers join the root FSDP unit; ``per_layer``: one unit per tower layer;
    ``replicate``: kept out of FSDP and replicated."""

    def __post_init__(self) -> None:
        if self.frozen_sharding not in get_args(FrozenSharding):
            raise ValueError(
                f"MultimodalDistributedConfig.frozen_sharding={self.frozen_sharding!r}; "
                "use 'root', 'per_layer' or 'replicate'"
            )


@dataclass(kw_only=True)
class FSDP2Config(ConfigDict):
    """PyTorch FSDP2 (``fully_shard``) with optional HSDP, tensor/sequence and context parallelism."""

    sequence_parallel: bool = False
    """Shard activations along the sequence between tensor-parallel regions (needs ``tp_size > 1``)."""
    tp_plan: dict[str, Any] | str | None = None
    """Tensor-parallel plan: a dict of FQN patterns to styles, a registered plan name, or an import path
    ``"pkg.module.NAME"`` to a dict or a function returning one. ``None``: resolve from the model."""
    patch_is_packed_sequence: bool = False
    """Make transformers treat every batch as unpacked, avoiding a device-to-host sync per step."""
    mp_policy: MixedPrecisionPolicy | None = field(default_factory=default_mp_policy)
    """FSDP2 mixed precision. ``None`` means the default (bf16 params/outputs, fp32 reduction)."""
    offload_policy: OffloadPolicy | None = None
    """``CPUOffloadPolicy`` to keep sharded parameters on CPU (use ``pin_memory=False`` on CPU-only hosts)."""
    autocast_dtype: torch.dtype | None = None
    """Run the forward under ``torch.autocast`` with this dtype (``None``: no autocast)."""
    activation_checkpointing: ActivationCheckpointingMode = False
    """``False``, ``True``/``"full"`` or ``"selective"``."""
    activation_checkpointing_scope: str | tuple[str, ...] | None = "all"
    """Layer groups to checkpoint: ``all``, ``language``, ``vision``, ``audio``, ``multimodal`` (or a
    combination such as ``"language+vision"``); normalised to a tuple (``None`` means ``("all",)``)."""
    defer_fsdp_grad_sync: bool = True
    """Under gradient accumulation, reduce-scatter gradients only on the last micro-batch."""
    reshard_after_forward: bool | int | None = None
    """``None``: reshard every block but the last after forward (and none under pipelining)."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (needs ``sequence_parallel`` and compile; CUDA only)."""
    enable_compile: bool = False
    """``torch.compile`` each transformer block after sharding."""
    enable_fsdp2_prefetch: bool = False
    """Set explicit forward/backward prefetch between consecutive blocks."""
    fsdp2_backward_prefetch_depth: int = 2
    """Blocks to prefetch ahead in backward when prefetch is on."""
    fsdp2_forward_prefetch_depth: int = 1
    """Blocks to prefetch ahead in forward when prefetch is on."""
    multimodal: MultimodalDistributedConfig = field(default_factory=MultimodalDistributedConfig)
    """Sharding policy for frozen multimodal towers."""
    host_runtime: HostRuntime | None = None
    """An opt-in layer for collectives and tensors in host memory (a CPU mesh, or CPU offload), such as
    ``automodel_cpu.CPURuntime`` (`automodel_distributed.host_runtime.HostRuntime`): the manager calls
    its ``prepare_process`` when created and its ``attach_fsdp`` after ``fully_shard`` on a CPU mesh.
    ``None`` (the default): plain torch FSDP2, no process-wide setting, no op override. A runtime on a
    CUDA mesh without CPU offload would act on nothing and is refused. Not in NeMo AutoModel; the
    ``automodel`` command gives one to its CPU jobs, and YAML cannot set it."""

    def __post_init__(self) -> None:
        _check_bool(
            self,
            "sequence_parallel",
            "patch_is_packed_sequence",
            "defer_fsdp_grad_sync",
            "enable_async_tensor_parallel",
            "enable_compile",
            "enable_fsdp2_prefetch",
        )
        if self.host_runtime is not None and not isinstance(self.host_runtime, HostRuntime):
            raise ValueError(
                "FSDP2Config.host_runtime must implement automodel_distributed.host_runtime.HostRuntime "
                f"(e.g. automodel_cpu.CPURuntime()), got {type(self.host_runtime).__name__}"
            )
        self.activation_checkpointing = _checked_activation_checkpointing(
            self.activation_checkpointing, "FSDP2Config.activation_checkpointing"
        )
        self.activation_checkpointing_scope = normalize_activation_checkpointing_scope(
            self.activation_checkpointing_scope, field_name="FSDP2Config.activation_checkpointing_scope"
        )
        if self.enable_async_tensor_parallel and not self.sequence_parallel:
            raise ValueError(
                "FSDP2Config.enable_async_tensor_parallel=True needs FSDP2Config.sequence_parallel=True "
                "(async TP overlaps the sequence-parallel all-gathers)"
            )
        if self.enable_async_tensor_parallel and not self.enable_compile:
            raise ValueError(
                "FSDP2Config.enable_async_tensor_parallel=True needs FSDP2Config.enable_compile=True: the "
                "overlap is an inductor pass over the compiled blocks, and without compile it never runs"
            )
        if not self.enable_fsdp2_prefetch:
            depths = ("fsdp2_forward_prefetch_depth", "fsdp2_backward_prefetch_depth")
            self.warn_unused(self.changed_fields(depths), "enable_fsdp2_prefetch is False")
        _warn_scope_without_checkpointing(self)
        if self.tp_plan is not None and not isinstance(self.tp_plan, dict | str):
            raise ValueError(
                "FSDP2Config.tp_plan must be a dict, a plan name or an import path, "
                f"got {type(self.tp_plan).__name__}"
            )
        for name in ("fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FSDP2Config.{name} must be an int >= 1, got {value!r}")
        raf = self.reshard_after_forward
        if raf is not None and not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 1):
            raise ValueError(
                f"FSDP2Config.reshard_after_forward must be None, a bool or an int >= 1 (a smaller world to "
                f"reshard to), got {raf!r}"
            )
        _check_dtype(self, "autocast_dtype")
        if self.mp_policy is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(self.mp_policy, MixedPrecisionPolicy):
                raise ValueError(
                    f"FSDP2Config.mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                    f"got {type(self.mp_policy).__name__}"
                )
        if self.offload_policy is not None:
            from torch.distributed.fsdp import OffloadPolicy

            if not isinstance(self.offload_policy, OffloadPolicy):
                raise ValueError(
                    f"FSDP2Config.offload_policy must be a torch.distributed.fsdp.CPUOffloadPolicy or None, "
                    f"got {type(self.offload_policy).__name__}"
                )
        if not isinstance(self.multimodal, MultimodalDistributedConfig):
            raise ValueError("FSDP2Config.multimodal must be a MultimodalDistributedConfig")

    def mesh_kind(self) -> MeshKind:
        """FSDP2 shards over the ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh."""
        return MeshKind.FSDP2

    def loads_before_sharding(self, layout: MeshLayout, *, adapters: bool) -> bool:
        """Load into real tensors before sharding only when nothing is sharded and there are no adapters."""
        return not adapters and not layout.shards_parameters

    def activation_dtype(self) -> torch.dtype | None:
        """The dtype the sharded blocks compute in and hand on (to the next pipeline stage, too).

        ``mp_policy.output_dtype``, else its ``param_dtype`` (the default policy: bf16); None: the
        parameters' own dtype. `FSDP2Manager` wraps even one data-parallel rank whenever the policy casts.
        """
        policy = self.mp_policy if self.mp_policy is not None else default_mp_policy()
        return policy.output_dtype or policy.param_dtype

    def describe_sharding(self, layout: MeshLayout, model: nn.Module) -> list[str]:
        """What `FSDP2Manager.parallelize` will do to ``model`` on ``layout``, in order (no collective).

        Reads the model's blocks and frozen towers (`automodel_distributed.fsdp2_units.plan_fsdp_units`,
        the units the applier makes); nothing is mutated. ``automodel plan`` prints it.
        """
        from automodel_distributed.blocks import find_transformer_blocks
        from automodel_distributed.fsdp2_units import plan_fsdp_units

        lines = []
        if layout.tp > 1:
            sp = " with sequence parallelism" if self.sequence_parallel else ""
            overlap = (
                ", its collectives overlapped with the matmuls (async TP)"
                if self.enable_async_tensor_parallel
                else ""
            )
            lines.append(f"tensor-parallel plan over tp={layout.tp}{sp}{overlap}")
        if layout.ep > 1:
            where = (
                f"experts sharded over ep_shard={layout.ep_shard}"
                if layout.ep_shard > 1
                else "ep_shard=1: experts stay out of FSDP when their dtype needs no cast"
            )
            lines.append(f"expert parallelism over ep={layout.ep}; {where}")
        mode = normalize_activation_checkpointing(self.activation_checkpointing)
        if mode:
            lines.append(f"activation checkpointing ({mode}) of each transformer block")
        blocks = {fqn for fqn, _ in find_transformer_blocks(model)}
        frozen = self.multimodal.frozen_sharding
        units = sum(
            p.fqn in blocks
            for p in plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding=frozen)
        )
        hsdp = (
            f", replicated over dp_replicate={layout.dp_replicate} (HSDP)" if layout.dp_replicate > 1 else ""
        )
        over = f"over dp_shard_cp={layout.dp_shard_cp}{hsdp}"
        return [*lines, f"fully_shard each of {units} transformer blocks, then the root, {over}"]

    def describe_compile(self, compile_config: CompileConfig | None) -> list[str]:
        """What `FSDP2Manager.compile` will do: every block in place, from either setting."""
        if self.enable_compile or (compile_config is not None and compile_config.enabled):
            return ["torch.compile each transformer block, in place"]
        return []


@dataclass(kw_only=True)
class MegatronFSDPConfig(ConfigDict):
    """Megatron-FSDP (the ``megatron-fsdp`` package, CUDA only) over the ``(dp, cp, tp)`` mesh."""

    megatron_fsdp_unit_modules: list[str] | None = None
    """Import paths of the module classes that form FSDP units; ``None``: from ``_no_split_modules``."""
    zero_dp_strategy: int = 3
    """ZeRO stage: 0 (DDP), 1 (optimizer state), 2 (+gradients), 3 (+parameters)."""
    init_fsdp_with_meta_device: bool = False
    grad_reduce_in_fp32: bool = False
    preserve_fp32_weights: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    check_for_nan_in_grad: bool = True
    report_nan_in_param_grad: bool = False
    average_in_collective: bool = False
    disable_bucketing: bool = False
    calculate_per_token_loss: bool = False
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    activation_checkpointing: ActivationCheckpointingMode = False
    """``False``, ``True``/``"full"`` or ``"selective"``."""

    def __post_init__(self) -> None:
        _check_bool(
            self,
            "init_fsdp_with_meta_device",
            "grad_reduce_in_fp32",
            "preserve_fp32_weights",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "check_for_nan_in_grad",
            "report_nan_in_param_grad",
            "average_in_collective",
            "disable_bucketing",
            "calculate_per_token_loss",
            "keep_fp8_transpose_cache",
            "nccl_ub",
            "fsdp_double_buffer",
        )
        if self.zero_dp_strategy not in (0, 1, 2, 3) or isinstance(self.zero_dp_strategy, bool):
            raise ValueError(
                f"MegatronFSDPConfig.zero_dp_strategy must be 0, 1, 2 or 3, got {self.zero_dp_strategy!r}"
            )
        units = self.megatron_fsdp_unit_modules
        if units is not None and (
            not isinstance(units, list | tuple) or not all(isinstance(u, str) for u in units)
        ):
            raise ValueError(
                "MegatronFSDPConfig.megatron_fsdp_unit_modules must be a list of import paths "
                f"('pkg.module.ClassName'), got {units!r}"
            )
        self.activation_checkpointing = _checked_activation_checkpointing(
            self.activation_checkpointing, "MegatronFSDPConfig.activation_checkpointing"
        )

    def mesh_kind(self) -> MeshKind:
        """Megatron-FSDP shards over the ``(dp, cp, tp)`` mesh."""
        return MeshKind.MEGATRON_FSDP

    def loads_before_sharding(self, layout: MeshLayout, *, adapters: bool) -> bool:
        """Megatron-FSDP wraps real tensors unless ``init_fsdp_with_meta_device``."""
        del layout, adapters
        return not self.init_fsdp_with_meta_device

    def describe_sharding(self, layout: MeshLayout, model: nn.Module) -> list[str]:
        """What `MegatronFSDPManager.parallelize` will do (no collective)."""
        del model
        return [f"Megatron-FSDP (ZeRO-{self.zero_dp_strategy}) over dp_cp={layout.dp_cp}, tp={layout.tp}"]

    def describe_compile(self, compile_config: CompileConfig | None) -> list[str]:
        """The whole model (pipeline stages: per block) when ``compile_config`` is enabled."""
        return _whole_model_compile(compile_config)


@dataclass(kw_only=True)
class DDPConfig(ConfigDict):
    """PyTorch ``DistributedDataParallel`` over the default process group."""

    activation_checkpointing: ActivationCheckpointingMode = False
    """``False``, ``True``/``"full"`` or ``"selective"``."""
    activation_checkpointing_scope: str | tuple[str, ...] | None = "all"
    """Layer groups to checkpoint (see `FSDP2Config.activation_checkpointing_scope`)."""
    broadcast_buffers: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    """DDP bucket size in MiB; ``None`` keeps torch's default."""
    gradient_as_bucket_view: bool = False
    autocast_dtype: torch.dtype | None = None
    """Run the forward under ``torch.autocast`` with this dtype (``None``: no autocast)."""

    def __post_init__(self) -> None:
        _check_bool(
            self, "broadcast_buffers", "find_unused_parameters", "static_graph", "gradient_as_bucket_view"
        )
        self.activation_checkpointing = _checked_activation_checkpointing(
            self.activation_checkpointing, "DDPConfig.activation_checkpointing"
        )
        self.activation_checkpointing_scope = normalize_activation_checkpointing_scope(
            self.activation_checkpointing_scope, field_name="DDPConfig.activation_checkpointing_scope"
        )
        _warn_scope_without_checkpointing(self)
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0):
            raise ValueError(f"DDPConfig.bucket_cap_mb must be a positive number or None, got {cap!r}")
        _check_dtype(self, "autocast_dtype")

    def mesh_kind(self) -> MeshKind:
        """DDP needs no device mesh."""
        return MeshKind.DDP

    def loads_before_sharding(self, layout: MeshLayout, *, adapters: bool) -> bool:
        """Always: DDP broadcasts rank 0's real weights when it wraps."""
        del layout, adapters
        return True

    def describe_sharding(self, layout: MeshLayout, model: nn.Module) -> list[str]:
        """What `DDPManager.parallelize` will do (no collective)."""
        del model
        mode = normalize_activation_checkpointing(self.activation_checkpointing)
        lines = [f"activation checkpointing ({mode}) of each transformer block"] if mode else []
        return [*lines, f"wrap in DistributedDataParallel over {layout.world_size} ranks"]

    def describe_compile(self, compile_config: CompileConfig | None) -> list[str]:
        """The whole model (pipeline stages: per block) when ``compile_config`` is enabled."""
        return _whole_model_compile(compile_config)


@dataclass(kw_only=True)
class CompileConfig(ConfigDict):
    """``torch.compile`` settings for the whole model (non-FSDP2 strategies)."""

    enabled: bool = False
    mode: str = "default"
    """``default``, ``reduce-overhead``, ``max-autotune`` or ``max-autotune-no-cudagraphs``."""
    fullgraph: bool = False
    dynamic: bool = False
    backend: str | None = None
    """``None``: inductor."""
    options: dict[str, Any] = field(default_factory=dict)
    """Inductor options (``torch.compile(options=...)``); ``None`` means ``{}``, as in the reference
    system. ``torch.compile`` takes a ``mode`` or options, not both: a non-default ``mode`` with options
    is accepted here (as in the reference system) and refused with a `ValueError` when compiling."""
    dynamo_cache_size_limit: int = 256
    compile_loss: bool = True
    """Also compile the default loss (`automodel_distributed.loss.MaskedCrossEntropy` with
    ``compiled=True``, as torchtitan compiles its loss): the fp32 copy of the logits and their
    log-probabilities are fused away. A loss of one's own is used as given."""

    def __post_init__(self) -> None:
        _check_bool(self, "enabled", "fullgraph", "dynamic", "compile_loss")
        modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if self.mode not in modes:
            raise ValueError(f"CompileConfig.mode={self.mode!r}; use one of {list(modes)}")
        limit = self.dynamo_cache_size_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"CompileConfig.dynamo_cache_size_limit must be an int >= 1, got {limit!r}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"CompileConfig.backend must be a backend name or None, got {self.backend!r}")
        if self.options is None:
            self.options = {}
        if not isinstance(self.options, dict):
            raise ValueError(
                f"CompileConfig.options must be a dict or None, got {type(self.options).__name__}"
            )
        if not self.enabled:
            settings = [f.name for f in fields(self) if f.name != "enabled"]
            self.warn_unused(self.changed_fields(settings), "enabled is False")


DistributedConfig: TypeAlias = FSDP2Config | MegatronFSDPConfig | DDPConfig
"""Any strategy config. Each says which mesh it needs (``mesh_kind``), whether its manager loads the
checkpoint before sharding (``loads_before_sharding``), and what its manager will do in the sharding
and compile steps (``describe_sharding`` / ``describe_compile``, what ``automodel plan`` prints)."""


def _whole_model_compile(compile_config: CompileConfig | None) -> list[str]:
    if compile_config is not None and compile_config.enabled:
        return ["torch.compile the whole model (pipeline stages: each block, in place)"]
    return []
