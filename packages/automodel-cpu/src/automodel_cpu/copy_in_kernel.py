"""FSDP2's reduce-scatter copy-in on the host without a temporary the size of the unit's gradients.

Before each reduce-scatter, FSDP2 copies a unit's unsharded gradients into one flat buffer, rank-major
(``torch.ops.fsdp.chunk_cat_mixed_dtype``, torch >= 2.15). Its kernel for host tensors calls
``aten::_chunk_cat.out``, which on CPU builds the result in the gradients' dtype and then copies it
into the buffer when the buffer's dtype differs: the default mixed precision (bf16 parameters,
``reduce_dtype=float32``) pays a temporary as large as the unit's bf16 gradients, measured at 130 MiB
for a 128 MiB gradient. For the tied 128k-vocabulary embedding of a Llama-3.2-1B shape that is 0.5
GiB on top of the fp32 buffer, at the moment of the step's peak (``benchmarks/bench_scale.py``).

`register_host_copy_in` gives the operator a CPU kernel, `chunk_cat_into`, that copies each chunk of
each gradient straight into its place in the buffer (casting as it copies; padding zeroed). The
values are the same bit for bit: a copy between floating-point dtypes rounds the same way whichever
kernel does it. Process-wide; nothing else changes.

**Deferred copy-in.** Even without the temporary, the buffer itself is a full-size copy of the unit's
gradients in the reduction dtype, held while the gradients still exist: for that tied embedding, 0.5
GiB of bf16 gradient and 1 GiB of fp32 buffer at once. A reduce-scatter that reads the buffer piece
by piece (`automodel_cpu.fsdp_buffer_pool.PooledReduceScatter` on gloo) does not need
it filled in advance: a buffer announced with `expect_copy_in` is left untouched by the kernel, which
records the gradients instead; the collective then takes them back (`take_copy_in`) and copies each
piece from them (`copy_in_rows`) into its staging buffer. The buffer's pages are never written, so
never resident. Only the caller that announced a buffer may do that: FSDP2 reads the buffer itself
when it divides before the collective (fp16 reduction) or copies instead of reducing (one rank).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

__all__ = ["chunk_cat_into", "copy_in_rows", "expect_copy_in", "register_host_copy_in", "take_copy_in"]

_library: torch.library.Library | None = None
# Buffers announced by `expect_copy_in`, by storage address: the buffer, then the copy-in it received.
_expected: dict[int, weakref.ref[torch.Tensor]] = {}
_received: dict[int, tuple[weakref.ref[torch.Tensor], list[torch.Tensor], int]] = {}


def copy_in_rows(
    tensors: Sequence[torch.Tensor], num_chunks: int, start: int, stop: int, out: torch.Tensor
) -> None:
    """Columns ``start:stop`` of ``torch._chunk_cat(tensors, 0, num_chunks)``'s rows, into ``out``.

    The rank-major layout of `chunk_cat_into` (row ``i``: the ``i``-th dim-0 chunk of every tensor,
    each padded with zeros to ``ceil(size / num_chunks)`` rows and flattened), restricted to a window
    of every row. Preconditions: ``out`` has shape ``(num_chunks, stop - start)``; the tensors are
    contiguous and at least 1-d. Mutates ``out`` only, casting to its dtype as it copies.
    """
    offset = 0
    for tensor in tensors:
        if offset >= stop:
            break
        size = tensor.size(0)
        inner = math.prod(tensor.shape[1:])
        per_chunk = -(-size // num_chunks)
        lo, hi = max(start, offset), min(stop, offset + per_chunk * inner)
        if lo < hi:
            flat = tensor.view(-1)
            for i in range(num_chunks):
                first = min(size, i * per_chunk) * inner
                filled = min(size, (i + 1) * per_chunk) * inner - first
                data_hi = min(hi, offset + filled)
                if lo < data_hi:
                    begin = first + lo - offset
                    out[i, lo - start : data_hi - start].copy_(flat[begin : begin + data_hi - lo])
                if max(lo, offset + filled) < hi:
                    out[i, max(lo, offset + filled) - start : hi - start].zero_()
        offset += per_chunk * inner


def chunk_cat_into(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int, out: torch.Tensor) -> None:
    """``out`` (``num_chunks`` rows) = row ``i``: the ``i``-th chunk along ``dim`` of every tensor, in order.

    The semantics of ``torch._chunk_cat`` (each tensor split into ``num_chunks`` chunks of
    ``ceil(size / num_chunks)`` along ``dim``, the short last chunks padded with zeros, each flattened),
    written into ``out`` in its dtype without an intermediate. Preconditions: ``out`` is contiguous and
    has exactly the padded size. Mutates ``out`` only. Tensors all of ``out``'s dtype (no temporary
    there), other dims, 0-d tensors or a non-contiguous ``out`` take ``aten::_chunk_cat.out``, as
    torch's own kernel does.
    """
    if (
        all(t.dtype == out.dtype for t in tensors)
        or dim != 0
        or not out.is_contiguous()
        or any(t.dim() == 0 for t in tensors)
    ):
        if len({t.dtype for t in tensors}) > 1:  # torch's kernel: inputs of mixed dtypes share out's first
            tensors = [t.to(out.dtype) for t in tensors]
        torch.ops.aten._chunk_cat.out(list(tensors), dim, num_chunks, out=out)
        return
    rows = out.view(num_chunks, -1)
    width = sum(-(-t.size(0) // num_chunks) * math.prod(t.shape[1:]) for t in tensors)
    assert width == rows.size(1), f"out has {rows.size(1)} elements per chunk, the tensors {width}"
    copy_in_rows([t.contiguous() for t in tensors], num_chunks, 0, width, rows)


def expect_copy_in(buffer: torch.Tensor) -> None:
    """Announce that whoever allocated ``buffer`` reads its copy-in back through `take_copy_in`.

    The next ``fsdp::chunk_cat_mixed_dtype`` into ``buffer`` (or a view of it) on the host then records
    its gradients instead of writing them (module docstring). Preconditions: the caller calls
    `take_copy_in` before anything else reads ``buffer``. Process-wide; no collectives.
    """
    for key, ref in list(_expected.items()):  # buffers that died without a copy-in
        if ref() is None:
            del _expected[key]
    _expected[buffer.untyped_storage().data_ptr()] = weakref.ref(buffer)


def take_copy_in(buffer: torch.Tensor) -> tuple[list[torch.Tensor], int] | None:
    """The gradients and chunk count recorded for ``buffer`` in place of its copy-in, or None.

    None where the copy-in was written (a buffer not announced, a copy the kernel could not defer, or
    torch before 2.15). Forgets the record (and the announcement).
    """
    key = buffer.untyped_storage().data_ptr()
    _expected.pop(key, None)
    record = _received.pop(key, None)
    if record is None or record[0]() is None:
        return None
    return record[1], record[2]


def _deferring_kernel(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int, out: torch.Tensor) -> None:
    key = out.untyped_storage().data_ptr()
    ref = _expected.pop(key, None)
    if (
        ref is None
        or (buffer := ref()) is None
        or dim != 0
        or out.storage_offset() != 0
        or out.numel() != buffer.numel()
        or any(t.dim() == 0 or not t.is_contiguous() for t in tensors)
    ):
        chunk_cat_into(tensors, dim, num_chunks, out)
        return
    _received[key] = (ref, list(tensors), num_chunks)


def register_host_copy_in() -> bool:
    """Make `chunk_cat_into` the CPU kernel of ``fsdp::chunk_cat_mixed_dtype``; False where torch has none.

    A buffer announced with `expect_copy_in` is not written (its copy-in is deferred, module docstring).

    Idempotent and process-wide (every FSDP2 model in the process); no collectives. Torch before 2.15
    copies in with ``torch._chunk_cat`` directly and is left as it is.
    """
    global _library
    if _library is not None:
        return True
    if not hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype"):
        return False
    library = torch.library.Library("fsdp", "IMPL")
    library.impl("chunk_cat_mixed_dtype", _deferring_kernel, "CPU")
    _library = library
    return True
