"""`DistributedSetup`: the reference system's bundle of a mesh and the configs that go with it.

It lives in automodel-infra because it is the one package that may see all of them: the mesh
(automodel-mesh), the strategy configs (automodel-distributed) and, through its optional extras, the
pipeline config (automodel-pipelining) and the MoE config (automodel-moe). Those two are imported only
when a setup needs them (``pp_size > 1``, ``ep_size > 1``, or a dict to turn into a config).

Unlike the reference system, the `MeshContext` is not rewritten to carry the policies: the setup holds
them next to it, and `DistributedSetup.instantiate_infrastructure` hands them to
`automodel_infra.instantiate_infrastructure`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from automodel_distributed.config import (
    ActivationCheckpointingMode,
    DDPConfig,
    DistributedConfig,
    FSDP2Config,
    MegatronFSDPConfig,
    normalize_activation_checkpointing,
)
from automodel_infra._optional import import_component
from automodel_mesh import MeshContext, ParallelismSizes

if TYPE_CHECKING:
    from automodel_infra.infrastructure import Infrastructure
    from automodel_moe.config import MoEParallelizerConfig
    from automodel_pipelining.config import PipelineConfig

__all__ = ["STRATEGY_NAMES", "DistributedSetup"]

#: Strategy names `DistributedSetup.build` accepts (case-insensitive), as in the reference system.
STRATEGY_NAMES: dict[str, type[FSDP2Config | MegatronFSDPConfig | DDPConfig]] = {
    "fsdp2": FSDP2Config,
    "megatron_fsdp": MegatronFSDPConfig,
    "megatron-fsdp": MegatronFSDPConfig,
    "mfsdp": MegatronFSDPConfig,
    "ddp": DDPConfig,
}


def _strategy(strategy: object) -> DistributedConfig:
    if isinstance(strategy, FSDP2Config | MegatronFSDPConfig | DDPConfig):
        return strategy
    if isinstance(strategy, str):
        cls = STRATEGY_NAMES.get(strategy.lower())
        if cls is None:
            raise ValueError(
                f"DistributedSetup.build: unknown strategy {strategy!r}; use one of {sorted(STRATEGY_NAMES)} "
                "or a strategy config (FSDP2Config, MegatronFSDPConfig, DDPConfig)"
            )
        return cls()
    raise ValueError(
        f"DistributedSetup.build: strategy must be a name or a strategy config, got {type(strategy).__name__}"
    )


def _optional_config(value: object, field: str, module: str, class_name: str, *, allow_dict: bool) -> Any:
    """``value`` as ``module.class_name`` (a dict is converted when ``allow_dict``), importing ``module``."""
    cls = getattr(import_component(module, f"DistributedSetup.{field}"), class_name)
    if allow_dict and isinstance(value, Mapping):
        return cls.from_dict(dict(value))
    if not isinstance(value, cls):
        raise ValueError(
            f"DistributedSetup.{field} must be a {module}.{class_name}"
            f"{' (or its dict)' if allow_dict else ' (dicts are converted by DistributedSetup.build)'}, "
            f"got {type(value).__name__}"
        )
    return value


def _pipeline_config(value: object, *, allow_dict: bool) -> PipelineConfig:
    config: PipelineConfig = _optional_config(
        value, "pipeline_config", "automodel_pipelining.config", "PipelineConfig", allow_dict=allow_dict
    )
    return config


def _moe_config(value: object, *, allow_dict: bool) -> MoEParallelizerConfig:
    config: MoEParallelizerConfig = _optional_config(
        value, "moe_parallel_config", "automodel_moe.config", "MoEParallelizerConfig", allow_dict=allow_dict
    )
    return config


@dataclass(frozen=True)
class DistributedSetup:
    """A `MeshContext` and the configs that parallelize a model over it (NeMo AutoModel's bundle).

    Build one with `DistributedSetup.build` (names or configs in, meshes built), or from parts. Frozen;
    nothing in it is modified afterwards.
    """

    mesh_context: MeshContext
    """The meshes (`MeshContext()` for a single device)."""
    strategy_config: DistributedConfig | None = None
    """``FSDP2Config``, ``MegatronFSDPConfig``, ``DDPConfig``, or ``None`` (no strategy)."""
    pipeline_config: PipelineConfig | None = None
    """Pipeline settings (automodel-pipelining), for ``pp_size > 1``."""
    moe_parallel_config: MoEParallelizerConfig | None = None
    """Expert-parallel settings (automodel-moe), for ``ep_size > 1``."""
    activation_checkpointing: ActivationCheckpointingMode = False
    """``False``, ``True``/``"full"`` or ``"selective"``; ``False`` keeps the strategy config's own."""

    def __post_init__(self) -> None:
        if not isinstance(self.mesh_context, MeshContext):
            raise ValueError(
                f"DistributedSetup.mesh_context must be an automodel_mesh.MeshContext, got "
                f"{type(self.mesh_context).__name__}"
            )
        if self.strategy_config is not None and not isinstance(
            self.strategy_config, FSDP2Config | MegatronFSDPConfig | DDPConfig
        ):
            raise ValueError(
                "DistributedSetup.strategy_config must be an FSDP2Config, MegatronFSDPConfig, DDPConfig or "
                f"None, got {type(self.strategy_config).__name__}"
            )
        if self.pipeline_config is not None:
            _pipeline_config(self.pipeline_config, allow_dict=False)
        if self.moe_parallel_config is not None:
            _moe_config(self.moe_parallel_config, allow_dict=False)
        normalize_activation_checkpointing(
            self.activation_checkpointing, field_name="DistributedSetup.activation_checkpointing"
        )

    @classmethod
    def build(
        cls,
        strategy: str | DistributedConfig = "fsdp2",
        parallelism_sizes: ParallelismSizes | Mapping[str, Any] | None = None,
        pipeline_config: PipelineConfig | Mapping[str, Any] | None = None,
        moe_parallel_config: MoEParallelizerConfig | Mapping[str, Any] | None = None,
        activation_checkpointing: ActivationCheckpointingMode = False,
        world_size: int | None = None,
        timeout_minutes: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> DistributedSetup:
        """Validate everything, then build the meshes (`MeshContext.build`) and bundle the configs.

        Preconditions and collectives: those of `MeshContext.build` (the default process group is
        initialised unless the run is one process; every rank calls this with the same arguments). All
        checks run before the first collective.

        Args:
            strategy: ``"fsdp2"``, ``"megatron_fsdp"`` (also ``"megatron-fsdp"``, ``"mfsdp"``), ``"ddp"``
                (case-insensitive), or a strategy config.
            parallelism_sizes: The degrees (a `ParallelismSizes` or its dict); ``None``: data parallel only.
            pipeline_config: Needs ``pp_size > 1``; a dict becomes a ``PipelineConfig``; ``None`` with
                ``pp_size > 1`` means ``PipelineConfig()``.
            moe_parallel_config: Needs ``ep_size > 1``; a dict becomes a ``MoEParallelizerConfig``;
                ``None`` with ``ep_size > 1`` means ``MoEParallelizerConfig()``.
            activation_checkpointing: As the field.
            world_size: As for `MeshContext.build`.
            timeout_minutes: As for `MeshContext.build`.
            ranks: As for `MeshContext.build`.

        Raises:
            ValueError: An unknown strategy; a pipeline config without ``pp_size > 1`` or a MoE config
                without ``ep_size > 1``; whatever `MeshContext.build` or the configs refuse.
            ImportError: automodel-pipelining / automodel-moe is needed but not installed.
        """
        strategy_config = _strategy(strategy)
        if parallelism_sizes is None:
            sizes = ParallelismSizes()
        elif isinstance(parallelism_sizes, Mapping):
            sizes = ParallelismSizes.from_dict(dict(parallelism_sizes))
        else:
            sizes = parallelism_sizes
        if pipeline_config is not None and sizes.pp_size <= 1:
            raise ValueError(
                f"DistributedSetup.build: pipeline_config needs pp_size > 1, got pp_size={sizes.pp_size}"
            )
        if moe_parallel_config is not None and sizes.ep_size <= 1:
            raise ValueError(
                f"DistributedSetup.build: moe_parallel_config needs ep_size > 1, got ep_size={sizes.ep_size}"
            )
        pipeline = None
        if sizes.pp_size > 1:
            pipeline = _pipeline_config({} if pipeline_config is None else pipeline_config, allow_dict=True)
        moe = None
        if sizes.ep_size > 1:
            moe = _moe_config({} if moe_parallel_config is None else moe_parallel_config, allow_dict=True)
        normalize_activation_checkpointing(
            activation_checkpointing, field_name="DistributedSetup.activation_checkpointing"
        )
        mesh = MeshContext.build(
            strategy_config, sizes, world_size=world_size, timeout_minutes=timeout_minutes, ranks=ranks
        )
        return cls(
            mesh_context=mesh,
            strategy_config=strategy_config,
            pipeline_config=pipeline,
            moe_parallel_config=moe,
            activation_checkpointing=activation_checkpointing,
        )

    def instantiate_infrastructure(
        self, *, qat_config: Any = None, device: torch.device | None = None
    ) -> Infrastructure:
        """`automodel_infra.instantiate_infrastructure` with this setup's mesh and configs.

        Returns:
            ``Infrastructure(model_wrapper, autopipeline, parallelize_fn, qat_quantizer)``.
        """
        from automodel_infra.infrastructure import instantiate_infrastructure

        return instantiate_infrastructure(
            distributed_config=self.strategy_config,
            pipeline_config=self.pipeline_config,
            qat_config=qat_config,
            moe_config=self.moe_parallel_config,
            activation_checkpointing=self.activation_checkpointing,  # type: ignore[arg-type]
            device=device,
            mesh=self.mesh_context,
        )
