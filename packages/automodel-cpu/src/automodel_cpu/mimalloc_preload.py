"""The workers' host memory allocator: glibc's ``malloc`` or mimalloc (``launch.host_allocator``).

Why the launcher chooses it: on a CPU job FSDP2's buffers live in host memory, and every step allocates
and frees the same large blocks (unsharded parameters, gradients, gloo's temporaries). glibc serves
them one of two ways, each with a cost measured on the job of ``benchmarks/bench_vs_nemo.py``: from
its heap (its default), which fragments until the peak per rank is about NeMo AutoModel's; or, with
the fixed mmap threshold of ``CPURuntime.tune_glibc``, as fresh mappings whose pages fault
in and are zeroed on every step (about 150,000 page faults and 1.5x the step time). No ``mallopt``
setting or trimming point avoided both. mimalloc reuses freed blocks of the same size without
returning them to the OS, which keeps both the peak and the step time low; docs/benchmarks.md has
the figures of every setting from one run.

An allocator replaces ``malloc`` only when it is loaded before everything else, at process start, so
the launcher preloads it into the workers it starts (``LD_PRELOAD``), from the ``cmeel-mimalloc``
wheel (a dependency of automodel-all on Linux), with two of mimalloc's options:

- ``purge_delay`` 5 s (``MIMALLOC_PURGE_DELAY``): freed memory stays with the process for reuse for
  5 s before it is decommitted, so a job whose steps reuse it within that time takes no page faults.
  mimalloc's default, 1 s, took about 500 page faults per step on the 25M-parameter FSDP2 job of
  ``benchmarks/bench_fsdp2_manager.py`` and 1.10x the step of hand-written ``fully_shard`` on the
  same allocator (against 0.98 and 1.05 with purging off, -1, in two runs of that job on this 2-core
  host). Purging off has its own cost at real widths, where FSDP2's largest buffers are fresh mappings
  (next item) that memory held free cannot serve: the two add up. So purging stays on, and FSDP2's
  host buffer pool purges at once (``mi_collect``) before each such buffer
  (`automodel_cpu.malloc_settings.release_host_memory`). On the Llama-3.2-1B shape over
  4 ranks (`benchmarks/bench_scale.py`, SGD), purging before every buffer above 64 MiB took the peak
  per rank from 3295 MiB with purging off to 2925 MiB (2913 MiB with a 1 s delay) in one experiment;
- ``arena_max_object_size`` 64 MiB (``MIMALLOC_ARENA_MAX_OBJECT_SIZE``): a block above it is
  mapped for itself and unmapped when freed, as glibc does above its mmap threshold. Kept, such blocks
  cannot serve a request of another size, and at real widths the sizes differ (a 128k-vocabulary
  embedding is 0.5 GiB gathered in bf16 and 1 GiB reduced in fp32, its logits other sizes again):
  on the Llama-3.2-1B shape over 4 ranks (`benchmarks/bench_scale.py`) keeping them all ran the ranks
  out of memory, above 6 GiB each. Blocks that large take seconds of compute each step, against which
  mapping them afresh is noise; the same bound decides what FSDP2's host buffer pool keeps
  (`automodel_cpu.limits.POOL_MAX_BYTES`).

The cost: memory below that size that a rank freed is not returned to the OS before the rank exits
(as with a caching allocator).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import warnings
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "HOST_ALLOCATORS",
    "MIMALLOC_DISTRIBUTION",
    "mimalloc_library",
    "resolve_host_allocator",
    "worker_environment",
]

HOST_ALLOCATORS = ("auto", "glibc", "mimalloc")
"""Values of ``launch.host_allocator``."""
MIMALLOC_DISTRIBUTION = "cmeel-mimalloc"
"""The PyPI distribution that ships ``libmimalloc.so``."""
# See the module docstring. The object-size bound matches the host pool's
# (`automodel_cpu.limits.POOL_MAX_BYTES`); a bare number would mean bytes.
_MIMALLOC_OPTIONS = {"MIMALLOC_PURGE_DELAY": "5000", "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "64MiB"}


def mimalloc_library() -> Path | None:
    """The ``libmimalloc.so`` of the installed ``cmeel-mimalloc`` distribution, or None without one."""
    try:
        files = importlib.metadata.distribution(MIMALLOC_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmimalloc.so"):
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return path
    return None


def resolve_host_allocator(setting: str, device_type: str) -> str:
    """``glibc`` or ``mimalloc`` for ``launch.host_allocator=setting`` on ``device_type`` workers.

    Rule of ``auto``: mimalloc for CPU jobs on Linux (FSDP2's buffers are host memory there), glibc
    otherwise (on GPUs the host allocator only serves data loading and bookkeeping), and glibc with a
    warning when the ``cmeel-mimalloc`` wheel is missing.

    Raises:
        ValueError: An unknown setting, or ``mimalloc`` off Linux or without its wheel.
    """
    if setting not in HOST_ALLOCATORS:
        raise ValueError(f"launch.host_allocator must be one of {HOST_ALLOCATORS}, got {setting!r}")
    linux = platform.system() == "Linux"
    if setting == "glibc" or (setting == "auto" and (device_type != "cpu" or not linux)):
        return "glibc"
    if not linux:
        raise ValueError(
            f"launch.host_allocator='mimalloc' needs Linux (it is preloaded with LD_PRELOAD); this is "
            f"{platform.system()}: use 'auto' or 'glibc'"
        )
    if mimalloc_library() is None:
        if setting == "auto":
            warnings.warn(
                f"launch.host_allocator='auto' keeps glibc's malloc for this CPU job: the "
                f"{MIMALLOC_DISTRIBUTION} wheel is not installed (pip install {MIMALLOC_DISTRIBUTION})",
                stacklevel=2,
            )
            return "glibc"
        raise ValueError(
            f"launch.host_allocator='mimalloc' needs the {MIMALLOC_DISTRIBUTION} wheel "
            f"(pip install {MIMALLOC_DISTRIBUTION}), or set it to 'glibc'"
        )
    return "mimalloc"


def worker_environment(allocator: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables to add for workers that run on ``allocator`` (from `resolve_host_allocator`).

    ``mimalloc``: ``LD_PRELOAD`` with the library in front of what ``environ`` (default ``os.environ``)
    already preloads, and mimalloc's options; ``glibc``: nothing. Mutates nothing.
    """
    if allocator == "glibc":
        return {}
    assert allocator == "mimalloc", allocator
    library = mimalloc_library()
    if library is None:
        raise ValueError(
            f"the {MIMALLOC_DISTRIBUTION} wheel is not installed (pip install {MIMALLOC_DISTRIBUTION})"
        )
    environ = os.environ if environ is None else environ
    kept = [p for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if p != str(library)]
    return {"LD_PRELOAD": " ".join([str(library), *kept]), **_MIMALLOC_OPTIONS}
