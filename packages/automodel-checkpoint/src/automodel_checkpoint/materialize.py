"""Materialise a (possibly sharded) meta-device model and initialise its weights.

`materialize_meta_tensors` gives storage to the parameters and buffers still on meta, and to nothing
else: each meta parameter is swapped in place (``torch.utils.swap_tensors``) for an empty tensor of the
same kind on the target device, so DTensor placements, FSDP2's references to its sharded parameters and
tied weights (one object under two names) all survive. Materialised tensors are marked as needing
initialisation until `initialize_model_weights` or a checkpoint load fills them; `verify_materialized`
fails loudly on any that are left.

Initialisation uses transformers' own ``initialize_weights`` (``_init_weights`` per module) when the
model is a transformers model, restricted to the tensors that need it through transformers'
``_is_hf_initialized`` flags; otherwise each module's ``reset_parameters()`` (torch's defaults). DTensor
parameters are initialised through DTensor's random ops. Non-persistent buffers are recomputed by
`reinitialize_non_persistent_buffers`. LoRA adapters are left to their owner: the caller's
``init_adapters`` (``automodel_peft.init_adapter_weights``) initialises them, once, after the base
weights are final.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from automodel_checkpoint.keys import (
    DEFAULT_KEY_RULES,
    KeyRules,
    TensorSlot,
    collect_tensor_slots,
)
from automodel_checkpoint.recomputed_buffers import (
    assign_buffer,
    fresh_buffers,
    reinitialize_non_persistent_buffers,
)
from automodel_modules import find_hf_model, is_adapter_fqn, is_dtensor, unwrap

__all__ = [
    "adapter_slots",
    "default_device",
    "has_meta_tensors",
    "initializable_hf_model",
    "initialize_model_weights",
    "mark_needs_init",
    "materialize_meta_tensors",
    "needs_init",
    "retie_weights",
    "run_adapter_init",
    "verify_materialized",
]

logger = logging.getLogger(__name__)

_NEEDS_INIT = "_automodel_needs_init"
_HF_FLAG = "_is_hf_initialized"


def needs_init(t: torch.Tensor) -> bool:
    """Whether ``t`` was materialised and has not been initialised or loaded since."""
    return bool(getattr(t, _NEEDS_INIT, False))


def mark_needs_init(t: torch.Tensor, value: bool) -> None:
    """Record on ``t`` that it holds no values yet (``value``), or that it was initialised or loaded."""
    if value:
        setattr(t, _NEEDS_INIT, True)
    elif hasattr(t, _NEEDS_INIT):
        delattr(t, _NEEDS_INIT)


def _is_meta(t: torch.Tensor) -> bool:
    """On meta, itself or (a tensor subclass such as torchao's float8 weight wrapper) any inner tensor."""
    if t.device.type == "meta":
        return True
    flatten = getattr(t, "__tensor_flatten__", None)
    if not callable(flatten):
        return False
    names, _ = flatten()
    inner = (getattr(t, name, None) for name in names)
    return any(isinstance(i, torch.Tensor) and _is_meta(i) for i in inner)


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage like ``t`` on ``device``; a DTensor keeps its mesh, placements and shape.

    DTensors are rebuilt from an empty local tensor with ``from_local`` (no sharding propagation, no
    communication), which is much cheaper than ``torch.empty_like`` on the DTensor.
    """
    if not is_dtensor(t):
        return torch.empty_like(t, device=device)
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        local = t.to_local()
        return DTensor.from_local(
            torch.empty_like(local, device=device),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )


def _swap_param(owners: list[tuple[nn.Module, str]], old: nn.Parameter, device: torch.device) -> None:
    new = nn.Parameter(_empty_like(old, device), requires_grad=old.requires_grad)
    saved = dict(old.__dict__)
    # Keep the old tensor's Python attributes (markers, tying) but never over the new tensor's own: a
    # tensor subclass keeps its inner tensors there (torchao's float8 weight: ``_tensor``), and the old
    # ones are on meta.
    try:
        torch.utils.swap_tensors(old, new)
        _add_missing(old.__dict__, saved)
    except RuntimeError:  # e.g. a weakref to the old tensor: fall back to re-registering everywhere
        _add_missing(new.__dict__, saved)
        for module, name in owners:
            module._parameters[name] = new


def _add_missing(attributes: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        attributes.setdefault(key, value)


def materialize_meta_tensors(
    model: nn.Module, device: torch.device | str, rules: KeyRules = DEFAULT_KEY_RULES
) -> list[str]:
    """Give storage on ``device`` to every parameter and buffer of ``model`` still on meta.

    Tensors not on meta are left alone. A DTensor stays a DTensor with the same mesh and placements;
    tied parameters stay tied. New storage is uninitialised (``torch.empty``) and marked as needing
    initialisation. Non-persistent buffers are recomputed at once (`reinitialize_non_persistent_buffers`).

    Preconditions: any parallelism (TP, FSDP2) is already applied. No collectives.

    Returns:
        Checkpoint keys of the materialised parameters and persistent buffers.

    Raises:
        ValueError: A meta non-persistent buffer cannot be recomputed.
    """
    dev = torch.device(device)
    done: list[str] = []
    for slot in collect_tensor_slots(model, rules, include_adapters=True):
        if not _is_meta(slot.tensor):
            continue
        if slot.is_param:
            assert isinstance(slot.tensor, nn.Parameter)
            _swap_param(slot.owners, slot.tensor, dev)
            module, name = slot.owners[0]
            mark_needs_init(module._parameters[name], True)  # type: ignore[arg-type]
        else:
            new = _empty_like(slot.tensor, dev)
            for module, name in slot.owners:
                module._buffers[name] = new
            mark_needs_init(new, True)
        done.extend(slot.keys[:1])
    reinitialize_non_persistent_buffers(model, dev, only_meta=True)
    return done


def initializable_hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside ``model`` (through peft, compile and DDP wrappers), if any."""
    _, inner = find_hf_model(unwrap(model))
    return inner if callable(getattr(inner, "initialize_weights", None)) else None


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [p for p in module._parameters.values() if p is not None]
    out += [
        b for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set
    ]
    return out


def _zero_padding_row(embedding: nn.Embedding) -> None:
    """Zero ``weight[padding_idx]`` on the rank(s) that hold that row (DTensor-aware, no collective)."""
    from automodel_checkpoint.slices import tensor_boxes

    weight, idx = embedding.weight, embedding.padding_idx
    assert idx is not None
    local = weight.to_local() if is_dtensor(weight) else weight
    _, boxes = tensor_boxes(weight)
    for box in boxes:
        row = idx - box.global_start[0]
        if 0 <= row < box.shape[0]:
            local[box.local_start[0] + row].narrow(0, box.local_start[1], box.shape[1]).zero_()


def _run_hf_init(hf: nn.Module, pending: list[torch.Tensor]) -> None:
    pending_ids = {id(t) for t in pending}
    saved_modules: list[tuple[nn.Module, Any]] = []
    flagged: list[torch.Tensor] = []
    padded: list[tuple[nn.Embedding, int]] = []
    for module in hf.modules():
        saved_modules.append((module, module.__dict__.get(_HF_FLAG, None)))
        own = _own_tensors(module)
        todo = [t for t in own if id(t) in pending_ids]
        setattr(module, _HF_FLAG, not todo)
        for t in own:
            if id(t) not in pending_ids and not getattr(t, _HF_FLAG, False):
                setattr(t, _HF_FLAG, True)
                flagged.append(t)
        if (
            todo
            and isinstance(module, nn.Embedding)
            and module.padding_idx is not None
            and is_dtensor(module.weight)
        ):
            padded.append((module, module.padding_idx))
            module.padding_idx = None  # transformers would index the DTensor; we zero it locally
    try:
        hf.initialize_weights()  # type: ignore[operator]
    finally:
        for module, value in saved_modules:
            if value is None:
                module.__dict__.pop(_HF_FLAG, None)
            else:
                setattr(module, _HF_FLAG, value)
        for t in flagged:
            delattr(t, _HF_FLAG)
        for module, idx in padded:
            module.padding_idx = idx
    with torch.no_grad():
        for module, _ in padded:
            _zero_padding_row(module)


def _run_torch_init(model: nn.Module, pending: list[torch.Tensor]) -> None:
    pending_ids = {id(t) for t in pending}
    for module in model.modules():
        own = [p for p in module._parameters.values() if p is not None]
        if (
            own
            and all(id(p) in pending_ids for p in own)
            and callable(getattr(module, "reset_parameters", None))
        ):
            module.reset_parameters()  # type: ignore[operator]
            for p in own:
                mark_needs_init(p, False)


def initialize_model_weights(
    model: nn.Module,
    device: torch.device | str,
    *,
    init_adapters: Callable[[nn.Module], object] | None = None,
    skip_keys: Iterable[str] = (),
    rules: KeyRules = DEFAULT_KEY_RULES,
) -> nn.Module:
    """Materialise the meta tensors of ``model`` on ``device`` and initialise every tensor needing it.

    Steps: `materialize_meta_tensors`; initialise the tensors marked as needing it, except those whose
    checkpoint key is in ``skip_keys`` (they are about to be loaded) and the LoRA adapters, with
    transformers' ``initialize_weights`` (or torch's ``reset_parameters`` for other models); recompute
    non-persistent buffers; re-tie tied weights (`retie_weights`); then ``init_adapters(model)``. Without
    ``init_adapters`` the adapters stay marked as needing initialisation (a loader passes none and
    initialises them after reading the base weights; `verify_materialized` names any left over).

    Preconditions: parallelisms already applied. Collectives: DTensor random ops may synchronise the RNG
    seed over a DTensor's mesh the first time they run (every rank must call this).

    Args:
        model: The model; mutated in place.
        device: Device for the new storage.
        init_adapters: The adapters' owner's initialiser (``automodel_peft.init_adapter_weights``).
        skip_keys: Checkpoint keys left marked as needing initialisation (the caller loads them).
        rules: Name rewrites from model FQNs to checkpoint keys.

    Returns:
        ``model``.

    Raises:
        ValueError: A non-persistent buffer cannot be recomputed.
    """
    materialize_meta_tensors(model, device, rules)
    skip = set(skip_keys)
    adapter_ids = {id(slot.tensor) for slot in adapter_slots(model, rules)}
    slots = collect_tensor_slots(model, rules)
    pending = [
        s
        for s in slots
        if needs_init(s.tensor) and not skip.intersection(s.keys) and id(s.tensor) not in adapter_ids
    ]
    pending = _init_buffers_as_built(model, pending)
    if pending:
        tensors = [s.tensor for s in pending]
        hf = initializable_hf_model(model)
        with torch.no_grad():
            if hf is not None:
                versions = {id(t): t._version for t in tensors}
                _run_hf_init(hf, tensors)
                for slot in pending:
                    # transformers' _init_weights covers every parameter; a buffer it did not write keeps
                    # its mark, so verify_materialized names it instead of training on garbage.
                    if slot.is_param or slot.tensor._version != versions[id(slot.tensor)]:
                        mark_needs_init(slot.tensor, False)
            else:
                _run_torch_init(model, tensors)
    reinitialize_non_persistent_buffers(model, None)
    retie_weights(model)
    run_adapter_init(model, init_adapters, rules)
    return model


def _init_buffers_as_built(model: nn.Module, pending: list[TensorSlot]) -> list[TensorSlot]:
    """Give pending persistent buffers the values a fresh construction of the model computes.

    Returns the slots still pending (parameters, and buffers the fresh model does not have).
    """
    if all(slot.is_param for slot in pending):
        return pending
    fresh = fresh_buffers(model)
    left: list[TensorSlot] = []
    for slot in pending:
        value = None if slot.is_param else next((fresh[k] for k in slot.keys if k in fresh), None)
        if value is None or value.shape != slot.tensor.shape:
            left.append(slot)
            continue
        first, name = slot.owners[0]
        assign_buffer(first, name, value, slot.tensor.device)
        for module, other in slot.owners[1:]:  # one tensor shared by every owner, as before
            module._buffers[other] = first._buffers[name]
    return left


def adapter_slots(model: nn.Module, rules: KeyRules = DEFAULT_KEY_RULES) -> list[TensorSlot]:
    """The LoRA adapter tensors of ``model`` (``automodel_modules.is_adapter_fqn``)."""
    return [
        slot
        for slot in collect_tensor_slots(model, rules, include_adapters=True)
        if any(is_adapter_fqn(fqn) for fqn in slot.fqns)
    ]


def run_adapter_init(
    model: nn.Module, init_adapters: Callable[[nn.Module], object] | None, rules: KeyRules = DEFAULT_KEY_RULES
) -> None:
    """Call the adapters' owner on ``model`` (once the base weights are final) and mark them initialised."""
    slots = adapter_slots(model, rules)
    if init_adapters is None or not slots:
        return
    init_adapters(model)
    for slot in slots:
        mark_needs_init(slot.tensor, False)


def retie_weights(model: nn.Module) -> list[str]:
    """Make sure weights that transformers declares tied are one tensor.

    Tied parameters survive materialisation (they are swapped in place), so this normally finds
    nothing to do. An unsharded model whose ties were broken is re-tied with transformers'
    ``tie_weights``; a sharded one cannot be re-tied after sharding.

    Returns:
        The ``target <- source`` pairs that had to be re-tied.

    Raises:
        RuntimeError: A sharded (DTensor) model has broken ties.
    """
    hf = initializable_hf_model(model)
    if hf is None:
        return []
    ties = getattr(hf, "all_tied_weights_keys", None) or {}
    broken = []
    for target, source in dict(ties).items():
        try:
            t, s = hf.get_parameter(target), hf.get_parameter(source)
        except AttributeError:
            continue
        if t is not s:
            broken.append((f"{target} <- {source}", t))
    if not broken:
        return []
    if any(is_dtensor(t) for _, t in broken):
        raise RuntimeError(
            f"tied weights {[b for b, _ in broken]} are separate tensors in a sharded model; tie them "
            "before sharding (transformers ties them when the model is built)"
        )
    hf.tie_weights()  # type: ignore[operator]
    return [b for b, _ in broken]


def verify_materialized(model: nn.Module, rules: KeyRules = DEFAULT_KEY_RULES) -> None:
    """Fail if any parameter or buffer is still on meta or was materialised but never initialised.

    No collectives; reads the model only.

    Raises:
        RuntimeError: Lists the offending names and what to call.
    """
    meta, uninit = [], []
    for slot in collect_tensor_slots(model, rules, include_adapters=True):
        if _is_meta(slot.tensor):
            meta.append(slot.fqns[0])
        elif needs_init(slot.tensor):
            uninit.append(slot.fqns[0])
    for name, buf in model.named_buffers():
        if buf is not None and _is_meta(buf) and name not in meta:
            meta.append(name)
    if meta or uninit:
        raise RuntimeError(
            f"model is not fully materialised: {len(meta)} tensor(s) still on meta {meta[:10]}, "
            f"{len(uninit)} materialised but never initialised or loaded {uninit[:10]}. Call "
            "initialize_model_weights(model, device) or load them from a checkpoint (strict=True lists "
            "what a checkpoint lacks); LoRA adapters are initialised by their owner: pass "
            "init_adapters=automodel_peft.init_adapter_weights."
        )


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` (or an inner tensor of one) is still on meta."""
    return any(_is_meta(t) for t in [*model.parameters(), *model.buffers()])


def default_device(model: nn.Module) -> torch.device:
    """Where meta tensors go by default: the model's device, else its DTensor mesh's device, else CPU."""
    tensors = [*model.parameters(), *model.buffers()]
    for t in tensors:
        if t.device.type != "meta":
            return t.device
    for t in tensors:
        if is_dtensor(t):
            kind = t.device_mesh.device_type
            if kind == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(kind)
    return torch.device("cpu")
