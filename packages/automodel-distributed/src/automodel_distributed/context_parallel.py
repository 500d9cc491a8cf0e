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
attention with no padding mask, and a sequence length divisible by ``2 * cp_size``. Right padding is
exact (causal attention never lets a token see the padding after it).

Packed rows (``position_ids`` restarting per document) are exact too, on another path: ring attention
takes no mask, so when the batch's positions restart inside a row the region shards the batch itself (the
same load-balanced layout) and opens a document region instead
(`automodel_distributed.cp_document_attention`): the model's attention, switched by
`apply_context_parallel` to the registered ``automodel_cp_sdpa`` implementation, all-gathers keys and
values over ``cp`` and runs SDPA with a per-document causal mask. That path holds all keys per rank and
an O(T^2 / cp) mask: it is exact, not fast. Unpacked batches keep ring attention.

CPU: PyTorch ships ring attention only for the CUDA kernels; on a CPU mesh (gloo) the region needs a
host runtime (``host_runtime=automodel_cpu.CPURuntime()``, whose ``ring_attention`` registers the CPU
kernel through private torch internals while the region is open); without one a CPU mesh is refused
with a `ValueError` before any collective. Packed batches do not use ring attention and need none.
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

from automodel_distributed.blocks import find_transformer_blocks
from automodel_distributed.cp_document_attention import (
    CP_DOCUMENT_ATTENTION,
    attention_window,
    document_ids,
    document_region,
    document_region_active,
    note_attention_module,
    register_cp_document_attention,
)
from automodel_distributed.host_runtime import HostRuntime
from automodel_mesh import MeshAxisName, MeshContext
from automodel_modules import embedding_module, find_hf_model, unwrap

__all__ = [
    "ATTENTION_MODULE_NAMES",
    "CP_SEQUENCE_KEYS",
    "SEQUENCE_MIXING_OPS",
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
_WINDOW_ATTR = "_automodel_cp_window"  # on the model: the smallest sliding window of its attention
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


def load_balance_indices(seq_len: int, cp_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The head-tail order of a sequence under CP: position ``i`` of the reordered sequence is ``out[i]``.

    The sequence is cut into ``2 * cp_size`` chunks; rank ``r`` holds chunks ``r`` and
    ``2 * cp_size - 1 - r``, one after the other. This is the layout of torch's default CP load balancer.
    The indices are made on ``device`` (the host unless told).

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp_size``.
    """
    if cp_size < 1 or seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"context parallelism needs a sequence length divisible by 2 * cp_size = {2 * cp_size}, got "
            f"{seq_len}; pad the batch to a multiple of {2 * cp_size}"
        )
    chunks = torch.arange(seq_len, device=device).chunk(2 * cp_size)
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

    ``position_ids`` restarting inside a row (packed documents) are kept: `context_parallel_region` then
    masks attention per document.

    Raises:
        ValueError: The ``attention_mask`` masks some positions (a padding mask is not supported under CP:
            pad at the end without a mask, or pack), or there is neither ``input_ids`` nor
            ``inputs_embeds``.
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
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand(batch_size, -1)
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
    config = getattr(module, "config", None)
    if document_region_active():
        # Packed rows or all-to-all attention: the registered attention does the rest (documents, any
        # sliding window); a module that calls SDPA itself would attend over its shard alone.
        impl = getattr(config, "_attn_implementation", "unknown (the module has no config)")
        note_attention_module(module)  # its own SDPA call, if it makes one, runs as the region's attention
        if impl not in (CP_DOCUMENT_ATTENTION, "sdpa"):
            raise ValueError(
                f"{type(module).__name__} runs attn_implementation={impl!r}, but packed rows and all-to-all "
                f"attention under context parallelism need {CP_DOCUMENT_ATTENTION!r} (set by "
                "apply_context_parallel; a model that calls SDPA itself cannot take it); call "
                "apply_context_parallel after any set_attn_implementation, or use ring attention "
                "(cp_ulysses_degree 1) on unpacked rows"
            )
        kwargs["attention_mask"] = None
        return args, kwargs
    window = attention_window(module)
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if window is not None and isinstance(hidden, torch.Tensor) and hidden.shape[1] * active_cp_size > window:
        raise ValueError(
            f"{type(module).__name__} uses sliding-window attention (window {window}) over a sequence of "
            f"{hidden.shape[1] * active_cp_size} tokens, which ring attention does not support (it is "
            "plainly causal); use all-to-all attention (cp_ulysses_degree = cp_size), packed rows, "
            "sequences no longer than the window, or cp_size=1"
        )
    kwargs["attention_mask"] = None
    return args, kwargs


def _attention_done(_module: nn.Module, _args: Any, _output: Any) -> None:
    note_attention_module(None)


SEQUENCE_MIXING_OPS: frozenset[str] = frozenset(
    {"matmul", "__matmul__", "bmm", "baddbmm", "einsum", "mm", "conv1d", "conv2d", "cumsum", "cumprod",
     "cummax", "logcumsumexp", "roll", "flip"}
)  # fmt: skip
"""Ops that can combine the positions of a sequence when they take floating-point activations (a
product of two activations, a convolution or a scan over time). Under context parallelism each rank holds
a slice of the sequence and only ``scaled_dot_product_attention`` (ring attention) sees all of it."""


def _check_positions_mix_only_in_sdpa(model: nn.Module) -> None:
    """Refuse a model whose forward combines positions outside SDPA (a silent error under CP).

    One forward of the transformers model on fake tensors (`automodel_modules.dataflow`; no compute, no
    memory, meta models included) labels everything computed from the token embeddings and records the
    ops of `SEQUENCE_MIXING_OPS` that take such activations: state-space and linear-attention layers
    (scans, convolutions over time), attention computed by hand, sparse-attention indexers. Layer kinds
    the config declares that are not attention (``layer_types``) are refused at once, and chunked
    attention (its mask is dropped under CP) too.

    Raises:
        ValueError: The forward mixes positions outside SDPA, or it does not run on fake tensors (so
            that CP cannot be shown to be exact for it).
    """
    from automodel_modules.dataflow import DataFlow, fake_forward

    _, hf = find_hf_model(unwrap(model))
    config = getattr(hf, "config", None)
    name = type(hf).__name__
    kinds = set(getattr(config, "layer_types", None) or ())
    others = sorted(k for k in kinds if k not in ("full_attention", "sliding_attention"))
    if others:
        raise ValueError(
            f"context parallelism spreads only attention over the sequence, but {name} has layers of kind "
            f"{others} (config.layer_types); use cp_size=1 for it"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        raise ValueError(
            f"{name} uses chunked attention (attention_chunk_size={chunk}), whose "
            "mask context parallelism cannot apply; use cp_size=1"
        )
    embeddings = embedding_module(hf, "input")
    if embeddings is None:
        raise ValueError(f"context parallelism cannot check {name}: it has no input embedding to trace from")
    mixing: set[str] = set()

    def on_op(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], labels_of: Any) -> None:
        if op == "scaled_dot_product_attention":
            # A mask computed from the activations (a learned, content-dependent mask) is over this
            # rank's keys only; ring attention runs unmasked, so it cannot apply it.
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if isinstance(mask, torch.Tensor) and labels_of(mask):
                mixing.add("an SDPA mask computed from activations")
            return
        if op not in SEQUENCE_MIXING_OPS:
            return
        floats = [
            a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()
        ]
        traced = [a for a in floats if labels_of(a)]
        products = op in ("matmul", "__matmul__", "bmm", "baddbmm", "einsum", "mm")
        if len(traced) >= (2 if products else 1):
            mixing.add(op)

    flow = DataFlow(on_op)
    hook = embeddings.register_forward_hook(lambda _m, _a, out: flow.set(out, {"activations"}))
    param = next(hf.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    try:
        # Unbacked sizes for value-dependent shapes: an MoE dispatch by nonzero() still traces.
        with fake_forward(flow, data_dependent_shapes=True):
            hf(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device), use_cache=False)
    except Exception as exc:
        raise ValueError(
            f"context parallelism cannot check {name}: its forward does not run on fake tensors "
            f"({type(exc).__name__}: {str(exc)[:200]}); use cp_size=1 for it"
        ) from None
    finally:
        hook.remove()
    if mixing:
        raise ValueError(
            f"{name} combines positions of the sequence outside scaled_dot_product_attention "
            f"({', '.join(sorted(mixing))}: a scan, a convolution over time, attention computed by hand or "
            "an attention mask computed from activations); under context parallelism each rank holds a "
            "slice of the sequence and only unmasked SDPA becomes ring attention, so use cp_size=1 for it"
        )


def apply_context_parallel(model: nn.Module) -> nn.Module:
    """Make ``model``'s attention run as plain causal SDPA inside `context_parallel_region`.

    Registers a forward pre-hook on the attention sub-module of every transformer block (found by the
    names in `ATTENTION_MODULE_NAMES`) that drops the ``attention_mask`` keyword while a CP region is open
    (SDPA then runs with ``is_causal=True``), and that raises ``ValueError`` for sliding-window
    attention over a sequence longer than the window under ring attention. Outside a region the hooks do
    nothing. Switches the model to the ``attn_implementation`` `CP_DOCUMENT_ATTENTION` (registered with
    transformers): SDPA with SDPA's masks outside a document region, document-masked over the gathered
    keys inside one (packed rows, see `context_parallel_region`). Idempotent.

    Preconditions: a transformers model with ``attn_implementation="sdpa"`` and causal attention.

    Returns:
        ``model`` (hooks added, its config's ``_attn_implementation`` set to `CP_DOCUMENT_ATTENTION`).

    Raises:
        ValueError: The model does not use SDPA attention, combines positions outside it
            (`_check_positions_mix_only_in_sdpa`), or no attention sub-module was found.
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is not None and impl not in ("sdpa", CP_DOCUMENT_ATTENTION):
        raise ValueError(
            "context parallelism runs attention through scaled_dot_product_attention (ring or "
            f"all-to-all), but {type(model).__name__} uses attn_implementation={impl!r}; load it with "
            "attn_implementation='sdpa'"
        )
    _check_positions_mix_only_in_sdpa(model)
    hooked = 0
    windows: list[int | None] = []
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
            attention.register_forward_hook(_attention_done)
            setattr(attention, _HOOKED_ATTR, True)
            hooked += 1
        windows.append(attention_window(attention))
    # Kept on the model (and on the stage copies a pipeline split makes of it), so that
    # context_parallel_region(model=...) refuses ring attention over a longer sequence on every rank,
    # before any collective, whichever stage holds the windowed layers.
    setattr(model, _WINDOW_ATTR, min((w for w in windows if w is not None), default=None))
    _, hf = find_hf_model(unwrap(model))
    set_implementation = getattr(hf, "set_attn_implementation", None)
    if getattr(getattr(hf, "config", None), "_attn_implementation", None) == "sdpa":
        register_cp_document_attention()
        try:
            if not callable(set_implementation):
                raise ValueError("it has no set_attn_implementation")
            set_implementation(CP_DOCUMENT_ATTENTION)
            if getattr(hf.config, "_attn_implementation", None) != CP_DOCUMENT_ATTENTION:  # it may only log
                raise ValueError("its attention implementation cannot be set after loading")
        except ValueError as exc:
            warnings.warn(
                f"context parallelism could not switch {type(hf).__name__} to {CP_DOCUMENT_ATTENTION!r} "
                f"({exc}); unpacked rows run ring attention as usual, packed rows will be refused",
                stacklevel=2,
            )
    logger.info("context parallelism: hooked %d attention module(s) of %s", hooked, type(model).__name__)
    return model


# ------------------------------------------------------------------------------------------ region


@contextlib.contextmanager
def context_parallel_region(
    mesh: DeviceMesh | MeshContext,
    batch: Mapping[str, Any],
    *,
    seq_dims: Mapping[str, int] | None = None,
    host_runtime: HostRuntime | None = None,
    ulysses_degree: int = 1,
    model: nn.Module | Sequence[nn.Module] | None = None,
) -> Iterator[dict[str, Any]]:
    """Shard ``batch`` over the ``cp`` axis and run SDPA as ring or all-to-all attention until it closes.

    Yields this rank's shard of the batch: copies of the tensors under `CP_SEQUENCE_KEYS` (and of any key
    in ``seq_dims``), reordered with `load_balance_indices` and cut along their sequence dim; other values
    unchanged. ``batch`` itself is not modified. Run the forward **and** the backward inside the context.
    With ``cp_size == 1`` the batch is yielded as is and nothing is patched.

    ``1 < ulysses_degree < cp_size``: ring attention between groups of all-to-all ranks. Consecutive
    ``cp`` ranks form groups of ``ulysses_degree``, which exchange heads for positions as all-to-all
    attention does; each group then holds one ring shard (torch's head-tail layout over the
    ``cp_size / ulysses_degree`` groups) for its share of the heads, and ring attention runs over the
    groups (`_ring_of_all_to_all`). Unpacked rows only (packed rows take the path below).

    ``ulysses_degree == cp_size`` (all-to-all, Ulysses-style context parallelism) and packed rows
    (``position_ids`` restarting inside a row, whatever ``ulysses_degree``): the same shards, but instead
    of ring attention a document region (`automodel_distributed.cp_document_attention.document_region`):
    each attention layer exchanges heads for positions by all-to-all and attends over whole rows (per
    document when packed; memory linear in the row), or, for packed rows whose layer has query heads the
    ``cp`` size does not divide, gathers keys and values and masks them per document (an O(T^2 / cp)
    mask per rank). No host runtime is needed then.

    Preconditions: `apply_context_parallel` was applied to the model; the batch went through
    `context_parallel_inputs`; every rank of the ``cp`` axis enters with the same global batch.
    Collectives: ring attention exchanges key/value blocks over the ``cp`` group in forward and backward
    (packed rows: every attention layer all-gathers keys and values, and reduces their gradients).

    Args:
        mesh: The ``cp`` mesh (1-D), a mesh with a ``cp`` axis, or a `MeshContext`.
        batch: The global batch.
        seq_dims: Sequence dim per key, overriding the default 1.
        ulysses_degree: 1 (ring attention), the ``cp`` size (all-to-all attention), or a divisor between
            (ring attention between groups of that many all-to-all ranks).
        model: The model (or the pipeline stages of this rank) that runs inside, to refuse up front,
            on every rank, ring attention over rows longer than its sliding window (which ring
            attention cannot apply). Without it the attention refuses when it runs: the same on every
            rank, except under pipelining, where the other stages would wait on the refusing one.
        host_runtime: On a CPU mesh, what runs ring attention on CPU tensors
            (`automodel_distributed.host_runtime.HostRuntime.ring_attention`, e.g.
            ``automodel_cpu.CPURuntime()``: private torch internals, patched only while the region is
            open). Refused on CUDA, where torch's own kernels run.

    Raises:
        ValueError: Sharded tensors disagree on the sequence length, or it is not divisible by
            ``2 * cp_size``; the batch has ``labels`` or ``attention_mask`` not named in ``seq_dims``; a
            CPU mesh without ``host_runtime`` (unpacked rows under ring attention), or a CUDA mesh with
            one; a ``ulysses_degree`` that does not divide the ``cp`` size.
        RuntimeError: On CPU, the installed torch lacks the internals the host runtime needs.
    """
    cp_mesh = _cp_mesh(mesh)
    if ulysses_degree < 1 or cp_mesh.size() % ulysses_degree:
        raise ValueError(
            f"context_parallel_region: ulysses_degree={ulysses_degree} with cp_size={cp_mesh.size()}; use "
            f"a divisor of it: 1 (ring attention), {cp_mesh.size()} (all-to-all attention), or one between "
            "(ring attention between groups of all-to-all ranks)"
        )
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
    order = load_balance_indices(  # validates divisibility
        next(iter(lengths.values())), cp_mesh.size(), device=batch[keys[0]].device
    )
    positions = batch.get("position_ids")
    positions = positions if isinstance(positions, torch.Tensor) else None
    packed = positions is not None and document_ids(positions) is not None
    if _ACTIVE_CP_SIZE.get():
        raise RuntimeError("context_parallel_region cannot be nested")
    seq_len = next(iter(lengths.values()))
    if packed or ulysses_degree == cp_mesh.size():
        # Shard in the same layout ourselves; attention runs all-to-all (or, for packed rows whose heads
        # the cp size does not divide, document-masked over gathered keys): no ring attention, so no
        # CPU backend is needed.
        mine = order.view(cp_mesh.size(), -1)[cp_mesh.get_local_rank()]
        local = dict(batch)
        local.update({k: batch[k].index_select(dims.get(k, 1), mine.to(batch[k].device)) for k in keys})
        with document_region(cp_mesh.get_group(), positions, order, all_to_all=True), _marked(cp_mesh.size()):
            yield local
        return
    _check_ring_window(model, seq_len)
    _check_host_runtime(cp_mesh, host_runtime)
    if ulysses_degree > 1:
        region = _ring_of_all_to_all(cp_mesh, ulysses_degree, batch, keys, dims, seq_len, host_runtime)
    else:
        region = _ring(cp_mesh, batch, keys, dims, host_runtime)
    with region as local, _marked(cp_mesh.size()):
        yield local


@contextlib.contextmanager
def _marked(cp_size: int) -> Iterator[None]:
    """Record the open region's cp size for the hooks (`_ACTIVE_CP_SIZE`) while the context is open."""
    token = _ACTIVE_CP_SIZE.set(cp_size)
    try:
        yield
    finally:
        _ACTIVE_CP_SIZE.reset(token)


@contextlib.contextmanager
def _ring(
    cp_mesh: DeviceMesh,
    batch: Mapping[str, Any],
    keys: Sequence[str],
    dims: Mapping[str, int],
    host_runtime: HostRuntime | None,
) -> Iterator[dict[str, Any]]:
    """Ring attention over the ``cp`` ranks: torch's region shards copies of the sequence tensors."""
    from torch.distributed.tensor.experimental import context_parallel

    local = dict(batch)
    buffers = [batch[k].clone() for k in keys]
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            context_parallel(
                cp_mesh,
                buffers=buffers,
                buffer_seq_dims=[dims.get(k, 1) for k in keys],
                no_restore_buffers=set(buffers),
            )
        )
        if host_runtime is not None:
            stack.enter_context(host_runtime.ring_attention())
        local.update(zip(keys, buffers, strict=True))
        yield local


_SPLIT_MESHES: dict[tuple[DeviceMesh, int], tuple[DeviceMesh, DeviceMesh]] = {}
"""``(cp mesh, ulysses degree)`` -> its ring and all-to-all meshes (their process groups are made once)."""


def _ring_and_ulysses(cp_mesh: DeviceMesh, ulysses_degree: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The ``cp`` mesh split into ``(cp_ring, cp_ulysses)``: consecutive ranks form the all-to-all groups.

    Collective the first time for a mesh (new process groups: every ``cp`` rank calls it together).
    """
    key = (cp_mesh, ulysses_degree)
    if key not in _SPLIT_MESHES:
        sizes = (cp_mesh.size() // ulysses_degree, ulysses_degree)
        split = cp_mesh._unflatten(0, sizes, ("cp_ring", "cp_ulysses"))
        _SPLIT_MESHES[key] = (split["cp_ring"], split["cp_ulysses"])
    return _SPLIT_MESHES[key]


@contextlib.contextmanager
def _ring_of_all_to_all(
    cp_mesh: DeviceMesh,
    ulysses_degree: int,
    batch: Mapping[str, Any],
    keys: Sequence[str],
    dims: Mapping[str, int],
    seq_len: int,
    host_runtime: HostRuntime | None,
) -> Iterator[dict[str, Any]]:
    """Ring attention over groups of ``ulysses_degree`` all-to-all ranks; yields this rank's shard.

    Group ``g`` of the ring holds torch's head-tail ring shard ``g`` of every row (``seq_len / ring``
    positions), cut into ``ulysses_degree`` consecutive pieces, one per rank of the group. Each attention
    layer exchanges heads for positions inside the group (all-to-all, in the shard's own order), so every
    rank holds the group's whole ring shard for its share of the heads, and the SDPA that follows is
    torch's ring attention over the ring mesh, which expects exactly that shard.
    """
    from torch.distributed.tensor.experimental import context_parallel

    ring_mesh, ulysses_mesh = _ring_and_ulysses(cp_mesh, ulysses_degree)
    device = batch[keys[0]].device
    shard = load_balance_indices(seq_len, ring_mesh.size(), device=device).view(ring_mesh.size(), -1)
    shard = shard[ring_mesh.get_local_rank()]
    mine = shard.view(ulysses_degree, -1)[ulysses_mesh.get_local_rank()]
    local = dict(batch)
    local.update({k: batch[k].index_select(dims.get(k, 1), mine.to(batch[k].device)) for k in keys})
    # torch's region takes its load balancer from a buffer's length: a stand-in of the rows' length.
    stand_in = torch.empty(1, seq_len, device=device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            context_parallel(
                ring_mesh, buffers=[stand_in], buffer_seq_dims=[1], no_restore_buffers={stand_in}
            )
        )
        if host_runtime is not None:
            stack.enter_context(host_runtime.ring_attention())
        order = torch.arange(shard.numel(), device=device)
        ring = ring_mesh.size()
        stack.enter_context(
            document_region(ulysses_mesh.get_group(), None, order, all_to_all=True, ring=ring)
        )
        yield local


def _check_host_runtime(cp_mesh: DeviceMesh, host_runtime: HostRuntime | None) -> None:
    """Ring attention on a CPU mesh needs the host runtime's kernel; a CUDA mesh must not get one."""
    on_cpu = cp_mesh.device_type == "cpu"
    if on_cpu and host_runtime is None:
        raise ValueError(
            "context parallelism on a CPU mesh: torch has ring attention for CUDA SDPA kernels only; pass "
            "context_parallel_region(..., host_runtime=automodel_cpu.CPURuntime()) for its CPU kernel "
            "(private torch internals, for testing), or run on CUDA devices"
        )
    if host_runtime is not None and not on_cpu:
        raise ValueError(
            f"context_parallel_region(host_runtime=...) acts on CPU meshes only; this is a "
            f"{cp_mesh.device_type} mesh, whose ring attention is torch's own: drop host_runtime"
        )


def _check_ring_window(model: nn.Module | Sequence[nn.Module] | None, seq_len: int) -> None:
    """Refuse ring attention over ``seq_len`` tokens for a model with a shorter sliding window."""
    parts = [model] if isinstance(model, nn.Module) else list(model or ())
    windows = [w for part in parts if (w := getattr(unwrap(part), _WINDOW_ATTR, None)) is not None]
    if windows and seq_len > min(windows):
        raise ValueError(
            f"{type(unwrap(parts[0])).__name__} uses sliding-window attention (window {min(windows)}) over "
            f"rows of {seq_len} tokens, which ring attention does not support (it is plainly causal); use "
            "all-to-all attention (cp_ulysses_degree = cp_size), packed rows, rows no longer than the "
            "window, or cp_size=1"
        )


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh | MeshContext,
    tensors: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    ulysses_degree: int = 1,
) -> list[torch.Tensor]:
    """Gather sequence shards from the ``cp`` ranks and undo the load-balancing order.

    The inverse of the sharding `context_parallel_region` does; use it on outputs such as logits (it does
    not carry gradients). Collective: one all-gather per tensor over the ``cp`` group.

    Args:
        mesh: The ``cp`` mesh, a mesh with a ``cp`` axis, or a `MeshContext`.
        tensors: This rank's shards (same shape on every rank).
        seq_dims: The sequence dim of each tensor.
        ulysses_degree: The region's; between 1 and the ``cp`` size the ranks in order hold the
            head-tail layout of the ring of all-to-all groups, not of the ``cp`` ranks.

    Returns:
        The full tensors, in the original sequence order, on every rank.
    """
    if len(tensors) != len(seq_dims):
        raise ValueError(f"context_parallel_unshard: {len(tensors)} tensors but {len(seq_dims)} seq_dims")
    cp_mesh = _cp_mesh(mesh)
    size = cp_mesh.size()
    if size == 1:
        return [t.detach().clone() for t in tensors]
    ring = size // ulysses_degree if 1 < ulysses_degree < size else size
    out: list[torch.Tensor] = []
    for tensor, dim in zip(tensors, seq_dims, strict=True):
        moved = tensor.detach().movedim(dim, 0).contiguous()
        gathered = moved.new_empty((moved.shape[0] * size, *moved.shape[1:]))
        dist.all_gather_into_tensor(gathered, moved, group=cp_mesh.get_group())
        order = load_balance_indices(gathered.shape[0], ring, device=gathered.device)
        restored = torch.empty_like(gathered)
        restored[order] = gathered
        out.append(restored.movedim(0, dim))
    return out
