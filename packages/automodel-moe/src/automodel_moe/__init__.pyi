"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .checkpoint import (
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from .config import MoEParallelizerConfig
from .experts import ExpertParallelExperts
from .parallelizer import parallelize_model
from .registry import (
    MOE_FAMILIES,
    MoEFamily,
    find_moe_family,
    register_moe_family,
)

__version__: str

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
