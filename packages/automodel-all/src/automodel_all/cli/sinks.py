"""Where a run's metrics go: JSON lines, TensorBoard, Weights & Biases and MLflow (``report.to``).

Each sink takes the same three things from rank 0 (`automodel_all.cli.metrics.MetricsWriter` fans
them out): the run's configuration when it opens, one record per step and per evaluation, and the
final model's folder (or why there is none) when it closes. Records are dictionaries whose numbers
are the scalars; the JSON-lines sink keeps them whole, the others log every number as
``<prefix>/<key>`` (``train/loss``, ``eval/eval_loss``, ``moe/imbalance``) at the record's step.

Every launch of a job is one run in each tracker: a resumed job is a new W&B and MLflow run whose
first step is the one after its checkpoint (a tracker's history cannot go back to the checkpoint's
step, and the interrupted run may have logged steps past it).

The W&B, MLflow and TensorBoard sinks need the ``automodel-all[wandb]``, ``[mlflow]`` and
``[tensorboard]`` extras; `require_sinks` checks that before any process starts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from automodel_all.cli.sections import ReportSection

__all__ = [
    "EVAL_LOG",
    "RUN_FILE",
    "TRAIN_LOG",
    "JsonLinesSink",
    "MetricSink",
    "MlflowSink",
    "TensorBoardSink",
    "WandbSink",
    "flat_scalars",
    "mlflow_tracking_uri",
    "open_sinks",
    "require_sinks",
]

TRAIN_LOG = "train_log.jsonl"
EVAL_LOG = "eval_log.jsonl"
RUN_FILE = "run.json"
"""The JSON-lines sink's record of the run itself: its configuration and the final model's folder."""

_EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
"""Sink -> (module it imports, extra of automodel-all that installs it)."""


class MetricSink(Protocol):
    """One destination of the metrics (written on rank 0 only)."""

    def log(self, prefix: str, record: dict[str, Any]) -> None:
        """Record one step (``prefix`` ``train``) or evaluation (``eval``); ``record["step"]`` is its step."""

    def close(self, final_model: str | None) -> None:
        """Record the final model's folder (``None``: the run stopped before exporting one) and flush."""


def flat_scalars(prefix: str, record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers as ``prefix/key`` (and ``moe/key`` for the expert load), without ``step``.

    Booleans, strings, None and lists are left out: they are not scalars a chart can draw.
    """

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    scalars = {f"{prefix}/{k}": float(v) for k, v in record.items() if k != "step" and number(v)}
    scalars |= {f"moe/{k}": float(v) for k, v in (record.get("moe") or {}).items() if number(v)}
    return scalars


def _flat_config(config: dict[str, Any]) -> dict[str, str]:
    """``section.key`` -> the value as JSON, for the trackers' parameter tables."""
    return {
        f"{section}.{key}": json.dumps(value)
        for section, values in config.items()
        for key, value in (values or {}).items()
    }


class JsonLinesSink:
    """``train_log.jsonl`` and ``eval_log.jsonl`` (one line per record) and ``run.json``."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        self._out = out
        self._run: dict[str, Any] = {"config": config, "final_model": None}
        self._write_run()

    def _write_run(self) -> None:
        (self._out / RUN_FILE).write_text(json.dumps(self._run, indent=1) + "\n", encoding="utf-8")

    def log(self, prefix: str, record: dict[str, Any]) -> None:
        """See `MetricSink.log`."""
        # NaN / Inf (a skipped step) become null: JSON has no such numbers.
        plain = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with (self._out / (TRAIN_LOG if prefix == "train" else EVAL_LOG)).open("a", encoding="utf-8") as f:
            f.write(json.dumps(plain) + "\n")

    def close(self, final_model: str | None) -> None:
        """See `MetricSink.close`."""
        self._run["final_model"] = final_model
        self._write_run()


class TensorBoardSink:
    """Event files under ``output_dir/tensorboard``; the configuration and final model as text."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, prefix: str, record: dict[str, Any]) -> None:
        """See `MetricSink.log`."""
        for key, value in flat_scalars(prefix, record).items():
            self._writer.add_scalar(key, value, record["step"])

    def close(self, final_model: str | None) -> None:
        """See `MetricSink.close`."""
        self._writer.add_text("final_model", str(final_model), 0)
        self._writer.close()


class WandbSink:
    """A Weights & Biases run (``report.wandb_mode``: ``online``, or ``offline`` files to sync later).

    Its files go under ``output_dir/wandb``; the configuration is the run's config, the final model's
    folder its summary's ``final_model``.
    """

    def __init__(self, out: Path, report: ReportSection, config: dict[str, Any]) -> None:
        import wandb

        self._run = wandb.init(
            project=report.project,
            name=report.run_name or out.name,
            dir=str(out),
            mode=report.wandb_mode,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, prefix: str, record: dict[str, Any]) -> None:
        """See `MetricSink.log`."""
        self._run.log(flat_scalars(prefix, record), step=record["step"])

    def close(self, final_model: str | None) -> None:
        """See `MetricSink.close`."""
        self._run.summary["final_model"] = final_model
        self._run.finish(exit_code=0 if final_model is not None else 1)


def mlflow_tracking_uri(report: ReportSection, out: Path) -> str:
    """``report.mlflow_tracking_uri``, or a SQLite store in the output folder (``mlflow.db``).

    MLflow's plain-folder store refuses new runs since MLflow 3.7 unless an environment variable
    allows it; its local default is now a SQLite file, which is what this is.
    """
    return report.mlflow_tracking_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"


class MlflowSink:
    """An MLflow run in experiment ``report.project`` of `mlflow_tracking_uri`.

    The configuration is logged whole as the artifact ``config.json`` and as parameters
    ``section.key`` (values of at most 250 characters as JSON: longer ones only in the artifact);
    the final model's folder is the tag ``final_model``. Metrics go in one batch per record.
    """

    def __init__(self, out: Path, report: ReportSection, config: dict[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = MlflowClient(tracking_uri=mlflow_tracking_uri(report, out))
        experiment = self._client.get_experiment_by_name(report.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(
                report.project, artifact_location=str(out / "mlflow_artifacts")
            )
        )
        run = self._client.create_run(experiment_id, run_name=report.run_name or out.name)
        self._id = run.info.run_id
        params = [Param(k, v) for k, v in _flat_config(config).items() if len(v) <= 250]
        self._client.log_batch(self._id, params=params)
        self._client.log_dict(self._id, config, "config.json")

    def log(self, prefix: str, record: dict[str, Any]) -> None:
        """See `MetricSink.log`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        scalars = flat_scalars(prefix, record)
        metrics = [Metric(k, v, now, record["step"]) for k, v in scalars.items()]
        self._client.log_batch(self._id, metrics=metrics)

    def close(self, final_model: str | None) -> None:
        """See `MetricSink.close`."""
        self._client.set_tag(self._id, "final_model", str(final_model))
        self._client.set_terminated(self._id, "FINISHED" if final_model is not None else "KILLED")


def require_sinks(report: ReportSection) -> None:
    """Check every sink's package is installed (call before starting processes).

    Raises:
        ImportError: A sink's package is missing; the message names the extra that installs it.
    """
    for sink in report.to:
        if sink in _EXTRAS and importlib.util.find_spec(_EXTRAS[sink][0]) is None:
            extra = _EXTRAS[sink][1]
            raise ImportError(
                f"report.to names {sink}, whose package is not installed: pip install "
                f"'automodel-all[{extra}]' (or uv sync --extra {extra}), or drop {sink} from report.to"
            )


def open_sinks(report: ReportSection, out: Path, config: dict[str, Any]) -> list[MetricSink]:
    """Open every sink of ``report.to`` in ``out`` (rank 0 only), each given the run's configuration."""
    out.mkdir(parents=True, exist_ok=True)
    opened: list[MetricSink] = []
    for sink in report.to:
        if sink == "jsonl":
            opened.append(JsonLinesSink(out, config))
        elif sink == "tensorboard":
            opened.append(TensorBoardSink(out / "tensorboard", config))
        elif sink == "wandb":
            opened.append(WandbSink(out, report, config))
        else:
            assert sink == "mlflow", sink  # ReportSection checks the names
            opened.append(MlflowSink(out, report, config))
    return opened
