"""`TrainingRun`: the state of one worker's job, typed, as the loop, evaluation and export read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel_all.cli.config import JobConfig, ResolvedJob
from automodel_all.cli.packing import TokenRows
from automodel_all.cli.steps import TokenLoss
from automodel_all.cli.utilization import Utilization
from automodel_distributed.strategy import StrategyManager
from automodel_mesh import MeshContext

__all__ = ["TrainingRun"]


@dataclass(kw_only=True)
class TrainingRun:
    """Everything a worker's loop needs, built once on every rank (``automodel_all.cli.train``)."""

    job: JobConfig
    resolved: ResolvedJob
    device: torch.device
    mesh: MeshContext
    tokenizer: Any
    """The tokenizer, or the processor of a vision-language model (saved with the export)."""
    model_config: Any
    rows: TokenRows | None
    """The training rows (prepared by the launcher); None with ``data.streaming`` (each rank streams)."""
    eval_rows: TokenRows | None
    """The evaluation rows, if the job has evaluation data."""
    model: Any
    """`apply_model_infrastructure`'s result: a module, or the `AutoPipeline`."""
    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    loss_fn: TokenLoss
    strategy: StrategyManager
    """The strategy manager: autocast and gradient sync of every step go through it."""
    utilization: Utilization
    """FLOPs per token and the GPU's peak, for each step's TFLOP/s and MFU (rank 0; unknown elsewhere)."""

    @property
    def pipeline(self) -> Any:
        """The `AutoPipeline` under pipeline parallelism, else None."""
        return self.model if not isinstance(self.model, nn.Module) else None

    @property
    def state_module(self) -> nn.Module:
        """What distributed checkpoints save: the model, or this rank's pipeline stages."""
        return self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)

    @property
    def out(self) -> Path:
        """The output folder."""
        return Path(self.job.train.output_dir)
