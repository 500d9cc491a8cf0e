"""The process's malloc: glibc's thresholds, and handing free memory back to the OS (glibc or mimalloc).

PyTorch allocates CPU tensors with ``malloc``. glibc serves a request at or above its mmap threshold
with a fresh ``mmap`` and returns it to the OS on ``free``; smaller requests come from heap arenas that
keep freed memory. The threshold is dynamic: each time a mapped block of up to 32 MiB is freed, it
rises to that block's size. FSDP2 allocates and frees blocks of exactly those sizes on every step
(all-gather outputs, unsharded parameters and gradients, reduce-scatter inputs), so after a few frees
they all land in the arenas, and the arenas' peak stays resident. On a 125M-parameter Llama over 4
ranks this tripled each rank's peak memory.

`configure_host_allocator` fixes the threshold (which also turns the dynamic adjustment off) and the
trim threshold, with ``mallopt``; `release_host_memory` hands free arena memory back with
``malloc_trim``. Both are no-ops (returning False) where glibc's malloc is not the process's: another
OS, or an allocator preloaded at process start (`malloc_is_glibc`). Process-wide; no collectives.
Returning blocks to the OS has a price: the next block of that size is a fresh mapping whose pages
fault in and are zeroed, every step. `automodel_cpu.fsdp_buffer_pool.HostBufferPool` removes that
price for the buffers FSDP2's collectives ask for, by keeping them from step to step; the other large blocks
(unsharded parameters, gradients, gloo's temporaries) still pay it: on the job of
``benchmarks/bench_vs_nemo.py``, about 155,000 page faults and 1.5x the step time of glibc's defaults.
No glibc setting avoids both costs; an allocator that reuses same-sized blocks without returning
them does, and can only be chosen at process start: the ``automodel`` launcher preloads mimalloc into
CPU workers (``launch.host_allocator``, `automodel_cpu.mimalloc_preload`).

The defaults (2 MiB mmap threshold, 64 MiB trim threshold) come from a sweep on the job of
``benchmarks/bench_vs_nemo.py`` with the pool on: a 1 MiB threshold kept the peak a little lower but
took about 1.8x the page faults per step; 4 MiB and more let the heap fragment again (the peak over
later steps grew). A trim threshold below the heap's free top memory made the heap shrink and grow
again each step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

__all__ = ["configure_host_allocator", "malloc_is_glibc", "release_host_memory"]

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, when it is the process's ``malloc`` (not when another allocator was preloaded)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # pragma: no cover
        return None
    # The process's malloc is the first one the dynamic linker finds; a preloaded allocator (the
    # launcher's launch.host_allocator='mimalloc') comes before glibc's own.
    process_malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    return libc if process_malloc == ctypes.cast(libc.malloc, ctypes.c_void_p).value else None


def malloc_is_glibc() -> bool:
    """Whether glibc's ``malloc`` serves this process (False off glibc or under a preloaded allocator)."""
    return _glibc() is not None


def configure_host_allocator(
    *, mmap_threshold: int = 2 << 20, trim_threshold: int = 64 << 20, arena_max: int | None = None
) -> bool:
    """Make glibc map every allocation of ``mmap_threshold`` bytes or more and trim heaps eagerly.

    Mutates process-wide allocator settings (affects allocations made afterwards). Call it once,
    early, in every rank (e.g. before building the model).

    Args:
        mmap_threshold: Allocations of at least this many bytes get their own mapping, returned to the
            OS when freed (glibc's maximum is 32 MiB on 64-bit hosts).
        trim_threshold: Free memory at the top of a heap beyond this is returned to the OS.
        arena_max: Cap on malloc arenas (None leaves glibc's default of 8 x cores).

    Returns:
        Whether the settings were applied (False on non-glibc hosts).
    """
    libc = _glibc()
    if libc is None:
        logger.info("the host allocator is not glibc's malloc; configure_host_allocator does nothing")
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))) and ok
    if arena_max is not None:
        ok = bool(libc.mallopt(_M_ARENA_MAX, int(arena_max))) and ok
    return ok


@functools.cache
def _mimalloc() -> ctypes.CDLL | None:
    """The process's symbols when mimalloc is loaded into it (the launcher preloads it), else None."""
    try:
        process = ctypes.CDLL(None)
    except OSError:  # pragma: no cover
        return None
    return process if hasattr(process, "mi_collect") else None


def release_host_memory() -> bool:
    """Return the memory the process's allocator holds free to the OS.

    glibc: ``malloc_trim(0)``; mimalloc: ``mi_collect(true)`` (the calling thread's free pages and the
    abandoned ones). Process-wide, no collectives; the memory faults in again when next used.

    Returns:
        Whether an allocator that can do it serves the process (False otherwise: a no-op).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
        return True
    mimalloc = _mimalloc()
    if mimalloc is not None:
        mimalloc.mi_collect(ctypes.c_bool(True))
        return True
    return False
