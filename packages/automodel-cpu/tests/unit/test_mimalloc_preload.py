"""launch.host_allocator: the rule of ``auto``, the workers' environment, and a real preloaded child."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from automodel_cpu.mimalloc_preload import mimalloc_library, resolve_host_allocator, worker_environment

linux = pytest.mark.skipif(platform.system() != "Linux", reason="mimalloc is preloaded with LD_PRELOAD")

# What the child reports: which malloc serves it, and whether the glibc tuning applied.
_PROBE = (
    "import ctypes\n"
    "from automodel_cpu.malloc_settings import configure_host_allocator, malloc_is_glibc\n"
    "print(hasattr(ctypes.CDLL(None), 'mi_version'), malloc_is_glibc(), configure_host_allocator())\n"
)


def _run_child(script: str, extra: dict[str, str]) -> str:
    """``script``'s output in a fresh Python process with ``extra`` added to the environment."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | extra
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout.strip()


@linux
def test_auto_is_mimalloc_for_cpu_jobs_and_glibc_on_gpus() -> None:
    assert mimalloc_library() is not None, (
        "the cmeel-mimalloc wheel is a dependency of automodel-all on Linux"
    )
    assert resolve_host_allocator("auto", "cpu") == "mimalloc"
    assert resolve_host_allocator("auto", "cuda") == "glibc"
    assert resolve_host_allocator("glibc", "cpu") == "glibc"
    assert resolve_host_allocator("mimalloc", "cuda") == "mimalloc"
    with pytest.raises(ValueError, match=r"launch.host_allocator must be one of .*'jemalloc'"):
        resolve_host_allocator("jemalloc", "cpu")


@linux
def test_worker_environment_preloads_mimalloc_first() -> None:
    library = str(mimalloc_library())
    assert worker_environment("glibc", {"LD_PRELOAD": "/x/libfoo.so"}) == {}
    env = worker_environment("mimalloc", {"LD_PRELOAD": "/x/libfoo.so:/y/libbar.so"})
    assert env["LD_PRELOAD"] == f"{library} /x/libfoo.so /y/libbar.so"
    assert env["MIMALLOC_PURGE_DELAY"] == "5000"  # milliseconds
    assert env["MIMALLOC_ARENA_MAX_OBJECT_SIZE"] == "64MiB"  # a bare number would be bytes
    again = worker_environment("mimalloc", {"LD_PRELOAD": env["LD_PRELOAD"]})
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"], "the library was preloaded twice"


# What the child reports: resident MiB held after freeing a 16 MiB and a 256 MiB tensor.
_RETAINED = (
    "import torch\n"
    "def rss():\n"
    "    with open('/proc/self/status') as f:\n"
    "        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS:')) >> 10\n"
    "for mib in (16, 256):\n"
    "    before = rss(); t = torch.ones(mib << 18); del t\n"
    "    print(rss() - before)\n"
)


@linux
def test_the_workers_mimalloc_keeps_small_freed_blocks_and_returns_large_ones() -> None:
    """Blocks up to 64 MiB stay for reuse (for purge_delay); larger ones go back to the OS when freed."""
    small, large = (int(x) for x in _run_child(_RETAINED, worker_environment("mimalloc", {})).split())
    assert small >= 12, f"the freed 16 MiB block was returned ({small} MiB kept): nothing keeps small blocks"
    assert large < 32, f"the freed 256 MiB block stayed resident ({large} MiB kept)"


# What the child reports: resident MiB held after freeing 256 MiB of 4 MiB blocks, then after asking for
# a buffer above the pool's bound (which purges first), then after an explicit release_host_memory().
_PURGED = (
    "import torch\n"
    "from automodel_cpu.fsdp_buffer_pool import HostBufferPool\n"
    "from automodel_cpu.malloc_settings import release_host_memory\n"
    "def rss():\n"
    "    with open('/proc/self/status') as f:\n"
    "        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS:')) >> 10\n"
    "pool = HostBufferPool(max_bytes=1 << 20, release_above=64 << 20)\n"
    "large = lambda: pool.allocate((128 << 20,), dtype=torch.uint8, device='cpu')\n"
    "for release in (large, release_host_memory):\n"
    "    before = rss(); blocks = [torch.ones(1 << 20) for _ in range(64)]; del blocks\n"
    "    kept = rss() - before; result = release()\n"
    "    print(kept, rss() - before)\n"
)


@linux
def test_the_workers_mimalloc_purges_before_a_buffer_the_pool_does_not_keep() -> None:
    """Memory held free goes back to the OS before a fresh large buffer, not 5 s later."""
    out = _run_child(_PURGED, worker_environment("mimalloc", {}))
    hows = ("the pool's large buffer", "release_host_memory")
    for line, how in zip(out.splitlines(), hows, strict=True):
        kept, after = (int(x) for x in line.split())
        assert kept >= 192, f"mimalloc returned the freed blocks at once ({kept} MiB kept): nothing to purge"
        assert after < 32, f"{after} MiB of the freed 256 MiB stayed resident after {how}"


@linux
def test_a_preloaded_child_runs_on_mimalloc_and_skips_the_glibc_tuning() -> None:
    assert _run_child(_PROBE, worker_environment("mimalloc", {})) == "True False False"
    assert _run_child(_PROBE, {}) == "False True True"
