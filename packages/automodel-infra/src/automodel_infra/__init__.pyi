"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .infrastructure import (
    APPLY_STEPS,
    Infrastructure,
    apply_model_infrastructure,
    instantiate_infrastructure,
    parallelize_for_pp,
)
from .setup import DistributedSetup
from .steps import PlannedJob, Step, describe_steps

__version__: str

__all__ = [
    "APPLY_STEPS",
    "DistributedSetup",
    "Infrastructure",
    "PlannedJob",
    "Step",
    "__version__",
    "apply_model_infrastructure",
    "describe_steps",
    "instantiate_infrastructure",
    "parallelize_for_pp",
]
