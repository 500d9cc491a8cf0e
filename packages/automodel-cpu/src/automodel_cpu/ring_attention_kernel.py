"""Ring attention on CPU for context parallelism: an explicit, opt-in test backend.

PyTorch ships ring attention only for the CUDA SDPA kernels (flash, memory-efficient, cuDNN); on CPU its
SDPA lowers to ``aten._scaled_dot_product_flash_attention_for_cpu``, for which torch raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered``. `cpu_ring_attention` registers that kernel with torch's ring-attention
template while its context is open, through private torch internals checked against torch 2.15
(`cpu_ring_attention_available`). It exists so context parallelism can be tested on CPU meshes (gloo),
not for speed, and it is never switched on behind the caller's back: it runs only inside
``context_parallel_region(..., host_runtime=CPURuntime())`` (`automodel_cpu.CPURuntime.ring_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["cpu_ring_attention", "cpu_ring_attention_available"]


def _cpu_ring_internals() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    from torch.distributed.tensor.experimental._context_parallel import _attention, _sharding_rules

    aten = torch.ops.aten
    return {
        "DTensor": DTensor,
        "RuntimeSchemaInfo": RuntimeSchemaInfo,
        "Placeholder": _ShardingPlaceholder,
        "strategy_context": _sharding_rules._single_dim_strategy_context,
        "seq_dim": _sharding_rules.SEQ_DIM,
        "ring_forward": _attention._templated_ring_attention,
        "ring_backward": _attention._templated_ring_attention_backward,
        "forward_op": aten._scaled_dot_product_flash_attention_for_cpu.default,
        "backward_op": aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }


def cpu_ring_attention_available() -> tuple[bool, str]:
    """Whether this torch has the internals CP on CPU relies on; ``(False, reason)`` otherwise."""
    try:
        internals = _cpu_ring_internals()
        internals["DTensor"]._op_dispatcher._custom_op_handlers  # noqa: B018 - probe the attribute
    except (ImportError, AttributeError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def _cpu_ring_handler(internals: dict[str, Any]) -> Any:
    dtensor = internals["DTensor"]
    seq_dim = internals["seq_dim"]
    forward_op, backward_op = internals["forward_op"], internals["backward_op"]

    def forward(
        mesh: DeviceMesh,
        query: Any,
        key: Any,
        value: Any,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        attn_mask: Any = None,
        scale: Any = None,
    ) -> Any:
        if attn_mask is not None:
            raise NotImplementedError("context parallelism supports causal SDPA without attn_mask")
        return internals["ring_forward"](
            mesh.get_group(),
            seq_dim,
            forward_op,
            query=query,
            key=key,
            value=value,
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=scale,
        )

    def backward(
        mesh: DeviceMesh,
        grad_out: Any,
        query: Any,
        key: Any,
        value: Any,
        out: Any,
        lse: Any,
        dropout_p: float,
        is_causal: bool,
        *,
        attn_mask: Any = None,
        scale: Any = None,
    ) -> Any:
        return internals["ring_backward"](
            mesh.get_group(),
            seq_dim,
            backward_op,
            grad_out=grad_out,
            grad_out_name="grad_out",
            query=query,
            key=key,
            value=value,
            out=out,
            logsumexp=lse,
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=scale,
        )

    def handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dispatcher = dtensor._op_dispatcher
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(op_info)
        sharding = op_info.output_sharding
        assert sharding is not None and not sharding.needs_redistribute, "CP inputs must be Shard(seq)"
        fn = forward if op_call is forward_op else backward
        local = fn(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
        return dispatcher.wrap(local, sharding.output_spec)

    return handler


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """Route the CPU flash-attention kernel through torch's ring attention while the context is open.

    Mutates, for the duration of the context only, the private DTensor op dispatcher's custom-op table
    and torch's single-dim sharding-strategy registry (both restored on exit).

    Raises:
        RuntimeError: This torch lacks the internals (see `cpu_ring_attention_available`).
    """
    available, reason = cpu_ring_attention_available()
    if not available:
        raise RuntimeError(
            f"context parallelism on CPU relies on torch internals this torch {torch.__version__} lacks "
            f"({reason}); run CP on CUDA devices"
        )
    internals = _cpu_ring_internals()
    placeholder = internals["Placeholder"]
    seq_dim = internals["seq_dim"]
    forward_op, backward_op = internals["forward_op"], internals["backward_op"]

    def forward_strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        return [[placeholder(seq_dim)] * 5]  # output, logsumexp, query, key, value

    def backward_strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        return [[placeholder(seq_dim)] * 9]  # grad q/k/v, grad_out, q, k, v, out, logsumexp

    dispatcher = internals["DTensor"]._op_dispatcher
    saved_handlers = dispatcher._custom_op_handlers
    handler = _cpu_ring_handler(internals)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            internals["strategy_context"](forward_op, forward_strategy, internals["RuntimeSchemaInfo"](3))
        )
        stack.enter_context(internals["strategy_context"](backward_op, backward_strategy, None))
        dispatcher._custom_op_handlers = {**saved_handlers, forward_op: handler, backward_op: handler}
        try:
            yield
        finally:
            dispatcher._custom_op_handlers = saved_handlers
