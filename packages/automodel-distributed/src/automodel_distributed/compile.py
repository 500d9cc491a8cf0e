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
from typing import Any

import torch
from torch import nn

from automodel_distributed.config import CompileConfig
from automodel_distributed.layers import find_transformer_blocks

__all__ = ["compile_blocks", "compile_kwargs", "compile_model", "configure_dynamo"]

logger = logging.getLogger(__name__)


def configure_dynamo(config: CompileConfig) -> None:
    """Apply the process-wide dynamo settings of ``config`` (its recompilation cache size limit).

    Mutates the global ``torch._dynamo.config.cache_size_limit`` (and raises
    ``accumulated_cache_size_limit`` to at least the same value).
    """
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = config.dynamo_cache_size_limit
    accumulated = torch._dynamo.config.accumulated_cache_size_limit
    torch._dynamo.config.accumulated_cache_size_limit = max(accumulated, config.dynamo_cache_size_limit)


def compile_kwargs(config: CompileConfig) -> dict[str, Any]:
    """Keyword arguments of ``torch.compile`` / ``Module.compile`` from ``config``.

    ``mode`` is passed unless ``options`` are given with the default mode (torch accepts only one of the
    two); ``backend=None`` means inductor.
    """
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
