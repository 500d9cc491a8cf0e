"""automodel-peft: LoRA / DoRA / QLoRA adapters through Hugging Face ``peft``, for FSDP2 and TP models.

- `PeftConfig` (the reference system's fields) or a plain ``peft.LoraConfig``;
- `apply_lora` / `apply_lora_to_linear_modules`: inject adapters (meta device welcome), freeze the base;
- `init_adapter_weights`: (re)initialise adapters after materialising a meta model;
- `save_adapters`: HF PEFT format from plain or sharded models; `merge_adapters`: fold them in.

``PeftConfig`` is imported eagerly (it needs only torch); everything that touches ``peft`` is loaded on
first access, so ``import automodel_peft`` costs about as much as ``import torch``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from automodel_peft._names import hf_checkpoint_key
from automodel_peft.config import PeftConfig

if TYPE_CHECKING:
    from automodel_peft.apply import (
        AdapterState,
        apply_lora,
        apply_lora_to_linear_modules,
        freeze_base,
        init_adapter_weights,
    )
    from automodel_peft.checkpoint import adapter_state_dict, hf_key_mapping, save_adapters
    from automodel_peft.layers import LinearLoRA
    from automodel_peft.matching import ModuleMatcher, resolve_target_modules
    from automodel_peft.merge import merge_adapters
    from automodel_peft.qlora import create_bnb_config

try:
    __version__ = version("automodel-peft")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

# Public name -> module that defines it, imported on first attribute access.
_LAZY = {
    "AdapterState": "automodel_peft.apply",
    "apply_lora": "automodel_peft.apply",
    "apply_lora_to_linear_modules": "automodel_peft.apply",
    "freeze_base": "automodel_peft.apply",
    "init_adapter_weights": "automodel_peft.apply",
    "adapter_state_dict": "automodel_peft.checkpoint",
    "hf_key_mapping": "automodel_peft.checkpoint",
    "save_adapters": "automodel_peft.checkpoint",
    "LinearLoRA": "automodel_peft.layers",
    "ModuleMatcher": "automodel_peft.matching",
    "resolve_target_modules": "automodel_peft.matching",
    "merge_adapters": "automodel_peft.merge",
    "create_bnb_config": "automodel_peft.qlora",
}

__all__ = [
    "AdapterState",
    "LinearLoRA",
    "ModuleMatcher",
    "PeftConfig",
    "__version__",
    "adapter_state_dict",
    "apply_lora",
    "apply_lora_to_linear_modules",
    "create_bnb_config",
    "freeze_base",
    "hf_checkpoint_key",
    "hf_key_mapping",
    "init_adapter_weights",
    "merge_adapters",
    "resolve_target_modules",
    "save_adapters",
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
