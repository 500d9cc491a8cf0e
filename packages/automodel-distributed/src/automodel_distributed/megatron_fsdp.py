"""`MegatronFSDPManager`: NVIDIA Megatron-FSDP (the ``megatron-fsdp`` package) over the ``(dp, cp, tp)`` mesh.

Megatron-FSDP needs CUDA devices (it creates CUDA streams and buffers), so `MegatronFSDPManager.parallelize`
checks for them before touching the model and points CPU users to ``FSDP2Config``. The package is an
optional extra (``pip install automodel-distributed[megatron]``), imported only by ``parallelize``.

Everything the manager decides before calling the package is a plain function that runs anywhere:
`derive_megatron_fsdp_unit_modules`, `megatron_fsdp_kwargs`, `megatron_fsdp_shard_axis`.

Differences from NeMo AutoModel, on purpose: a data-parallel size of one is not cast to bf16 behind the
caller's back; activation checkpointing is applied when nothing is sharded and refused (``ValueError``)
when Megatron-FSDP shards, instead of being logged and ignored; tensor parallelism with Megatron-FSDP is
not wired yet (``NotImplementedError``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel_checkpoint.materialize import has_meta_tensors
from automodel_distributed.activation_checkpointing import (
    apply_activation_checkpointing,
    resolve_checkpointing_mode,
)
from automodel_distributed.blocks import no_split_module_names
from automodel_distributed.config import MegatronFSDPConfig
from automodel_distributed.strategy import StrategyDefaults
from automodel_mesh import MeshAxisName, MeshContext

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MegatronFSDPManager",
    "derive_megatron_fsdp_unit_modules",
    "megatron_fsdp_kwargs",
    "megatron_fsdp_shard_axis",
    "warn_transformer_engine_settings",
]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'automodel-distributed[megatron]'"
_REQUIRED_AXES = (MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP)
# Config fields handed to megatron_fsdp.fully_shard_model under the same name.
_PASSTHROUGH_FIELDS = (
    "zero_dp_strategy",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "report_nan_in_param_grad",
    "average_in_collective",
    "disable_bucketing",
    "calculate_per_token_loss",
    "keep_fp8_transpose_cache",
    "nccl_ub",
    "fsdp_double_buffer",
)
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def warn_transformer_engine_settings(config: MegatronFSDPConfig, model: nn.Module) -> None:
    """Name ``keep_fp8_transpose_cache`` when ``model`` has no Transformer Engine module for it to act on.

    Megatron-FSDP keeps the FP8 transpose caches of Transformer Engine's layers; a transformers model
    built from its own classes has none.
    """
    if config.keep_fp8_transpose_cache and not any(
        type(m).__module__.startswith("transformer_engine") for m in model.modules()
    ):
        config.warn_unused(
            ["keep_fp8_transpose_cache"],
            "it keeps the FP8 transpose caches of Transformer Engine layers, and this model has none",
            stacklevel=3,
        )


def derive_megatron_fsdp_unit_modules(model: nn.Module) -> list[str]:
    """Import paths (``module.ClassName``) of the block classes Megatron-FSDP should shard as units.

    The classes are those of the model's sub-modules whose class name is in its ``_no_split_modules``
    (see `automodel_distributed.blocks.no_split_module_names`), in module order, without duplicates.

    Raises:
        ValueError: The model declares no ``_no_split_modules``, or no sub-module has a declared class;
            the message says to set ``MegatronFSDPConfig.megatron_fsdp_unit_modules``.
    """
    names = no_split_module_names(model)
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules to derive Megatron-FSDP units from; set "
            "MegatronFSDPConfig.megatron_fsdp_unit_modules to the import path(s) of its block class(es), "
            "e.g. ['transformers.models.llama.modeling_llama.LlamaDecoderLayer']"
        )
    paths: list[str] = []
    for module in model.modules():
        cls = type(module)
        path = f"{cls.__module__}.{cls.__qualname__}"
        if cls.__name__ in names and path not in paths:
            paths.append(path)
    if not paths:
        raise ValueError(
            f"none of the _no_split_modules {sorted(names)} of {type(model).__name__} is the class of one of "
            "its sub-modules; set MegatronFSDPConfig.megatron_fsdp_unit_modules to the import path(s) of its "
            "block class(es)"
        )
    return paths


def megatron_fsdp_shard_axis(mesh: MeshContext) -> str:
    """The mesh axis Megatron-FSDP shards over: ``dp_cp`` when context parallelism is on, else ``dp``."""
    return MeshAxisName.DP_CP.value if mesh.cp_size > 1 else MeshAxisName.DP.value


def megatron_fsdp_kwargs(
    config: MegatronFSDPConfig,
    *,
    unit_modules: list[str],
    dp_shard_dim: str,
    tp_dim: str = MeshAxisName.TP.value,
) -> dict[str, Any]:
    """Map a `MegatronFSDPConfig` to keyword arguments of ``megatron_fsdp.fully_shard_model`` (0.6 API).

    Precision flags become a ``"mixed_precision"`` entry (a dict of dtypes, turned into a
    ``megatron_fsdp.MixedPrecisionPolicy`` by the caller, so this function needs no import):
    ``preserve_fp32_weights`` -> ``main_params_dtype=float32`` (else ``None``: the model's own weights are
    the optimizer's); ``grad_reduce_in_fp32`` -> ``main_grads_dtype=float32`` (else ``None``: gradients
    in the parameters' dtype), and the reduction follows the main-gradient dtype.
    ``check_for_nan_in_grad`` has no counterpart since megatron-fsdp 0.5 and is dropped (with a one-time
    warning when it is True; use ``report_nan_in_param_grad``). ``device_mesh`` and ``device`` are left
    to the caller.

    Args:
        config: The Megatron-FSDP settings.
        unit_modules: Import paths of the FSDP unit classes.
        dp_shard_dim: The mesh axis to shard over (`megatron_fsdp_shard_axis`).
        tp_dim: The tensor-parallel mesh axis.

    Returns:
        The keyword arguments.
    """
    if config.check_for_nan_in_grad:
        _warn_once(
            "check_for_nan_in_grad",
            "MegatronFSDPConfig.check_for_nan_in_grad=True is ignored: megatron-fsdp >= 0.5 has no "
            "buffer-level NaN check; set report_nan_in_param_grad=True for its per-parameter check",
        )
    kwargs: dict[str, Any] = {name: getattr(config, name) for name in _PASSTHROUGH_FIELDS}
    kwargs.update(
        fsdp_unit_modules=list(unit_modules),
        dp_shard_dim=dp_shard_dim,
        tp_dim=tp_dim,
        init_model_with_meta_device=config.init_fsdp_with_meta_device,
        mixed_precision={
            "main_params_dtype": torch.float32 if config.preserve_fp32_weights else None,
            "main_grads_dtype": torch.float32 if config.grad_reduce_in_fp32 else None,
            "grad_comm_dtype": None,
        },
    )
    return kwargs


def _import_megatron_fsdp() -> Any:
    try:
        return importlib.import_module("megatron_fsdp")
    except ImportError as exc:
        raise ImportError(
            f"MegatronFSDPConfig needs the megatron-fsdp package, which is not installed ({exc}); install it "
            f"with `{_INSTALL_HINT}`, or use FSDP2Config"
        ) from exc


class MegatronFSDPManager(StrategyDefaults):
    """Shard a model with Megatron-FSDP over the ``(dp, cp, tp)`` device mesh.

    Implements `automodel_distributed.strategy.StrategyManager` (gradient reduction follows
    Megatron-FSDP's own overlap settings, so `gradient_sync` switches nothing). Every `MegatronFSDPConfig`
    field is also an attribute of the manager, as in NeMo AutoModel.

    Args:
        config: The Megatron-FSDP settings.
        device_mesh: The ``(dp, cp, tp)`` mesh with the flattened ``dp_cp`` axis, as built by
            ``MeshContext.build(MegatronFSDPConfig(...))``, or that `MeshContext` itself (kept as is).

    Raises:
        ValueError: ``config`` is not a `MegatronFSDPConfig`, or the mesh lacks a ``dp``, ``cp`` or
            ``tp`` axis.
    """

    def __init__(self, config: MegatronFSDPConfig, device_mesh: DeviceMesh | MeshContext) -> None:
        if not isinstance(config, MegatronFSDPConfig):
            raise ValueError(f"MegatronFSDPManager needs a MegatronFSDPConfig, got {type(config).__name__}")
        given = device_mesh
        device_mesh = given.device_mesh if isinstance(given, MeshContext) else given  # type: ignore[assignment]
        names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
        missing = [axis.value for axis in _REQUIRED_AXES if axis.value not in names]
        if missing:
            raise ValueError(
                f"MegatronFSDPManager needs a device mesh with axes ('dp', 'cp', 'tp'); this one has {names} "
                f"(missing {missing}). Build it with MeshContext.build(MegatronFSDPConfig(...))"
            )
        self.config = config
        for name, value in config.to_dict().items():
            setattr(self, name, value)
        self.megatron_fsdp_unit_modules: list[str] | None = config.megatron_fsdp_unit_modules
        self.zero_dp_strategy: int = config.zero_dp_strategy
        self.activation_checkpointing: Any = config.activation_checkpointing
        self.device_mesh = device_mesh
        self.mesh = given if isinstance(given, MeshContext) else MeshContext.from_meshes(given)
        if self.zero_dp_strategy != 3:
            logger.warning(
                "MegatronFSDPConfig.zero_dp_strategy=%s: parameters will not be sharded (only 3 shards them)",
                self.zero_dp_strategy,
            )

    def _check_can_run(self) -> None:
        if self.device_mesh.device_type != "cuda" or not torch.cuda.is_available():
            where = "no CUDA device is available" if not torch.cuda.is_available() else "the mesh is on 'cpu'"
            raise RuntimeError(
                f"Megatron-FSDP needs CUDA devices (it allocates CUDA streams and buffers), but {where}. "
                "Use FSDP2Config (PyTorch FSDP2, which also runs on CPU with gloo) instead, or run on GPUs "
                "with the NCCL backend."
            )

    def parallelize(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Shard ``model`` (and ``optimizer``, when given) with Megatron-FSDP.

        Steps: check CUDA and the package; if the data-parallel shard axis has one rank, move the model
        to this rank's GPU, apply activation checkpointing if configured and return it unsharded;
        otherwise resolve the unit modules (`derive_megatron_fsdp_unit_modules` unless configured) and
        call ``megatron_fsdp.fully_shard`` (with an optimizer: megatron-fsdp replaces its parameter groups
        by one group over the sharded parameters, so per-group settings are lost, and patches
        ``step``/``zero_grad``) or ``fully_shard_model`` (then build the optimizer over the returned
        model's parameters and pass it to `shard_optimizer`, which keeps its groups).

        Preconditions: CUDA devices with an NCCL process group; every rank calls this (collective over the
        ``dp`` axis, or ``dp_cp`` with context parallelism). Build the optimizer after this call, or pass
        it here.

        Args:
            model: The model (on meta when ``init_fsdp_with_meta_device``); mutated and wrapped.
            optimizer: An optimizer over ``model``'s parameters, or None.

        Returns:
            ``(model, optimizer)``: the ``MegatronFSDP`` wrapper (or the model itself when nothing is
            sharded) and the optimizer (``None`` when none was given).

        Raises:
            RuntimeError: No CUDA device, or a mesh on CPU.
            ImportError: megatron-fsdp is not installed.
            ValueError: No unit modules can be derived, or activation checkpointing is asked for while
                Megatron-FSDP shards.
            NotImplementedError: The mesh has a tensor-parallel axis larger than one.
        """
        self._check_can_run()
        megatron_fsdp = _import_megatron_fsdp()
        if self.mesh.tp_size > 1:
            raise NotImplementedError(
                f"tensor parallelism (tp_size={self.mesh.tp_size}) with Megatron-FSDP is not supported yet; "
                "use FSDP2Config for TP, or tp_size=1"
            )
        device = torch.device("cuda", torch.cuda.current_device())
        shard_axis = megatron_fsdp_shard_axis(self.mesh)
        if self.mesh.submesh(shard_axis).size() == 1:
            return self._one_rank(model, device, shard_axis), optimizer
        if resolve_checkpointing_mode(self.activation_checkpointing) is not None:
            raise ValueError(
                "MegatronFSDPConfig.activation_checkpointing is not supported while Megatron-FSDP shards the "
                "model; set it to False, or use FSDP2Config(activation_checkpointing=...)"
            )
        warn_transformer_engine_settings(self.config, model)
        units = self.megatron_fsdp_unit_modules or derive_megatron_fsdp_unit_modules(model)
        kwargs = megatron_fsdp_kwargs(self.config, unit_modules=units, dp_shard_dim=shard_axis)
        precision = megatron_fsdp.MixedPrecisionPolicy(**kwargs.pop("mixed_precision"))
        kwargs.update(device_mesh=self.device_mesh, device=device, mixed_precision_policy=precision)
        if optimizer is not None:
            return megatron_fsdp.fully_shard(model, optimizer, **kwargs)
        wrapped = megatron_fsdp.fully_shard_model(model, **kwargs)
        # Swap the module's parameters for the distributed ones, so an optimizer built later sees them.
        wrapped._replace_param_with_distributed_if_needed()
        return wrapped, None

    def _one_rank(self, model: nn.Module, device: torch.device, shard_axis: str) -> nn.Module:
        """The model on this GPU, unwrapped, with activation checkpointing if configured.

        A meta model stays on meta (``init_fsdp_with_meta_device``): `apply_model_infrastructure`'s
        materialise step loads it onto the device, recomputed buffers included; ``model.to`` cannot copy
        a meta tensor. The settings that only the wrapper reads are named in a warning.
        """
        acting = ("activation_checkpointing", "init_fsdp_with_meta_device")
        wrapper_only = [f.name for f in dataclasses.fields(self.config) if f.name not in acting]
        self.config.warn_unused(
            self.config.changed_fields(wrapper_only),
            f"the {shard_axis!r} axis has one rank, so Megatron-FSDP does not wrap the model",
            stacklevel=5,
        )
        if not has_meta_tensors(model):
            model = model.to(device)
        mode = resolve_checkpointing_mode(self.activation_checkpointing)
        if mode is not None:
            apply_activation_checkpointing(model, mode=mode)
        return model

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make an optimizer built after `parallelize` (without one) drive Megatron-FSDP, in place.

        Calls ``megatron_fsdp.fully_shard_optimizer``: ``step`` then also waits for the gradient
        reduce-scatter and installs the updated weights, ``zero_grad`` also clears Megatron-FSDP's
        gradient buffer. Build the optimizer over the parameters of the model `parallelize` returned.

        Raises:
            ImportError: megatron-fsdp is not installed.
        """
        sharded: torch.optim.Optimizer = _import_megatron_fsdp().fully_shard_optimizer(optimizer)
        return sharded

    # ------------------------------------------------------------------ StrategyManager

    def shard(self, model: nn.Module) -> nn.Module:
        """`parallelize` without an optimizer, reduced to the model.

        Build the optimizer afterwards and pass it to `shard_optimizer`.
        """
        return self.parallelize(model)[0]

    def loads_before_sharding(self, *, adapters: bool) -> bool:
        """`MegatronFSDPConfig.loads_before_sharding`: real weights unless ``init_fsdp_with_meta_device``."""
        return self.config.loads_before_sharding(self.mesh.layout, adapters=adapters)
