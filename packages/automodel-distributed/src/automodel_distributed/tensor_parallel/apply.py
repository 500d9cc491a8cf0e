"""`apply_tensor_parallel`: shard a model in place with its tensor-parallel (and sequence-parallel) plan."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from automodel_distributed.tensor_parallel._fqn import match_modules
from automodel_distributed.tensor_parallel.linear_styles import linear_features
from automodel_distributed.tensor_parallel.lora import expand_lora_plan
from automodel_distributed.tensor_parallel.registry import PlanMapping
from automodel_distributed.tensor_parallel.resolve import resolve_tp_plan
from automodel_distributed.tensor_parallel.sequence import SequenceShardedBlock, install_sequence_length
from automodel_distributed.tensor_parallel.styles import ACTIVATION_STYLES
from automodel_distributed.tensor_parallel.validate import (
    PARAM_STYLES,
    is_local_colwise,
    modules_by_style,
    validate_tensor_parallel,
)
from automodel_modules import find_hf_model, fqn_of, is_conv1d, join_fqn

__all__ = ["apply_tensor_parallel"]

logger = logging.getLogger(__name__)

# Per-module head counts that older attention code reads to reshape q/k/v; divided by tp_size after a
# column shard. transformers 5 reshapes with ``view(*shape, -1, head_dim)`` and needs none of this.
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
_TieGroup = list[tuple[str, nn.Module, str]]


def _tie_groups(model: nn.Module) -> list[_TieGroup]:
    """Parameters shared by several (module, name) slots, e.g. tied input/output embeddings."""
    slots: dict[int, _TieGroup] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                group = slots.setdefault(id(param), [])
                if not any(m is module and n == name for _, m, n in group):
                    group.append((fqn, module, name))
    return [group for group in slots.values() if len(group) > 1]


def _predicted_layout(module: nn.Module, name: str, styles: list[ParallelStyle]) -> str | None:
    """The placement the plan gives a parameter ("not sharded" if none), or None if it cannot be told."""
    if any(not isinstance(s, PARAM_STYLES + ACTIVATION_STYLES) for s in styles):
        return None  # a custom style: we cannot tell what it does to the parameters
    param_styles = [s for s in styles if isinstance(s, PARAM_STYLES)]
    if not param_styles:
        return "not sharded"
    style = param_styles[0]
    conv1d = is_conv1d(module)  # weight stored [in, out]
    if isinstance(style, ColwiseParallel):
        if conv1d:
            return "Shard(1)" if name == "weight" else "Shard(0)"
        return "Shard(0)" if isinstance(module, nn.Linear) else "Shard(1)"
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return "Shard(0)"
        if name != "weight":
            return "Replicate()"
        return "Shard(0)" if conv1d else "Shard(1)"
    return "Replicate()"


def _check_ties(
    model: nn.Module, by_module: Mapping[str, list[ParallelStyle]], ties: list[_TieGroup]
) -> None:
    for group in ties:
        layouts = {
            join_fqn(fqn, name): _predicted_layout(module, name, by_module.get(fqn, []))
            for fqn, module, name in group
        }
        if None in layouts.values():
            continue
        if len(set(layouts.values())) > 1:
            raise ValueError(
                f"tied parameters {sorted(layouts)} would be sharded differently ({layouts}); give them "
                "the same layout (e.g. 'rowwise_rep' for the input embedding with 'colwise_vocab' for the LM "
                "head: both shard the [vocab, hidden] weight on the vocabulary) or untie them"
            )


def _retie(ties: list[_TieGroup]) -> None:
    for group in ties:
        params = [getattr(module, name) for _, module, name in group]
        canonical = next((p for p in params if isinstance(p, DTensor)), params[0])
        for (fqn, module, name), param in zip(group, params, strict=True):
            if param is canonical:
                continue
            if isinstance(canonical, DTensor) and (
                not isinstance(param, DTensor)
                or param.placements != canonical.placements
                or param.shape != canonical.shape
                or param.device_mesh != canonical.device_mesh
            ):
                raise RuntimeError(
                    f"cannot re-tie {join_fqn(fqn, name)} to its tied parameter: the plan sharded them "
                    "differently; give tied parameters the same layout"
                )
            setattr(module, name, canonical)


def _head_count_fixes(
    model: nn.Module, by_module: Mapping[str, list[ParallelStyle]], tp_size: int
) -> list[tuple[nn.Module, str, int]]:
    fixes: dict[tuple[int, str], tuple[nn.Module, str, int]] = {}
    problems: list[str] = []
    for fqn, styles in by_module.items():
        if not any(is_local_colwise(s) for s in styles) or linear_features(model.get_submodule(fqn)) is None:
            continue
        logical = fqn.removesuffix(".base_layer") if fqn.endswith(".base_layer") else fqn
        if ".lora_" in logical:
            continue
        parent_fqn = logical.rpartition(".")[0]  # "" for a child of the root
        parent = model.get_submodule(parent_fqn)
        for attr in _HEAD_ATTRS:
            value = getattr(parent, attr, None)
            if not isinstance(value, int) or isinstance(value, bool) or (id(parent), attr) in fixes:
                continue
            if value % tp_size:
                name = f"{parent_fqn or '<root>'}.{attr}"
                problems.append(f"{name}={value} is not divisible by tp_size={tp_size}")
            fixes[(id(parent), attr)] = (parent, attr, value // tp_size)
    if problems:
        raise ValueError("cannot shard attention heads: " + "; ".join(problems))
    return list(fixes.values())


def _check_output_head(model: nn.Module, by_module: Mapping[str, list[ParallelStyle]]) -> None:
    prefix, hf_model = find_hf_model(model)
    get_head = getattr(hf_model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        return
    name = fqn_of(hf_model, head)
    fqn = join_fqn(prefix, name) if name is not None else None
    if fqn is not None and any(is_local_colwise(s) for s in by_module.get(fqn, [])):
        raise ValueError(
            f"the plan makes the output head {fqn!r} return this rank's vocabulary slice as a plain tensor, "
            "so the logits and the loss would be wrong; use 'colwise_vocab' (vocab-sharded DTensor logits, "
            "loss under loss_parallel()) or 'colwise_rep' (replicated logits), or their '_seq' forms under "
            "sequence parallelism"
        )


def _is_under(fqn: str, prefixes: Sequence[str]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def _leave_out(
    model: nn.Module, plan: Mapping[str, ParallelStyle], exclude: Sequence[str]
) -> dict[str, ParallelStyle]:
    """``plan`` without the modules of ``exclude`` and everything under them.

    An entry whose pattern matches only excluded modules is dropped; one that matches both kinds is
    replaced by one entry per module it still applies to (concrete names: ``parallelize_module`` takes
    them as patterns that match themselves).
    """
    if not exclude:
        return dict(plan)
    kept: dict[str, ParallelStyle] = {}
    dropped: list[str] = []
    for key, style in plan.items():
        matches = [fqn for fqn, _ in match_modules(model, key)]
        inside = [fqn for fqn in matches if _is_under(fqn, exclude)]
        if not inside:
            kept[key] = style
            continue
        dropped.append(key)
        for fqn in matches:
            if fqn not in inside:
                kept[fqn] = style
    if dropped:
        logger.info("tensor parallel: left to the expert-parallel step (not in the plan): %s", dropped)
    return kept


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    tp_plan: PlanMapping | str | None = None,
    sequence_parallel: bool = False,
    exclude: Sequence[str] = (),
) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` with tensor (and optionally sequence) parallelism.

    Steps: check head counts (`validate_tensor_parallel`); resolve the plan (`resolve_tp_plan`); rewrite
    entries that target peft LoRA wrappers into entries for ``base_layer``, ``lora_A`` and ``lora_B``;
    check module shapes, tied parameters and sequence-parallel preconditions; then ``parallelize_module``,
    re-tie tied parameters (e.g. ``lm_head.weight`` stays ``embed_tokens.weight``: both are sharded on the
    vocabulary) and divide per-module head counts (``num_heads`` and friends, if an attention module has
    them) after a column shard of its projections. Every check runs before the first collective, so a
    model that cannot be sharded raises the same ``ValueError`` on every rank.

    Preconditions: call before FSDP2 (parameters must still be plain tensors) and on every rank of
    ``tp_mesh`` with identical models; the model may be on the meta device. Parameters are taken from TP
    rank 0 (scattered or broadcast), as ``parallelize_module`` does.

    Outputs: with the built-in plans the logits are a vocab-sharded DTensor (``Shard(-1)``): compute the
    loss, forward and backward, under ``torch.distributed.tensor.parallel.loss_parallel()`` (transformers'
    own ``labels=`` loss works there), and call ``.full_tensor()`` for the full logits. For replicated plain
    logits, give the LM head ``'colwise_rep'`` (``'colwise_seq_rep'`` under SP) in the plan, e.g.
    ``plan = resolve_tp_plan(model, tp_size=n); plan["lm_head"] = "colwise_rep"``.

    Sequence parallelism (``sequence_parallel=True``) keeps the residual stream between the decoder blocks
    sharded on the sequence dim (`automodel_distributed.tensor_parallel.sequence`): Megatron-style with a
    registered sequence-parallel plan, derived from the TP plan otherwise. Masks, position ids and rotary
    tables are built over the whole sequence, so padding masks, implicit position ids and every attention
    implementation work. The sequence length must divide by the TP size (a forward pre-hook on ``model``
    raises a ``ValueError`` otherwise); use ``use_cache=False``.

    Mesh axes and collectives: ``tp_mesh`` is the 1-D ``tp`` axis; sharding scatters/broadcasts weights
    from TP rank 0; the forward and backward all-reduce (TP) or all-gather / reduce-scatter (SP) over it.

    Args:
        model: A transformers model (possibly inside a peft wrapper) or any module with a plan.
        tp_mesh: The 1-D tensor-parallel mesh (e.g. ``mesh_context.submesh("tp")``).
        tp_plan: A plan dict, a registered plan name or an import path; None resolves one from the model.
        sequence_parallel: Use the sequence-parallel variant of the plan.
        exclude: Module FQNs (relative to ``model``) the plan leaves alone with everything under them:
            their parameters stay as they are and may already be DTensors on another mesh (the experts the
            expert-parallel step sharded over ``ep``, and their routers, which stay replicated).

    Returns:
        ``model``, mutated: its sharded parameters are DTensors on ``tp_mesh``. A mesh of size 1 leaves it
        untouched.

    Raises:
        ValueError: A 2-D mesh, a model already holding DTensors outside ``exclude``, head counts or shard
            dims that do not divide, no usable plan, a LoRA layer that cannot be sharded, tied parameters
            sharded differently, a vocab-sliced plain-tensor output head, or sequence parallelism without
            findable decoder blocks.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tensor_parallel needs a 1-D tp mesh, got {tp_mesh.ndim} axes; slice it first"
        )
    tp_size = int(tp_mesh.size())
    if tp_size == 1:
        if tp_plan is not None or sequence_parallel:
            warnings.warn("tp_plan / sequence_parallel are ignored: the tp mesh has one rank", stacklevel=2)
        return model
    distributed = [
        fqn for fqn, p in model.named_parameters() if isinstance(p, DTensor) and not _is_under(fqn, exclude)
    ]
    if distributed:
        raise ValueError(
            f"the model already holds DTensor parameters ({distributed[:3]}): apply tensor parallelism once, "
            "before FSDP2"
        )
    plan = _leave_out(
        model,
        expand_lora_plan(
            model, resolve_tp_plan(model, tp_plan, sequence_parallel=sequence_parallel, tp_size=tp_size)
        ),
        exclude,
    )
    validate_tensor_parallel(model, tp_size, plan=plan)
    by_module = modules_by_style(model, plan)
    lengths = {id(s.length): s.length for s in plan.values() if isinstance(s, SequenceShardedBlock)}
    is_sp = bool(lengths)
    _check_output_head(model, by_module)
    ties = _tie_groups(model)
    _check_ties(model, by_module, ties)
    head_fixes = _head_count_fixes(model, by_module, tp_size)

    parallelize_module(model, tp_mesh, plan)

    _retie(ties)
    for module, attr, value in head_fixes:
        setattr(module, attr, value)
    for length in lengths.values():
        install_sequence_length(model, length, tp_size)
    logger.info(
        "tensor parallel over %d ranks%s: %d plan entries",
        tp_size,
        " with sequence parallel" if is_sp else "",
        len(plan),
    )
    return model
