"""Faults injected into real gloo ranks: a rank that raises, dies or stalls mid-step, or dies mid-save.

Measured per case: whether the surviving rank hung (no error within the configured timeout plus a
margin), its time to error, and whether data was lost (the previous checkpoint damaged or gone, or a
new checkpoint that looks complete but does not hold the state it claims). After a crash mid-save,
training resumes from the last complete checkpoint and must give the losses of an uninterrupted run.

The victim kills itself with SIGKILL from a background thread that polls the file system (the staging
folder, a shard file, the completion marker): nothing of ours is patched.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from automodel_testing import (
    DistributedRunError,
    build_tiny_model,
    causal_lm_loss,
    make_batch,
    run_distributed,
    to_full,
)

pytestmark = [pytest.mark.faults, pytest.mark.distributed, pytest.mark.timeout(240)]

PG_TIMEOUT_S = 15.0  # the configured timeout: every mesh group (all training collectives run on them)
INIT_TIMEOUT_S = 90.0  # the default group's: spawning ranks on a loaded machine may take long
MARGIN_S = 8.0  # start-up of the error path, on a shared 2-core machine
SEQ = 16


# ------------------------------------------------------------------------------------------ rank side


def _sharded_model(meta: bool) -> tuple[nn.Module, dist.ProcessGroup]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes

    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    )
    ctx = MeshContext.build(config, ParallelismSizes(), timeout_minutes=PG_TIMEOUT_S / 60)
    model = build_tiny_model("llama", meta=meta, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP2Manager(config, ctx.device_mesh).parallelize(model), ctx.get_group("dp")


def _step(
    model: nn.Module,
    group: dist.ProcessGroup,
    opt: torch.optim.Optimizer,
    step: int,
    before_backward: Callable[[], None] | None = None,
) -> float:
    rank = dist.get_rank()
    batch = make_batch(128, 2, SEQ, seed=1000 * step + rank)  # each rank its own data, the same every run
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    loss = causal_lm_loss(out.logits, batch["labels"])
    if before_backward is not None:
        before_backward()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total.item()) / dist.get_world_size()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_when(predicate: Callable[[], bool], poll_s: float = 0.0005) -> None:
    """SIGKILL this process as soon as ``predicate()`` holds (checked from a daemon thread)."""

    def holds() -> bool:
        try:
            return predicate()
        except OSError:  # a file vanished between listing and stat (the staging folder was renamed)
            return False

    def watch() -> None:
        while not holds():
            time.sleep(poll_s)
        _kill_self()

    threading.Thread(target=watch, daemon=True).start()


def _survivor_report(out: str, start: float, exc: BaseException) -> None:
    Path(out, f"rank{dist.get_rank()}.json").write_text(
        json.dumps({"seconds": time.perf_counter() - start, "error": f"{type(exc).__name__}: {exc}"[:300]})
    )


def step_fault(mode: str, out: str) -> float:
    """One good step, then rank 1 fails mid-step (after forward, before the backward's reduce-scatter)."""
    model, group = _sharded_model(meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, group, opt, 1)
    victim = dist.get_rank() == 1

    def fault() -> None:
        if not victim:
            return
        if mode == "raise":
            raise RuntimeError("injected fault: rank 1 raises mid-step")
        if mode == "sigkill":
            _kill_self()
        if mode == "stall":
            time.sleep(20 * PG_TIMEOUT_S)  # alive, silent: the others must time out

    if mode == "timer" and victim:  # killed at a random point of the next steps
        threading.Timer(0.4, _kill_self).start()
    start = time.perf_counter()
    try:
        for step in range(2, 40):
            _step(model, group, opt, step, fault if mode != "timer" else None)
    except BaseException as exc:
        if not victim:
            _survivor_report(out, start, exc)
        raise
    return time.perf_counter() - start


def hang_outside_collectives(seconds: float) -> None:
    """Rank 1 loops in Python, in no collective: only the launcher's wall-clock limit can end it."""
    if dist.get_rank() == 1:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.1)


def _fingerprint(model: nn.Module) -> dict[str, list[float]]:
    return {
        name: [float(t.sum()), float(t.abs().sum())]
        for name, t in ((n, to_full(p)) for n, p in model.named_parameters())
    }


def save_fault(point: str, root: str, out: str) -> None:
    """Save a good checkpoint at step 2, train step 3, then one rank dies while step 3 is being saved."""
    from automodel_checkpoint import save_distributed_checkpoint
    from automodel_checkpoint.atomic import COMPLETE_MARKER, staging_dir_for

    model, group = _sharded_model(meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    losses = [_step(model, group, opt, s) for s in (1, 2)]
    save_distributed_checkpoint(model, opt, Path(root, "step_2"), step=2)
    prints = {"step_2": _fingerprint(model), "losses": losses}
    losses.append(_step(model, group, opt, 3))
    prints["step_3"] = _fingerprint(model)
    if rank == 0:
        Path(out, "fingerprints.json").write_text(json.dumps(prints))
    final = Path(root, "step_3")
    staging = staging_dir_for(final)
    victim = {"staging": 1, "shard": 1, "marker": 0}[point]
    if rank == victim:
        # Each watcher also fires once the save is published, so a lost race still ends in a kill
        # (then right after the publish, another legitimate point to die at).
        if point == "staging":
            _kill_when(lambda: staging.exists() or final.exists())
        elif point == "shard":
            _kill_when(
                lambda: (
                    final.exists() or any(f.stat().st_size > 0 for f in staging.glob(f"__{rank}_*.distcp"))
                )
            )
        else:
            _kill_when(lambda: (staging / COMPLETE_MARKER).exists() or final.exists())
    dist.barrier(group=group)
    start = time.perf_counter()
    try:
        save_distributed_checkpoint(model, opt, Path(root, "step_3"), step=3)
        time.sleep(2 * PG_TIMEOUT_S)  # the victim's watcher may fire late; it must not survive the save
    except BaseException as exc:
        if rank != victim:
            _survivor_report(out, start, exc)
        raise


def resume(root: str) -> dict[str, Any]:
    """An uninterrupted run of 5 steps, and a run resumed from the newest complete checkpoint."""
    from automodel_checkpoint import latest_checkpoint, load_distributed_checkpoint

    model, group = _sharded_model(meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = [_step(model, group, opt, s) for s in range(1, 6)]
    found = latest_checkpoint(root)
    assert found is not None, f"no complete checkpoint under {root}"
    model, group = _sharded_model(meta=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    info = load_distributed_checkpoint(model, opt, found)
    assert info.step is not None
    resumed = [_step(model, group, opt, s) for s in range(info.step + 1, 6)]
    return {"reference": reference, "resumed": resumed, "from_step": info.step, "path": str(found)}


# ------------------------------------------------------------------------------------------ parent side


def _launch(fn: Callable[..., Any], *args: Any) -> tuple[float, DistributedRunError | None]:
    start = time.perf_counter()
    try:
        run_distributed(fn, 2, *args, timeout_s=200, pg_timeout_s=INIT_TIMEOUT_S)
    except DistributedRunError as exc:
        return time.perf_counter() - start, exc
    return time.perf_counter() - start, None


def _survivor(out: Path, rank: int) -> dict[str, Any] | None:
    path = out / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.parametrize("mode", ["raise", "sigkill", "stall", "timer"])
def test_rank_fault_mid_step_ends_the_others(mode: str, tmp_path: Path, fault_ledger: Any) -> None:
    wall, error = _launch(step_fault, mode, str(tmp_path))
    report = _survivor(tmp_path, 0)
    limit = PG_TIMEOUT_S + MARGIN_S
    hung = report is None or report["seconds"] > limit
    fault_ledger.fault(
        "rank fails mid-step (2 ranks, FSDP2)",
        mode,
        hung=hung,
        seconds=None if report is None else report["seconds"],
        data_lost=False,
        detail="" if report is None else report["error"],
    )
    assert error is not None, f"{mode}: the run succeeded although rank 1 failed"
    assert report is not None, (
        f"{mode}: the surviving rank never raised; run_distributed had to stop it ({wall:.0f} s):\n{error}"
    )
    assert report["seconds"] <= limit, f"{mode}: the survivor needed {report['seconds']:.1f} s > {limit} s"


def test_a_rank_hung_outside_collectives_is_stopped_by_the_wall_clock_limit(fault_ledger: Any) -> None:
    """run_distributed's own limit (timeout_s) ends a rank that no process-group timeout can reach."""
    # Rank 0 must be done before the limit (unfinished == [1]): a forked rank starts in a few seconds
    # even on a loaded 2-core machine (importing this module and ours); the rest is the hang.
    limit = 15.0
    start = time.perf_counter()
    with pytest.raises(DistributedRunError, match="timed out") as info:
        run_distributed(hang_outside_collectives, 2, 3600.0, timeout_s=limit, pg_timeout_s=INIT_TIMEOUT_S)
    seconds = time.perf_counter() - start
    hung = seconds > limit + MARGIN_S
    fault_ledger.fault(
        "rank hangs outside any collective",
        f"run_distributed(timeout_s={limit:g})",
        hung=hung,
        seconds=seconds,
        data_lost=False,
        detail=str(info.value).splitlines()[0],
    )
    assert not hung, f"stopped after {seconds:.1f} s, limit {limit} s"
    assert info.value.unfinished == [1]


def _load_fingerprint(path: Path) -> dict[str, list[float]]:
    from automodel_checkpoint import load_distributed_checkpoint

    model = build_tiny_model("llama", meta=True)
    with warnings.catch_warnings():
        # Loading in this single process, without a process group, is the point: DCP says so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_distributed_checkpoint(model, None, path)
    with torch.no_grad():
        return {name: [float(p.sum()), float(p.abs().sum())] for name, p in model.named_parameters()}


def _same(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    return a.keys() == b.keys() and all(
        torch.allclose(torch.tensor(a[k]), torch.tensor(b[k]), rtol=1e-6) for k in a
    )


@pytest.fixture(scope="module")
def crashed_root(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {}


@pytest.mark.parametrize("point", ["staging", "shard", "marker"])
def test_rank_killed_mid_save_loses_nothing(
    point: str, tmp_path: Path, fault_ledger: Any, crashed_root: dict[str, Any]
) -> None:
    from automodel_checkpoint import is_complete_checkpoint, latest_checkpoint

    root, out = tmp_path / "ckpts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    _, error = _launch(save_fault, point, str(root), str(out))
    prints = json.loads((out / "fingerprints.json").read_text())
    problems = []
    if error is None:
        problems.append("the save survived the kill")
    previous_ok = is_complete_checkpoint(root / "step_2") and _same(
        _load_fingerprint(root / "step_2"), prints["step_2"]
    )
    if not previous_ok:
        problems.append("the previous checkpoint step_2 is damaged or gone")
    new_ok = True
    if (root / "step_3").exists():
        new_ok = is_complete_checkpoint(root / "step_3") and _same(
            _load_fingerprint(root / "step_3"), prints["step_3"]
        )
        if not new_ok:
            problems.append("step_3 exists but does not hold the step-3 state")
    latest = latest_checkpoint(root)
    if latest not in (root / "step_2", root / "step_3"):
        problems.append(f"latest_checkpoint gives {latest}")
    survivor = _survivor(out, 1 - {"staging": 1, "shard": 1, "marker": 0}[point])
    hung = survivor is None or survivor["seconds"] > PG_TIMEOUT_S + MARGIN_S
    if hung:
        problems.append(f"the surviving rank did not raise within {PG_TIMEOUT_S + MARGIN_S} s: {survivor}")
    fault_ledger.fault(
        "rank killed mid-save (DCP, 2 ranks)",
        f"{point} (newest complete: {latest.name if latest else None})",
        hung=hung,
        seconds=None if survivor is None else survivor["seconds"],
        data_lost=not (previous_ok and new_ok),
        detail="; ".join(problems),
    )
    crashed_root.setdefault("root", root)
    assert not problems, "\n".join(problems) + f"\n{error}"


def test_resume_after_a_crash_matches_an_uninterrupted_run(
    crashed_root: dict[str, Any], fault_ledger: Any
) -> None:
    if "root" not in crashed_root:
        pytest.skip("needs a crashed save from test_rank_killed_mid_save_loses_nothing")
    results = run_distributed(
        resume, 2, str(crashed_root["root"]), timeout_s=200, pg_timeout_s=INIT_TIMEOUT_S
    )
    r = results[0]
    expected = r["reference"][r["from_step"] :]
    same = len(expected) == len(r["resumed"]) and all(
        abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(expected, r["resumed"], strict=True)
    )
    fault_ledger.fault(
        "resume after a crash mid-save",
        f"from step {r['from_step']}: {len(r['resumed'])} steps, max loss difference "
        f"{max((abs(a - b) for a, b in zip(expected, r['resumed'], strict=False)), default=0.0):.1e}",
        hung=False,
        seconds=None,
        data_lost=not same,
    )
    assert r["from_step"] == 2, r
    assert same, r
