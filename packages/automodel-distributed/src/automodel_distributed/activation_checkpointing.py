"""Activation checkpointing of transformer blocks: full recompute or selective (save some ops).

Both modes wrap each block in scope with torch's ``checkpoint_wrapper`` (non-reentrant
``torch.utils.checkpoint``) inside its parent container, so they compose with FSDP2, DDP, tensor
parallelism and per-block compile the same way. Apply it after tensor parallelism and before
``fully_shard`` / DDP / compile. The wrapper inserts ``_checkpoint_wrapped_module.`` into parameter FQNs.

Selective mode keeps the outputs of expensive or communicating ops and recomputes the cheap rest; the op
lists (`SELECTIVE_AC_MATMUL_OPS`, `SELECTIVE_AC_ALWAYS_SAVE_OPS`) are data. Either mode takes more ops to
save (``save_ops``: the save-ops policy hook): mixture-of-experts models save their router's outputs
(``automodel_moe.ROUTER_SAVE_OPS``) so that recompute routes every token exactly as forward did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from automodel_distributed.blocks import blockless_parts, blocks_in_scope, find_transformer_blocks
from automodel_distributed.config import normalize_activation_checkpointing
from automodel_distributed.multimodal import LANGUAGE, PROJECTOR, model_parts

__all__ = [
    "SELECTIVE_AC_ALWAYS_SAVE_OPS",
    "SELECTIVE_AC_IGNORED_OPS",
    "SELECTIVE_AC_MATMUL_OPS",
    "SUBMODULE_CHECKPOINT_ROLES",
    "apply_activation_checkpointing",
    "apply_submodule_checkpointing",
    "check_checkpointing_scope",
    "disable_kv_cache",
    "ignore_annotations_in_selective_checkpointing",
    "resolve_checkpointing_mode",
    "selective_checkpoint_policy",
    "unwrap_checkpoint_wrapper",
]

logger = logging.getLogger(__name__)

SELECTIVE_AC_MATMUL_OPS: tuple[str, ...] = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
"""Matmul ops (``namespace.op.overload``): selective AC saves the output of every other one per block
call (the 1st, 3rd, ...), halving their recompute cost for half their memory."""

SELECTIVE_AC_ALWAYS_SAVE_OPS: tuple[str, ...] = (
    # Attention kernels: the most expensive op of a block to recompute.
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    # Low-precision matmul. (Router top-k is not saved: eager recompute is deterministic, and models such
    # as Mixtral normalise the top-k values in place, which a saved output must not see.)
    "aten._scaled_mm.default",
    # Communication: recomputing it would repeat the collective in backward.
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_gather_into_tensor.default",
)
"""Ops (``namespace.op.overload``) whose outputs selective AC always saves. Names missing from the
installed torch are skipped."""

SELECTIVE_AC_IGNORED_OPS: tuple[str, ...] = (
    "profiler._record_function_enter.default",
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit.default",
    "profiler._record_function_exit._RecordFunction",
)
"""Profiler ranges: selective checkpointing runs them as they come and keeps them out of its replay
accounting (`ignore_annotations_in_selective_checkpointing`). They annotate, they compute nothing, and the
forward and its recompute legitimately open different ranges: an FSDP2 unit nested inside a
checkpointed block (the experts on ``ep_shard``) is still idle when the block's recompute starts (its
output's gradient has not arrived, e.g. DeepSeek-V3's shared experts are recomputed first), so its hooks
take FSDP's forward-root path on recompute and open ``FSDP::root_pre_forward``, which the forward, under
the model's root, never did. torch counts every op per kind and fails on the extra one."""

_AC_MODE_ATTR = "_automodel_ac_mode"

SUBMODULE_CHECKPOINT_ROLES: dict[str, tuple[str, ...]] = {
    "mlp": ("mlp", "feed_forward", "ffn"),
    "attention": ("self_attn", "attention", "attn", "linear_attn"),
    "pre_norm": ("input_layernorm", "attention_norm", "layer_norm1", "norm1"),
    "post_norm": ("post_attention_layernorm", "ffn_norm", "layer_norm2", "norm2"),
}
"""`apply_submodule_checkpointing`: per role, the child names a decoder layer may use (first found wins)."""


def resolve_checkpointing_mode(setting: object) -> Literal["full", "selective"] | None:
    """Map a config's ``activation_checkpointing`` to ``None`` (off), ``"full"`` or ``"selective"``.

    Accepts what `automodel_distributed.config.normalize_activation_checkpointing` accepts (``True`` means
    ``"full"``).

    Raises:
        ValueError: Any other value.
    """
    if setting is None:
        return None
    mode: Literal["full", "selective"] | Literal[False] = normalize_activation_checkpointing(setting)
    return mode or None


def _resolve_ops(names: tuple[str, ...]) -> frozenset[Any]:
    ops: set[Any] = set()
    for name in names:
        namespace, op_name, overload = name.split(".")
        try:
            ops.add(getattr(getattr(getattr(torch.ops, namespace), op_name), overload))
        except (AttributeError, RuntimeError):
            logger.debug("selective AC: op %s is not available in this torch build", name)
    return frozenset(ops)


def _reads_to_host(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``op`` reads an accelerator tensor back to the host (``.tolist()``, ``.item()``, ``.cpu()``).

    Each is a host sync (the CPU waits for the device's queue to drain); saved, recompute gets the host
    copy back instead of waiting again. The values are tiny (counts, sizes), so saving costs nothing.
    """
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or source.device.type == "cpu":
        return False
    if op is torch.ops.aten._local_scalar_dense.default:
        return True
    target = kwargs.get("device")
    return op is torch.ops.aten._to_copy.default and target is not None and torch.device(target).type == "cpu"


def selective_checkpoint_policy(
    save_ops: Sequence[str] = (), *, save_matmuls: bool = True
) -> Callable[..., CheckpointPolicy]:
    """Build a fresh selective-AC policy (one per checkpointed block call: it counts matmuls).

    Args:
        save_ops: More ops (``namespace.op.overload``) whose outputs are always saved.
        save_matmuls: Save every other matmul and the ops of `SELECTIVE_AC_ALWAYS_SAVE_OPS` (selective
            mode); False saves only ``save_ops`` (full recompute of everything else).

    Returns:
        A ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`` for
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: ``MUST_SAVE`` for ``save_ops``,
        the ops in `SELECTIVE_AC_ALWAYS_SAVE_OPS`, every other matmul of `SELECTIVE_AC_MATMUL_OPS` (the
        1st, 3rd, ...) and every read of an accelerator tensor back to the host (so recompute repeats
        no host sync: expert parallelism's split sizes), ``PREFER_RECOMPUTE`` for everything else.
    """
    matmuls = _resolve_ops(SELECTIVE_AC_MATMUL_OPS) if save_matmuls else frozenset()
    always = _resolve_ops((*SELECTIVE_AC_ALWAYS_SAVE_OPS, *save_ops) if save_matmuls else tuple(save_ops))
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in always or _reads_to_host(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if op in matmuls:
            # torch >= 2.12 only calls the policy in forward; older ones also call it on recompute.
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def ignore_annotations_in_selective_checkpointing() -> None:
    """Keep the ops of `SELECTIVE_AC_IGNORED_OPS` out of selective checkpointing's replay accounting.

    Adds them to ``torch.utils.checkpoint.SAC_IGNORED_OPS``, torch's own set of ops that selective
    checkpointing executes directly, neither saved nor counted (it holds ``aten.detach`` for the same
    reason: forward and recompute run different numbers of them). Process-wide and idempotent; ops the
    installed torch lacks are skipped. Called by `apply_activation_checkpointing` whenever it builds a
    selective context. No collectives.
    """
    torch_checkpoint.SAC_IGNORED_OPS.update(_resolve_ops(SELECTIVE_AC_IGNORED_OPS))


def _context_fn(save_ops: tuple[str, ...], save_matmuls: bool) -> Callable[[], tuple[Any, Any]]:
    ignore_annotations_in_selective_checkpointing()

    def context_fn() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(
            selective_checkpoint_policy(save_ops, save_matmuls=save_matmuls)
        )

    return context_fn


def _iter_configs(model: nn.Module) -> Iterator[Any]:
    """Every transformers config reachable from ``model``: each module's ``config`` and its sub-configs."""
    from transformers import PreTrainedConfig

    seen: set[int] = set()
    stack: list[Any] = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        config = stack.pop()
        if not isinstance(config, PreTrainedConfig) or id(config) in seen:
            continue
        seen.add(id(config))
        yield config
        stack.extend(vars(config).values())


def disable_kv_cache(model: nn.Module) -> list[str]:
    """Set ``use_cache=False`` on every transformers config of ``model``, sub-configs included.

    A KV cache is wrong under recompute (the recomputed forward appends to it a second time) and useless
    in training. Each change is logged at INFO.

    Returns:
        The config class names that were changed.
    """
    changed: list[str] = []
    for config in _iter_configs(model):
        if getattr(config, "use_cache", False):
            config.use_cache = False
            changed.append(type(config).__name__)
    if changed:
        logger.info("activation checkpointing: set use_cache=False on %s", ", ".join(changed))
    return changed


def _set_child(model: nn.Module, fqn: str, child: nn.Module) -> None:
    """Replace the sub-module at ``fqn`` (as spelled by `find_transformer_blocks`) with ``child``."""
    *path, name = fqn.split(".")
    parent = model
    for part in path:
        parent = getattr(parent, part)
        if isinstance(parent, CheckpointWrapper):
            parent = parent._checkpoint_wrapped_module
    setattr(parent, name, child)


def check_checkpointing_scope(model: nn.Module, scope: tuple[str, ...]) -> None:
    """Refuse a scope that names a tower with no blocks: it would silently wrap nothing there.

    ``scope`` is normalised (`automodel_distributed.config.normalize_activation_checkpointing_scope`).
    Reads only; no collective.

    Raises:
        ValueError: A tower in ``scope`` (``vision``, ``audio``; every tower for ``multimodal``) has no
            block of `automodel_distributed.blocks.find_transformer_blocks` (names the towers).
    """
    if scope == ("all",):
        return
    parts = model_parts(model).parts
    towers = [role for role in parts if role not in (LANGUAGE, PROJECTOR)]
    roles = [role for role in towers if role in scope or "multimodal" in scope]
    bare = blockless_parts(model, roles)
    if bare:
        raise ValueError(
            f"activation_checkpointing_scope={scope!r}: the {' and '.join(sorted({r for r, _ in bare}))} "
            f"part(s) {[fqn for _, fqn in bare]} of {type(model).__name__} have no repeated blocks to "
            "checkpoint (no class of `_no_split_modules` inside them and no nn.ModuleList of blocks); "
            "leave them out of the scope (e.g. 'language'), or add the tower's block class to the model's "
            "`_no_split_modules`"
        )


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    mode: Literal["full", "selective"],
    scope: tuple[str, ...] = ("all",),
    save_ops: Sequence[str] = (),
) -> nn.Module:
    """Wrap the transformer blocks in ``scope`` with activation checkpointing, in place.

    ``"full"`` recomputes each block's whole forward in backward; ``"selective"`` saves the ops chosen by
    `selective_checkpoint_policy` and recomputes the rest; ``save_ops`` are saved in either mode (the
    save-ops policy hook). All use ``checkpoint_wrapper`` with ``CheckpointImpl.NO_REENTRANT`` around the
    block in its parent container. Also sets ``use_cache=False`` on the model's configs
    (`disable_kv_cache`), and, when it saves anything, keeps profiler ranges out of selective
    checkpointing's accounting (`ignore_annotations_in_selective_checkpointing`).

    Idempotent: a block that is already checkpoint-wrapped is left as it is (with a warning when its
    mode differs from ``mode``).

    Preconditions: apply after tensor parallelism and before ``fully_shard``, DDP and per-block compile.
    Works on meta-device models (nothing is allocated). No collectives.

    Args:
        model: A transformers model (or any model `find_transformer_blocks` understands).
        mode: ``"full"`` or ``"selective"``.
        scope: Layer groups to checkpoint, normalised as by
            `automodel_distributed.config.normalize_activation_checkpointing_scope`.
        save_ops: Ops (``namespace.op.overload``) whose outputs are saved instead of recomputed (names
            missing from the installed torch are skipped).

    Returns:
        ``model`` itself (its block containers now hold ``CheckpointWrapper`` modules).

    Raises:
        ValueError: An unknown ``mode`` or scope, a model without transformer blocks, or a scope naming
            a tower that has no blocks (`automodel_distributed.blocks.blockless_parts`).
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode={mode!r} is not valid; use 'full' or 'selective'")
    blocks = blocks_in_scope(model, scope)
    check_checkpointing_scope(model, scope)
    if not blocks:
        logger.warning(
            "activation checkpointing: no block of %s is in scope %s (blocks: %s); nothing wrapped",
            type(model).__name__,
            scope,
            [fqn for fqn, _ in find_transformer_blocks(model)][:4],
        )
        return model
    disable_kv_cache(model)
    wrapped = 0
    for fqn, block in blocks:
        if isinstance(block, CheckpointWrapper):
            existing = getattr(block, _AC_MODE_ATTR, "full")
            if existing != mode:
                logger.warning(
                    "activation checkpointing: %s is already wrapped (%s); keeping it, mode=%r ignored there",
                    fqn,
                    existing,
                    mode,
                )
            continue
        kwargs: dict[str, Any] = {}
        if mode == "selective" or save_ops:
            kwargs["context_fn"] = _context_fn(tuple(save_ops), save_matmuls=mode == "selective")
        wrapper = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        setattr(wrapper, _AC_MODE_ATTR, mode)
        _set_child(model, fqn, wrapper)
        wrapped += 1
    logger.info(
        "activation checkpointing (%s): wrapped %d block(s) of %s", mode, wrapped, type(model).__name__
    )
    return model


def apply_submodule_checkpointing(
    layers: Iterable[nn.Module],
    has_kv_sharing: bool,
    *,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> dict[str, int]:
    """Checkpoint the sub-modules of each decoder layer instead of the whole layer, in place.

    The reference system's finer-grained variant of full activation checkpointing: in every layer, the
    first child found for each role of `SUBMODULE_CHECKPOINT_ROLES` (MLP, attention, the two norms) is
    wrapped with a non-reentrant ``checkpoint_wrapper``. With ``has_kv_sharing`` the attention is left
    alone: recomputing it would write the shared KV cache a second time. Children already wrapped are
    skipped; a role name that is a property returning another child (one module serving two roles) wraps
    that child once, under its registered name, so the state-dict keys are those of a plain wrap.
    `apply_activation_checkpointing` (whole blocks) is what the strategy managers use.

    Preconditions: as for `apply_activation_checkpointing` (after TP, before ``fully_shard``). No
    collectives; works on meta tensors.

    Args:
        layers: The decoder layers (mutated: their children are replaced by ``CheckpointWrapper`` s).
        has_kv_sharing: Whether layers reuse K/V through the cache (skip attention).
        context_fn: A ``torch.utils.checkpoint`` context function for the attention and MLP wrappers
            (e.g. from ``create_selective_checkpoint_contexts``); ``None``: plain recompute. The reference
            system defaults to one that restores the forward's SDPA backend state during recompute.

    Returns:
        How many children were wrapped, per role.
    """
    counts = dict.fromkeys(SUBMODULE_CHECKPOINT_ROLES, 0)
    if context_fn is not None:
        ignore_annotations_in_selective_checkpointing()
    for layer in layers:
        for role, names in SUBMODULE_CHECKPOINT_ROLES.items():
            if role == "attention" and has_kv_sharing:
                continue
            child = next((c for n in names if isinstance(c := getattr(layer, n, None), nn.Module)), None)
            if child is None or isinstance(child, CheckpointWrapper):
                continue
            # A role name may be a property aliasing a child registered under another name (one mixer
            # serving as attention and MLP): wrap that child, once, where it is registered, so that no
            # second child appears and the state-dict keys keep their names.
            name = next((n for n, c in layer.named_children() if c is child), None)
            if name is None:
                continue  # not a direct child of the layer; not ours to replace
            kwargs: dict[str, Any] = {}
            if context_fn is not None and role in ("mlp", "attention"):
                kwargs["context_fn"] = context_fn
            wrapper = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
            setattr(layer, name, wrapper)
            counts[role] += 1
    logger.info("sub-module activation checkpointing: wrapped %s", counts)
    return counts


def unwrap_checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """The module inside a ``CheckpointWrapper``, or ``module`` itself when it is not wrapped (pure)."""
    return module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
