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

CPU: PyTorch ships ring attention only for the CUDA kernels; on a CPU mesh (gloo) the region needs
``cpu_ring_attention=True``, the explicit switch to automodel's test backend
(`automodel_distributed.cpu_ring_attention`, private torch internals); without it a CPU mesh is refused
with a `ValueError` before any collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
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
# The cp size of the context_parallel_region open in this thread / task (0: none), read by the hooks.
_ACTIVE_CP_SIZE: contextvars.ContextVar[int] = contextvars.ContextVar("automodel_active_cp_size", default=0)


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
    active_cp_size = _ACTIVE_CP_SIZE.get()
    if active_cp_size == 0:
        return args, kwargs
    # The attention module's own attribute wins (None on full-attention layers); else its config's.
    window: object = getattr(module, "sliding_window", None)
    if not hasattr(module, "sliding_window"):
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if (
        isinstance(window, int)
        and isinstance(hidden, torch.Tensor)
        and hidden.shape[1] * active_cp_size > window
    ):
        raise NotImplementedError(
            f"{type(module).__name__} uses sliding-window attention (window {window}) over a sequence of "
            f"{hidden.shape[1] * active_cp_size} tokens, which context parallelism does not support "
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


# ------------------------------------------------------------------------------------------ region


@contextlib.contextmanager
def context_parallel_region(
    mesh: DeviceMesh | MeshContext,
    batch: Mapping[str, Any],
    *,
    seq_dims: Mapping[str, int] | None = None,
    cpu_ring_attention: bool = False,
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
        cpu_ring_attention: On a CPU mesh, run ring attention through automodel's CPU test backend
            (`automodel_distributed.cpu_ring_attention`: private torch internals, patched only while the
            region is open). Ignored, with a warning, on CUDA.

    Raises:
        ValueError: Sharded tensors disagree on the sequence length, or it is not divisible by
            ``2 * cp_size``; the batch has ``labels`` or ``attention_mask`` not named in ``seq_dims``; a
            CPU mesh without ``cpu_ring_attention=True``.
        RuntimeError: With ``cpu_ring_attention``, the installed torch lacks the internals it needs.
    """
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
    on_cpu = cp_mesh.device_type == "cpu"
    if on_cpu and not cpu_ring_attention:
        raise ValueError(
            "context parallelism on a CPU mesh: torch has ring attention for CUDA SDPA kernels only; pass "
            "context_parallel_region(..., cpu_ring_attention=True) to use automodel's CPU test backend "
            "(private torch internals, for testing), or run on CUDA devices"
        )
    if cpu_ring_attention and not on_cpu:
        warnings.warn(
            "context_parallel_region(cpu_ring_attention=True) is ignored on a CUDA mesh", stacklevel=3
        )
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
        if on_cpu:
            from automodel_distributed.cpu_ring_attention import cpu_ring_attention as cpu_backend

            stack.enter_context(cpu_backend())
        local.update(zip(keys, buffers, strict=True))
        if _ACTIVE_CP_SIZE.get():
            raise RuntimeError("context_parallel_region cannot be nested")
        token = _ACTIVE_CP_SIZE.set(cp_mesh.size())
        try:
            yield local
        finally:
            _ACTIVE_CP_SIZE.reset(token)


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
