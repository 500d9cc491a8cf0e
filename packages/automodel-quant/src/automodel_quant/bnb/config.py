"""`BnBQuantizationConfig`: 4-bit / 8-bit bitsandbytes base weights (QLoRA), with HF field names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel_mesh.config_dict import ConfigDict
from automodel_quant._dtypes import dtype_name, parse_dtype

__all__ = ["BNB_4BIT_QUANT_TYPES", "BnBQuantizationConfig"]

BNB_4BIT_QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")


@dataclass(kw_only=True)
class BnBQuantizationConfig(ConfigDict):
    """Quantized base weights through bitsandbytes (the ``[bnb]`` extra).

    Field names are those of ``transformers.BitsAndBytesConfig``; defaults are the QLoRA recipe (4-bit
    NF4, double quantization, bfloat16 compute and storage). `to_hf_kwargs` gives the keyword arguments
    of a ``transformers.BitsAndBytesConfig`` for ``from_pretrained``; `apply_bnb_quantization` swaps the
    linears of an already-loaded model.
    """

    load_in_4bit: bool = True
    """4-bit weights (QLoRA). Exactly one of ``load_in_4bit`` / ``load_in_8bit`` must be True."""

    load_in_8bit: bool = False
    """8-bit weights (LLM.int8())."""

    bnb_4bit_quant_type: str = "nf4"
    """``"nf4"`` (normal float 4, the QLoRA choice) or ``"fp4"``."""

    bnb_4bit_compute_dtype: torch.dtype = torch.bfloat16
    """dtype of the 4-bit matmuls; also the default dtype of LoRA adapters on these layers."""

    bnb_4bit_use_double_quant: bool = True
    """Quantize the quantization constants too (about 0.4 bit per weight saved)."""

    bnb_4bit_quant_storage: torch.dtype = torch.bfloat16
    """dtype the packed 4-bit weights are stored in (bfloat16 lets FSDP shard them with the rest)."""

    llm_int8_threshold: float = 6.0
    """8-bit: activation outlier threshold of LLM.int8()."""

    llm_int8_skip_modules: list[str] = field(default_factory=list)
    """Modules kept in high precision: a leaf name (``"router"``), a dotted suffix or a full name. The
    output head is always kept, as transformers does."""

    allow_cpu: bool = False
    """bitsandbytes >= 0.47 also runs on CPU (slowly); by default quantizing on a CPU device raises."""

    def __post_init__(self) -> None:
        for name in ("load_in_4bit", "load_in_8bit", "bnb_4bit_use_double_quant", "allow_cpu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BnBQuantizationConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.load_in_4bit == self.load_in_8bit:
            raise ValueError(
                f"BnBQuantizationConfig: set exactly one of load_in_4bit / load_in_8bit, got "
                f"load_in_4bit={self.load_in_4bit}, load_in_8bit={self.load_in_8bit}"
            )
        if self.bnb_4bit_quant_type not in BNB_4BIT_QUANT_TYPES:
            raise ValueError(
                f"BnBQuantizationConfig.bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}; use one of "
                f"{list(BNB_4BIT_QUANT_TYPES)}"
            )
        self.bnb_4bit_compute_dtype = parse_dtype(
            self.bnb_4bit_compute_dtype, "BnBQuantizationConfig.bnb_4bit_compute_dtype"
        )
        self.bnb_4bit_quant_storage = _parse_storage(self.bnb_4bit_quant_storage)
        threshold = self.llm_int8_threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not 0 < threshold < math.inf
        ):
            raise ValueError(
                f"BnBQuantizationConfig.llm_int8_threshold={self.llm_int8_threshold} must be > 0"
            )
        skip = self.llm_int8_skip_modules
        skip = [skip] if isinstance(skip, str) else skip
        if skip is not None and (
            not isinstance(skip, list | tuple) or not all(isinstance(m, str) and m for m in skip)
        ):
            raise ValueError(
                f"BnBQuantizationConfig.llm_int8_skip_modules must be a list of module names, got {skip!r}"
            )
        self.llm_int8_skip_modules = list(skip or [])
        if self.load_in_8bit:
            four = ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant")
            self.warn_unused(self.changed_fields([*four, "bnb_4bit_quant_storage"]), "load_in_8bit is True")
        else:
            self.warn_unused(self.changed_fields(["llm_int8_threshold"]), "load_in_4bit is True")

    @property
    def bits(self) -> int:
        """4 or 8."""
        return 4 if self.load_in_4bit else 8

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype LoRA adapters default to on these layers (4-bit compute dtype; bfloat16 for 8-bit)."""
        return self.bnb_4bit_compute_dtype if self.load_in_4bit else torch.bfloat16

    def to_hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``transformers.BitsAndBytesConfig`` (dtypes as torch dtypes)."""
        out: dict[str, Any] = {"load_in_4bit": self.load_in_4bit, "load_in_8bit": self.load_in_8bit}
        if self.load_in_4bit:
            out.update(
                bnb_4bit_quant_type=self.bnb_4bit_quant_type,
                bnb_4bit_compute_dtype=self.bnb_4bit_compute_dtype,
                bnb_4bit_use_double_quant=self.bnb_4bit_use_double_quant,
                bnb_4bit_quant_storage=self.bnb_4bit_quant_storage,
            )
        else:
            out["llm_int8_threshold"] = self.llm_int8_threshold
        if self.llm_int8_skip_modules:
            out["llm_int8_skip_modules"] = list(self.llm_int8_skip_modules)
        return out

    def _dict_value(self, name: str, value: Any) -> Any:
        """Dtypes as names (`to_dict` output is YAML-friendly)."""
        return dtype_name(value) if isinstance(value, torch.dtype) else value


def _parse_storage(value: object) -> torch.dtype:
    if isinstance(value, str) and value.removeprefix("torch.") == "uint8":
        return torch.uint8
    if value is torch.uint8:
        return torch.uint8
    return parse_dtype(value, "BnBQuantizationConfig.bnb_4bit_quant_storage")
