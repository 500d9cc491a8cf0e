"""`HostRuntime`: the one object through which an opt-in host-memory layer joins a strategy.

The default path is plain torch on every device: `FSDP2Manager` and `context_parallel_region` change
nothing process-wide and override no torch op. Runs whose collectives and tensors live in host memory
(CPU meshes on gloo, CPU offload) can be given a host runtime, ``automodel_cpu.CPURuntime`` (the
``automodel`` command gives one to its CPU jobs), through ``FSDP2Config.host_runtime`` and
``context_parallel_region(..., host_runtime=...)``. This protocol is what those call; nothing here
imports an implementation.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["HostRuntime"]


@runtime_checkable
class HostRuntime(Protocol):
    """What a strategy asks of a host-memory layer, at the three points where it may act."""

    def prepare_process(self) -> None:
        """Process-wide settings that must precede the model's allocations (the host allocator's).

        Called once by `automodel_distributed.fsdp2.FSDP2Manager` when it is created over a CPU mesh
        or with CPU offload, before anything is materialised.
        """
        ...

    def attach_fsdp(self, model: nn.Module) -> None:
        """Change how the FSDP2 units of ``model`` allocate and fill their host collective buffers.

        Called by `automodel_distributed.fsdp2.FSDP2Manager.parallelize` after ``fully_shard`` on a CPU
        mesh. Must leave every value the same (only memory and time may change); no collective.
        """
        ...

    def ring_attention(self) -> AbstractContextManager[None]:
        """A context in which torch's ring attention runs on CPU tensors (context parallelism on gloo)."""
        ...
