"""The model matrices' results: one row per (family, layout) case, merged from every rank's record.

Each rank of a matrix launch appends one JSON line per family to ``rank<r>.jsonl`` in a progress
folder (``{"family": ..., "status": "works" | "refused" | "fails", "message": ..., "seconds": ...}``
plus the measured differences); `read_progress` reads them back and `merge_ranks` turns the ranks'
records of one case into a `Row`. Ranks must agree: a refusal on some ranks only is a failure.
"""

from __future__ import annotations

import json
import pathlib
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Row",
    "assert_no_failure",
    "merge_ranks",
    "prepare_checkpoints",
    "read_progress",
    "record_families",
    "refusal",
]


@dataclass
class Row:
    """One (family, layout) case of a matrix, merged over the ranks."""

    family: str
    layout: str
    status: str
    message: str = ""
    logits: float | None = None
    loss_diff: float | None = None
    grad_norm: float | None = None
    seconds: float = 0.0


def merge_ranks(family: str, layout: str, per_rank: list[dict[str, Any]]) -> Row:
    """One row from every rank's record of a case (the worst rank's message; the largest differences)."""
    statuses = {r["status"] for r in per_rank}
    first = per_rank[0]
    worst = next((r for r in per_rank if r["status"] == "fails"), first)
    row = Row(
        family, layout, worst["status"], worst.get("message", ""), seconds=max(r["seconds"] for r in per_rank)
    )
    if len(statuses) > 1:
        row.status = "fails"
        row.message = f"ranks disagree: {[r['status'] for r in per_rank]}: {worst.get('message', '')}"
    if "logits" in worst:
        row.logits = max(r.get("logits", 0.0) for r in per_rank)
        row.loss_diff = max(r.get("loss_diff", 0.0) for r in per_rank)
        row.grad_norm = max(r.get("grad_norm", 0.0) for r in per_rank)
    if row.status == "fails" and "traceback" in worst:
        row.message += "\n" + worst["traceback"]
    return row


def read_progress(folder: str | pathlib.Path, world_size: int) -> dict[str, list[dict[str, Any]]]:
    """Family -> the records of the ranks that wrote one, from ``folder/rank<r>.jsonl``."""
    found: dict[str, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        path = pathlib.Path(folder) / f"rank{rank}.jsonl"
        for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
            item = json.loads(line)
            found.setdefault(item.pop("family"), []).append(item)
    return found


def refusal(exc: ValueError) -> dict[str, Any]:
    """The record of a refusal: a ``ValueError`` automodel raised; any other exception is re-raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or "automodel_" not in frames[-1].filename:
        raise exc
    return {"status": "refused", "message": f"{type(exc).__name__}: {exc}"}


def record_families(
    run_one: Callable[[str], dict[str, Any]],
    checkpoints: Mapping[str, str],
    log_path: str | pathlib.Path,
    *,
    after_each: Callable[[str, dict[str, Any]], None],
) -> None:
    """Run ``run_one(path)`` for each family on this rank and append its record to ``log_path``.

    An exception becomes a ``fails`` record with its traceback; ``after_each(family, record)`` runs
    after each record is written (a barrier, or a raise that stops the launch after a failure).
    """
    with pathlib.Path(log_path).open("a", encoding="utf-8") as log:
        for family, path in checkpoints.items():
            start = time.perf_counter()
            try:
                result = run_one(path)
            except Exception as exc:
                result = {
                    "status": "fails",
                    "message": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500],
                    "traceback": traceback.format_exc()[-3000:],
                }
            result["seconds"] = round(time.perf_counter() - start, 2)
            log.write(json.dumps({"family": family, **result}) + "\n")
            log.flush()
            after_each(family, result)


def assert_no_failure(rows: list[Row]) -> None:
    """Fail (``AssertionError``) naming every case of ``rows`` that fails, with its message."""
    failed = [row for row in rows if row.status == "fails"]
    assert not failed, "\n\n".join(f"{row.family} under {row.layout}: {row.message}" for row in failed)


def prepare_checkpoints(
    prepare: Callable[[str, pathlib.Path], dict[str, Any]], families: Sequence[str], root: pathlib.Path
) -> dict[str, str]:
    """Family -> checkpoint folder from ``prepare(family, root)``; every family must build.

    Raises:
        AssertionError: Naming the families whose ``reference_error`` transformers itself raised.
    """
    prepared = {family: prepare(family, root) for family in families}
    broken = {f: p["reference_error"] for f, p in prepared.items() if "reference_error" in p}
    assert not broken, f"transformers cannot run these fast-slice families: {broken}"
    return {family: p["path"] for family, p in prepared.items()}
