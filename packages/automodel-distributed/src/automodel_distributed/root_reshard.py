"""Free the FSDP2 root unit's gathered parameters as soon as backward no longer reads them.

The root unit stays gathered from its forward to the end of backward (``reshard_after_forward=False``:
backward starts in it, at the final norm and the output head). Where the head's weight is tied to the
input embedding, that weight lives in the root, and the root then holds the whole embedding through
every block's backward (a 128k-vocabulary Llama-3.2-1B shape: 0.5 GiB in bf16 per rank), although after
the head's and the final norm's backward the only use left is the input embedding's backward, which
reads the token ids and never the weight.

`reshard_root_after_head_backward` watches each forward of the root with gradients: which modules that
own root parameters run, before, between or after the child units (the blocks). When every one that
runs before the last unit needs no weight in backward (a plain ``nn.Embedding``), it reshards the root
(``FSDPModule.reshard``, freeing the gathered storage) once the gradients of the inputs of every module
that runs after the last unit exist, that is once their backward has read the weights. The gradients
are the same: only when the unsharded storage is freed changes; the root's post-backward reduces the
same ``.grad`` tensors and its own reshard finds nothing left to do. A forward that starts before the
previous forward's backward has run (two losses summed into one backward) turns the early reshard off
until every pending backward is done: FSDP2 gathers the root once for all of them.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves

from automodel_distributed.fsdp2_units import needs_no_weight_in_backward

__all__ = ["reshard_root_after_head_backward"]


def _grad_tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]


class _RootWatch:
    """Per root forward: the order its parameter owners and child units ran in, and the trigger."""

    def __init__(self, root: FSDPModule) -> None:
        self.root = root
        self.in_forward = False
        # ("owner", module, its inputs that need a gradient) or ("unit", None, []).
        self.events: list[tuple[str, nn.Module | None, list[torch.Tensor]]] = []
        # Triggers registered whose backward has not run yet, by a weak reference to one of their
        # tensors (a graph dropped without backward frees it).
        self.pending: list[weakref.ref[torch.Tensor]] = []
        self.overlapped = False

    def start(self, *_: Any) -> None:
        self.in_forward = torch.is_grad_enabled()
        self.events = []
        self.pending = [ref for ref in self.pending if ref() is not None]
        if not self.pending:
            self.overlapped = False
        elif self.in_forward:
            # A second forward before the first one's backward (two losses summed, DPO's chosen and
            # rejected): FSDP2 gathers the root once for both backwards, so none may free it early.
            self.overlapped = True

    def owner_ran(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.in_forward:
            self.events.append(("owner", module, _grad_tensors(args, kwargs)))

    def unit_ran(self, *_: Any) -> None:
        if self.in_forward:
            self.events.append(("unit", None, []))

    def finish(self, *_: Any) -> None:
        events, self.events = self.events, []
        in_forward, self.in_forward = self.in_forward, False
        if not in_forward or self.overlapped:
            return
        last_unit = max((i for i, (kind, _, _) in enumerate(events) if kind == "unit"), default=None)
        if last_unit is None:
            return
        # Owners that run before the last unit run their backward after it: they must not need weights.
        if any(
            kind == "owner" and module is not None and not needs_no_weight_in_backward(module)
            for kind, module, _ in events[:last_unit]
        ):
            return
        after = [(module, inputs) for kind, module, inputs in events[last_unit + 1 :] if kind == "owner"]
        # An owner after the units whose inputs take no gradient could run its backward at any time.
        if not after or any(not inputs for _, inputs in after):
            return
        tensors = [t for _, inputs in after for t in inputs]
        ref = weakref.ref(tensors[0])
        self.pending.append(ref)
        torch.autograd.graph.register_multi_grad_hook(
            tensors, functools.partial(self._release, ref), mode="all"
        )

    def _release(self, ref: weakref.ref[torch.Tensor], _grads: Any) -> None:
        self.pending = [r for r in self.pending if r is not ref]
        group = self.root._get_fsdp_state()._fsdp_param_group
        # A user who keeps the root gathered across micro-batches (set_reshard_after_backward(False)).
        if not self.overlapped and group is not None and group.reshard_after_backward:
            self.root.reshard()
        if not self.pending:
            self.overlapped = False


def reshard_root_after_head_backward(root: nn.Module) -> bool:
    """Reshard ``root`` in backward once the modules after its last child unit are done (module docstring).

    Preconditions: ``root`` is the model after ``fully_shard`` of its units and of itself, outside a
    pipeline (a pipeline stage runs several micro-batches' backward per gather). Mutates ``root`` by
    registering forward hooks on it, on its child units and on the modules owning its own parameters;
    returns False and changes nothing when the root owns no parameters or has no child unit. No
    collective is added: the next forward gathers the root as it would after the usual reshard.
    """
    if not isinstance(root, FSDPModule):
        return False
    units = [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root]
    in_units = {id(p) for unit in units for p in unit.parameters()}
    owners = [m for m in root.modules() if any(id(p) not in in_units for p in m.parameters(recurse=False))]
    if not units or not owners:
        return False
    watch = _RootWatch(root)
    # The hooks only record and register a gradient hook; compiled graphs must not trace them.
    root.register_forward_pre_hook(torch.compiler.disable(watch.start), prepend=True)
    root.register_forward_hook(torch.compiler.disable(watch.finish))
    for owner in owners:
        owner.register_forward_pre_hook(torch.compiler.disable(watch.owner_ran), with_kwargs=True)
    for unit in units:
        unit.register_forward_hook(torch.compiler.disable(watch.unit_ran))
    return True
