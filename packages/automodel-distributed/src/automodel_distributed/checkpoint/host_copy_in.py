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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["chunk_cat_into", "register_host_copy_in"]

_library: torch.library.Library | None = None


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
    offset = 0
    for tensor in tensors:
        size = tensor.size(0)
        inner = math.prod(tensor.shape[1:])
        per_chunk = -(-size // num_chunks)
        flat = tensor.reshape(size, inner)
        for i in range(num_chunks):
            start, stop = min(size, i * per_chunk), min(size, (i + 1) * per_chunk)
            place = rows[i, offset : offset + per_chunk * inner]
            filled = (stop - start) * inner
            if filled:
                place[:filled].view(stop - start, inner).copy_(flat[start:stop])
            if filled < place.numel():
                place[filled:].zero_()
        offset += per_chunk * inner
    assert offset == rows.size(1), f"out has {rows.size(1)} elements per chunk, the tensors {offset}"


def register_host_copy_in() -> bool:
    """Make `chunk_cat_into` the CPU kernel of ``fsdp::chunk_cat_mixed_dtype``; False where torch has none.

    Idempotent and process-wide (every FSDP2 model in the process); no collectives. Torch before 2.15
    copies in with ``torch._chunk_cat`` directly and is left as it is.
    """
    global _library
    if _library is not None:
        return True
    if not hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype"):
        return False
    library = torch.library.Library("fsdp", "IMPL")
    library.impl("chunk_cat_mixed_dtype", chunk_cat_into, "CPU")
    _library = library
    return True
