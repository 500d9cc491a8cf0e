"""automodel-moe: expert parallelism with FSDP2 for Hugging Face mixture-of-experts models.

The config and the experts discovery (`find_experts`: from the model's own metadata, with a registry for
the rest) are light and imported eagerly; the parallelizer and the expert sharding pull in DTensor/FSDP
and are loaded on first attribute access. Checkpoints of MoE models load and save with
automodel-checkpoint (``automodel_checkpoint.load_hf_checkpoint``): it converts transformers'
per-expert on-disk layout to and from the fused in-memory experts, and each rank reads only the
experts and slices it holds.
"""

import lazy_loader

from automodel_mesh.version import installed_version
from automodel_moe.config import MoEParallelizerConfig as MoEParallelizerConfig
from automodel_moe.registry import MOE_FAMILIES as MOE_FAMILIES
from automodel_moe.registry import ExpertsCall as ExpertsCall
from automodel_moe.registry import ExpertsSite as ExpertsSite
from automodel_moe.registry import MoEFamily as MoEFamily
from automodel_moe.registry import expert_weight_targets as expert_weight_targets
from automodel_moe.registry import find_experts as find_experts
from automodel_moe.registry import find_routers as find_routers
from automodel_moe.registry import has_experts as has_experts
from automodel_moe.registry import register_moe_family as register_moe_family

# The names of __init__.pyi (what type checkers read) load on first access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]

__version__ = installed_version("automodel-moe")
