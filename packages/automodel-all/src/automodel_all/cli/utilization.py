"""Model FLOPs per token, TFLOP/s per GPU and MFU of a run, counted as torchtitan counts them.

The FLOPs per token come from the planner's count of the job's model (`automodel_planner.flops_per_token`:
the fake forward of one micro-batch; three times the matmul FLOPs of trainable weights, twice a frozen
weight's, three times the attention's; recompute excluded), computed once on rank 0 before the first
step. A step's TFLOP/s per GPU is its document tokens per second per rank times that count; MFU divides
it by the GPU's dense bf16 peak from the planner's table of devices (`automodel_planner.device_named`),
so it is absent on CPU and on a GPU the table does not hold (the reason is in docs/cli.md).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from automodel_all.cli.config import JobConfig, ResolvedJob
from automodel_all.cli.planning import plan_input, planning_model
from automodel_all.cli.progress import warn

__all__ = ["Utilization"]


@dataclass(frozen=True)
class Utilization:
    """What a step's throughput is worth: FLOPs per token and the device's peak (None: unknown)."""

    flops_per_token: float | None
    peak_flops: float | None
    """Dense bf16 FLOP/s of one GPU (None on CPU or a GPU outside the planner's table)."""

    @classmethod
    def of(
        cls, job: JobConfig, resolved: ResolvedJob, model_config: Any, device: torch.device
    ) -> Utilization:
        """Count the job's FLOPs per token (the planner's fake forward) and look up the device's peak.

        A model the fake forward cannot run leaves the FLOPs unknown, with a warning: the step
        metrics must never stop a run.
        """
        from automodel_planner import device_named, flops_per_token

        flops = None
        try:
            # A copy: building a model from a config sets its attention implementation, and the
            # training model shares this one (context parallelism switched it to its own).
            model_config = copy.deepcopy(model_config)
            model, _ = planning_model(job, model_config)
            plan = plan_input(resolved, model, model_config)
            # The job's own attention, never the one a parallelism switched the config to (context
            # parallelism's runs collectives, which this rank alone must not enter): same FLOPs. None:
            # transformers' default, SDPA where the family has it.
            default = "sdpa" if getattr(type(model), "_supports_sdpa", False) else "eager"
            plan = dataclasses.replace(plan, attn_implementation=job.model.attn_implementation or default)
            flops = flops_per_token(plan)
        except Exception as exc:  # reported, never fatal: a metric, not the training
            warn(f"no TFLOP/s or MFU in the metrics: counting the model's FLOPs failed ({exc})")
        peak = None
        if device.type == "cuda":
            found = device_named(torch.cuda.get_device_name(device))
            peak = found.bf16_flops if found is not None else None
        return cls(flops, peak)

    def of_step(self, tokens_per_s: float, world_size: int) -> dict[str, float | None]:
        """``tflops_per_gpu`` and ``mfu`` of a step that processed ``tokens_per_s`` over all ranks."""
        if self.flops_per_token is None:
            return {"tflops_per_gpu": None, "mfu": None}
        flops = tokens_per_s / world_size * self.flops_per_token
        mfu = flops / self.peak_flops if self.peak_flops else None
        return {"tflops_per_gpu": flops / 1e12, "mfu": mfu}
