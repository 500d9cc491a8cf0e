"""automodel-infra: the two orchestration functions of automodel.

`instantiate_infrastructure` turns configs and a `MeshContext` into runtime objects;
`apply_model_infrastructure` applies them to a (usually meta) model in a fixed order, `APPLY_STEPS`
(data: ``automodel plan`` prints it through `describe_steps`), and loads its checkpoint into the
shards. See `automodel_infra.infrastructure`, `automodel_infra.steps` and docs/concepts.md.

The functions live in `automodel_infra.infrastructure`, which imports ``torch.distributed`` and the
strategy managers; they are loaded on first access so that ``import automodel_infra`` stays cheap.
"""

import lazy_loader

from automodel_mesh.version import installed_version

# The names of __init__.pyi (what type checkers read) load on first access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]

__version__ = installed_version("automodel-infra")
