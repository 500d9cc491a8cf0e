"""`QATConfig`: which torchao QAT quantizer to build, with the settings that fit the model chosen for you."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from automodel_quant._deps import import_torchao
from automodel_quant._dtypes import dtype_name, parse_dtype

__all__ = [
    "QAT_MODES",
    "QAT_QUANTIZER_TYPES",
    "QATConfig",
    "UnsupportedLayerPolicy",
]

#: ``quantizer_type`` -> the mode string recorded on a prepared model (``model._qat_mode``).
QAT_MODES: Mapping[str, str] = {"int8_dynact_int4weight": "8da4w-qat", "int4_weight_only": "4w-qat"}
QAT_QUANTIZER_TYPES: tuple[str, ...] = tuple(QAT_MODES)

UnsupportedLayerPolicy = Literal["skip", "error"]

# Keyword arguments each torchao quantizer takes (torchao 0.14 - 0.18).
_QUANTIZER_KWARGS: Mapping[str, frozenset[str]] = {
    "int8_dynact_int4weight": frozenset({"groupsize", "padding_allowed", "precision", "scales_precision"}),
    "int4_weight_only": frozenset({"groupsize", "inner_k_tiles", "precision", "scales_precision"}),
}
_INT4_GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = (2, 4, 8)
_OWN_FIELDS = ("quantizer_type", "quantizer_kwargs", "on_unsupported_layer")


@dataclass(kw_only=True, init=False)
class QATConfig:
    """Quantization-aware training with a torchao QAT quantizer.

    Built like the reference system's config: ``QATConfig(quantizer_type="int4_weight_only", groupsize=64)``
    (extra keywords are quantizer arguments) or ``QATConfig(quantizer_type=..., quantizer_kwargs={...})``.
    When neither ``groupsize`` nor ``inner_k_tiles`` is given, `prepare_qat_model` picks the values that
    fit the model's linear layers (torchao needs every quantized layer's input size to divide by the group
    size, and for int4 weight-only also by ``inner_k_tiles * 16``).
    """

    quantizer_type: str = "int8_dynact_int4weight"
    """``"int8_dynact_int4weight"`` (int8 dynamic activations, int4 grouped weights; torchao's
    ``Int8DynActInt4WeightQATQuantizer``) or ``"int4_weight_only"`` (``Int4WeightOnlyQATQuantizer``)."""

    quantizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Quantizer arguments: ``groupsize``, ``precision``, ``scales_precision`` (dtypes; default
    bfloat16), ``padding_allowed`` (8da4w) or ``inner_k_tiles`` (4w: 2, 4 or 8)."""

    on_unsupported_layer: UnsupportedLayerPolicy = "skip"
    """What `prepare_qat_model` does with a linear no setting fits: ``"skip"`` leaves it in high
    precision with one warning that lists them all; ``"error"`` raises ``ValueError``."""

    def __init__(
        self,
        *,
        quantizer_type: str = "int8_dynact_int4weight",
        quantizer_kwargs: Mapping[str, Any] | None = None,
        on_unsupported_layer: UnsupportedLayerPolicy = "skip",
        **extra_quantizer_kwargs: Any,
    ) -> None:
        if quantizer_kwargs is not None and not isinstance(quantizer_kwargs, Mapping):
            raise ValueError(
                "QATConfig.quantizer_kwargs must be a dict of quantizer arguments or None, got "
                f"{quantizer_kwargs!r}"
            )
        overlap = sorted(set(quantizer_kwargs or {}) & set(extra_quantizer_kwargs))
        if overlap:
            raise ValueError(
                f"QATConfig: {overlap} given both in quantizer_kwargs and as keywords; give each once"
            )
        self.quantizer_type = quantizer_type
        self.quantizer_kwargs = {**dict(quantizer_kwargs or {}), **extra_quantizer_kwargs}
        self.on_unsupported_layer = on_unsupported_layer
        self.__post_init__()

    def __post_init__(self) -> None:
        if not isinstance(self.quantizer_type, str) or self.quantizer_type not in QAT_MODES:
            raise ValueError(
                f"QATConfig.quantizer_type={self.quantizer_type!r} is unknown; use one of "
                f"{list(QAT_QUANTIZER_TYPES)}"
            )
        if self.on_unsupported_layer not in ("skip", "error"):
            raise ValueError(
                f"QATConfig.on_unsupported_layer={self.on_unsupported_layer!r}; use 'skip' or 'error'"
            )
        allowed = _QUANTIZER_KWARGS[self.quantizer_type]
        unknown = sorted(set(self.quantizer_kwargs) - allowed)
        if unknown:
            raise ValueError(
                f"QATConfig.quantizer_kwargs: {unknown} are not arguments of the {self.quantizer_type!r} "
                f"quantizer; it takes {sorted(allowed)}"
            )
        kwargs = self.quantizer_kwargs
        for name in ("precision", "scales_precision"):
            if name in kwargs:
                kwargs[name] = parse_dtype(kwargs[name], f"QATConfig.quantizer_kwargs[{name!r}]")
        group = kwargs.get("groupsize")
        if group is not None:
            if isinstance(group, bool) or not isinstance(group, int) or group < 1:
                raise ValueError(f"QATConfig.quantizer_kwargs['groupsize']={group!r} must be a positive int")
            if self.quantizer_type == "int4_weight_only" and group not in _INT4_GROUP_SIZES:
                raise ValueError(
                    f"QATConfig.quantizer_kwargs['groupsize']={group} is not supported by int4 weight-only "
                    "QAT; "
                    f"use one of {list(_INT4_GROUP_SIZES)} (or leave it unset to pick one from the model)"
                )
        tiles = kwargs.get("inner_k_tiles")
        if tiles is not None and tiles not in _INNER_K_TILES:
            raise ValueError(
                f"QATConfig.quantizer_kwargs['inner_k_tiles']={tiles!r}; use one of {list(_INNER_K_TILES)} "
                "(or leave it unset to pick one from the model)"
            )
        padding = kwargs.get("padding_allowed")
        if padding is not None and not isinstance(padding, bool):
            raise ValueError(f"QATConfig.quantizer_kwargs['padding_allowed']={padding!r} must be a bool")

    @property
    def mode(self) -> str:
        """The mode string a model prepared with this config records (``"8da4w-qat"`` / ``"4w-qat"``)."""
        return QAT_MODES[self.quantizer_type]

    @property
    def auto_layout(self) -> bool:
        """Whether `prepare_qat_model` chooses ``groupsize`` / ``inner_k_tiles`` from the model."""
        return "groupsize" not in self.quantizer_kwargs and "inner_k_tiles" not in self.quantizer_kwargs

    def create_quantizer(self) -> Any:
        """Build the torchao quantizer (``precision`` and ``scales_precision`` default to bfloat16).

        The quantizer remembers this config's ``on_unsupported_layer`` and whether its layout may be
        chosen from the model, for `prepare_qat_model`.

        Raises:
            ImportError: torchao is missing.
        """
        qat = import_torchao("torchao.quantization.qat", "QATConfig.create_quantizer")
        kwargs: dict[str, Any] = {"precision": torch.bfloat16, "scales_precision": torch.bfloat16}
        kwargs.update(self.quantizer_kwargs)
        if self.quantizer_type == "int8_dynact_int4weight":
            quantizer = qat.Int8DynActInt4WeightQATQuantizer(**kwargs)
        else:
            quantizer = qat.Int4WeightOnlyQATQuantizer(**kwargs)
        quantizer._automodel_auto_layout = self.auto_layout
        quantizer._automodel_on_unsupported_layer = self.on_unsupported_layer
        return quantizer

    def to_dict(self) -> dict[str, Any]:
        """A flat, YAML-friendly dict: own fields plus the quantizer keywords (dtypes as names)."""
        kwargs = {
            k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in self.quantizer_kwargs.items()
        }
        return {
            "quantizer_type": self.quantizer_type,
            "on_unsupported_layer": self.on_unsupported_layer,
            **kwargs,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QATConfig:
        """Inverse of `to_dict`; also takes a nested ``quantizer_kwargs`` mapping."""
        data = dict(data)
        nested = dict(data.pop("quantizer_kwargs", None) or {})
        own = {k: data.pop(k) for k in _OWN_FIELDS if k in data}
        return cls(**own, quantizer_kwargs=nested, **data)
