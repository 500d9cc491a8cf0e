"""`MoEParallelizerConfig`: how `automodel_moe.parallelizer.parallelize_model` shards an MoE model.

Field names and defaults follow NeMo AutoModel's MoE parallelizer config. This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from automodel_mesh.config_dict import ConfigDict

__all__ = ["MoEParallelizerConfig"]


@dataclass(kw_only=True)
class MoEParallelizerConfig(ConfigDict):
    """Options of expert parallelism + FSDP for mixture-of-experts models."""

    ignore_router_for_ac: bool = True
    """Under activation checkpointing, save the router's top-k outputs (and the token all-to-alls) instead
    of recomputing them, so routing decisions cannot change between forward and recompute. False: full
    recompute of each block."""
    reshard_after_forward: bool = False
    """FSDP ``reshard_after_forward`` for every unit (blocks and experts). False keeps the parameters
    gathered between forward and backward (more memory, fewer all-gathers)."""
    lm_head_precision: torch.dtype | None = None
    """Parameter dtype of the LM head's FSDP unit (e.g. ``torch.float32`` for an fp32 head under a bf16
    policy). None: the head uses ``mp_policy`` like every other unit."""
    wrap_outer_model: bool = True
    """Apply ``fully_shard`` to the root model too (its leftover parameters: final norm, tied embeddings).
    False leaves the root unwrapped (its parameters then stay replicated, unsharded)."""
    mp_policy: Any = None
    """A ``torch.distributed.fsdp.MixedPrecisionPolicy``; None means no mixed precision (parameters keep
    their dtype)."""

    def __post_init__(self) -> None:
        for name in ("ignore_router_for_ac", "reshard_after_forward", "wrap_outer_model"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"MoEParallelizerConfig.{name} must be a bool, got {value!r}")
        if self.lm_head_precision is not None and not isinstance(self.lm_head_precision, torch.dtype):
            if isinstance(self.lm_head_precision, str) and isinstance(
                getattr(torch, self.lm_head_precision.removeprefix("torch."), None), torch.dtype
            ):
                self.lm_head_precision = getattr(torch, self.lm_head_precision.removeprefix("torch."))
            else:
                raise ValueError(
                    "MoEParallelizerConfig.lm_head_precision must be a torch.dtype (or its name) or None, "
                    f"got {self.lm_head_precision!r}"
                )
        if self.mp_policy is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(self.mp_policy, MixedPrecisionPolicy):
                raise ValueError(
                    "MoEParallelizerConfig.mp_policy must be a MixedPrecisionPolicy or None, got "
                    f"{type(self.mp_policy).__name__}"
                )
