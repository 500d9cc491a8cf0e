"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .config import MoEParallelizerConfig
from .load import ExpertLoad
from .parallelizer import ExpertParallel, parallelize_model
from .registry import (
    MOE_FAMILIES,
    ExpertsCall,
    ExpertsSite,
    MoEFamily,
    expert_weight_targets,
    find_experts,
    find_routers,
    has_experts,
    register_moe_family,
)

__version__: str

__all__ = [
    "MOE_FAMILIES",
    "ExpertLoad",
    "ExpertParallel",
    "ExpertsCall",
    "ExpertsSite",
    "MoEFamily",
    "MoEParallelizerConfig",
    "__version__",
    "expert_weight_targets",
    "find_experts",
    "find_routers",
    "has_experts",
    "parallelize_model",
    "register_moe_family",
]
