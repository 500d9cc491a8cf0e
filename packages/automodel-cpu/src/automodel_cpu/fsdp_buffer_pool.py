"""FSDP2's collective buffers on the host, kept from step to step and handed to gloo in pieces.

Every step FSDP2 asks for the same few host buffers (each unit's all-gather output, its reduce-scatter
input and output). `HostBufferPool` keeps them instead of allocating and freeing them each time (a
freed and re-requested large host block costs page faults and zeroing, or heap fragmentation); the
pooled comms (`PooledAllGather`, `PooledReduceScatter`, plugged in through FSDP2's own
``set_custom_all_gather`` / ``set_custom_reduce_scatter``) serve from it and run the collectives on
gloo in pieces of at most `GLOO_CHUNK_BYTES`, since gloo allocates a temporary of the whole size.
`free_all_gather_outputs_after_copy_out` drops an all-gather output once forward has copied it out.
Relies on FSDP2's private comm classes (``torch.distributed.fsdp._fully_shard._fsdp_api``); attached
only by `automodel_cpu.CPURuntime`.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from automodel_cpu.copy_in_kernel import chunk_cat_into, copy_in_rows, expect_copy_in, take_copy_in
from automodel_cpu.limits import GLOO_CHUNK_BYTES, POOL_MAX_BYTES, RELEASE_ABOVE_BYTES
from automodel_cpu.malloc_settings import release_host_memory

__all__ = [
    "HANDBACK_WAIT_S",
    "HostBufferPool",
    "PooledAllGather",
    "PooledReduceScatter",
    "free_all_gather_outputs_after_copy_out",
    "host_buffer_pools",
    "pool_fsdp_buffers",
]


HANDBACK_WAIT_S = 0.02
"""Longest wait of `HostBufferPool.allocate` for a busy kept buffer to come free (a finished
collective's tensors held by gloo's worker thread until it gets a core: a few time slices of a loaded
core). Only paid when the pool would otherwise keep one more buffer."""
_HANDBACK_POLL_S = 50e-6


class HostBufferPool:
    """Buffers of FSDP2's collectives kept from step to step instead of allocated and freed each time.

    Every step, FSDP2 asks for the same few buffer shapes (each unit's all-gather output, its
    reduce-scatter input and output). `allocate` hands out a view of a kept buffer of that shape that
    no tensor uses any more, or keeps a new one. A freed and re-requested host buffer costs a fresh
    mapping (page faults and zeroing) above glibc's mmap threshold, or heap fragmentation below it; a
    kept one costs neither. The pool holds at most as many buffers of a shape as were in use at once,
    and none above ``max_bytes`` (`POOL_MAX_BYTES`): those are allocated afresh each time, after the
    allocator has returned the memory it holds free when above ``release_above``
    (`RELEASE_ABOVE_BYTES`). Not thread-safe; one pool per model.

    ``requests`` and ``reused`` count the requests of a poolable size and those served by a kept
    buffer. A buffer is free only once nothing else holds its storage, and gloo's worker thread drops
    its hold on a finished collective's tensors just after ``wait()`` returns, when it next gets a
    core: on a loaded host that can be after the buffer is asked for again. So when every kept buffer
    of a shape is busy, `allocate` waits up to ``handback_wait_s`` for one to come free before keeping
    one more, which would stay for the rest of the run. In steady state no buffer is added, so the
    wait is paid once per kept buffer, on the first step. Measured on the 2-rank test of the planner's
    terms with a CPU burner on the 2 cores: one buffer more than the planner's count in 6 of 15 runs
    without the wait, in none of 14 with it.
    """

    def __init__(
        self,
        max_bytes: int = POOL_MAX_BYTES,
        release_above: int = RELEASE_ABOVE_BYTES,
        handback_wait_s: float = HANDBACK_WAIT_S,
    ) -> None:
        self.max_bytes = max_bytes
        self.release_above = release_above
        self.handback_wait_s = handback_wait_s
        self.requests = 0
        self.reused = 0
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[torch.Tensor]] = {}

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor of ``size`` and ``dtype`` on ``device`` (uninitialised, as ``torch.empty``)."""
        key = (tuple(int(s) for s in size), dtype, torch.device(device))
        nbytes = math.prod(key[0]) * dtype.itemsize
        if nbytes > self.max_bytes:
            if nbytes > self.release_above:
                release_host_memory()
            return torch.empty(key[0], dtype=dtype, device=device)
        kept = self._buffers.setdefault(key, [])
        self.requests += 1
        deadline = None
        while True:
            # Users of the storage: the kept tensor and the temporary storage object of this check.
            # Anything more is a view still in use (FSDP's copies out of it, a gradient, a pending op).
            for buffer in kept:
                if torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2:
                    self.reused += 1
                    return buffer.view(key[0])
            if not kept:
                break
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.handback_wait_s
            elif now >= deadline:
                break
            time.sleep(_HANDBACK_POLL_S)  # off the core, so that gloo's worker can run on it
        buffer = torch.empty(key[0], dtype=dtype, device=device)
        kept.append(buffer)
        return buffer.view(key[0])

    @property
    def nbytes(self) -> int:
        """Bytes kept by the pool."""
        return sum(b.untyped_storage().nbytes() for kept in self._buffers.values() for b in kept)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> Any:
    # torch's own DefaultAllGather calls all_gather_single (torch >= 2.15), so whatever observes FSDP2's
    # calls sees ours; older torch (the packages support 2.9 on) has the same collective under its
    # older name. Looked up at call time, so a patched function is seen.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: dist.ProcessGroup, async_op: bool
) -> Any:
    reduce = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce(output, input, op=op, group=group, async_op=async_op)


class _FromPool:
    """The ``allocate`` half of FSDP2's ``Comm`` interface, served by a `HostBufferPool`."""

    def __init__(self, pool: HostBufferPool, chunk_bytes: int = GLOO_CHUNK_BYTES) -> None:
        self.pool = pool
        self.chunk_bytes = chunk_bytes

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A pooled buffer (see `HostBufferPool.allocate`)."""
        return self.pool.allocate(size, dtype=dtype, device=device)

    def _piece(self, full: torch.Tensor, group: dist.ProcessGroup) -> int | None:
        """Elements per rank of each piece when ``full`` (the rank-major buffer) is split; None: whole."""
        if full.nbytes <= self.chunk_bytes or dist.get_backend(group) != "gloo":
            return None
        return max(1, self.chunk_bytes // (group.size() * full.element_size()))


class PooledAllGather(_FromPool, AllGather):
    """FSDP2's all-gather (``all_gather_single``, as torch's default) with its output buffer pooled.

    On gloo, an output above ``chunk_bytes`` is gathered piece by piece through a pooled staging
    buffer (`GLOO_CHUNK_BYTES`), synchronously: the same result without gloo's whole-size temporary.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather ``input_tensor`` of every rank of ``group`` into ``output_tensor``."""
        piece = self._piece(output_tensor, group)
        if piece is None:
            return _all_gather(output_tensor, input_tensor, group, async_op)
        world, numel = group.size(), input_tensor.numel()
        rows = output_tensor.view(world, numel)
        staging = self.pool.allocate((world * piece,), dtype=output_tensor.dtype, device=output_tensor.device)
        for start in range(0, numel, piece):
            length = min(piece, numel - start)
            gathered = staging[: world * length]
            _all_gather(gathered, input_tensor[start : start + length], group, False)
            rows[:, start : start + length].copy_(gathered.view(world, length))
        return None  # done: FSDP2 waits only on a returned Work


class PooledReduceScatter(_FromPool, ReduceScatter):
    """FSDP2's reduce-scatter (``reduce_scatter_single``, as torch's default) with its buffers pooled.

    On gloo, an input above ``chunk_bytes`` is reduced piece by piece through a pooled staging buffer
    (`GLOO_CHUNK_BYTES`): the same sums without gloo's whole-size temporary.

    With ``defer_copy_in`` (units sharded over more than one rank), an input this comm allocates above
    the pool's ``max_bytes`` (not kept from step to step) is never filled: FSDP2's copy-in into it is
    deferred (`automodel_cpu.copy_in_kernel.expect_copy_in`) and each piece is copied
    from the gradients straight into the staging buffer, so the full-size input (1 GiB in fp32 for a
    128k x 2048 embedding) is never resident next to the gradients it copies. The same values go
    through the same pieces. Units on one rank get a comm without it: FSDP2 copies their input
    itself instead of calling the collective, and would read it unfilled.

    An input this comm allocated above the pool's ``max_bytes`` has its storage freed as soon as a
    synchronous reduction returns. FSDP2 keeps every unit's input alive
    until the next unit's post-backward (``reduce_scatter_states``), which on a GPU stops the caching
    allocator from handing the memory to the compute stream while the collective still reads it; on
    the host the collective has finished when the call returns, so that hold only kept a dead buffer
    resident through the next unit's backward: a block's fp32 input (245 MiB per rank on the
    Llama-3.2-1B shape over 4 ranks) on top of that backward's own.
    """

    def __init__(
        self, pool: HostBufferPool, chunk_bytes: int = GLOO_CHUNK_BYTES, *, defer_copy_in: bool = False
    ) -> None:
        super().__init__(pool, chunk_bytes)
        self.defer_copy_in = defer_copy_in
        # id -> weak reference of the unpooled inputs handed out and not yet reduced.
        self._unpooled: dict[int, weakref.ref[torch.Tensor]] = {}

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A pooled buffer (see `HostBufferPool.allocate`); one above the pool's bound is remembered."""
        buffer = self.pool.allocate(size, dtype=dtype, device=device)
        if buffer.nbytes > self.pool.max_bytes:
            # Forget inputs that died unreduced (a world of one copies instead), so an id is never stale.
            self._unpooled = {k: ref for k, ref in self._unpooled.items() if ref() is not None}
            self._unpooled[id(buffer)] = weakref.ref(buffer)
            # fp16 is divided in place before the collective (FSDP2's overflow guard): no deferral.
            if self.defer_copy_in and dtype in (torch.float32, torch.bfloat16):
                expect_copy_in(buffer)
        return buffer

    def _release(self, input_tensor: torch.Tensor) -> None:
        """Free ``input_tensor``'s storage when this comm allocated it unpooled (nothing reads it again)."""
        ref = self._unpooled.pop(id(input_tensor), None)
        if ref is not None and ref() is input_tensor:
            input_tensor.untyped_storage().resize_(0)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` over ``group`` with ``op``; this rank's chunk goes to ``output_tensor``."""
        piece = self._piece(input_tensor, group)
        world, numel = group.size(), output_tensor.numel()
        deferred = take_copy_in(input_tensor)
        if deferred is not None and (piece is None or async_op):
            chunk_cat_into(deferred[0], 0, deferred[1], input_tensor)  # the copy-in after all
            deferred = None
        if piece is None or async_op:
            work = _reduce_scatter(output_tensor, input_tensor, op, group, async_op)
            if not async_op:
                self._release(input_tensor)
            return work
        rows = input_tensor.view(world, numel)
        staging = self.pool.allocate((world * piece,), dtype=input_tensor.dtype, device=input_tensor.device)
        for start in range(0, numel, piece):
            length = min(piece, numel - start)
            block = staging[: world * length]
            if deferred is not None:
                assert deferred[1] == world, "FSDP2 copies in one chunk per rank of the group"
                copy_in_rows(deferred[0], world, start, start + length, block.view(world, length))
            else:
                block.view(world, length).copy_(rows[:, start : start + length])
            _reduce_scatter(output_tensor[start : start + length], block, op, group, False)
        self._release(input_tensor)
        return None


def pool_fsdp_buffers(
    model: torch.nn.Module,
    *,
    max_bytes: int = POOL_MAX_BYTES,
    release_above: int = RELEASE_ABOVE_BYTES,
    chunk_bytes: int = GLOO_CHUNK_BYTES,
) -> HostBufferPool:
    """Make every FSDP2 unit of ``model`` take its collective buffers from one new `HostBufferPool`.

    Preconditions: ``fully_shard`` has been applied (units are `FSDPModule`). Mutates each unit's
    all-gather and reduce-scatter (``set_custom_all_gather`` / ``set_custom_reduce_scatter``); the
    collectives themselves are unchanged. A unit torch refuses that for (several parameter groups from
    per-parameter meshes) keeps its own buffers. No collectives run.

    Args:
        model: The sharded model.
        max_bytes: Largest buffer kept (`POOL_MAX_BYTES`).
        release_above: Free memory goes back to the OS before a buffer above this (`RELEASE_ABOVE_BYTES`).
        chunk_bytes: Largest piece of a gloo collective (`GLOO_CHUNK_BYTES`).
    """
    pool = HostBufferPool(max_bytes=max_bytes, release_above=release_above)
    all_gather = PooledAllGather(pool, chunk_bytes)
    # A unit on one rank has no collective: FSDP2 copies its input itself, so the copy-in must be there.
    reduce_scatters = {
        True: PooledReduceScatter(pool, chunk_bytes, defer_copy_in=True),
        False: PooledReduceScatter(pool, chunk_bytes),
    }
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            sharded = group is not None and getattr(group.mesh_info, "shard_mesh_size", 1) > 1
            try:
                module.set_custom_all_gather(all_gather)
                module.set_custom_reduce_scatter(reduce_scatters[sharded])
            except ValueError:  # a unit with several parameter groups (per-parameter meshes) keeps torch's
                continue
    return pool


def free_all_gather_outputs_after_copy_out(model: torch.nn.Module) -> None:
    """Free each FSDP2 unit's all-gather output once forward has copied it into the unsharded parameters.

    In forward, FSDP2 keeps a unit's all-gather output (``all_gather_state``) until the next unit's
    all-gather, so that on a GPU the copy-out can overlap that collective without the caching allocator
    reusing the memory early; the root's post-forward drops the last one. On the host the copy-out has
    finished when the unit's pre-forward returns, so the hold only keeps a second copy of the unit's
    parameters resident through its forward: for the last unit, the LM head, through the logits and
    the loss too (0.6 GiB per rank for a 152k x 2048 head in bf16). This adds a forward pre-hook to
    every unit, run after FSDP2's own (which unshards), that releases it through FSDP2's
    ``release_all_gather_state_on_current_stream`` (torch 2.15; before it, by dropping the state). A
    pooled output goes back to its pool.

    Preconditions: ``fully_shard`` has been applied and the units' parameters live on the host.
    Mutates: registers a forward pre-hook on each `FSDPModule`; no collectives.
    """

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # bookkeeping, not a compiled graph
    def release(module: torch.nn.Module, args: Any) -> None:
        assert isinstance(module, FSDPModule)
        comm_ctx = module._get_fsdp_state()._comm_ctx
        release_now = getattr(comm_ctx, "release_all_gather_state_on_current_stream", None)
        if release_now is not None:
            release_now()
        else:  # torch before 2.15 has no method for it; on the host there is no stream to order
            comm_ctx.all_gather_state = None

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Not prepended: FSDP2 prepends its pre-forward, so this runs after the unit's unshard.
            module.register_forward_pre_hook(release)


def host_buffer_pools(model: torch.nn.Module) -> list[HostBufferPool]:
    """The `HostBufferPool` objects the FSDP2 units of ``model`` take their buffers from (none: unpooled).

    Reads each unit's all-gather (FSDP2's parameter-group state, where ``set_custom_all_gather`` put
    it); mutates nothing. Used to check the planner's collective-buffer term against the real pool.
    """
    pools: dict[int, HostBufferPool] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            comm = getattr(group, "_all_gather_comm", None)
            if isinstance(comm, PooledAllGather):
                pools[id(comm.pool)] = comm.pool
    return list(pools.values())
