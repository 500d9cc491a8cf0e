"""Context parallelism (CP): shard the sequence over the ``cp`` mesh axis and run ring attention in SDPA.

Built on PyTorch's experimental ``torch.distributed.tensor.experimental.context_parallel``: inside
`context_parallel_region` every ``scaled_dot_product_attention`` call becomes ring attention over the
``cp`` ranks (forward *and* backward must run inside the region), and the sequence tensors of the batch
are sharded with torch's head-tail load balancing (rank ``r`` of ``n`` holds sequence chunks ``r`` and
``2n-1-r`` of ``2n``, so causal attention costs the same on every rank).

A training step, on every rank of the ``cp`` axis::

    apply_context_parallel(model)                          # once: causal SDPA without masks under CP
    batch = context_parallel_inputs(global_batch)          # adds position_ids, pre-shifts the labels
    n = int((batch["shift_labels"] != -100).sum())         # label tokens of the whole sequence
    with context_parallel_region(cp_mesh, batch) as local:  # local: this rank's shard of every tensor
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                    labels=local["shift_labels"], shift_labels=local["shift_labels"],
                    num_items_in_batch=n / cp_size)
        out.loss.backward()

transformers' loss is then ``sum of this shard's token losses / num_items_in_batch``. The gradient of
the mean loss over the whole sequence is the *sum* over the cp ranks of the gradients of
``shard sum / n``; FSDP2 sharding over ``dp_shard_cp`` *averages* gradients over those ranks, hence
``n / cp_size`` above (use ``n`` when you sum the gradients yourself). The step's loss is the average of
``out.loss`` over the cp ranks (times ``cp_size`` with ``n``: their sum).

Labels are shifted *before* sharding (``shift_labels``), because shifting a shard would pair tokens with
labels of the neighbouring chunk. Requirements: SDPA attention (``attn_implementation="sdpa"``), causal
attention with no padding or packing mask, and a sequence length divisible by ``2 * cp_size``. Packed
rows (position ids restarting per document) are refused: ring attention cannot keep documents apart.
Right padding is exact (causal attention never lets a token see the padding after it), so one sequence
per row, padded at the end, is the way to train on short records under CP.

CPU: PyTorch ships ring attention only for the CUDA kernels (flash, memory-efficient, cuDNN); on CPU its
SDPA lowers to ``aten._scaled_dot_product_flash_attention_for_cpu``, for which torch raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered``. For CPU meshes (gloo) this module registers that kernel with torch's
ring-attention template for the duration of the region, through private torch internals checked against
torch 2.15 (`cpu_ring_attention_available`); it exists so CP is testable on CPU, not for speed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel_distributed.layers import find_transformer_blocks
from automodel_mesh import MeshAxisName, MeshContext

__all__ = [
    "ATTENTION_MODULE_NAMES",
    "CP_SEQUENCE_KEYS",
    "apply_context_parallel",
    "context_parallel_inputs",
    "context_parallel_region",
    "context_parallel_unshard",
    "cpu_ring_attention_available",
    "load_balance_indices",
]

logger = logging.getLogger(__name__)

ATTENTION_MODULE_NAMES: tuple[str, ...] = ("self_attn", "attention", "attn", "self_attention")
"""Attribute names of the attention sub-module inside a transformer block."""

CP_SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "position_ids", "shift_labels", "inputs_embeds")
"""Batch keys `context_parallel_region` shards (along dim 1 unless told otherwise); other keys pass as is.
``labels`` is refused unless named in ``seq_dims``: a model that shifts labels itself would shift each
shard (see `context_parallel_inputs`)."""

_HOOKED_ATTR = "_automodel_cp_hooked"
_active_cp_size = 0  # the cp size of the open context_parallel_region, 0 when none is open


# ----------------------------------------------------------------------------------------- helpers


def _cp_mesh(mesh: DeviceMesh | MeshContext) -> DeviceMesh:
    if isinstance(mesh, MeshContext):
        return mesh.submesh(MeshAxisName.CP)
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh
    if MeshAxisName.CP.value not in names:
        raise ValueError(f"the device mesh has axes {names} and no 'cp' axis to shard the sequence over")
    return mesh[MeshAxisName.CP.value]


def load_balance_indices(seq_len: int, cp_size: int) -> torch.Tensor:
    """The head-tail order of a sequence under CP: position ``i`` of the reordered sequence is ``out[i]``.

    The sequence is cut into ``2 * cp_size`` chunks; rank ``r`` holds chunks ``r`` and
    ``2 * cp_size - 1 - r``, one after the other. This is the layout of torch's default CP load balancer.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp_size``.
    """
    if cp_size < 1 or seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"context parallelism needs a sequence length divisible by 2 * cp_size = {2 * cp_size}, got "
            f"{seq_len}; pad the batch to a multiple of {2 * cp_size}"
        )
    chunks = torch.arange(seq_len).chunk(2 * cp_size)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp_size - 1 - r]]) for r in range(cp_size)])


def context_parallel_inputs(batch: Mapping[str, Any], *, ignore_index: int = -100) -> dict[str, Any]:
    """Prepare a global (unsharded) causal-LM batch for `context_parallel_region`.

    Adds ``position_ids`` (``arange`` per row) when missing, replaces ``labels`` by ``shift_labels``
    (``labels[:, 1:]`` followed by ``ignore_index``: the target of each position, so the loss needs no
    shift after sharding) and drops an ``attention_mask`` that masks nothing.

    Args:
        batch: ``input_ids`` (or ``inputs_embeds``) ``[batch, seq, ...]``, optional ``labels``,
            ``position_ids`` and ``attention_mask``; other entries are kept.
        ignore_index: Label value the loss ignores.

    Returns:
        A new dict (the input tensors are not modified).

    Raises:
        ValueError: The ``attention_mask`` masks some positions (padding or packing is not supported
            under CP), the ``position_ids`` restart inside a row (packed sequences), or there is neither
            ``input_ids`` nor ``inputs_embeds``.
    """
    out = dict(batch)
    ids = out.get("input_ids", out.get("inputs_embeds"))
    if not isinstance(ids, torch.Tensor):
        raise ValueError("context_parallel_inputs needs 'input_ids' or 'inputs_embeds' in the batch")
    batch_size, seq_len = ids.shape[0], ids.shape[1]
    mask = out.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ValueError(
            "context parallelism supports causal attention without padding: the attention_mask masks "
            f"{int((~mask.bool()).sum())} position(s); pack sequences without padding or drop the mask"
        )
    positions = out.get("position_ids")
    if positions is None:
        out["position_ids"] = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand(batch_size, -1)
    elif isinstance(positions, torch.Tensor) and positions.shape[-1] > 1:
        # Ring attention is causal over the whole row; restarting positions mean packed documents, whose
        # block-diagonal mask it cannot apply (they would silently attend to each other).
        restarts = int((positions[..., 1:] - positions[..., :-1] != 1).sum())
        if restarts:
            raise ValueError(
                f"context parallelism runs causal ring attention over whole rows, but the position_ids "
                f"restart {restarts} time(s) inside rows (packed sequences, each needing its own attention "
                "block); give one sequence per row, padded at the end (causal attention keeps the padding "
                "out of the sequence's tokens)"
            )
    labels = out.pop("labels", None)
    if isinstance(labels, torch.Tensor):
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        out["shift_labels"] = shifted
    return out


def _strip_attention_mask(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # transformers builds its mask from the *local* positions, which are not contiguous under load
    # balancing; ring attention applies causality itself.
    if _active_cp_size == 0:
        return args, kwargs
    # The attention module's own attribute wins (None on full-attention layers); else its config's.
    window: object = getattr(module, "sliding_window", None)
    if not hasattr(module, "sliding_window"):
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if (
        isinstance(window, int)
        and isinstance(hidden, torch.Tensor)
        and hidden.shape[1] * _active_cp_size > window
    ):
        raise NotImplementedError(
            f"{type(module).__name__} uses sliding-window attention (window {window}) over a sequence of "
            f"{hidden.shape[1] * _active_cp_size} tokens, which context parallelism does not support "
            "(ring attention is plainly causal); use sequences no longer than the window or cp_size=1"
        )
    kwargs["attention_mask"] = None
    return args, kwargs


def apply_context_parallel(model: nn.Module) -> nn.Module:
    """Make ``model``'s attention run as plain causal SDPA inside `context_parallel_region`.

    Registers a forward pre-hook on the attention sub-module of every transformer block (found by the
    names in `ATTENTION_MODULE_NAMES`) that drops the ``attention_mask`` keyword while a CP region is open
    (SDPA then runs with ``is_causal=True``), and that raises ``NotImplementedError`` for sliding-window
    attention over a sequence longer than the window. Outside a region the hooks do nothing. Idempotent.

    Preconditions: a transformers model with ``attn_implementation="sdpa"`` and causal attention.

    Returns:
        ``model`` (hooks added).

    Raises:
        ValueError: The model does not use SDPA attention, or no attention sub-module was found.
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is not None and impl != "sdpa":
        raise ValueError(
            f"context parallelism runs ring attention inside scaled_dot_product_attention, but "
            f"{type(model).__name__} uses attn_implementation={impl!r}; load it with "
            "attn_implementation='sdpa'"
        )
    hooked = 0
    for fqn, block in find_transformer_blocks(model):
        attention = next(
            (
                getattr(block, name)
                for name in ATTENTION_MODULE_NAMES
                if isinstance(getattr(block, name, None), nn.Module)
            ),
            None,
        )
        if attention is None:
            inner = getattr(block, "_checkpoint_wrapped_module", None)
            if isinstance(inner, nn.Module):
                attention = next(
                    (
                        getattr(inner, n)
                        for n in ATTENTION_MODULE_NAMES
                        if isinstance(getattr(inner, n, None), nn.Module)
                    ),
                    None,
                )
        if attention is None:
            raise ValueError(
                f"block {fqn} of {type(model).__name__} has no attention sub-module named one of "
                f"{list(ATTENTION_MODULE_NAMES)}; add its name to ATTENTION_MODULE_NAMES"
            )
        if not getattr(attention, _HOOKED_ATTR, False):
            attention.register_forward_pre_hook(_strip_attention_mask, with_kwargs=True)
            setattr(attention, _HOOKED_ATTR, True)
            hooked += 1
    logger.info("context parallelism: hooked %d attention module(s) of %s", hooked, type(model).__name__)
    return model


# ----------------------------------------------------------------------------- ring attention on CPU
# Private torch internals, isolated here: the ring-attention templates, the DTensor custom-op table and
# the single-dim sharding-strategy registry of torch.distributed.tensor (checked against torch 2.15).


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
def _cpu_ring_attention() -> Iterator[None]:
    """Route the CPU flash-attention kernel through torch's ring attention while the context is open."""
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


# ------------------------------------------------------------------------------------------ region


@contextlib.contextmanager
def context_parallel_region(
    mesh: DeviceMesh | MeshContext,
    batch: Mapping[str, Any],
    *,
    seq_dims: Mapping[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Shard ``batch`` over the ``cp`` axis and run SDPA as ring attention until the context closes.

    Yields this rank's shard of the batch: copies of the tensors under `CP_SEQUENCE_KEYS` (and of any key
    in ``seq_dims``), reordered with `load_balance_indices` and cut along their sequence dim; other values
    unchanged. ``batch`` itself is not modified. Run the forward **and** the backward inside the context.
    With ``cp_size == 1`` the batch is yielded as is and nothing is patched.

    Preconditions: `apply_context_parallel` was applied to the model; the batch went through
    `context_parallel_inputs`; every rank of the ``cp`` axis enters with the same global batch.
    Collectives: ring attention exchanges key/value blocks over the ``cp`` group in forward and backward.

    Args:
        mesh: The ``cp`` mesh (1-D), a mesh with a ``cp`` axis, or a `MeshContext`.
        batch: The global batch.
        seq_dims: Sequence dim per key, overriding the default 1.

    Raises:
        ValueError: Sharded tensors disagree on the sequence length, or it is not divisible by
            ``2 * cp_size``; the batch has ``labels`` or ``attention_mask`` not named in ``seq_dims``.
        RuntimeError: On CPU, the installed torch lacks the internals CPU ring attention needs.
    """
    global _active_cp_size
    cp_mesh = _cp_mesh(mesh)
    dims = dict(seq_dims or {})
    for key, why in (("labels", "shift them before sharding"), ("attention_mask", "CP attention is causal")):
        if key in batch and key not in dims:
            raise ValueError(
                f"context_parallel_region got {key!r} ({why}); pass the batch through "
                "context_parallel_inputs first (or name the key in seq_dims to shard it as is)"
            )
    if cp_mesh.size() == 1:
        yield dict(batch)
        return
    keys = [
        k for k, v in batch.items() if isinstance(v, torch.Tensor) and (k in CP_SEQUENCE_KEYS or k in dims)
    ]
    if not keys:
        raise ValueError(f"context_parallel_region found none of {list(CP_SEQUENCE_KEYS)} in the batch")
    lengths = {k: batch[k].shape[dims.get(k, 1)] for k in keys}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"context_parallel_region: the sequence tensors disagree on their length: {lengths}")
    load_balance_indices(next(iter(lengths.values())), cp_mesh.size())  # validates divisibility
    local = dict(batch)
    buffers = [batch[k].clone() for k in keys]
    from torch.distributed.tensor.experimental import context_parallel

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            context_parallel(
                cp_mesh,
                buffers=buffers,
                buffer_seq_dims=[dims.get(k, 1) for k in keys],
                no_restore_buffers=set(buffers),
            )
        )
        if cp_mesh.device_type == "cpu":
            stack.enter_context(_cpu_ring_attention())
        local.update(zip(keys, buffers, strict=True))
        if _active_cp_size:
            raise RuntimeError("context_parallel_region cannot be nested")
        _active_cp_size = cp_mesh.size()
        try:
            yield local
        finally:
            _active_cp_size = 0


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh | MeshContext, tensors: Sequence[torch.Tensor], seq_dims: Sequence[int]
) -> list[torch.Tensor]:
    """Gather sequence shards from the ``cp`` ranks and undo the load-balancing order.

    The inverse of the sharding `context_parallel_region` does; use it on outputs such as logits (it does
    not carry gradients). Collective: one all-gather per tensor over the ``cp`` group.

    Args:
        mesh: The ``cp`` mesh, a mesh with a ``cp`` axis, or a `MeshContext`.
        tensors: This rank's shards (same shape on every rank).
        seq_dims: The sequence dim of each tensor.

    Returns:
        The full tensors, in the original sequence order, on every rank.
    """
    if len(tensors) != len(seq_dims):
        raise ValueError(f"context_parallel_unshard: {len(tensors)} tensors but {len(seq_dims)} seq_dims")
    cp_mesh = _cp_mesh(mesh)
    size = cp_mesh.size()
    if size == 1:
        return [t.detach().clone() for t in tensors]
    out: list[torch.Tensor] = []
    for tensor, dim in zip(tensors, seq_dims, strict=True):
        moved = tensor.detach().movedim(dim, 0).contiguous()
        gathered = moved.new_empty((moved.shape[0] * size, *moved.shape[1:]))
        dist.all_gather_into_tensor(gathered, moved, group=cp_mesh.get_group())
        order = load_balance_indices(gathered.shape[0], size).to(gathered.device)
        restored = torch.empty_like(gathered)
        restored[order] = gathered
        out.append(restored.movedim(0, dim))
    return out
