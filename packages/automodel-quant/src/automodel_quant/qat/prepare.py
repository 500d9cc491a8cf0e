"""Prepare a model for QAT, toggle its fake quantization, and convert it to a quantized model.

Two kinds of quantizer are accepted wherever a quantizer is:

- torchao's legacy two-step quantizers (``Int8DynActInt4WeightQATQuantizer``,
  ``Int4WeightOnlyQATQuantizer``), usually built by `QATConfig.create_quantizer`: modes ``"8da4w-qat"``
  and ``"4w-qat"``;
- torchao's ``quantize_`` configs: a ``torchao.quantization.qat.QATConfig`` with ``step="prepare"`` or a
  base post-training config (e.g. ``Int8DynamicActivationIntxWeightConfig``), which is wrapped in one:
  mode ``"torchao-qat"``; converting applies the same config with ``step="convert"``.

LoRA adapter layers (``lora_A`` / ``lora_B``) are never fake-quantized: QAT targets the base weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

from torch import nn

from automodel_modules import is_dtensor
from automodel_quant._deps import import_torchao
from automodel_quant._modules import clean_fqn, is_adapter_fqn, linear_modules, parameter_dtypes, shielded
from automodel_quant.qat.config import QAT_MODES, UnsupportedLayerPolicy
from automodel_quant.qat.layout import LinearShape, QATLayout, resolve_qat_layout

__all__ = [
    "TORCHAO_QAT_MODE",
    "convert_qat_model",
    "disable_fake_quant",
    "enable_fake_quant",
    "get_disable_fake_quant_fn",
    "get_enable_fake_quant_fn",
    "get_quantizer_mode",
    "prepare_qat_model",
]

logger = logging.getLogger(__name__)

#: Attributes a prepared model carries: its mode, and the quantizer `convert_qat_model` uses.
QAT_MODE_ATTR = "_qat_mode"
QAT_QUANTIZER_ATTR = "_qat_quantizer"
#: Mode of models prepared through ``quantize_`` with a torchao ``QATConfig``.
TORCHAO_QAT_MODE = "torchao-qat"
_LEGACY_CLASSES = {
    "Int8DynActInt4WeightQATQuantizer": "int8_dynact_int4weight",
    "Int4WeightOnlyQATQuantizer": "int4_weight_only",
}
_MODES = (*QAT_MODES.values(), TORCHAO_QAT_MODE)


def _legacy_type(quantizer: object) -> str | None:
    for cls in type(quantizer).__mro__:
        if cls.__name__ in _LEGACY_CLASSES and cls.__module__.startswith("torchao."):
            return _LEGACY_CLASSES[cls.__name__]
    return None


def _is_torchao_config(obj: object) -> bool:
    return any(
        cls.__name__ == "AOBaseConfig" and cls.__module__.startswith("torchao.") for cls in type(obj).__mro__
    )


def get_quantizer_mode(quantizer: object) -> str | None:
    """The mode string of a quantizer: ``"8da4w-qat"``, ``"4w-qat"``, ``"torchao-qat"`` or None.

    None means a quantizer with ``prepare``/``convert`` methods that is neither of torchao's legacy QAT
    quantizers (it is prepared, but fake quantization cannot be toggled by mode).
    """
    legacy = _legacy_type(quantizer)
    if legacy is not None:
        return QAT_MODES[legacy]
    if _is_torchao_config(quantizer):
        return TORCHAO_QAT_MODE
    return None


def _check_bf16(model: nn.Module) -> None:
    by_dtype = parameter_dtypes(model)
    others = {dtype: names for dtype, names in by_dtype.items() if dtype != "bfloat16"}
    if others:
        listing = "; ".join(
            f"{dtype}: {len(names)} parameters (e.g. {names[0]})" for dtype, names in others.items()
        )
        raise ValueError(
            f"QAT needs a bfloat16 model, but it has {listing}. Cast it first with model.to(torch.bfloat16) "
            "(or build/load it with dtype=torch.bfloat16)"
        )


def _check_not_sharded(model: nn.Module, what: str) -> None:
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            f"{what} needs an unsharded model, but its parameters are DTensors: apply QAT before FSDP2/TP, "
            "and convert a model loaded from a full (gathered) state dict"
        )


def _candidates(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    qat_linear = import_torchao("torchao.quantization.qat", "prepare_qat_model").FakeQuantizedLinear
    return [
        (fqn, m)
        for fqn, m in linear_modules(model)
        if not is_adapter_fqn(clean_fqn(fqn)) and not isinstance(m, qat_linear)
    ]


def _report(unsupported: dict[str, str], policy: UnsupportedLayerPolicy, mode: str) -> None:
    if not unsupported:
        return
    listing = "; ".join(f"{fqn} ({why})" for fqn, why in unsupported.items())
    if policy == "error":
        raise ValueError(
            f"QAT ({mode}): no quantizer setting fits {len(unsupported)} linear layer(s): {listing}. "
            "Use on_unsupported_layer='skip' to keep them in high precision"
        )
    warnings.warn(
        f"QAT ({mode}): {len(unsupported)} linear layer(s) stay in high precision: {listing}",
        stacklevel=3,
    )


@contextlib.contextmanager
def _quiet_torchao() -> Iterator[None]:
    # torchao's legacy quantizers warn about its own internal use of TorchAODType; nothing to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TorchAODType is deprecated")
        yield


def _legacy_layout(quantizer: Any, legacy: str, layers: list[LinearShape]) -> tuple[Any, QATLayout]:
    auto = bool(getattr(quantizer, "_automodel_auto_layout", False))
    int4 = legacy == "int4_weight_only"
    layout = resolve_qat_layout(
        layers,
        legacy,
        groupsize=None if auto else quantizer.groupsize,
        inner_k_tiles=(None if auto else quantizer.inner_k_tiles) if int4 else None,
        padding_allowed=bool(getattr(quantizer, "padding_allowed", False)),
    )
    chosen = copy.copy(quantizer)  # never modify the caller's quantizer
    chosen.groupsize = layout.groupsize
    if int4:
        chosen.inner_k_tiles = layout.inner_k_tiles
    if auto:
        logger.info(
            "QAT %s: groupsize=%d%s chosen from the model's linear sizes",
            legacy,
            layout.groupsize,
            f", inner_k_tiles={layout.inner_k_tiles}" if int4 else "",
        )
    return chosen, layout


def _torchao_prepare_config(config: Any) -> Any:
    qat = import_torchao("torchao.quantization.qat", "prepare_qat_model")
    if isinstance(config, qat.QATConfig):
        if str(config.step) not in ("prepare", "QATStep.PREPARE"):
            raise ValueError(
                f"prepare_qat_model needs a torchao QATConfig with step='prepare', got step={config.step!r}; "
                "use convert_qat_model to convert"
            )
        return config
    return qat.QATConfig(config, step="prepare")  # a base post-training config


def _group_size_problem(config: Any, module: nn.Linear) -> str | None:
    weight_config = getattr(config, "weight_config", None)
    group = getattr(weight_config, "group_size", None)
    if isinstance(group, int) and module.in_features % group:
        return f"in_features={module.in_features} does not divide by group_size={group}"
    return None


def prepare_qat_model(
    model: nn.Module, quantizer: Any, *, on_unsupported_layer: UnsupportedLayerPolicy | None = None
) -> tuple[nn.Module, str | None]:
    """Swap the model's linear layers for fake-quantized ones, in place.

    Preconditions: every parameter is bfloat16; the model is not sharded yet (QAT comes before FSDP2 /
    TP); it may be on the meta device. LoRA adapters, if applied, stay unquantized.

    For torchao's legacy quantizers built by `QATConfig.create_quantizer` without ``groupsize`` /
    ``inner_k_tiles``, those are chosen from the model's linear sizes (see `resolve_qat_layout`); the
    caller's quantizer object is never modified (a copy with the chosen values is used and recorded).
    Layers no setting fits stay in high precision with one warning listing them, or raise, as
    ``on_unsupported_layer`` (default: the quantizer's config, else ``"skip"``) says.

    Mutates ``model``: swapped modules; ``model._qat_mode`` (the mode) and ``model._qat_quantizer`` (what
    `convert_qat_model` uses).

    Args:
        model: The model.
        quantizer: A legacy torchao QAT quantizer (or any object with ``prepare``), a torchao
            ``QATConfig(step="prepare")``, or a torchao base config to derive one from.
        on_unsupported_layer: ``"skip"`` or ``"error"``; overrides the quantizer's own policy.

    Returns:
        ``(model, mode)``; mode as `get_quantizer_mode`.

    Raises:
        ValueError: A non-bfloat16 parameter (naming the dtypes and the fix), a sharded model, a quantizer
            without ``prepare``, or an unfitting layer under ``on_unsupported_layer="error"``.
    """
    mode = get_quantizer_mode(quantizer)
    if mode is None and not callable(getattr(quantizer, "prepare", None)):
        raise ValueError(
            f"prepare_qat_model: {type(quantizer).__name__} has no prepare() and is not a torchao config; "
            "pass a torchao QAT quantizer (e.g. QATConfig(...).create_quantizer()) or a torchao QATConfig"
        )
    policy: UnsupportedLayerPolicy = on_unsupported_layer or cast(
        UnsupportedLayerPolicy, getattr(quantizer, "_automodel_on_unsupported_layer", "skip")
    )
    _check_bf16(model)
    _check_not_sharded(model, "prepare_qat_model")
    candidates = _candidates(model)
    adapters = [fqn for fqn, _ in linear_modules(model) if is_adapter_fqn(clean_fqn(fqn))]
    legacy = _legacy_type(quantizer)

    if mode == TORCHAO_QAT_MODE:
        config = _torchao_prepare_config(quantizer)
        unsupported = {
            fqn: why for fqn, m in candidates if (why := _group_size_problem(config, m)) is not None
        }
        _report(unsupported, policy, mode)
        allowed = {id(m) for fqn, m in candidates if fqn not in unsupported}
        quant_api = import_torchao("torchao.quantization", "prepare_qat_model")
        quant_api.quantize_(model, config, filter_fn=lambda m, _fqn: id(m) in allowed)
        used: Any = config
    elif legacy is not None:
        shapes = [LinearShape(fqn, m.in_features, m.bias is not None) for fqn, m in candidates]
        used, layout = _legacy_layout(quantizer, legacy, shapes)
        _report(layout.unsupported, policy, mode or legacy)
        with shielded(model, [*layout.unsupported, *adapters]), _quiet_torchao():
            used.prepare(model)
    else:
        with shielded(model, adapters):
            quantizer.prepare(model)
        used = quantizer
    setattr(model, QAT_MODE_ATTR, mode)
    setattr(model, QAT_QUANTIZER_ATTR, used)
    return model, mode


def convert_qat_model(model: nn.Module, quantizer: Any = None) -> nn.Module:
    """Replace the fake-quantized layers of a prepared model with quantized ones, in place.

    Preconditions: ``model`` was prepared by `prepare_qat_model` (or ``quantizer`` is given) and is not
    sharded: under FSDP2, gather a full state dict into an unsharded prepared model first.

    Args:
        model: The prepared model.
        quantizer: What prepared it; default: the one `prepare_qat_model` recorded.

    Returns:
        ``model``, with ``_qat_mode`` reset to None.

    Raises:
        ValueError: A sharded model, or no quantizer known.
    """
    _check_not_sharded(model, "convert_qat_model")
    used = quantizer if quantizer is not None else getattr(model, QAT_QUANTIZER_ATTR, None)
    if used is None:
        raise ValueError(
            "convert_qat_model: the model was not prepared by prepare_qat_model; pass quantizer="
        )
    if get_quantizer_mode(used) == TORCHAO_QAT_MODE:
        qat = import_torchao("torchao.quantization.qat", "convert_qat_model")
        quant_api = import_torchao("torchao.quantization", "convert_qat_model")
        prepared = _torchao_prepare_config(used)
        quant_api.quantize_(model, qat.QATConfig(prepared.base_config, step="convert"))
    else:
        with _quiet_torchao():
            used.convert(model)
    setattr(model, QAT_MODE_ATTR, None)
    setattr(model, QAT_QUANTIZER_ATTR, None)
    return model


def _set_fake_quant(module: nn.Module, enabled: bool) -> None:
    for name in ("activation_fake_quantizer", "weight_fake_quantizer"):
        fake_quantizer = getattr(module, name, None)
        if fake_quantizer is not None and hasattr(fake_quantizer, "enabled"):
            fake_quantizer.enabled = enabled


def _check_mode(mode: str | None) -> str:
    if mode not in _MODES:
        raise ValueError(f"unknown QAT mode {mode!r}; known modes: {list(_MODES)}")
    return mode


def get_enable_fake_quant_fn(mode: str | None) -> Callable[[nn.Module], None]:
    """A per-module function that turns fake quantization on; use it as ``model.apply(fn)``.

    Raises:
        ValueError: An unknown mode.
    """
    _check_mode(mode)
    return lambda module: _set_fake_quant(module, True)


def get_disable_fake_quant_fn(mode: str | None) -> Callable[[nn.Module], None]:
    """A per-module function that turns fake quantization off (layers then compute in high precision).

    Raises:
        ValueError: An unknown mode.
    """
    _check_mode(mode)
    return lambda module: _set_fake_quant(module, False)


def _model_mode(model: nn.Module, mode: str | None) -> str:
    resolved = mode if mode is not None else getattr(model, QAT_MODE_ATTR, None)
    if resolved is None:
        raise ValueError(
            "the model has no QAT mode (was it prepared with prepare_qat_model?); pass mode= explicitly"
        )
    return _check_mode(resolved)


def enable_fake_quant(model: nn.Module, mode: str | None = None) -> nn.Module:
    """Turn fake quantization on in every QAT layer of ``model`` (e.g. after a delay of N steps).

    Args:
        model: A prepared model (plain or sharded).
        mode: Its QAT mode; default ``model._qat_mode``.

    Returns:
        ``model``, mutated.
    """
    model.apply(get_enable_fake_quant_fn(_model_mode(model, mode)))
    return model


def disable_fake_quant(model: nn.Module, mode: str | None = None) -> nn.Module:
    """Turn fake quantization off in every QAT layer of ``model``; see `enable_fake_quant`."""
    model.apply(get_disable_fake_quant_fn(_model_mode(model, mode)))
    return model
