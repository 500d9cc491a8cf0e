"""automodel-peft: LoRA / DoRA / QLoRA adapters through Hugging Face ``peft``, for FSDP2 and TP models.

- `PeftConfig` (the reference system's fields) or a plain ``peft.LoraConfig``;
- `apply_lora` / `apply_lora_to_linear_modules`: inject adapters (meta device welcome), freeze the base;
- `init_adapter_weights`: (re)initialise adapters after materialising a meta model;
- `save_adapters`: HF PEFT format from plain or sharded models; `merge_adapters`: fold them in.

``PeftConfig`` is imported eagerly (it needs only torch); everything that touches ``peft`` is loaded on
first access, so ``import automodel_peft`` costs about as much as ``import torch``.
"""

import lazy_loader

from automodel_mesh.version import installed_version
from automodel_peft._names import hf_checkpoint_key as hf_checkpoint_key
from automodel_peft.config import PeftConfig as PeftConfig

# The names of __init__.pyi (what type checkers read) load on first access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]

__version__ = installed_version("automodel-peft")
