"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .infrastructure import (
    Infrastructure,
    apply_model_infrastructure,
    instantiate_infrastructure,
    parallelize_for_pp,
)

__version__: str

__all__ = [
    "Infrastructure",
    "__version__",
    "apply_model_infrastructure",
    "instantiate_infrastructure",
    "parallelize_for_pp",
]
