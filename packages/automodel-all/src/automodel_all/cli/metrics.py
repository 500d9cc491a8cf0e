"""What a run records: one JSON line per step and per evaluation, TensorBoard events, a loss-curve PNG.

Files in the output folder (rank 0 writes them):

- ``train_log.jsonl``: one line per optimizer step: ``step``, ``loss``, ``lr``, ``grad_norm``,
  ``tokens`` (label tokens of the global batch), ``tokens_per_s`` (tokens of documents, padding
  excluded, over all ranks), ``tflops_per_gpu`` and ``mfu`` (`automodel_all.cli.utilization`; MFU null
  on CPU), ``seconds``, ``slowest_rank`` and ``slowest_seconds`` (the rank that reached the step's
  agreement last, and its time since the previous agreement), ``memory_gib`` (rank 0: resident set
  on CPU, peak CUDA allocation on GPU), ``skipped`` (a step dropped for a NaN/Inf,
  ``train.on_nonfinite: skip``) and ``skipped_total``; for mixture-of-experts models also ``moe``
  (`automodel_moe.ExpertLoad.summary`).
- ``eval_log.jsonl``: one line per evaluation: ``step``, ``eval_loss``, ``eval_ppl``, ``eval_tokens``.
- ``tensorboard/``: the same scalars as TensorBoard events (``train.tensorboard: true``; the
  ``automodel-all[tensorboard]`` extra).
- ``loss_curve.png``: training and evaluation loss against the step, drawn at the end when
  matplotlib is installed (the ``automodel-all[plot]`` extra; ``train.plot``).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

__all__ = [
    "EVAL_LOG",
    "PLOT_FILE",
    "TRAIN_LOG",
    "MetricsWriter",
    "plot_losses",
    "truncate_logs",
]

TRAIN_LOG = "train_log.jsonl"
EVAL_LOG = "eval_log.jsonl"
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
    """Appends the JSON lines (and TensorBoard events) on rank 0; a no-op on the other ranks.

    Args:
        out: The output folder.
        enabled: True on the rank that writes (rank 0).
        tensorboard: Also write TensorBoard events under ``out/tensorboard``.

    Raises:
        ImportError: ``tensorboard`` is asked for but the package is missing (names the extra).
    """

    def __init__(self, out: Path, *, enabled: bool, tensorboard: bool) -> None:
        self._out = out
        self._enabled = enabled
        self._board: Any = None
        if enabled and tensorboard:
            self._board = open_tensorboard(out / "tensorboard")

    def _write(self, name: str, record: dict[str, Any], prefix: str) -> None:
        if not self._enabled:
            return
        # NaN / Inf (a skipped step) become null: JSON has no such numbers.
        plain = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with (self._out / name).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(plain) + "\n")
        if self._board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._board.add_scalar(f"{prefix}/{key}", value, record["step"])
            for key, value in (record.get("moe") or {}).items():
                if isinstance(value, int | float):
                    self._board.add_scalar(f"moe/{key}", value, record["step"])

    def step(self, record: dict[str, Any]) -> None:
        """Record one training step."""
        self._write(TRAIN_LOG, record, "train")

    def evaluation(self, record: dict[str, Any]) -> None:
        """Record one evaluation."""
        self._write(EVAL_LOG, record, "eval")

    def close(self) -> None:
        """Flush TensorBoard."""
        if self._board is not None:
            self._board.close()


def open_tensorboard(folder: Path) -> Any:
    """A ``SummaryWriter`` writing into ``folder``.

    Raises:
        ImportError: The ``tensorboard`` package is missing; the message names the extra to install.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "train.tensorboard needs the tensorboard package: pip install 'automodel-all[tensorboard]' "
            f"(or uv sync --extra tensorboard) ({exc})"
        ) from None
    return SummaryWriter(log_dir=str(folder))


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
