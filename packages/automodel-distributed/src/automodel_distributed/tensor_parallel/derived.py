"""`derived_tp_plan`: a tensor-parallel plan read off a model's structure, for models with no usable plan.

Every linear projection of the model (``nn.Linear``, transformers' ``Conv1D``, or a LoRA-wrapped one) is
column-parallel with a gathered output (``colwise_rep``, transformers' ``colwise_gather_output``): each
rank holds and multiplies by a slice of the output features, and the slices are all-gathered. The
result is the full projection on every rank, so the plan is exact whatever the model computes around
its linears (fused q/k/v, convolutions, recurrences, routers, per-head norms), and it needs no knowledge of
the model family: only the module types. The input embedding is vocab-parallel (``rowwise_rep``) when it
is a plain ``nn.Embedding``; the output head is column-parallel with vocab-sharded DTensor logits
(``colwise_vocab``).

What it costs against a Megatron-style plan: linear weights, their gradients and optimizer state are
sharded and the matmul work is split, but attention itself and the element-wise work run on every rank,
and each linear all-gathers its output (instead of one all-reduce per attention or MLP block).

Left replicated (no entry): linears whose weight another module also holds (tied weights other than
the head), linears whose owner reads their weight directly (its class source mentions
``self.<name>.weight``, e.g. Mamba's ``self.dt_proj.weight @ x``: a sharded weight there would meet a
plain tensor), linears with fewer output features than ranks, and every non-linear parameter.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter

from torch import nn

from automodel_distributed.tensor_parallel.hf_plan import is_plain_embedding, module_fqn
from automodel_distributed.tensor_parallel.linear_styles import linear_features
from automodel_distributed.tensor_parallel.lora import is_lora_linear
from automodel_modules import embedding_module

__all__ = ["derived_tp_plan"]


def _linear_of(module: nn.Module) -> nn.Module:
    """The linear a module computes with: a LoRA wrapper's ``base_layer``, else the module itself."""
    base = module.get_submodule("base_layer") if is_lora_linear(module) else module
    return base


@functools.cache
def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _weight_read_directly(root: nn.Module, fqn: str) -> bool:
    """Whether the owner of ``fqn`` mentions ``self.<name>.weight`` (or ``.bias``) in its class source."""
    owner_fqn, _, name = fqn.rpartition(".")
    owner = root.get_submodule(owner_fqn)
    source = "".join(
        _class_source(cls) for cls in type(owner).__mro__ if cls.__module__ != "torch.nn.modules.module"
    )
    return f"self.{name}.weight" in source or f"self.{name}.bias" in source


def derived_tp_plan(hf_model: nn.Module, tp_size: int) -> tuple[dict[str, str] | None, str]:
    """The structure-derived plan of ``hf_model`` (see the module docstring). Pure.

    Args:
        hf_model: The transformers model (keys of the plan are relative to it). LoRA wrappers count as
            the linears they wrap.
        tp_size: The tensor-parallel degree (a linear narrower than it stays replicated).

    Returns:
        ``(plan, note)``: the plan of concrete module names to style names, or None (with the reason)
        when the model has no linear to shard.
    """
    holders = Counter(id(p) for _, m in hf_model.named_modules() for p in m.parameters(recurse=False))
    head = module_fqn(hf_model, embedding_module(hf_model, "output"))
    embeddings = module_fqn(hf_model, embedding_module(hf_model, "input"))
    plan: dict[str, str] = {}
    if embeddings is not None and is_plain_embedding(embeddings[1]):
        plan[embeddings[0]] = "rowwise_rep"
    for fqn, module in hf_model.named_modules():
        if ".lora_" in f".{fqn}" or fqn.endswith("base_layer"):
            continue  # the parts of a LoRA wrapper: the wrapper itself is the entry
        linear = _linear_of(module)
        features = linear_features(linear)
        if features is None:
            continue
        if head is not None and fqn == head[0]:
            if isinstance(linear, nn.Linear):
                plan[fqn] = "colwise_vocab"
            continue
        if features[1] < tp_size or holders[id(linear.weight)] > 1 or _weight_read_directly(hf_model, fqn):
            continue
        plan[fqn] = "colwise_rep"
    if not plan:
        return None, "the model has no linear projection (nn.Linear / Conv1D) or plain embedding to shard"
    return plan, f"derived from the model's structure: {len(plan)} modules"
