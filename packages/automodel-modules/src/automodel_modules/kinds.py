"""What a module or tensor is, asked without importing what it might be (reads only).

``torch.distributed.tensor`` costs seconds to import and transformers is not a dependency here, so
`is_dtensor` and `is_conv1d` look in ``sys.modules``: a type nobody imported cannot have instances.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_conv1d", "is_dtensor", "maps_like_linear"]


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``DTensor``, without importing ``torch.distributed.tensor``.

    That import costs seconds; if nothing imported it yet, nothing can be a DTensor, so single-process
    code paths never pay for it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear, its weight stored ``[in, out]``).

    Read from ``sys.modules`` (this package does not depend on transformers): a ``Conv1D`` exists only once
    transformers defined it.
    """
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    return isinstance(conv1d, type) and isinstance(module, conv1d)


def maps_like_linear(module: nn.Module, in_features: int, out_features: int) -> bool:
    """Whether one call of ``module`` maps ``(..., in_features)`` to a tensor ``(..., out_features)``.

    For linear subclasses with a forward of their own (torchao's ``Float8Linear``, Falcon's linear): the
    call runs on fake tensors (no compute, no memory, meta weights included), its input on the weight's
    device. A block-diagonal grouped projection that only borrows the weight gives another shape or
    fails; a router returns a tuple. Either way it is not a linear map that sharding or a low-rank delta
    of the weight's shape could treat as one.
    """
    from automodel_modules.fake_mode import fake_mode

    weight = getattr(module, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else None
    try:
        with fake_mode(allow_non_fake_inputs=True):
            out = module(torch.empty(2, 3, in_features, device=device))
    except Exception:  # it cannot take (..., in): not a plain linear map
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 3, out_features)
