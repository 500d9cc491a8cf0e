"""The LoRA layer class under the reference system's name, for ``isinstance`` checks.

Adapters here are Hugging Face ``peft`` layers: ``peft.tuners.lora.Linear`` on plain linears, and its
bitsandbytes variants under QLoRA. All of them derive from ``peft.tuners.lora.LoraLayer``, so
``isinstance(module, LinearLoRA)`` is true exactly for an adapted layer, as with the reference system's
``LinearLoRA``. Constructing one is peft's business (`apply_lora` does it); its attributes are peft's
(``base_layer``, ``lora_A[adapter]``, ``lora_B[adapter]``, ``scaling[adapter]``).
"""

from __future__ import annotations

from peft.tuners.lora import LoraLayer

__all__ = ["LinearLoRA"]

LinearLoRA = LoraLayer
"""Every peft LoRA layer (``peft.tuners.lora.LoraLayer``): the reference system's ``LinearLoRA``."""
