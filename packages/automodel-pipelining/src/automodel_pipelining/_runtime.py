"""The torch side: pipeline stages with our gradient-sync policy, and schedule construction.

Imported only by `AutoPipeline.build` (``torch.distributed.pipelining`` and FSDP take seconds to import).

Gradient synchronisation under FSDP (``defer_fsdp_grad_sync``):

- ``True`` (default): gradients accumulate unreduced over the microbatches of a step and are
  reduce-scattered once, when the schedule finalises the stage after its last backward. This is torch's
  own behaviour for a stage whose root module is FSDP; the least communication.
- ``False``: every microbatch's backward reduce-scatters its gradients into the sharded gradients (less
  memory for unsharded gradients, more communication). FSDP units whose inputs need no gradient (the
  input embedding) are still reduced once, when the stage is finalised. Only full backward passes can do
  this; the zero-bubble schedules split backward into input and weight passes and always reduce once at
  the end.

The result is numerically the same either way (up to summation order).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._backward import stage_backward

from automodel_pipelining.schedules import ScheduleSpec

__all__ = ["AutoPipelineStage", "build_schedule", "warn_nested_sync_without_target"]

logger = logging.getLogger(__name__)


def _fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def warn_nested_sync_without_target(enabled: bool, parts: Sequence[nn.Module]) -> None:
    """Name ``patch_stage_backward_maybe_with_nosync`` when no stage has FSDP modules under a plain root.

    Only such modules are its target: torch's own stage backward handles a stage whose root is FSDP.
    """

    def nested(part: nn.Module) -> bool:
        return not isinstance(part, FSDPModule) and any(isinstance(m, FSDPModule) for m in part.modules())

    if enabled and not any(nested(part) for part in parts):
        warnings.warn(
            "PipelineConfig.patch_stage_backward_maybe_with_nosync ignored: it acts on FSDP modules inside a "
            "stage whose root is not FSDP, and this rank's stages have none (torch's own backward handles "
            "an FSDP stage root)",
            stacklevel=4,
        )


class AutoPipelineStage(PipelineStage):
    """A `PipelineStage` whose backward applies the pipeline's gradient-sync policy.

    Args:
        reduce_grad_per_microbatch: Reduce FSDP gradients after every microbatch's (full) backward instead
            of once after the last one (``not defer_fsdp_grad_sync``).
        sync_nested_fsdp: Apply the policy to FSDP modules inside a stage whose root is not FSDP
            (``patch_stage_backward_maybe_with_nosync``).
        *args, **kwargs: As for `PipelineStage`.
    """

    def __init__(
        self,
        *args: Any,
        reduce_grad_per_microbatch: bool = False,
        sync_nested_fsdp: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_grad_per_microbatch = reduce_grad_per_microbatch
        self.sync_nested_fsdp = sync_nested_fsdp

    # torch's runtime schedules hand input gradients between two adjacent stages on the same rank (the
    # V schedules' turn, or every stage pair on one rank) even in eval(), where no stage has a backward,
    # and then fail ("can't steal_bwd_input"). Without a backward there is nothing to hand over.
    def get_local_bwd_output(self, mb_index: int) -> Any:
        """Input gradients for the previous local stage (nothing in a forward-only run)."""
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(
        self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int
    ) -> None:
        """Take the next local stage's input gradients (ignored in a forward-only run)."""
        if not self.has_backward:
            return
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        """Run one microbatch's backward with the gradient-sync setting of the policy."""
        root_is_fsdp = isinstance(self.submod, FSDPModule)
        if backward_type != "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if root_is_fsdp and self.reduce_grad_per_microbatch:
            fsdp_root: Any = self.submod
            fsdp_root.set_reshard_after_backward(False)
            fsdp_root.set_requires_gradient_sync(True)
            grads = stage_backward(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
            )
            return grads, None
        if not root_is_fsdp and self.sync_nested_fsdp:
            sync = last_backward or self.reduce_grad_per_microbatch
            for module in _fsdp_modules(self.submod):
                module.set_requires_gradient_sync(sync, recurse=False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def build_stages(
    modules: Sequence[nn.Module],
    stage_ids: Sequence[int],
    *,
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup,
    example_io: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    reduce_grad_per_microbatch: bool,
    sync_nested_fsdp: bool,
) -> list[AutoPipelineStage]:
    """One `AutoPipelineStage` per local stage module (static shapes when ``example_io`` is given)."""
    stages = []
    for module, stage_id in zip(modules, stage_ids, strict=True):
        io = example_io(stage_id) if example_io is not None else None
        stages.append(
            AutoPipelineStage(
                module,
                stage_id,
                num_stages,
                device,
                input_args=io[0] if io is not None else None,
                output_args=io[1] if io is not None else None,
                group=group,
                reduce_grad_per_microbatch=reduce_grad_per_microbatch,
                sync_nested_fsdp=sync_nested_fsdp,
            )
        )
    return stages


def build_schedule(
    spec: ScheduleSpec | None,
    stages: Sequence[AutoPipelineStage],
    *,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    scale_grads: bool,
    csv_path: str | None = None,
) -> Any:
    """Create the torch schedule object for the local stages.

    A named schedule uses its torch class (single-stage classes get the one local stage); a CSV schedule
    is a ``_PipelineScheduleRuntime`` loaded with ``_load_csv`` (compute-only format, lowered to
    communication actions by torch).
    """
    if spec is None:
        if csv_path is None:
            raise ValueError("a CSV schedule needs its path")
        schedule = torch_schedules._PipelineScheduleRuntime(
            list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads
        )
        schedule._load_csv(csv_path)
        return schedule
    cls = getattr(torch_schedules, spec.torch_class)
    if spec.multi_stage:
        return cls(list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if len(stages) != 1:
        raise ValueError(f"schedule {spec.name!r} runs one stage per rank, got {len(stages)}")
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
