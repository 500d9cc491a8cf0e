"""Where the tensors handed to a collective must live: the process group's device, not the default one."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["collective_device"]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor for a collective on ``group`` (default: the world) must be made on.

    NCCL takes only CUDA tensors, on this process's current device; gloo takes CPU tensors. A group with
    both (``"cpu:gloo,cuda:nccl"``) takes CUDA tensors when CUDA is available. Never the default device
    (``torch.set_default_device``), which may be ``meta`` or another accelerator.

    Precondition: a default process group exists. Reads only; no collective.
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
