"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .infrastructure import (
    Infrastructure,
    apply_model_infrastructure,
    instantiate_infrastructure,
    parallelize_for_pp,
)
from .setup import DistributedSetup

__version__: str

__all__ = [
    "DistributedSetup",
    "Infrastructure",
    "__version__",
    "apply_model_infrastructure",
    "instantiate_infrastructure",
    "parallelize_for_pp",
]
