"""`DDPManager`: PyTorch ``DistributedDataParallel`` over the default process group.

Differences from NeMo AutoModel, on purpose:

- a world of one rank is never cast to bf16 behind the caller's back (the reference casts on CUDA);
  ask for reduced precision with ``DDPConfig.autocast_dtype``;
- ``autocast_dtype`` is honoured (the reference stores it and ignores it): the model's forward runs
  under ``torch.autocast`` (see `apply_autocast`); parameters, gradients and the optimizer stay in
  their own dtype;
- activation checkpointing wraps whole blocks (`apply_activation_checkpointing`) in both modes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_distributed.activation_checkpointing import (
    apply_activation_checkpointing,
    resolve_checkpointing_mode,
)
from automodel_distributed.config import DDPConfig
from automodel_distributed.strategy import StrategyDefaults
from automodel_mesh import MeshContext

__all__ = ["DDPManager", "apply_autocast", "ddp_device", "ddp_kwargs"]

logger = logging.getLogger(__name__)

_AUTOCAST_ATTR = "_automodel_autocast"


def ddp_device() -> torch.device:
    """The device DDP uses on this rank, from the default process group's backend.

    ``cuda:LOCAL_RANK`` (set as the current device) when the backend includes NCCL and CUDA is
    available, else ``cpu`` (gloo).

    Raises:
        RuntimeError: torch.distributed is unavailable or the default process group is not initialised.
    """
    if not dist.is_available():
        raise RuntimeError("DDPManager needs torch.distributed, which this torch build does not provide")
    if not dist.is_initialized():
        raise RuntimeError(
            "DDPManager needs an initialised default process group: call "
            "torch.distributed.init_process_group() (or launch with torchrun) before building it; for a "
            "single process use init_process_group('gloo', rank=0, world_size=1, init_method=...)"
        )
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@functools.cache
def _ddp_has_forward_sync_buffers() -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def ddp_kwargs(config: DDPConfig, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for ``DistributedDataParallel`` from ``config``.

    ``device_ids`` is ``[device.index]`` on CUDA and ``None`` on CPU; ``bucket_cap_mb`` is passed only
    when set, so torch's default applies otherwise. ``broadcast_buffers`` (sync buffers at each forward)
    goes to ``forward_sync_buffers`` on torch >= 2.13, which deprecated ``broadcast_buffers``; buffers are
    then always synced once when DDP is built, which ``broadcast_buffers=False`` used to skip.
    """
    buffers_key = "forward_sync_buffers" if _ddp_has_forward_sync_buffers() else "broadcast_buffers"
    kwargs: dict[str, Any] = {
        "device_ids": [device.index] if device.type == "cuda" else None,
        buffers_key: config.broadcast_buffers,
        "find_unused_parameters": config.find_unused_parameters,
        "static_graph": config.static_graph,
        "gradient_as_bucket_view": config.gradient_as_bucket_view,
    }
    if config.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = config.bucket_cap_mb
    return kwargs


def _autocast_forward(
    forward: Callable[..., Any], device_type: str, dtype: torch.dtype, *args: Any, **kwargs: Any
) -> Any:
    with torch.autocast(device_type=device_type, dtype=dtype):
        return forward(*args, **kwargs)


def apply_autocast(model: nn.Module, dtype: torch.dtype, device_type: str) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(device_type, dtype)``, in place.

    The instance's ``forward`` is replaced by one that enters autocast and calls the original, so
    whoever calls the module (a DDP wrapper, a trainer) gets it; the backward runs in the dtypes autocast
    chose in forward. Parameters are not cast. Applying it again replaces the previous autocast setting.

    Args:
        model: The module whose forward to wrap.
        dtype: The autocast dtype (``torch.bfloat16`` or ``torch.float16``).
        device_type: ``"cuda"`` or ``"cpu"``: the device the forward runs on.

    Returns:
        ``model``.
    """
    original = getattr(model, _AUTOCAST_ATTR, None) or model.forward
    model.forward = functools.partial(_autocast_forward, original, device_type, dtype)
    setattr(model, _AUTOCAST_ATTR, original)
    return model


def _check_materialised(model: nn.Module) -> None:
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"DDPManager.parallelize needs materialised parameters, but {len(meta)} are on the meta device "
            f"(e.g. {meta[0]!r}); load or initialise the model (to_empty + init) before wrapping it in DDP"
        )


class DDPManager(StrategyDefaults):
    """Data parallelism with ``DistributedDataParallel`` over the default process group.

    Implements `automodel_distributed.strategy.StrategyManager`. Every `DDPConfig` field is also an
    attribute of the manager (``manager.activation_checkpointing``, ``manager.bucket_cap_mb``, ...), as in
    NeMo AutoModel. Construction checks the process group and picks this rank's device (``rank``,
    ``world_size`` and ``device`` attributes).

    Args:
        config: The settings.
        mesh: The run's `MeshContext` (``MeshContext.build(DDPConfig())``: the process group, no device
            mesh); default: the default process group.

    Raises:
        RuntimeError: The default process group is not initialised.
    """

    def __init__(self, config: DDPConfig, *, mesh: MeshContext | None = None) -> None:
        if not isinstance(config, DDPConfig):
            raise ValueError(f"DDPManager needs a DDPConfig, got {type(config).__name__}")
        self.config = config
        self.activation_checkpointing = config.activation_checkpointing
        self.activation_checkpointing_scope = config.activation_checkpointing_scope
        self.broadcast_buffers = config.broadcast_buffers
        self.find_unused_parameters = config.find_unused_parameters
        self.static_graph = config.static_graph
        self.bucket_cap_mb = config.bucket_cap_mb
        self.gradient_as_bucket_view = config.gradient_as_bucket_view
        self.autocast_dtype = config.autocast_dtype
        self.device = ddp_device()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.mesh = mesh if mesh is not None else MeshContext(process_group=dist.group.WORLD)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Prepare ``model`` for data-parallel training on this rank.

        Steps: move to `device`; activation checkpointing if configured; autocast if configured; then,
        with more than one rank, wrap in ``DistributedDataParallel`` (which broadcasts rank 0's
        parameters and buffers to the others, a collective over the default group). With one rank the
        unwrapped model is returned.

        Preconditions: parameters are materialised (not meta); every rank calls this (collective).

        Args:
            model: The model; it is mutated (moved, blocks wrapped, forward wrapped).

        Returns:
            A ``DistributedDataParallel`` wrapping ``model``, or ``model`` itself for one rank.

        Raises:
            ValueError: A parameter is still on the meta device.
        """
        _check_materialised(model)
        model = model.to(self.device)
        mode = resolve_checkpointing_mode(self.activation_checkpointing)
        if mode is not None:
            scope = self.activation_checkpointing_scope
            assert isinstance(scope, tuple), "DDPConfig normalises the scope to a tuple"
            apply_activation_checkpointing(model, mode=mode, scope=scope)
        if self.autocast_dtype is not None:
            apply_autocast(model, self.autocast_dtype, self.device.type)
        if self.world_size == 1:
            settings = ("broadcast_buffers", "find_unused_parameters", "static_graph", "bucket_cap_mb")
            changed = self.config.changed_fields((*settings, "gradient_as_bucket_view"))
            self.config.warn_unused(changed, "world size 1, no DDP wrapper", stacklevel=3)
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, **ddp_kwargs(self.config, self.device))

    # ------------------------------------------------------------------ StrategyManager

    def shard(self, model: nn.Module) -> nn.Module:
        """`parallelize`."""
        return self.parallelize(model)

    def loads_before_sharding(self, *, adapters: bool) -> bool:
        """`DDPConfig.loads_before_sharding`: always (DDP replicates real tensors, broadcasting rank 0's)."""
        return self.config.loads_before_sharding(self.mesh.layout, adapters=adapters)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, *, enabled: bool) -> Iterator[None]:
        """``DistributedDataParallel.no_sync()`` for the micro-batches that must not all-reduce."""
        from torch.nn.parallel import DistributedDataParallel

        if enabled or not isinstance(model, DistributedDataParallel):
            yield
            return
        with model.no_sync():
            yield

    def autocast(self) -> AbstractContextManager[None]:
        """Nothing to enter: `parallelize` already runs the forward under ``autocast_dtype``."""
        return contextlib.nullcontext()
