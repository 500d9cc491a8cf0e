"""The tensors transformers keeps out of the compute dtype, and how FSDP2's mixed precision keeps them too.

transformers run in bf16 (``from_pretrained(dtype=torch.bfloat16)``) does not hold every tensor in
bf16. A model may create a parameter in float32 on purpose (a router, a short convolution) or list it in
``_keep_in_fp32_modules_strict``; a buffer computed with an explicit float32 (rotary ``inv_freq``) stays
float32, while one computed in the default dtype (MiniMax's decay tables) becomes bf16. The forward is
written for exactly those dtypes: an fp32 router weight against ``hidden.float()``, a bf16 decay table
against bf16 activations.

FSDP2's ``MixedPrecisionPolicy`` casts every parameter of a unit to ``param_dtype`` and leaves every
buffer alone, so without help such a model meets ``expected m1 and m2 to have the same dtype`` under the
default policy, or computes a router in bf16 that transformers computes in fp32. When the policy casts,
`reference_dtypes` builds the model on meta as transformers builds it for the compute dtype and reads
each tensor's dtype (data from the model's own code, no family list); `kept_precision_units` returns the
modules owning parameters kept wider than the compute dtype as FSDP units of their own that do not cast
(transformers' own FSDP plan gives them their own group too); `cast_buffers_to_reference` gives each
buffer the reference's dtype.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel_checkpoint import checkpoint_key
from automodel_checkpoint.convert import built_class
from automodel_distributed.fsdp2_units import FSDPUnitPlan
from automodel_modules import find_hf_model, join_fqn, unwrap

__all__ = ["cast_buffers_to_reference", "kept_precision_units", "reference_dtypes"]

_CACHE: dict[tuple[type[nn.Module], str, torch.dtype], dict[str, torch.dtype]] = {}
_CACHE_KEPT = 4  # constructions cached (per class, config and dtype)


def _kept_patterns(hf: nn.Module, dtype: torch.dtype) -> list[re.Pattern[str]]:
    """The keep-in-fp32 globs of transformers for a load in ``dtype``, as ``from_pretrained`` applies them."""
    names = set(getattr(hf, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:  # the non-strict list only guards against fp16 overflow
        names |= set(getattr(hf, "_keep_in_fp32_modules", None) or ())
    return [re.compile(re.escape(name).replace(r"\*", ".*")) for name in sorted(names)]


def _construct(hf: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    config: Any = hf.config
    model_class: Any = built_class(hf)  # a transformers PreTrainedModel subclass
    with torch.device("meta"):
        built = model_class._from_config(copy.deepcopy(config), dtype=dtype)
    patterns = _kept_patterns(built, dtype)
    dtypes: dict[str, torch.dtype] = {}
    for prefix, module in built.named_modules():
        # The lists apply to what a checkpoint loads: parameters and persistent buffers.
        loaded = [(n, p) for n, p in module._parameters.items()]
        loaded += [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, tensor in loaded:
            if tensor is not None and tensor.is_floating_point():
                full = join_fqn(prefix, name)
                kept = any(p.search(full) for p in patterns)
                dtypes[checkpoint_key(full)] = torch.float32 if kept else tensor.dtype
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and name in module._non_persistent_buffers_set:
                dtypes[checkpoint_key(join_fqn(prefix, name))] = buf.dtype
    return dtypes


def reference_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each floating parameter's and buffer's dtype in ``model``'s transformers model loaded in ``dtype``.

    The transformers model inside ``model`` (through peft, compile and checkpoint wrappers) is built again
    on the meta device from its class and config under ``dtype``, as ``from_pretrained(dtype=dtype)``
    builds it, and its keep-in-fp32 lists are applied. No storage is allocated, nothing is mutated and no
    collective runs; results are cached per class, config and dtype.

    Returns:
        Checkpoint key (`automodel_checkpoint.checkpoint_key`) -> dtype; ``{}`` when ``model`` holds no
        transformers model, or one its config alone cannot build again (warned): then nothing is known
        beyond the policy.
    """
    _, hf = find_hf_model(unwrap(model))
    config: Any = getattr(hf, "config", None)
    if not callable(getattr(config, "to_json_string", None)) or not hasattr(hf, "_from_config"):
        return {}
    key = (built_class(hf), config.to_json_string(use_diff=False), dtype)
    if key not in _CACHE:
        while len(_CACHE) >= _CACHE_KEPT:
            _CACHE.pop(next(iter(_CACHE)))
        try:
            _CACHE[key] = _construct(hf, dtype)
        except Exception as exc:  # a custom class that its config alone cannot build (extra arguments)
            warnings.warn(
                f"{type(hf).__name__} cannot be built again from its config on the meta device ({exc!r}): "
                "which of its tensors transformers keeps in fp32 is unknown, so every parameter follows the "
                "mixed-precision policy (pass mp_policy=None to train in the model's own dtypes)",
                stacklevel=2,
            )
            _CACHE[key] = {}
    return _CACHE[key]


def _is_kept(
    param: nn.Parameter, key: str, reference: Mapping[str, torch.dtype], compute: torch.dtype
) -> bool:
    wanted = reference.get(checkpoint_key(key))
    return wanted is not None and wanted != compute and wanted == param.dtype


def _children_read_directly(module: nn.Module) -> set[str]:
    """Child names whose weights ``module``'s forward reads without calling the child.

    transformers marks such a forward with ``force_accelerate_hooks(child_names)`` (a short convolution
    handing ``self.conv1d.weight`` to a kernel) so that offloading hooks fire: the decorator's argument,
    read from the forward's closures (each ``functools.wraps`` layer), is that list.
    """
    names: set[str] = set()
    forward: Any = type(module).forward
    while callable(forward):
        try:
            found = inspect.getclosurevars(forward).nonlocals.get("child_module_names")
        except (TypeError, ValueError):  # a builtin or C function: no closure to read
            found = None
        if isinstance(found, list | tuple):
            names.update(n for n in found if isinstance(n, str))
        forward = getattr(forward, "__wrapped__", None)
    return names


def _kept_modules(
    model: nn.Module, reference: Mapping[str, torch.dtype], compute: torch.dtype, taken: set[str]
) -> tuple[dict[str, nn.Module], list[str]]:
    """The largest modules whose floating parameters are all kept wider, and the kept parameters left.

    Largest, not the parameter's owner: a parent may read a child's weight without calling the child
    (a short convolution passing ``self.conv1d.weight`` to a kernel), and FSDP gathers a unit's
    parameters only around the unit's own forward; a module whose parent reads it so
    (`_children_read_directly`) cannot be one either. A module in ``taken`` (a dense unit, the root) is
    not one: its unit holds other parameters too. Returns (FQN -> module, names of the kept parameters
    no such module holds).
    """
    kept = {
        fqn
        for fqn, param in model.named_parameters()
        if param.is_floating_point() and _is_kept(param, fqn, reference, compute)
    }
    # A child its parent reads directly would never be gathered by a unit of its own.
    unreachable = {
        join_fqn(fqn, child) for fqn, m in model.named_modules() for child in _children_read_directly(m)
    }
    found: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        names = [join_fqn(fqn, n) for n, p in module.named_parameters() if p.is_floating_point()]
        if fqn in taken or fqn in unreachable or not names or not kept.issuperset(names):
            continue
        if not any(fqn.startswith(outer + ".") for outer in found):
            found[fqn] = module
    held = {join_fqn(fqn, n) for fqn, module in found.items() for n, _ in module.named_parameters()}
    return found, sorted(kept - held)


def _listed(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def kept_precision_units(
    model: nn.Module,
    mp_policy: MixedPrecisionPolicy,
    reference: Mapping[str, torch.dtype],
    dense: Sequence[FSDPUnitPlan],
) -> list[FSDPUnitPlan]:
    """The modules whose parameters transformers keeps wider than ``mp_policy.param_dtype``, as FSDP units.

    Each is a largest module, other than a dense unit or the root, all of whose floating parameters have
    a reference dtype (`reference_dtypes`) that is their own and not the compute dtype; its unit computes
    in the parameters' dtype (``param_dtype=None``) and casts no input, reducing gradients in the
    policy's ``reduce_dtype``. A kept parameter that shares its module with others (attention sinks
    beside the projections), or whose module its parent reads without calling it (a convolution beside
    the projections whose weight the attention hands to a kernel), cannot get a dtype of its own in
    FSDP2: a warning names it. Reads only;
    deepest first, so `apply_fsdp2` shards a nested unit before the one containing it.
    """
    compute = mp_policy.param_dtype
    if compute is None or not reference:
        return []
    policy = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=mp_policy.reduce_dtype, output_dtype=None, cast_forward_inputs=False
    )
    found, left = _kept_modules(model, reference, compute, {"", *(unit.fqn for unit in dense)})
    if left:
        warnings.warn(
            f"{_listed(left)} compute in {compute} (FSDP2Config.mp_policy.param_dtype), although "
            "transformers keeps them wider: an FSDP unit has one compute dtype, and their module holds "
            "other parameters too or is read by its parent without being called",
            stacklevel=3,
        )
    units = [FSDPUnitPlan(fqn, module, None, mp_policy=policy) for fqn, module in found.items()]
    return sorted(units, key=lambda unit: unit.fqn.count("."), reverse=True)


def _cast_during_forward(module: nn.Module, names: list[str], dtype: torch.dtype) -> None:
    """Hooks that hold ``module``'s buffers ``names`` in ``dtype`` only while its forward runs.

    The stored buffers (what ``state_dict``, a checkpoint and an export see) keep their dtype.
    """
    stored: dict[str, torch.Tensor] = {}

    def swap_in(mod: nn.Module, _args: Any) -> None:
        if stored:  # a recursive or re-entered call: already swapped
            return
        for name in names:
            buf = mod._buffers[name]
            assert buf is not None, "a registered floating buffer"
            stored[name] = buf
            mod._buffers[name] = buf.to(dtype)

    def restore(mod: nn.Module, _args: Any, _output: Any) -> None:
        for name, buf in stored.items():
            mod._buffers[name] = buf
        stored.clear()

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(restore, always_call=True)


def cast_buffers_to_reference(
    model: nn.Module, reference: Mapping[str, torch.dtype], compute: torch.dtype
) -> list[str]:
    """Give each floating buffer of ``model`` that transformers holds in ``compute`` that dtype in forward.

    Only casts to ``compute`` (the policy's ``param_dtype``): a buffer transformers keeps wider (rotary
    ``inv_freq``) keeps its dtype. A non-persistent buffer is cast in place (materialisation keeps a
    buffer's dtype, so meta buffers work); a persistent one is saved and exported, and its stored dtype
    must not change, so hooks of its module cast it for the duration of each forward (recompute
    included). Mutates ``model``'s buffers and hooks; no collective. Returns the buffers' names.
    """
    cast: list[str] = []
    for fqn, module in model.named_modules():
        persistent: list[str] = []
        for name, buf in module._buffers.items():
            if buf is None or not buf.is_floating_point() or buf.dtype == compute:
                continue
            if reference.get(checkpoint_key(join_fqn(fqn, name))) != compute:
                continue
            cast.append(join_fqn(fqn, name))
            if name in module._non_persistent_buffers_set:
                module._buffers[name] = buf.to(compute)
            else:
                persistent.append(name)
        if persistent:
            _cast_during_forward(module, persistent, compute)
    return cast
