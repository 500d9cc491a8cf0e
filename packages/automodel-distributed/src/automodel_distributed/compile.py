"""``torch.compile`` for a whole model (`compile_model`) or per transformer block in place (`compile_blocks`).

Under FSDP2 compile each block after ``fully_shard`` with `compile_blocks`: ``Module.compile()`` compiles in
place, so parameter FQNs (and checkpoint keys) keep their names. `compile_model` returns torch's
``OptimizedModule``, whose state-dict keys gain an ``_orig_mod.`` prefix; use it for DDP or single-device
models whose checkpoints are saved from the unwrapped module.

Failures are not hidden: NeMo AutoModel logs a failed ``torch.compile`` and runs eagerly; here errors
propagate, because a silently eager model is a silently slower model. Note that ``torch.compile`` is lazy:
graph-capture and backend errors surface at the first forward, from dynamo. Setting
``torch._dynamo.config.suppress_errors = True`` yourself restores a fall-back to eager.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from automodel_distributed.blocks import find_transformer_blocks
from automodel_distributed.config import CompileConfig

__all__ = [
    "build_compile_config",
    "compile_blocks",
    "compile_kwargs",
    "compile_model",
    "compile_module_inplace",
    "configure_dynamo",
    "configure_torch_dynamo",
    "create_compile_config_from_dict",
]

logger = logging.getLogger(__name__)


def build_compile_config(config: CompileConfig | Mapping[str, Any] | None) -> CompileConfig:
    """``None`` -> ``CompileConfig()`` (disabled); a `CompileConfig` -> itself; a dict -> `from_dict`.

    Raises:
        ValueError: A dict with an unknown key (the reference system ignores unknown keys).
    """
    if config is None:
        return CompileConfig()
    if isinstance(config, CompileConfig):
        return config
    return CompileConfig.from_dict(config)


def create_compile_config_from_dict(config_dict: Mapping[str, Any]) -> CompileConfig:
    """The reference system's name for `CompileConfig.from_dict` (missing keys take the defaults).

    Raises:
        ValueError: An unknown key (the reference system ignores unknown keys).
    """
    return CompileConfig.from_dict(config_dict)


def configure_torch_dynamo(cache_size_limit: int = 256, capture_scalar_outputs: bool = True) -> None:
    """Raise dynamo's recompilation cache limits to ``cache_size_limit`` (never lower them).

    Mutates the process-wide ``torch._dynamo.config``: ``cache_size_limit`` and
    ``accumulated_cache_size_limit`` become at least ``cache_size_limit``; with
    ``capture_scalar_outputs`` (the reference system's default), ``.item()`` is traced into the graph
    instead of breaking it.
    """
    import torch._dynamo

    dynamo_config: Any = torch._dynamo.config
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, cache_size_limit)
    dynamo_config.accumulated_cache_size_limit = max(
        dynamo_config.accumulated_cache_size_limit, cache_size_limit
    )
    if capture_scalar_outputs:
        dynamo_config.capture_scalar_outputs = True


def configure_dynamo(config: CompileConfig) -> None:
    """Apply the process-wide dynamo settings of ``config``: its cache size limit.

    That is `configure_torch_dynamo` without scalar capture, which would change what dynamo traces. A
    limit below the process's current one is named in a warning: it never lowers a limit someone raised.
    """
    import torch._dynamo

    current = torch._dynamo.config.cache_size_limit
    if config.dynamo_cache_size_limit < current:
        warnings.warn(
            f"CompileConfig.dynamo_cache_size_limit={config.dynamo_cache_size_limit} ignored: "
            f"torch._dynamo.config.cache_size_limit is already {current} in this process, and the setting "
            "only raises it",
            stacklevel=3,
        )
    configure_torch_dynamo(config.dynamo_cache_size_limit, capture_scalar_outputs=False)


def compile_kwargs(config: CompileConfig) -> dict[str, Any]:
    """Keyword arguments of ``torch.compile`` / ``Module.compile`` from ``config``.

    ``mode`` is passed unless ``options`` are given (torch accepts only one of the two); ``backend=None``
    means inductor.

    Raises:
        ValueError: ``options`` together with a non-default ``mode``.
    """
    if config.options and config.mode != "default":
        raise ValueError(
            f"CompileConfig.mode={config.mode!r} and CompileConfig.options cannot both be used "
            "(torch.compile takes one of them); put the mode's settings into options or drop options"
        )
    kwargs: dict[str, Any] = {
        "fullgraph": config.fullgraph,
        "dynamic": config.dynamic,
        "backend": config.backend or "inductor",
    }
    if config.options:
        kwargs["options"] = dict(config.options)
    else:
        kwargs["mode"] = config.mode
    return kwargs


def compile_model(model: nn.Module, config: CompileConfig) -> nn.Module:
    """Compile the whole model with ``torch.compile`` when ``config.enabled``.

    Preconditions: apply after sharding and activation checkpointing. No collectives.

    Args:
        model: The model; not mutated (apart from the global dynamo settings of `configure_dynamo`).
        config: The compile settings.

    Returns:
        ``model`` itself when compilation is disabled, else torch's ``OptimizedModule`` wrapping it (its
        parameter names start with ``_orig_mod.``).

    Raises:
        Whatever ``torch.compile`` raises when it wraps the model (e.g. an unknown backend); compile
        errors at the first forward come from dynamo and are not caught either.
    """
    if not config.enabled:
        return model
    configure_dynamo(config)
    kwargs = compile_kwargs(config)
    logger.info("torch.compile(%s, %s)", type(model).__name__, kwargs)
    compiled: nn.Module = torch.compile(model, **kwargs)  # type: ignore[assignment]
    return compiled


def compile_module_inplace(module: nn.Module, config: CompileConfig) -> None:
    """Compile ``module`` in place with ``Module.compile()`` when ``config.enabled``; else a no-op.

    No wrapper: the parameter names stay. Compilation is lazy: errors surface at the first forward.

    Raises:
        ValueError: ``options`` together with a non-default ``mode``.
    """
    if not config.enabled:
        return
    configure_dynamo(config)
    module.compile(**compile_kwargs(config))


def compile_blocks(model: nn.Module, config: CompileConfig | None = None) -> nn.Module:
    """Compile every transformer block in place with ``Module.compile()``.

    Parameter FQNs do not change (no ``_orig_mod.`` segment), so checkpoints load and save as before. A
    block wrapped by activation checkpointing is compiled as a whole, wrapper included; blocks already
    compiled are skipped.

    Preconditions: apply after tensor parallelism, activation checkpointing and ``fully_shard``.

    Args:
        model: The model; its blocks are mutated.
        config: Compile settings (``enabled`` is not consulted: calling this function is the request);
            ``None`` means ``CompileConfig()`` defaults (inductor, default mode).

    Returns:
        ``model``.

    Raises:
        ValueError: The model has no transformer blocks.
    """
    config = config if config is not None else CompileConfig()
    configure_dynamo(config)
    kwargs = compile_kwargs(config)
    compiled = 0
    for _, block in find_transformer_blocks(model):
        if getattr(block, "_compiled_call_impl", None) is not None:
            continue
        block.compile(**kwargs)
        compiled += 1
    logger.info("compiled %d block(s) of %s in place (%s)", compiled, type(model).__name__, kwargs)
    return model
