"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from ._names import hf_checkpoint_key
from .apply import (
    AdapterState,
    adapter_initializer,
    apply_lora,
    apply_lora_to_linear_modules,
    freeze_base,
    init_adapter_weights,
)
from .checkpoint import (
    adapter_state_dict,
    hf_key_mapping,
    peft_reload_problem,
    save_adapters,
)
from .config import PeftConfig
from .linear_lora import LinearLoRA
from .matching import (
    ModuleMatcher,
    resolve_target_modules,
)
from .merge import merge_adapters
from .qlora import create_bnb_config

__version__: str

__all__ = [
    "AdapterState",
    "LinearLoRA",
    "ModuleMatcher",
    "PeftConfig",
    "__version__",
    "adapter_initializer",
    "adapter_state_dict",
    "apply_lora",
    "apply_lora_to_linear_modules",
    "create_bnb_config",
    "freeze_base",
    "hf_checkpoint_key",
    "hf_key_mapping",
    "init_adapter_weights",
    "merge_adapters",
    "peft_reload_problem",
    "resolve_target_modules",
    "save_adapters",
]
