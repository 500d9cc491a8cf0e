"""Apply float8 training (torchao) to a model, and the post-optimizer hook for FP8 all-gather."""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from automodel_quant._deps import import_torchao
from automodel_quant.fp8.config import FP8Config
from automodel_quant.fp8.plan import FP8Plan, resolve_fp8_targets

__all__ = ["apply_fp8_to_model", "precompute_fp8_scales_for_fsdp", "verify_fp8_conversion"]

logger = logging.getLogger(__name__)

#: Attribute set on a converted model (the name the reference system's trainers read).
PRECOMPUTE_ATTR = "precompute_float8_dynamic_scale_for_fsdp"


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (older ones take per-tensor only)."""
    a = torch.zeros(16, 16, device="cpu").to(torch.float8_e4m3fn)
    b = torch.zeros(16, 16, device="cpu").to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(
            a,
            b,
            scale_a=torch.ones(16, 1, device="cpu"),
            scale_b=torch.ones(1, 16, device="cpu"),
            out_dtype=torch.bfloat16,
        )
    except RuntimeError:
        return False
    return True


def _check_hardware(config: FP8Config) -> None:
    if config.emulate:
        return
    if not torch.cuda.is_available():  # CPU: torch runs float8 matmuls (_scaled_mm) on CPU
        if config.recipe_name not in (None, "tensorwise") and not cpu_rowwise_scaled_mm():
            raise ValueError(
                f"FP8Config.recipe_name={config.recipe_name!r} on CPU: this torch {torch.__version__}'s CPU "
                "float8 matmul takes per-tensor scales only; set emulate=True, use the tensorwise recipe, "
                "or run on a GPU"
            )
        return
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise ValueError(
            f"FP8 training needs a GPU with compute capability >= 8.9 (Ada/Hopper), this one has "
            f"{capability[0]}.{capability[1]}; set FP8Config.emulate=True to emulate float8 in high precision"
        )


def _torchao_config(config: FP8Config) -> Any:
    float8 = import_torchao("torchao.float8", "apply_fp8_to_model")
    if config.recipe_name in (None, "tensorwise"):
        return float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather,
            force_recompute_fp8_weight_in_bwd=config.force_recompute_fp8_weight_in_bwd,
            emulate=config.emulate,
        )
    base = float8.Float8LinearConfig.from_recipe_name(config.recipe_name)
    # torch.compile of rowwise scaling must round like eager to keep its numerics (as torchtitan does).
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    return dataclasses.replace(
        base,
        emulate=config.emulate,
        force_recompute_fp8_weight_in_bwd=config.force_recompute_fp8_weight_in_bwd,
    )


def _warn_unsupported(plan: FP8Plan) -> None:
    if not plan.unsupported_dims:
        return
    listing = ", ".join(
        f"{fqn or '<the model>'} {list(shape)}" for fqn, shape in plan.unsupported_dims.items()
    )
    warnings.warn(
        f"FP8: {len(plan.unsupported_dims)} linear layer(s) stay in high precision because a weight dim does "
        f"not divide by 16: {listing}",
        stacklevel=3,
    )


def verify_fp8_conversion(model: nn.Module) -> dict[str, Any]:
    """Count the float8 and high-precision linears of ``model`` (the reference system's statistics).

    A ``Float8Linear`` is recognised by its class name, so this needs no torchao import.

    Returns:
        ``{"linear_count": m, "fp8_count": n, "conversion_rate": 100 * n / m (0 without linears),
        "fp8_modules": [{"name", "type", "weight_shape"}, ...], "success": n > 0}``, where ``m`` counts
        every ``nn.Linear`` (``Float8Linear`` is one).
    """
    fp8_modules: list[dict[str, Any]] = []
    linear_count = 0
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        linear_count += 1
        if type(module).__name__ == "Float8Linear":
            fp8_modules.append(
                {"name": fqn, "type": type(module).__name__, "weight_shape": list(module.weight.shape)}
            )
    return {
        "linear_count": linear_count,
        "fp8_count": len(fp8_modules),
        "conversion_rate": 100.0 * len(fp8_modules) / linear_count if linear_count else 0.0,
        "fp8_modules": fp8_modules,
        "success": bool(fp8_modules),
    }


def apply_fp8_to_model(
    model: nn.Module, config: FP8Config | Mapping[str, Any] | None = None, **legacy_kwargs: Any
) -> nn.Module:
    """Convert the model's eligible linears to torchao ``Float8Linear``, in place.

    Preconditions: before FSDP2/TP (the conversion swaps modules) and after LoRA; the model may be on the
    meta device. Which layers convert is `resolve_fp8_targets`; layers whose dims do not divide by 16
    stay in high precision with one warning listing them. Unlike the reference system, a failed
    conversion raises instead of returning the unconverted model.

    Mutates ``model``: swapped modules, and ``model.precompute_float8_dynamic_scale_for_fsdp`` (bool):
    whether the trainer should call `precompute_fp8_scales_for_fsdp` after each optimizer step.

    Args:
        model: The model.
        config: An `FP8Config` (or its dict). ``enabled=False`` makes this a no-op.
        **legacy_kwargs: The reference system's older keyword form (``recipe_name=``, ``filter_fqns=``,
            ``emulate=``, ``enabled=`` (default True), ...), meaning ``FP8Config(enabled=True,
            **legacy_kwargs)``; only without ``config``.

    Returns:
        ``model``; when ``model`` itself is a bare ``nn.Linear`` that converts, the new ``Float8Linear``
        that replaces it (a root module cannot be swapped in place; use the return value).

    Raises:
        ValueError: ``config`` and keywords together; a GPU older than SM 8.9 without ``emulate``.
        ImportError: torchao is missing.
        RuntimeError: torchao failed to convert, or converted other layers than planned.
    """
    if config is not None and legacy_kwargs:
        raise ValueError(f"apply_fp8_to_model: pass config= or keywords {sorted(legacy_kwargs)}, not both")
    if config is None:
        config = FP8Config.from_dict({"enabled": True, **legacy_kwargs})
    elif not isinstance(config, FP8Config):
        config = FP8Config.from_dict(config)
    if not config.enabled:
        logger.info("FP8 disabled (FP8Config.enabled=False): model unchanged")
        return model
    _check_hardware(config)
    float8 = import_torchao("torchao.float8", "apply_fp8_to_model")
    plan = resolve_fp8_targets(model, config)
    _warn_unsupported(plan)
    if not plan.convert:
        warnings.warn(
            "FP8 is enabled but no linear layer qualifies for float8; model unchanged", stacklevel=2
        )
        setattr(model, PRECOMPUTE_ATTR, False)
        return model
    targets = set(plan.convert)
    ao_config = _torchao_config(config)
    try:
        # torchao swaps children in place but returns a new module for a root nn.Linear.
        model = float8.convert_to_float8_training(
            model, config=ao_config, module_filter_fn=lambda _module, fqn: fqn in targets
        )
    except Exception as exc:
        raise RuntimeError(
            f"FP8 conversion failed ({type(exc).__name__}: {exc}); the model is unusable"
        ) from exc
    converted = {m["name"] for m in verify_fp8_conversion(model)["fp8_modules"]}
    if converted != targets:
        raise RuntimeError(
            f"FP8 conversion converted {sorted(converted ^ targets)} unlike planned; report this as a bug"
        )
    setattr(model, PRECOMPUTE_ATTR, config.precompute_scales)
    logger.info(
        "FP8 (%s%s): %d linears converted, %d excluded, %d kept for their dims",
        config.recipe_name or "tensorwise",
        ", emulated" if config.emulate else "",
        len(targets),
        len(plan.excluded),
        len(plan.unsupported_dims),
    )
    return model


def precompute_fp8_scales_for_fsdp(model: nn.Module) -> bool:
    """The post-optimizer-step hook of FP8 all-gather: precompute every float8 weight's scale.

    Call it on every rank right after ``optimizer.step()``. A no-op (returns False) unless the model was
    converted with tensorwise scaling, ``enable_fsdp_float8_all_gather`` and
    ``precompute_float8_dynamic_scale_for_fsdp``.

    Collectives: one all-reduce (max of the weights' absolute values) over the FSDP mesh.

    Returns:
        Whether scales were computed.
    """
    if not getattr(model, PRECOMPUTE_ATTR, False):
        return False
    float8 = import_torchao("torchao.float8", "precompute_fp8_scales_for_fsdp")
    float8.precompute_float8_dynamic_scale_for_fsdp(model)
    return True
