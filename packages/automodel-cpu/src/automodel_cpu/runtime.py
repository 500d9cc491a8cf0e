"""`CPURuntime`: what makes FSDP2 and context parallelism small and fast on CPU meshes (gloo), opt-in.

Nothing here runs unless a `CPURuntime` is handed over: ``FSDP2Config(host_runtime=CPURuntime())`` for
the FSDP2 strategy, ``context_parallel_region(..., host_runtime=runtime)`` for context parallelism. The
``automodel`` command does both for its CPU jobs; a library user on GPUs never meets it. It implements
`automodel_distributed.host_runtime.HostRuntime` (structurally: this package imports no strategy).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from automodel_cpu.limits import GLOO_CHUNK_BYTES, POOL_MAX_BYTES, RELEASE_ABOVE_BYTES

__all__ = ["CPURuntime"]


@dataclass(frozen=True, kw_only=True)
class CPURuntime:
    """The host-memory layer for CPU training; each part acts only where its hook is called.

    - `prepare_process` (the FSDP2 manager calls it on creation, over a CPU mesh or with CPU offload):
      when glibc's malloc serves the process, fix its mmap and trim thresholds
      (`automodel_cpu.malloc_settings.configure_host_allocator`, process-wide) so that the large blocks
      FSDP2 frees every step go back to the OS instead of staying in fragmented arenas. Nothing under
      mimalloc (which the ``automodel`` launcher preloads into CPU workers) or another allocator.
    - `attach_fsdp` (after ``fully_shard`` on a CPU mesh): every unit takes its all-gather and
      reduce-scatter buffers from one pool, kept from step to step up to ``pool_max_bytes`` a buffer;
      gloo's collectives run in pieces of at most ``gloo_chunk_bytes``; each all-gather output is freed
      once copied out; before a buffer above ``release_above_bytes`` the allocator's free memory goes
      back to the OS (`automodel_cpu.fsdp_buffer_pool`); and gradients are copied into the
      reduce-scatter buffer without a temporary of their size, by a CPU kernel registered for
      ``fsdp::chunk_cat_mixed_dtype`` (process-wide, the same values bit for bit:
      `automodel_cpu.copy_in_kernel`).
    - `ring_attention` (inside ``context_parallel_region`` on a CPU mesh): torch's ring attention for the
      CPU flash-attention kernel, through private torch internals, while the context is open
      (`automodel_cpu.ring_attention_kernel`).

    Every value of every step is the same with or without it; memory and time are what change
    (docs/benchmarks.md, "The CPU runtime").
    """

    tune_glibc: bool = True
    """Fix glibc's mmap and trim thresholds in `prepare_process` (when glibc's malloc serves the process)."""
    pool_max_bytes: int = POOL_MAX_BYTES
    """Largest collective buffer kept from step to step."""
    release_above_bytes: int = RELEASE_ABOVE_BYTES
    """Before a collective buffer above this, free allocator memory goes back to the OS."""
    gloo_chunk_bytes: int = GLOO_CHUNK_BYTES
    """Largest piece of a collective handed to gloo in one call."""

    def __post_init__(self) -> None:
        for name in ("pool_max_bytes", "release_above_bytes", "gloo_chunk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CPURuntime.{name} must be a positive int (bytes), got {value!r}")
        if not isinstance(self.tune_glibc, bool):
            raise ValueError(f"CPURuntime.tune_glibc must be a bool, got {self.tune_glibc!r}")

    def prepare_process(self) -> None:
        """Glibc's thresholds, process-wide, when ``tune_glibc`` (see the class docstring)."""
        if self.tune_glibc:
            from automodel_cpu.malloc_settings import configure_host_allocator

            configure_host_allocator()

    def attach_fsdp(self, model: nn.Module) -> None:
        """Pool, piece and free the host collective buffers of ``model``'s FSDP2 units (class docstring).

        Preconditions: ``fully_shard`` has been applied over a CPU mesh. Mutates the units' comms and
        hooks, and registers the copy-in kernel (once per process); no collective.
        """
        # FSDP2's comm classes are private torch API and slow to import: loaded when first attached.
        from automodel_cpu.copy_in_kernel import register_host_copy_in
        from automodel_cpu.fsdp_buffer_pool import free_all_gather_outputs_after_copy_out, pool_fsdp_buffers

        pool_fsdp_buffers(
            model,
            max_bytes=self.pool_max_bytes,
            release_above=self.release_above_bytes,
            chunk_bytes=self.gloo_chunk_bytes,
        )
        free_all_gather_outputs_after_copy_out(model)
        register_host_copy_in()

    @contextmanager
    def ring_attention(self) -> Iterator[None]:
        """Ring attention for CPU SDPA while the context is open (`cpu_ring_attention`)."""
        from automodel_cpu.ring_attention_kernel import cpu_ring_attention

        with cpu_ring_attention():
            yield
