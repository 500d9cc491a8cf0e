"""`get_hf_tp_shard_plan`: the tensor-parallel plan transformers declares for a model, as styles."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from automodel_distributed.tensor_parallel.resolve import translate_hf_tp_plan
from automodel_distributed.tensor_parallel.styles import parallel_style

__all__ = ["get_hf_tp_shard_plan"]


def get_hf_tp_shard_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The model's own (transformers) tensor-parallel plan as ``{module path: ParallelStyle}``.

    The reference system's name for `translate_hf_tp_plan` followed by `parallel_style`: the same
    translation `resolve_tp_plan` uses when no plan is given (expert and "local" styles left out, the
    input embedding vocab-parallel, the output head column-parallel with vocab-sharded logits). Pure: the
    model is not changed.

    Raises:
        ValueError: transformers declares no usable plan for the model (the message says why); give
            ``FSDP2Config.tp_plan`` or run with ``tp_size=1``.
    """
    plan, note = translate_hf_tp_plan(model)
    if plan is None:
        raise ValueError(
            f"Hugging Face TP plan is not supported for {type(model).__name__}: {note}; provide "
            "FSDP2Config.tp_plan or run with tp_size=1"
        )
    return {fqn: parallel_style(style) for fqn, style in plan.items()}
