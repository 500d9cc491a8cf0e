"""Apply LoRA / DoRA adapters with Hugging Face ``peft``, freeze the base, initialise the adapters.

Adapters are injected in place with ``peft.inject_adapter_in_model``, not ``get_peft_model``: the model
keeps its class (transformers' helpers, ``_no_split_modules`` and the FSDP2 unit plan keep working) and
its parameter names, except that an adapted linear's weight moves under peft's ``base_layer``
(``...q_proj.base_layer.weight``; `hf_checkpoint_key` maps it back to the checkpoint's
``...q_proj.weight``). That ``base_layer`` / ``lora_A`` / ``lora_B`` shape is what
``automodel_distributed.tensor_parallel`` recognises to shard adapters with their base weight.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel_modules import is_conv1d, is_dtensor
from automodel_peft._names import clean_fqn, hf_checkpoint_key, is_adapter_name
from automodel_peft.config import DEFAULT_TARGET_MODULES, PeftConfig
from automodel_peft.dropout import install_post_dropout
from automodel_peft.lora_layers import lora_layers
from automodel_peft.matching import is_linear_layer, resolve_target_modules, unmatched_patterns

if TYPE_CHECKING:
    import peft

__all__ = [
    "ADAPTER_STATE_ATTR",
    "AdapterState",
    "adapter_initializer",
    "apply_lora",
    "apply_lora_to_linear_modules",
    "freeze_base",
    "init_adapter_weights",
]

logger = logging.getLogger(__name__)

#: Attribute of an adapted model holding its `AdapterState`.
ADAPTER_STATE_ATTR = "_automodel_adapter_state"


@dataclass(frozen=True)
class AdapterState:
    """What `apply_lora` did, kept on the model for initialisation, saving and merging.

    Attributes:
        adapter_name: peft adapter name.
        lora_config: The ``peft.LoraConfig`` injected (explicit target names for a `PeftConfig`).
        config: The `PeftConfig`, or None when a ``peft.LoraConfig`` was given.
        targets: Names of the adapted modules.
        lora_A_init: ``"xavier"`` or ``"kaiming"``.
    """

    adapter_name: str
    lora_config: Any
    config: PeftConfig | None
    targets: tuple[str, ...]
    lora_A_init: str


def _lora_config_class() -> type[peft.LoraConfig]:
    import peft

    return peft.LoraConfig


def _normalise(config: object) -> PeftConfig | peft.LoraConfig:
    if isinstance(config, PeftConfig):
        return config
    if isinstance(config, Mapping):
        return PeftConfig.from_dict(config)
    if isinstance(config, _lora_config_class()):
        return config
    raise ValueError(
        f"apply_lora needs a PeftConfig, its dict or a peft.LoraConfig, got {type(config).__name__}"
    )


def freeze_base(model: nn.Module) -> int:
    """Make only adapter parameters trainable: ``requires_grad`` False on everything else. In place.

    Returns:
        Number of trainable parameter elements left.
    """
    trainable = 0
    for name, param in model.named_parameters():
        is_adapter = is_adapter_name(name)
        param.requires_grad_(is_adapter)
        trainable += param.numel() if is_adapter else 0
    return trainable


def _adapter_params(layer: Any, adapter: str) -> list[nn.Parameter]:
    params = [*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters()]
    magnitudes = getattr(layer, "lora_magnitude_vector", None)
    if isinstance(magnitudes, nn.ModuleDict) and adapter in magnitudes:
        params += list(magnitudes[adapter].parameters())
    return params


def _assign(param: Any, full: torch.Tensor) -> None:
    """Copy a full-size value into ``param`` (its shard, for a DTensor: scattered from rank 0)."""
    full = full.to(dtype=param.dtype)
    with torch.no_grad():
        if is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor

            shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full.to(param.device))


def _full(t: Any) -> torch.Tensor:
    full: torch.Tensor = t.full_tensor() if is_dtensor(t) else t
    return full


def _warn_unmatched_patterns(model: nn.Module, cfg: PeftConfig) -> None:
    """Name each ``target_modules`` / ``exclude_modules`` entry that matches no linear layer."""
    given = {"target_modules": cfg.target_modules, "exclude_modules": cfg.exclude_modules}
    if list(cfg.target_modules) == list(DEFAULT_TARGET_MODULES):
        del given["target_modules"]  # the default, chosen (with a warning) when nothing was given
    for field_name, patterns in given.items():
        unmatched = unmatched_patterns(model, patterns)
        if unmatched:
            warnings.warn(
                f"PeftConfig.{field_name} entries {unmatched} match no linear layer of "
                f"{type(model).__name__} and act on nothing; check the names (fused expert weights are "
                "parameters: see target_parameters)",
                stacklevel=4,
            )


def _init_a(shape: torch.Size, method: str) -> torch.Tensor:
    # Drawn on the host, so every device and layout starts from the same numbers for one seed.
    value = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    if method == "xavier":
        nn.init.xavier_uniform_(value)
    else:
        nn.init.kaiming_uniform_(value, a=math.sqrt(5))
    return value


def init_adapter_weights(
    model: nn.Module, *, lora_A_init: str | None = None, adapter_name: str | None = None
) -> None:
    """(Re)initialise every adapter: A random, B zero, DoRA magnitudes from the current base weights.

    Call it after the model is materialised and its base weights are loaded (DoRA magnitudes are the
    row norms of the loaded weights), e.g. after ``to_empty`` + checkpoint load of a model adapted on the
    meta device. Works on plain and sharded (DTensor) models; with DTensors it is a collective: call it
    on every rank, with the same model. Random values come from rank 0 (scattered), so every rank agrees.

    Args:
        model: An adapted model.
        lora_A_init: ``"xavier"`` or ``"kaiming"``; default the one `apply_lora` recorded, else kaiming.
        adapter_name: Only this adapter; default all.

    Raises:
        ValueError: Adapter parameters still on the meta device, or an unknown init method.
    """
    state: AdapterState | None = getattr(model, ADAPTER_STATE_ATTR, None)
    method = lora_A_init or (state.lora_A_init if state is not None else "kaiming")
    if method not in ("xavier", "kaiming"):
        raise ValueError(f"lora_A_init={method!r}; use 'xavier' or 'kaiming'")
    for name, layer, adapter in lora_layers(model, adapter_name):
        params = _adapter_params(layer, adapter)
        if any(p.is_meta for p in params):
            raise ValueError(
                f"{name}: adapter {adapter!r} is still on the meta device; materialise the model first"
            )
        lora_a = layer.lora_A[adapter].weight
        _assign(lora_a, _init_a(lora_a.shape, method))
        with torch.no_grad():
            layer.lora_B[adapter].weight.zero_()
        magnitudes = getattr(layer, "lora_magnitude_vector", None)
        if isinstance(magnitudes, nn.ModuleDict) and adapter in magnitudes:
            base = _full(layer.get_base_layer().weight)
            _assign(magnitudes[adapter].weight, torch.linalg.norm(base, dim=1))


def adapter_initializer(
    config: PeftConfig | peft.LoraConfig | Mapping[str, Any],
) -> Callable[[nn.Module], None]:
    """`init_adapter_weights` bound to the config's ``lora_A_init``.

    What a checkpoint loader calls, once, after the base weights are final (the ``init_adapters`` of
    ``automodel_checkpoint.load_hf_checkpoint``). A ``peft.LoraConfig`` has no
    ``lora_A_init``: then what `apply_lora` recorded, else kaiming.
    """
    method = (
        config.get("lora_A_init") if isinstance(config, Mapping) else getattr(config, "lora_A_init", None)
    )
    return functools.partial(init_adapter_weights, lora_A_init=method)


def _check_fresh(model: nn.Module, adapter_name: str) -> None:
    existing = sorted({name for name, _, adapter in lora_layers(model) if adapter == adapter_name})
    if existing:
        raise ValueError(
            f"the model already has a LoRA adapter {adapter_name!r} (e.g. on {existing[0]}); apply_lora "
            "once, or use another adapter_name"
        )


@contextlib.contextmanager
def _targets_as_given() -> Iterator[None]:
    """Inject with the target modules as given, without peft's transformers-4 compatibility rewrite.

    For MoE families whose experts transformers 5 fuses, peft rewrites targets named like transformers
    4's expert projections (``gate_proj``, ``up_proj``, ``down_proj``, the router ``gate``) into the fused
    expert parameters, so that adapters trained on transformers 4 still load. Our targets are resolved
    against this model's own modules, so the rewrite would only drop planned linears of the dense layers
    and shared experts (and add the fused experts): it is switched off for this call alone.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft without the rewrite
        yield
        return
    original = conversion.convert_peft_config_for_transformers

    def as_given(peft_config: Any, model: nn.Module, conversions: Any) -> None:
        del peft_config, model, conversions

    conversion.convert_peft_config_for_transformers = as_given
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _check_target_parameters(model: nn.Module, targets: list[str]) -> None:
    """Every ``target_parameters`` entry names some parameter (as peft matches: the name or a suffix)."""
    names = [name for name, _ in model.named_parameters()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"PeftConfig.target_parameters {missing} match no parameter of {type(model).__name__} (give a "
            "parameter name or a dotted suffix of one, e.g. 'mlp.experts.gate_up_proj')"
        )


def _inject(model: nn.Module, lora_config: Any, adapter_name: str, skip_freeze: bool) -> None:
    import peft

    saved = {name: p.requires_grad for name, p in model.named_parameters()} if skip_freeze else {}
    with _targets_as_given():
        peft.inject_adapter_in_model(lora_config, model, adapter_name=adapter_name)
    for name, param in model.named_parameters():
        before = saved.get(name, saved.get(hf_checkpoint_key(name)))  # a wrapped weight is now base_layer.*
        if before is not None and not is_adapter_name(name):
            param.requires_grad_(before)  # peft freezes the base itself; skip_freeze undoes that


def _finish_adapters(
    model: nn.Module, adapter: str, dtype: torch.dtype | None, post_dropout: float, method: str
) -> None:
    for _, layer, name in lora_layers(model, adapter):
        if dtype is not None:
            for param in _adapter_params(layer, name):
                param.data = param.data.to(dtype)
        if post_dropout > 0:
            install_post_dropout(layer.lora_B[name], post_dropout)
        lora_a = layer.lora_A[name].weight
        if method == "xavier" and not lora_a.is_meta:
            with torch.no_grad():
                lora_a.copy_(_init_a(lora_a.shape, "xavier"))


def _fan_in_fan_out(model: nn.Module, targets: Sequence[str]) -> dict[str, bool]:
    """The ``fan_in_fan_out`` peft needs: True for transformers' ``Conv1D`` (weight stored ``(in, out)``).

    peft keeps one value per config, so targets of both kinds are refused.

    Raises:
        ValueError: The targets mix ``Conv1D`` and `nn.Linear` layers.
    """
    modules = {clean_fqn(name): module for name, module in model.named_modules()}
    kinds = {is_conv1d(modules[name]) for name in targets if name in modules}
    if len(kinds) > 1:
        conv = [n for n in targets if n in modules and is_conv1d(modules[n])][:3]
        raise ValueError(
            f"PeftConfig targets both transformers Conv1D layers ({conv}, ...) and nn.Linear layers; peft "
            "stores their weights transposed from each other under one fan_in_fan_out setting: adapt one "
            "kind per config (target_modules or exclude_modules)"
        )
    return {"fan_in_fan_out": True} if kinds == {True} else {}


def apply_lora(
    model: nn.Module,
    config: PeftConfig | peft.LoraConfig | Mapping[str, Any],
    *,
    quantization_config: object = None,
    skip_freeze: bool = False,
    adapter_name: str = "default",
) -> nn.Module:
    """Add LoRA (or DoRA) adapters to the model's matching linear layers, in place, with ``peft``.

    Preconditions: the model is not sharded yet (adapters come before FP8, QAT, TP and FSDP2); it may be
    on the meta device (then call `init_adapter_weights` after materialising and loading it), except with
    ``quantization_config``, which needs loaded weights.

    Steps: resolve the targets (`resolve_target_modules`; a ``peft.LoraConfig`` uses peft's own
    matching); with ``quantization_config``, quantize the base linears with bitsandbytes unless the model
    already is (QLoRA); ``peft.inject_adapter_in_model``; cast the adapters to ``lora_dtype`` (default: the
    base dtype, or the quantization compute dtype); install "post" dropout; re-initialise A with xavier when
    asked; freeze everything but the adapters (unless ``skip_freeze``).

    Mutates ``model``: LoRA layers replace the targets (base weights under ``base_layer``), parameters'
    ``requires_grad``, ``model.peft_config`` (peft's record) and the `AdapterState` attribute.

    Args:
        model: A transformers model (or any module with linears).
        config: A `PeftConfig`, its dict, or a ``peft.LoraConfig`` used as is.
        quantization_config: A `automodel_quant.bnb.BnBQuantizationConfig` (or its dict) for QLoRA.
        skip_freeze: Leave ``requires_grad`` of the base parameters as it was (freeze later).
        adapter_name: peft adapter name.

    Returns:
        ``model``.

    Raises:
        ValueError: A bad config, no matching module, an adapter of that name already present, DoRA with
            quantization, quantization of meta weights.
        ImportError: QLoRA without automodel-quant (``pip install automodel-peft[quant]``) or bitsandbytes.
        RuntimeError: QLoRA without CUDA (unless the quantization config allows CPU).
    """
    cfg = _normalise(config)
    _check_fresh(model, adapter_name)
    peft_cfg = cfg if isinstance(cfg, PeftConfig) else None
    if peft_cfg is not None:
        peft_cfg.warn_ignored()
    use_dora = bool(cfg.use_dora)
    quant_dtype: torch.dtype | None = None
    if quantization_config is not None:
        from automodel_peft.qlora import prepare_quantized_base

        quant_dtype = prepare_quantized_base(model, quantization_config, use_dora=use_dora)
    if peft_cfg is not None:
        targets = resolve_target_modules(model, peft_cfg)
        if not targets:
            linears = [n for n, m in model.named_modules() if is_linear_layer(m)][:8]
            raise ValueError(
                f"PeftConfig matches no linear layer (target_modules={peft_cfg.target_modules}, "
                f"exclude_modules="
                f"{peft_cfg.exclude_modules}, match_all_linear={peft_cfg.match_all_linear}); linears include "
                f"{linears}"
            )
        _warn_unmatched_patterns(model, peft_cfg)
        _check_target_parameters(model, peft_cfg.target_parameters)
        lora_config: Any = peft_cfg.to_lora_config(targets, **_fan_in_fan_out(model, targets))
    else:
        lora_config = cfg
    _inject(model, lora_config, adapter_name, skip_freeze)
    adapted = tuple(clean_fqn(name) for name, _, _ in lora_layers(model, adapter_name))
    # Parameter adapters (peft's ParamWrapper, from target_parameters) are not among the planned linears.
    adapted_linears = {
        clean_fqn(name)
        for name, layer, _ in lora_layers(model, adapter_name)
        if not hasattr(layer, "parameter_name")
    }
    if peft_cfg is not None and adapted_linears != set(targets):
        raise RuntimeError(
            f"peft adapted {sorted(adapted_linears ^ set(targets))} unlike planned; report this as a bug"
        )
    dtype = (peft_cfg.lora_dtype if peft_cfg is not None else None) or quant_dtype
    method = peft_cfg.lora_A_init if peft_cfg is not None else "kaiming"
    _finish_adapters(model, adapter_name, dtype, peft_cfg.post_dropout if peft_cfg else 0.0, method)
    if not skip_freeze:
        freeze_base(model)
    setattr(model, ADAPTER_STATE_ATTR, AdapterState(adapter_name, lora_config, peft_cfg, adapted, method))
    logger.info(
        "LoRA%s: %d modules adapted (rank %s)", " (DoRA)" if use_dora else "", len(adapted), lora_config.r
    )
    return model


def apply_lora_to_linear_modules(
    model: nn.Module,
    peft_config: PeftConfig | peft.LoraConfig | Mapping[str, Any],
    quantization_config: object = None,
    skip_freeze: bool = False,
) -> int:
    """The reference system's entry point: `apply_lora`, returning the number of adapted modules."""
    apply_lora(model, peft_config, quantization_config=quantization_config, skip_freeze=skip_freeze)
    state: AdapterState = getattr(model, ADAPTER_STATE_ATTR)
    return len(state.targets)
