"""Put FSDP2 units back in their sharded state (no collective)."""

from __future__ import annotations

from torch import nn

__all__ = ["reshard_fsdp_units"]


def reshard_fsdp_units(model: nn.Module) -> None:
    """Reshard every FSDP2 unit under ``model`` (``FSDPModule.reshard`` is not recursive).

    A forward without gradients leaves the units built with ``reshard_after_forward=False`` (the root,
    the last blocks) gathered, since no backward comes to free them. Mutates only the units' sharding
    state (their unsharded parameters are freed); a model without FSDP2 units is left alone.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
