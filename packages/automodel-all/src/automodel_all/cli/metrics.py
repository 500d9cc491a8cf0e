"""What a run records: one JSON line per step and per evaluation, the other sinks, a loss-curve PNG.

Files in the output folder (rank 0 writes them; ``report.to`` picks the sinks, `automodel_all.cli.sinks`):

- ``train_log.jsonl`` (``jsonl``): one line per optimizer step: ``step``, ``loss``, ``lr``,
  ``grad_norm``, ``tokens`` (label tokens of the global batch), ``tokens_per_s`` (tokens of documents,
  padding excluded, over all ranks), ``tflops_per_gpu`` and ``mfu``
  (`automodel_all.cli.utilization`; MFU null on CPU), ``seconds``, ``slowest_rank`` and
  ``slowest_seconds`` (the rank that reached the step's agreement last, and its time since the
  previous agreement), ``memory_gib`` (rank 0: resident set on CPU, peak CUDA allocation on GPU),
  ``skipped`` (a step dropped for a NaN/Inf, ``train.on_nonfinite: skip``) and ``skipped_total``; for
  mixture-of-experts models also ``moe`` (`automodel_moe.ExpertLoad.summary`).
- ``eval_log.jsonl`` (``jsonl``): one line per evaluation: ``step``, ``eval_loss``, ``eval_ppl``,
  ``eval_tokens``.
- ``run.json`` (``jsonl``): the run's configuration and the final model's folder.
- ``tensorboard/``, ``wandb/``, ``mlflow.db``: the same scalars for TensorBoard, Weights & Biases and
  MLflow (the ``automodel-all[tensorboard]``, ``[wandb]``, ``[mlflow]`` extras).
- ``loss_curve.png``: training and evaluation loss against the step, drawn at the end from the JSON
  lines when matplotlib is installed (the ``automodel-all[plot]`` extra; ``train.plot``).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from automodel_all.cli.sections import ReportSection
from automodel_all.cli.sinks import EVAL_LOG, TRAIN_LOG, MetricSink, open_sinks

__all__ = [
    "PLOT_FILE",
    "MetricsWriter",
    "plot_losses",
    "truncate_logs",
]

PLOT_FILE = "loss_curve.png"


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_logs(out: Path, last_step: int) -> None:
    """Keep the log lines of steps up to ``last_step`` (a resumed run rewrites what follows)."""
    for name in (TRAIN_LOG, EVAL_LOG):
        path = out / name
        if last_step == 0:
            path.unlink(missing_ok=True)
            continue
        kept = [r for r in _read(path) if r["step"] <= last_step]
        if path.is_file():
            path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


class MetricsWriter:
    """Hands every record to the sinks of ``report.to`` on rank 0; a no-op on the other ranks.

    Args:
        report: The ``report`` section (which sinks, the run name, the trackers' settings).
        out: The output folder.
        config: The run's configuration (the job's sections as plain values), given to every sink.
        enabled: True on the rank that writes (rank 0); the sinks open here, before any collective,
            so that a sink that cannot open stops the job before the other ranks wait on this one.
    """

    def __init__(self, report: ReportSection, out: Path, config: dict[str, Any], *, enabled: bool) -> None:
        self._sinks: list[MetricSink] = open_sinks(report, out, config) if enabled else []

    def step(self, record: dict[str, Any]) -> None:
        """Record one training step."""
        for sink in self._sinks:
            sink.log("train", record)

    def evaluation(self, record: dict[str, Any]) -> None:
        """Record one evaluation."""
        for sink in self._sinks:
            sink.log("eval", record)

    def close(self, final_model: str | None) -> None:
        """Record the final model's folder (``None``: none was exported) and close every sink."""
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close(final_model)


def plot_losses(out: Path, *, required: bool = False) -> Path | None:
    """Draw ``out/loss_curve.png`` from the logs (training loss, and evaluation loss if any).

    Args:
        out: The output folder.
        required: Warn (naming the extra) when matplotlib is missing; otherwise skip silently.

    Returns:
        The PNG, or None when matplotlib is not installed or nothing was logged.
    """
    train = [
        r for r in _read(out / TRAIN_LOG) if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])
    ]
    evals = _read(out / EVAL_LOG)
    if not train:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if required:
            warnings.warn(
                "train.plot: matplotlib is not installed, so no loss_curve.png was drawn; install "
                "'automodel-all[plot]' (or set train.plot: false)",
                stacklevel=2,
            )
        return None
    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss", linewidth=1)
    if evals:
        axis.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="evaluation loss",
            linewidth=2,
        )
    axis.set_xlabel("step")
    axis.set_ylabel("loss (nats per target token)")
    axis.set_title(f"automodel train: {out.name}")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path = out / PLOT_FILE
    figure.savefig(path)
    plt.close(figure)
    return path
