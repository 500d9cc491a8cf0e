"""automodel-moe: expert parallelism with FSDP2 for Hugging Face mixture-of-experts models.

The config and the family registry are light and imported eagerly; the parallelizer, the experts module
and the checkpoint functions pull in DTensor/FSDP and are loaded on first attribute access.
`load_hf_checkpoint` / `save_hf_checkpoint` are automodel-distributed's (re-exported here for
convenience): they convert transformers' per-expert on-disk layout to and from the fused in-memory
experts, and each rank reads only the experts and slices it holds.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from automodel_moe.config import MoEParallelizerConfig
from automodel_moe.registry import MOE_FAMILIES, MoEFamily, find_moe_family, register_moe_family

if TYPE_CHECKING:
    from automodel_distributed.checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from automodel_moe.experts import ExpertParallelExperts
    from automodel_moe.parallelizer import parallelize_model

try:
    __version__ = version("automodel-moe")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

_LAZY = {
    "parallelize_model": "automodel_moe.parallelizer",
    "ExpertParallelExperts": "automodel_moe.experts",
    "load_hf_checkpoint": "automodel_distributed.checkpoint",
    "save_hf_checkpoint": "automodel_distributed.checkpoint",
}

__all__ = [
    "MOE_FAMILIES",
    "ExpertParallelExperts",
    "MoEFamily",
    "MoEParallelizerConfig",
    "__version__",
    "find_moe_family",
    "load_hf_checkpoint",
    "parallelize_model",
    "register_moe_family",
    "save_hf_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
