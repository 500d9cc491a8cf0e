"""`StrategyManager`: what the orchestration (``automodel_infra``) and a training loop need from a strategy.

Every strategy manager (`FSDP2Manager`, `DDPManager`, `MegatronFSDPManager`) implements this typed
protocol, so a caller never asks ``isinstance`` or ``getattr`` what a manager is: each step of
``apply_model_infrastructure`` is one call (`StrategyManager.check`, `StrategyManager.shard`,
`StrategyManager.loads_before_sharding`, `StrategyManager.init_device`, `StrategyManager.compile`,
`StrategyManager.place`), and a training loop
wraps its forward in `StrategyManager.autocast` and each micro-batch's backward in
`StrategyManager.gradient_sync`. `NoStrategy` is the manager of a run without a strategy config (one
device, or expert parallelism through ``automodel_moe.parallelize_model`` alone); `as_strategy` picks it.
`StrategyDefaults` holds the behaviour the managers share.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from automodel_distributed.config import CompileConfig
from automodel_mesh import MeshContext

__all__ = ["NoStrategy", "StrategyDefaults", "StrategyManager", "as_strategy"]


@runtime_checkable
class StrategyManager(Protocol):
    """The steps a strategy contributes to building and training a model (see the module docstring)."""

    mesh: MeshContext
    """The mesh the strategy works on (the object it was given; never a rebuilt copy)."""

    def check(self, model: nn.Module) -> None:
        """Raise ``ValueError`` when `shard` would refuse the whole, unsplit ``model``; pure, no collective.

        Called before anything changes: under pipeline parallelism `shard` runs on each stage, which may
        not hold what the strategy refuses (a stage of dense layers under expert parallelism).
        """
        ...

    def shard(self, model: nn.Module) -> nn.Module:
        """Apply the strategy (TP, checkpointing, FSDP / DDP) in place; return the model to use."""
        ...

    def loads_before_sharding(self, *, adapters: bool) -> bool:
        """Whether the checkpoint must be loaded into real tensors before `shard`.

        Args:
            adapters: The model has LoRA adapters (they are initialised after the base is loaded, on
                the same path at every world size).
        """
        ...

    def init_device(self, device: torch.device | str) -> torch.device | str:
        """Where sharded meta parameters are materialised (``device``, or CPU under CPU offload)."""
        ...

    def compile(self, model: nn.Module, config: CompileConfig | None, *, in_place: bool) -> nn.Module:
        """Compile after sharding as the strategy wants it; return the module to use.

        Args:
            model: The sharded model or a pipeline stage.
            config: The compile settings (``None`` or disabled: only the strategy's own setting applies).
            in_place: The module must keep its identity and parameter names (pipeline stages).
        """
        ...

    def place(self, model: nn.Module, device: torch.device | str) -> None:
        """Move what the strategy left unplaced to ``device`` (unsharded models), in place."""
        ...

    def gradient_sync(self, model: nn.Module, *, enabled: bool) -> AbstractContextManager[None]:
        """Context for one micro-batch's forward and backward: reduce gradients only when ``enabled``."""
        ...

    def autocast(self) -> AbstractContextManager[None]:
        """Context for the forward pass: the strategy's ``autocast_dtype``, if any."""
        ...


def _has_dtensors(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


class StrategyDefaults:
    """Behaviour the managers share: whole-model compile, placement of unsharded models, no-op contexts."""

    def check(self, model: nn.Module) -> None:
        """Nothing to refuse before sharding."""
        del model

    def init_device(self, device: torch.device | str) -> torch.device | str:
        """``device`` itself."""
        return device

    def compile(self, model: nn.Module, config: CompileConfig | None, *, in_place: bool) -> nn.Module:
        """``compile_blocks`` in place for stages, ``compile_model`` otherwise; nothing when disabled."""
        from automodel_distributed.compile import compile_blocks, compile_model

        if config is None or not config.enabled:
            return model
        if in_place:
            return compile_blocks(model, config)
        return compile_model(model, config)

    def place(self, model: nn.Module, device: torch.device | str) -> None:
        """``model.to(device)`` unless it holds DTensors (their shards already live where the mesh says)."""
        if not _has_dtensors(model):
            model.to(device)

    def gradient_sync(self, model: nn.Module, *, enabled: bool) -> AbstractContextManager[None]:
        """Nothing to switch: gradients are local (or reduced by the strategy on its own schedule)."""
        del model, enabled
        return contextlib.nullcontext()

    def autocast(self) -> AbstractContextManager[None]:
        """No autocast."""
        return contextlib.nullcontext()


class NoStrategy(StrategyDefaults):
    """The manager of a run without a strategy config: one device, or a ``parallelize_fn`` that shards.

    Args:
        mesh: The run's mesh (an empty context for one device).
    """

    def __init__(self, mesh: MeshContext) -> None:
        self.mesh = mesh

    def shard(self, model: nn.Module) -> nn.Module:
        """Nothing to apply."""
        return model

    def loads_before_sharding(self, *, adapters: bool) -> bool:
        """Load first when every rank holds whole parameters and there are no adapters."""
        return not adapters and not self.mesh.layout.shards_parameters


def as_strategy(manager: StrategyManager | None, mesh: MeshContext) -> StrategyManager:
    """``manager``, or `NoStrategy` over ``mesh`` when there is none.

    Raises:
        ValueError: ``manager`` does not implement `StrategyManager` (names what it is).
    """
    if manager is None:
        return NoStrategy(mesh)
    if not isinstance(manager, StrategyManager):
        raise ValueError(
            f"model_wrapper must be a strategy manager (FSDP2Manager, DDPManager, MegatronFSDPManager or any "
            f"automodel_distributed.strategy.StrategyManager), got {type(manager).__name__}"
        )
    return manager
