"""The CPU runtime's pieces in one process: the host buffer pool, the allocator helpers, the runtime."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from automodel_cpu import CPURuntime
from automodel_cpu.fsdp_buffer_pool import HANDBACK_WAIT_S, HostBufferPool
from automodel_cpu.limits import POOL_MAX_BYTES
from automodel_cpu.malloc_settings import configure_host_allocator, release_host_memory


def test_host_allocator_helpers() -> None:
    assert isinstance(configure_host_allocator(), bool)
    assert isinstance(release_host_memory(), bool)


def test_host_buffer_pool_reuses_only_buffers_nobody_uses() -> None:
    pool = HostBufferPool()
    cpu = torch.device("cpu")
    first = pool.allocate((6,), dtype=torch.float32, device=cpu)
    chunks = first.view(2, 3).unbind(0)  # FSDP's copy-out holds views like these while it reads them
    second = pool.allocate((6,), dtype=torch.float32, device=cpu)
    assert second.data_ptr() != first.data_ptr(), "a buffer still in use was handed out again"
    other = pool.allocate((6,), dtype=torch.float16, device=cpu)
    assert other.dtype == torch.float16 and pool.nbytes == 2 * 6 * 4 + 6 * 2
    address = first.data_ptr()
    del first, chunks
    again = pool.allocate((6,), dtype=torch.float32, device=cpu)
    assert again.data_ptr() == address and again.shape == (6,)
    assert pool.nbytes == 2 * 6 * 4 + 6 * 2, "a freed buffer was kept twice"
    assert (pool.requests, pool.reused) == (4, 1)


def test_host_buffer_pool_waits_for_a_buffer_another_thread_is_about_to_drop() -> None:
    """As gloo's worker thread drops a finished collective's tensors just after ``wait()`` returns."""
    cpu = torch.device("cpu")
    pool = HostBufferPool(handback_wait_s=10.0)  # a bound no test machine reaches
    held = [pool.allocate((6,), dtype=torch.float32, device=cpu)]
    address = held[0].data_ptr()
    dropper = threading.Timer(0.05, held.clear)
    dropper.start()
    again = pool.allocate((6,), dtype=torch.float32, device=cpu)
    dropper.join()
    assert again.data_ptr() == address and pool.nbytes == 6 * 4, "kept a second buffer instead of waiting"
    # Held past the wait: a new buffer, after about the wait.
    assert 0 < HANDBACK_WAIT_S <= 0.1
    pool = HostBufferPool(handback_wait_s=0.05)
    first = pool.allocate((6,), dtype=torch.float32, device=cpu)
    start = time.monotonic()
    second = pool.allocate((6,), dtype=torch.float32, device=cpu)
    assert time.monotonic() - start >= 0.05
    assert second.data_ptr() != first.data_ptr() and pool.nbytes == 2 * 6 * 4


def test_host_buffer_pool_keeps_nothing_above_its_bound() -> None:
    assert POOL_MAX_BYTES == 64 << 20  # the launcher's mimalloc bound (automodel_cpu.mimalloc_preload)
    pool = HostBufferPool(max_bytes=64)
    cpu = torch.device("cpu")
    kept = pool.allocate((16,), dtype=torch.float32, device=cpu)  # 64 bytes: at the bound, kept
    large = pool.allocate((17,), dtype=torch.float32, device=cpu)
    assert pool.nbytes == 64 and large.shape == (17,) and large.dtype == torch.float32
    address = kept.data_ptr()
    del kept, large
    assert pool.allocate((16,), dtype=torch.float32, device=cpu).data_ptr() == address
    assert pool.nbytes == 64, "a buffer above the bound was kept"
    assert (pool.requests, pool.reused) == (2, 1), "a request above the bound was counted"


def test_the_runtime_checks_its_fields_and_is_a_host_runtime() -> None:
    from automodel_distributed.host_runtime import HostRuntime

    runtime = CPURuntime()
    assert isinstance(runtime, HostRuntime)
    for field in ("pool_max_bytes", "release_above_bytes", "gloo_chunk_bytes"):
        with pytest.raises(ValueError, match=rf"CPURuntime\.{field} must be a positive int"):
            CPURuntime(**{field: 0})
    with pytest.raises(ValueError, match=r"CPURuntime\.tune_glibc must be a bool"):
        CPURuntime(tune_glibc="yes")  # type: ignore[arg-type]
