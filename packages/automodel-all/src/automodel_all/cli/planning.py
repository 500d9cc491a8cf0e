"""The planner's view of a job: its model on the meta device and its `automodel_planner.PlanInput`.

Shared by ``automodel plan`` (memory, throughput, ``--suggest``) and ``automodel train`` (the FLOPs per
token of its TFLOP/s and MFU), so both count the same model.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel_all.cli.config import JobConfig, ResolvedJob
from automodel_all.cli.model import build_meta_model, model_class, model_dtype
from automodel_all.cli.yaml_source import ConfigError

if TYPE_CHECKING:
    from automodel_planner import PlanInput

__all__ = ["compute_dtype", "plan_input", "planning_model"]


def planning_model(job: JobConfig, model_config: Any) -> tuple[nn.Module, int]:
    """The job's model on the meta device as the planner sees it: frozen towers, then LoRA adapters.

    Returns:
        The model and the number of layers LoRA adapts (0 without ``peft``).

    Raises:
        ConfigError: The model does not support the job's attention kernel.
    """
    from transformers.initialization import no_init_weights

    from automodel_planner.sdpa_choice import profiled_attention

    # The planner reads the model's structure, not its attention kernel: a kernel only a GPU runs (and
    # this host may not have installed) is built as the planner profiles it.
    try:
        kernel = profiled_attention(job.model.attn_implementation, model_class(model_config))
    except ValueError as exc:
        raise ConfigError(f"model.attn_implementation: {exc}") from None
    # The plan reads the model's structure and never materialises it: torch's per-module init, which
    # fills nothing on meta tensors, is skipped (half of building a 405B Llama's 126 blocks). The switch
    # also stubs transformers' init_weights, whose only work on meta is tying the weights: tied here.
    with no_init_weights():
        model = build_meta_model(
            dataclasses.replace(job, model=dataclasses.replace(job.model, attn_implementation=kernel)),
            model_config,
        )
    tie_weights: Any = model.tie_weights  # a transformers PreTrainedModel's (build_meta_model's class)
    tie_weights()
    if job.freeze_config is not None:
        from automodel_distributed.multimodal import apply_freeze_config

        apply_freeze_config(model, job.freeze_config)  # before adapters, as apply_model_infrastructure does
    adapted = 0
    if job.peft is not None:
        from automodel_peft import apply_lora_to_linear_modules

        adapted = apply_lora_to_linear_modules(model, job.peft)  # on meta: free; freezes the base
    return model, adapted


def compute_dtype(job: JobConfig) -> torch.dtype:
    """The dtype the job computes in: FSDP2's ``mp_policy.param_dtype`` where it casts, else the model's."""
    policy = getattr(job.distributed, "mp_policy", None)
    param_dtype = getattr(policy, "param_dtype", None)
    return param_dtype if isinstance(param_dtype, torch.dtype) else model_dtype(job)


def plan_input(
    resolved: ResolvedJob,
    model: nn.Module,
    model_config: Any,
    base_weight_bits: int | None = None,
    model_memo: dict[str, Any] | None = None,
) -> PlanInput:
    """The planner's view of a job (`automodel_planner.PlanInput`) on its resolved layout.

    ``model_memo``: shared by the plans of one model (`PlanInput.model_memo`), e.g. every layout a
    search tries; a fresh one by default.
    """
    from automodel_planner import PlanInput

    job = resolved.job
    micro_batch = job.train.micro_batch_size or resolved.rows_per_dp_rank
    return PlanInput(
        model=model,
        model_config=model_config,
        layout=resolved.layout,
        strategy=job.distributed,
        dtype=compute_dtype(job),
        seq_len=job.data.seq_len,
        micro_batch_size=micro_batch,
        accumulation=max(resolved.rows_per_dp_rank // micro_batch, 1),
        pipeline=resolved.pipeline,
        moe=job.moe,
        peft=job.peft,
        fp8=job.fp8,
        base_weight_bits=base_weight_bits,
        attn_implementation=job.model.attn_implementation,
        compile=job.compile is not None and job.compile.enabled,
        compiled_loss=job.compile is not None and job.compile.enabled and job.compile.compile_loss,
        model_memo=model_memo if model_memo is not None else {},
    )
