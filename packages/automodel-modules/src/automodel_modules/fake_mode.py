"""``FakeTensorMode`` as every fake-tensor forward here runs it, with the meta kernels an older torch lacks.

A fake forward dispatches every op to its meta kernel. torch 2.11's meta kernel of ``aten._grouped_mm``
(transformers' default MoE experts) accepts bf16 only, while its CPU kernel computes fp32 (torch 2.12+
accepts both in either): an fp32 MoE model runs, yet its fake forward raises, and every structural check
built on one (context parallelism, sequence parallelism, the pipeline split, the planner) would refuse
it. `fake_mode` adds a dispatch mode that runs such a call's shape logic on bf16 stand-ins and returns
the dtype the real kernel would; only on a torch whose meta kernel refuses fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["fake_mode"]


@functools.cache
def _grouped_mm_meta_refuses_fp32() -> bool:
    """Whether this torch's meta ``_grouped_mm`` refuses fp32 inputs its CPU kernel takes (torch 2.11)."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    meta = torch.device("meta")
    a = torch.empty(4, 8, device=meta)
    b = torch.empty(2, 8, 8, device=meta).transpose(-2, -1)
    offs = torch.empty(2, dtype=torch.int32, device=meta)
    try:
        grouped_mm(a, b, offs=offs)
    except RuntimeError:
        return True
    return False


class _GroupedMMInWideDtypes(TorchDispatchMode):
    """Give ``aten._grouped_mm`` on fp32/fp16 fake tensors the shape of the bf16 call, in their dtype."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        dtype = kwargs.get("out_dtype") or args[0].dtype
        narrow = [a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args)]
        return func(*narrow, **{k: v for k, v in kwargs.items() if k != "out_dtype"}).to(dtype)


@contextlib.contextmanager
def fake_mode(mode: Any = None, **kwargs: Any) -> Iterator[Any]:
    """``FakeTensorMode(**kwargs)``, entered, with the missing meta kernels of an older torch; yields it.

    ``mode``: a ``FakeTensorMode`` made by an earlier call, entered again (its fake tensors, say a fake
    model's parameters, belong to it and cannot meet another mode's); ``kwargs`` must then be empty.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert mode is None or not kwargs, "kwargs configure a new mode only"
    mode = mode if mode is not None else FakeTensorMode(**kwargs)
    with mode, _GroupedMMInWideDtypes() if _grouped_mm_meta_refuses_fp32() else contextlib.nullcontext():
        yield mode
