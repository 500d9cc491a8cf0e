"""Load Hugging Face checkpoints into an expert-parallel model and save it back in the HF format.

The simple approach: every rank reads the full checkpoint through transformers (which converts the
per-expert on-disk layout to the fused in-memory one) and keeps its own slice; saving gathers full
tensors (``full_tensor()``) and rank 0 writes them with ``save_pretrained``. Peak memory per rank is the
full model, so this suits small and medium models; sharded loading goes through automodel_distributed's
checkpoint functions.
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["gather_hf_state_dict", "hf_name", "load_hf_checkpoint", "save_hf_checkpoint"]

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def hf_name(fqn: str) -> str:
    """The transformers name of a parameter FQN (checkpoint/compile wrapper segments removed)."""
    for segment in _WRAPPER_SEGMENTS:
        fqn = fqn.replace(segment, "")
    return fqn


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | pathlib.Path) -> nn.Module:
    """Copy the weights of the HF checkpoint at ``path`` into ``model`` (sharded or not), in place.

    Preconditions: ``model`` is parallelized (or plain) with materialised parameters. No collectives:
    each rank reads the whole checkpoint and slices locally (``distribute_tensor(src_data_rank=None)``).

    Raises:
        KeyError: A parameter of ``model`` has no counterpart in the checkpoint.
    """
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    for name, param in model.named_parameters():
        key = hf_name(name)
        if key not in full:
            raise KeyError(f"checkpoint {path} has no tensor {key!r} (parameter {name})")
        src = full[key].to(param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(src, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(src)
    return model


def gather_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of every parameter and persistent buffer, under transformers names.

    Collective: all ranks must call it (DTensor ``full_tensor`` all-gathers over each tensor's mesh).
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        out[hf_name(name)] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
    return out


def save_hf_checkpoint(model: nn.Module, path: str | pathlib.Path, *, rank: int = 0) -> None:
    """Save ``model`` as a plain transformers checkpoint (rank ``rank`` writes; all ranks must call).

    Builds a plain model from ``model.config`` on rank ``rank``, loads the gathered full state dict and
    calls ``save_pretrained`` (which writes the on-disk per-expert layout).
    """
    from transformers import AutoModelForCausalLM

    state = gather_hf_state_dict(model)
    is_writer = not dist.is_initialized() or dist.get_rank() == rank
    if is_writer:
        plain = AutoModelForCausalLM.from_config(model.config)
        plain.load_state_dict(state, strict=True)
        plain.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()
