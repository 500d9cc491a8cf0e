"""The model matrices' results: one row per (family, layout) case, merged from every rank's record.

Each rank of a matrix launch appends one JSON line per family to ``rank<r>.jsonl`` in a progress
folder (``{"family": ..., "status": "works" | "refused" | "fails" | "upstream", "message": ...,
"seconds": ...}`` plus the measured differences; ``upstream``: transformers itself fails the case's
reference, so there is nothing to compare with); `read_progress` reads them back and `merge_ranks`
turns the ranks' records of one case into a `Row`. Ranks must agree: a refusal on some ranks only is
a failure.

The rank side of a case shares `sgd_parity` (the reference and the model trained side by side) and
`judge` (the tolerances and the training check); the parent side shares `launch_layout` (one launch per
layout, relaunched for the families after one that raised) and `select_families`.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from automodel_testing.distributed import DistributedRunError, run_distributed
from automodel_testing.numerics import to_full

__all__ = [
    "Row",
    "assert_no_failure",
    "barrier_or_stop",
    "gradient_difference",
    "judge",
    "judge_low_precision",
    "launch_layout",
    "merge_ranks",
    "prepare_checkpoints",
    "read_progress",
    "record_families",
    "refusal",
    "select_families",
    "sgd_parity",
    "squared_grad_sum",
    "upstream_failure",
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
    failed = [r for r in per_rank if r["status"] == "fails"]
    # The rank that failed first, not a peer that lost its connection to it.
    worst = next((r for r in failed if not _peer_failure(r)), failed[0] if failed else per_rank[0])
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


_PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def _peer_failure(record: dict[str, Any]) -> bool:
    """Whether a rank failed only because another one did (its collective lost the peer)."""
    return any(text in record.get("message", "") for text in _PEER_FAILURES)


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


def upstream_failure(exc: Exception, what: str) -> dict[str, Any]:
    """The record of a case whose reference (``what``: plain transformers run that way) raises ``exc``."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return {
        "status": "upstream",
        "message": f"transformers itself fails {what}: {type(exc).__name__}: {first}",
    }


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


# ------------------------------------------------------------------------------------ rank side


def sgd_parity(
    steps: int,
    reference: Callable[[], float],
    ours: Callable[[], float],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    first: Callable[[], None],
) -> dict[str, list[float]]:
    """Train the reference and the model side by side: ``steps + 1`` forward/backward passes.

    ``reference()`` and ``ours()`` each run one forward and backward and return the (world) mean loss;
    ``first()`` runs after the first pair, before any optimizer step (to compare logits and gradients);
    every optimizer of ``optimizers`` then steps and zeroes its gradients.

    Returns:
        ``{"losses": [...], "ref_losses": [...]}``, one entry per pass.
    """
    out: dict[str, list[float]] = {"losses": [], "ref_losses": []}
    for step in range(steps + 1):
        out["ref_losses"].append(reference())
        out["losses"].append(ours())
        if step == 0:
            first()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return out


def squared_grad_sum(params: Iterable[torch.Tensor]) -> float:
    """Sum of the squared entries of every gradient of ``params`` (DTensor gradients gathered whole)."""
    total = torch.zeros((), dtype=torch.float64)
    for param in params:
        if param.grad is not None:
            total += to_full(param.grad).double().square().sum()
    return float(total)


def gradient_difference(ours_square_sum: float, reference: torch.nn.Module) -> dict[str, float]:
    """The gradient norm's difference from the reference's (whose gradients are in place).

    Returns:
        ``grad_norm``: the difference relative to the norm where the norm exceeds 1 (fp32 sums in a
        different order differ in proportion to the magnitude: Gemma 3's scaled embeddings give norms in
        the hundreds), absolute below; ``grad_rel``: the difference relative to the norm, so that a
        family whose gradients are tiny still proves they arrive (infinite when the reference has none).
    """
    ref_norm = squared_grad_sum(reference.parameters()) ** 0.5
    difference = abs(ours_square_sum**0.5 - ref_norm)
    return {
        "grad_norm": difference / max(1.0, ref_norm),
        "grad_rel": difference / ref_norm if ref_norm > 0 else float("inf"),
    }


def judge(
    out: dict[str, Any],
    atol: float,
    problems: Sequence[str] = (),
    reordered: Callable[[], Sequence[float] | None] | None = None,
) -> dict[str, Any]:
    """Set ``loss_diff``, ``status`` and ``message`` of a case's record ``out`` and return it.

    ``out`` holds ``losses`` and ``ref_losses`` (from `sgd_parity`), ``logits`` (the largest difference
    of the first logits) and `gradient_difference`'s fields. The case works when logits and losses are
    within ``atol``, the gradient norm within ``10 * atol``, training shows (the loss falls; or, for a
    family whose few SGD steps move the loss by less than the comparison resolves, the reference's
    falls by at most ``atol`` too and the gradients agree to 0.1% of their norm), and ``problems`` (the
    caller's own checks) is empty.

    Losses after optimizer steps carry the first step's rounding forward, amplified by each update: a
    sharded model that sums in another order (tensor-parallel partial products, expert-parallel
    combines) can drift past ``atol`` of the plain reference while computing the same function. When
    only those later losses are off, ``reordered()`` (called then only) gives the reference's losses
    when transformers itself sums in the sharding's order (`split_like_tensor_parallel`,
    `combine_like_expert_parallel`; None where the layout reorders nothing), and the losses pass when
    they are within ``atol`` of those: the drift is then the order's, and a real defect (a missing
    reduction, a wrong scale) differs from both references alike.
    """
    out["loss_diff"] = _loss_diff(out["losses"], out["ref_losses"])
    checks = list(problems)
    loss_diff = out["loss_diff"]
    first_steps_agree = abs(out["losses"][0] - out["ref_losses"][0]) <= atol
    if loss_diff > atol and first_steps_agree and reordered is not None:
        reference_in_order = reordered()
        if reference_in_order is not None:
            out["reordered_loss_diff"] = _loss_diff(out["losses"], reference_in_order)
            loss_diff = out["reordered_loss_diff"]
    in_order = (
        f"losses {out['reordered_loss_diff']:.2e} off transformers summing in the sharding's order"
        if "reordered_loss_diff" in out
        else ""
    )
    if out["logits"] > atol or loss_diff > atol or out["grad_norm"] > atol * 10:
        checks.append(
            f"differs from transformers: logits {out['logits']:.2e}, losses {out['loss_diff']:.2e}, "
            f"gradient norm {out['grad_norm']:.2e}" + (f" ({in_order})" if in_order else "")
        )
    verdict = _verdict(out, checks, resolution=atol)
    if verdict["status"] == "works" and in_order:
        verdict["message"] = f"losses after steps {out['loss_diff']:.2e} off transformers, {in_order}"
    return verdict


def _loss_diff(losses: Sequence[float], ref_losses: Sequence[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))


def _verdict(out: dict[str, Any], checks: list[str], resolution: float = 0.0) -> dict[str, Any]:
    """Add the training check (the loss falls) to ``checks``; set ``status`` and ``message``.

    A reference whose loss falls by at most ``resolution`` counts as flat: a fall of one float32 step
    there while ours stays put is within what the comparison resolves.
    """
    reference_flat = out["ref_losses"][0] - out["ref_losses"][-1] <= resolution
    if not (out["losses"][-1] < out["losses"][0] or (reference_flat and out["grad_rel"] <= 1e-3)):
        checks.append(f"the loss does not fall: {out['losses']}")
    out["status"] = "fails" if checks else "works"
    out["message"] = "; ".join(checks)
    return out


def judge_low_precision(
    out: dict[str, Any], low: dict[str, Any], *, factor: float, floor: float, used: float
) -> dict[str, Any]:
    """`judge` for a bf16 case: its error may be at most ``factor`` times transformers' own bf16 error.

    Both are measured against the same fp32 reference (``out["ref_losses"]``, ``out["logits"]``,
    `gradient_difference`): ``out`` for the case, ``low`` for transformers run in bf16 on the same
    checkpoint, batch and steps (``low["losses"]``, ``low["logits"]``, ``low["grad_norm"]``). A metric
    passes when it is at most ``factor * low + floor``. The case must also really compute in bf16: its
    logits or losses must differ from fp32 by more than ``used`` (a policy that acted on nothing would
    match fp32).
    """
    out["loss_diff"] = _loss_diff(out["losses"], out["ref_losses"])
    low["loss_diff"] = _loss_diff(low["losses"], out["ref_losses"])
    out["low_precision_reference"] = low
    checks = []
    over = [
        f"{name} {out[key]:.2e} (transformers bf16: {low[key]:.2e})"
        for name, key in (("logits", "logits"), ("losses", "loss_diff"), ("gradient norm", "grad_norm"))
        if out[key] > factor * low[key] + floor
    ]
    if over:
        checks.append(
            f"differs from fp32 by more than {factor:g}x transformers' own bf16 error: " + ", ".join(over)
        )
    if max(out["logits"], out["loss_diff"]) <= used:
        checks.append(
            f"logits and losses within {used:g} of fp32: the bf16 mixed precision acted on nothing "
            "(computed in fp32)"
        )
    return _verdict(out, checks)


def barrier_or_stop(layout: str) -> Callable[[str, dict[str, Any]], None]:
    """`record_families`' ``after_each``: a barrier, or a raise that stops the launch after a failure.

    A family that raised (anything but a refusal) may leave the process group out of step (a peer
    waiting for a collective that never comes), so the launch stops there; `launch_layout` launches
    again for the families left.
    """

    def after_each(family: str, result: dict[str, Any]) -> None:
        if "traceback" in result:
            raise RuntimeError(f"{family} failed under {layout}; relaunching for the rest")
        dist.barrier()

    return after_each


# ------------------------------------------------------------------------------------ parent side


def launch_layout(
    run_layout: Callable[[str, dict[str, str], str], None],
    layout: str,
    world_size: int,
    checkpoints: Mapping[str, str],
    *,
    timeout_s: float = 3600,
) -> list[Row]:
    """``run_layout(layout, checkpoints, progress_folder)`` on ``world_size`` ranks; one row per family.

    One launch runs every family (each rank records into the progress folder with `record_families`
    and `barrier_or_stop`); when a family fails with an exception, or a rank dies or hangs, the launch
    stops, that family is a failure, and a new launch runs the families after it.
    """
    rows: dict[str, Row] = {}
    left = dict(checkpoints)
    with tempfile.TemporaryDirectory(prefix=f"matrix-{layout}-") as tmp:
        while left:
            folder = pathlib.Path(tmp, str(len(rows)))
            folder.mkdir()
            error = ""
            try:
                run_distributed(
                    run_layout, world_size, layout, left, str(folder), timeout_s=timeout_s, pg_timeout_s=60
                )
            except DistributedRunError as exc:
                error = str(exc)
            done = read_progress(folder, world_size)
            for family in left:
                if len(done.get(family, [])) == world_size:
                    rows[family] = merge_ranks(family, layout, done[family])
                    if any("traceback" in r for r in done[family]):
                        break  # the ranks stopped on purpose after this family; relaunch for the rest
                    continue
                # The family this launch stopped at: a rank raised, died or hung there.
                recorded = "; ".join(r.get("message", "") for r in done.get(family, []))
                rows[family] = Row(family, layout, "fails", f"{recorded}\n{error[-2500:]}".strip())
                break
            left = {f: p for f, p in left.items() if f not in rows}
    return [rows[family] for family in checkpoints]


def select_families(families: Sequence[str], selection: str | None) -> list[str]:
    """The families of a matrix run that ``selection`` names (a run of the ``models`` session in chunks).

    Args:
        families: Every family of the matrix, in its order.
        selection: ``None`` or empty (every family), a comma-separated list of model types, or a slice
            ``START:STOP`` of ``families`` (Python slice bounds, either may be empty).

    Raises:
        ValueError: A named family is not in ``families``, or the slice is malformed.
    """
    if not selection:
        return list(families)
    if ":" in selection:
        start, _, stop = selection.partition(":")
        try:
            bounds = slice(int(start) if start else None, int(stop) if stop else None)
        except ValueError:
            raise ValueError(f"family selection {selection!r}: use START:STOP with integers") from None
        return list(families)[bounds]
    names = [name.strip() for name in selection.split(",") if name.strip()]
    unknown = sorted(set(names) - set(families))
    if unknown:
        raise ValueError(f"family selection {selection!r}: {unknown} are not families of this matrix")
    return [family for family in families if family in names]
