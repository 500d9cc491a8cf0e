"""Property tests of mesh layouts: random sizes and world sizes, then a sample built on real gloo ranks.

`MeshContext.resolve` needs no process group, so hypothesis drives it over thousands of layouts; a
sample of valid and invalid layouts drawn here is then built for real by `MeshContext.build` on four
ranks in one launch (valid ones must give the same sizes and working axis groups; invalid ones must raise
the same `ValueError` on every rank and leave the ranks in step for the next build).
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel_mesh import MeshContext, ParallelismSizes
from automodel_mesh.layout import MeshKind, MeshLayout
from automodel_testing import run_distributed

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

PROPERTY = settings(
    max_examples=400,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SIZE_FIELDS = ("dp_size", "dp_replicate_size", "tp_size", "pp_size", "cp_size", "ep_size")
SIZE = st.one_of(st.integers(-2, 9), st.none(), st.sampled_from([1.0, "2", True, 2**40]))
SIZES = st.fixed_dictionaries({}, optional={name: SIZE for name in SIZE_FIELDS})
KINDS = st.sampled_from([MeshKind.FSDP2, MeshKind.MEGATRON_FSDP, MeshKind.DDP, "fsdp2", "ddp", "hsdp"])
WORLD = st.one_of(st.integers(-1, 64), st.sampled_from([2.0, "8", None, True]))


def _layout_problems(layout: MeshLayout, sizes: ParallelismSizes, world: int) -> list[str]:
    """What is wrong with a layout that resolve returned for ``sizes`` on ``world`` ranks."""
    bad = []
    if layout.pp * layout.dp * layout.cp * layout.tp != world:
        bad.append("pp*dp*cp*tp != world")
    if layout.ep * layout.ep_shard != layout.dp * layout.cp * layout.tp:
        bad.append("ep*ep_shard != dp*cp*tp")
    if layout.kind is not MeshKind.DDP:
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(layout, name) != getattr(sizes, f"{name}_size"):
                bad.append(f"{name}={getattr(layout, name)} != requested {getattr(sizes, f'{name}_size')}")
        if not sizes.inferred_dp and layout.dp != sizes.dp_size:
            bad.append(f"dp={layout.dp} != requested {sizes.dp_size}")
    if (
        min(layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep, layout.ep_shard)
        < 1
    ):
        bad.append("a size < 1")
    return bad


@PROPERTY
@given(fields=SIZES, kind=KINDS, world=WORLD)
def test_resolve_builds_a_valid_layout_or_names_the_field(
    fields: dict[str, Any], kind: Any, world: Any, fault_ledger: Any
) -> None:
    case = f"{kind} world={world!r} {fields}"
    names = (*fields, "world_size", "strategy_config", "dp_size", "ep_size", "pp_size", "cp_size", "tp_size")
    try:
        sizes = ParallelismSizes(**fields)
        layout = MeshContext.resolve(kind, sizes, world)
    except ValueError as exc:
        message = str(exc)
        named = [n for n in names if n in message]
        fault_ledger.bad_input("mesh layout (resolve)", case, clear=bool(named), detail=message)
        assert named, f"{case}: the ValueError names no field: {message}"
        return
    except Exception as exc:
        fault_ledger.bad_input("mesh layout (resolve)", case, clear=False, detail=repr(exc))
        raise AssertionError(f"{case}: {type(exc).__name__}, not ValueError: {exc}") from exc
    bad = _layout_problems(layout, sizes, world)
    fault_ledger.bad_input("mesh layout (resolve)", case, clear=False, valid=not bad, detail="; ".join(bad))
    assert not bad, f"{case}: invalid layout {layout}: {bad}"


@st.composite
def _valid_fsdp2(draw: st.DrawFn) -> tuple[dict[str, int], int]:
    pp, rep, shard, cp, tp = (draw(st.integers(1, 4)) for _ in range(5))
    world = pp * rep * shard * cp * tp
    if rep > 1 and shard == 1:
        shard = 2  # pure replication is DDP's job; FSDP2 rejects it
        world = pp * rep * shard * cp * tp
    non_pp = rep * shard * cp * tp
    ep = draw(st.sampled_from([d for d in range(1, non_pp + 1) if non_pp % d == 0]))
    dp = rep * shard
    sizes = {"pp_size": pp, "dp_replicate_size": rep, "cp_size": cp, "tp_size": tp, "ep_size": ep}
    if draw(st.booleans()):
        sizes["dp_size"] = dp
    return sizes, world


@PROPERTY
@given(case=_valid_fsdp2())
def test_every_tiling_of_the_world_is_accepted(case: tuple[dict[str, int], int], fault_ledger: Any) -> None:
    """No false rejections: every factorisation of the world into FSDP2 axes resolves."""
    fields, world = case
    sizes = ParallelismSizes(**fields)
    layout = MeshContext.resolve(MeshKind.FSDP2, sizes, world)
    bad = _layout_problems(layout, sizes, world)
    fault_ledger.bad_input(
        "mesh layout (valid tilings)", f"{fields} world={world}", clear=False, valid=not bad
    )
    assert not bad, bad


@PROPERTY
@given(fields=SIZES, kind=KINDS, world=WORLD)
def test_build_without_a_process_group_validates_first(fields: dict[str, Any], kind: Any, world: Any) -> None:
    """Single process: a layout for more than one rank raises ValueError, never builds or hangs."""
    try:
        sizes = ParallelismSizes(**fields)
    except ValueError:
        return
    try:
        ctx = MeshContext.build(kind, sizes, world_size=world)
    except ValueError:
        return
    assert world in (None, 1), f"built a context for world_size={world!r} without a process group"
    assert ctx.world_size == 1


# --------------------------------------------------------------------------------- real builds


def _sample_for_four_ranks(seed: int = 0, count: int = 12) -> list[tuple[str, dict[str, Any], bool]]:
    """Layouts for 4 ranks: (kind, sizes, expected valid), drawn from every tiling plus broken ones."""
    rng = random.Random(seed)
    valid: list[tuple[str, dict[str, Any], bool]] = []
    for pp in (1, 2, 4):
        for tp in (1, 2, 4):
            for cp in (1, 2, 4):
                if 4 % (pp * tp * cp):
                    continue
                dp = 4 // (pp * tp * cp)
                for ep in [d for d in range(1, dp * cp * tp + 1) if (dp * cp * tp) % d == 0]:
                    valid.append(
                        ("fsdp2", {"pp_size": pp, "tp_size": tp, "cp_size": cp, "ep_size": ep}, True)
                    )
    valid.append(("fsdp2", {"dp_replicate_size": 2}, True))
    valid.append(("megatron_fsdp", {"tp_size": 2}, True))
    valid.append(("ddp", {}, True))
    broken = [
        ("fsdp2", {"tp_size": 3}, False),
        ("fsdp2", {"dp_size": 3}, False),
        ("fsdp2", {"ep_size": 3}, False),
        ("fsdp2", {"dp_replicate_size": 4}, False),
        ("megatron_fsdp", {"pp_size": 2}, False),
        ("ddp", {"tp_size": 2}, False),
    ]
    picked = rng.sample(valid, min(count - len(broken), len(valid))) + broken
    rng.shuffle(picked)
    return picked


def build_many(layouts: list[tuple[str, dict[str, Any], bool]]) -> list[dict[str, Any]]:
    """Build each layout on every rank; check sizes and one all-reduce per axis."""
    out = []
    for kind, fields, _ in layouts:
        row: dict[str, Any] = {"kind": kind, "fields": fields}
        start = time.perf_counter()
        try:
            ctx = MeshContext.build(kind, ParallelismSizes(**fields), timeout_minutes=0.5)
        except ValueError as exc:
            row.update(error=str(exc), seconds=time.perf_counter() - start)
            out.append(row)
            continue
        expected = MeshContext.resolve(kind, ParallelismSizes(**fields), dist.get_world_size())
        row["sizes"] = {
            "pp": ctx.pp_size, "tp": ctx.tp_size, "cp": ctx.cp_size, "ep": ctx.ep_size,
            "dp": ctx.dp_size, "world": ctx.world_size,
        }  # fmt: skip
        row["expected"] = {
            "pp": expected.pp, "tp": expected.tp, "cp": expected.cp, "ep": expected.ep,
            "dp": expected.dp, "world": expected.world_size,
        }  # fmt: skip
        sums = {}
        for axis in ctx.axis_names():
            ones = torch.ones(1)
            dist.all_reduce(ones, group=ctx.get_group(axis))
            sums[axis] = (int(ones.item()), int(ctx.submesh(axis).size()))
        row["axis_sums"] = sums
        out.append(row)
    return out


@pytest.mark.distributed
def test_real_builds_on_four_ranks(fault_ledger: Any) -> None:
    layouts = _sample_for_four_ranks()
    results = run_distributed(build_many, 4, layouts, timeout_s=240, pg_timeout_s=30)
    for index, (kind, fields, valid) in enumerate(layouts):
        rows = [r[index] for r in results]
        case = f"{kind} {fields} on 4 ranks"
        if valid:
            ok = all("error" not in r and r["sizes"] == r["expected"] for r in rows) and all(
                got == size for r in rows for got, size in r["axis_sums"].values()
            )
            fault_ledger.bad_input(
                "mesh layout (real gloo builds)", case, clear=False, valid=ok, detail=str(rows[0])
            )
            assert ok, f"{case}: {rows}"
        else:
            errors = {r.get("error") for r in rows}
            clear = len(errors) == 1 and None not in errors
            fault_ledger.bad_input("mesh layout (real gloo builds)", case, clear=clear, detail=str(errors))
            assert clear, f"{case}: expected the same ValueError on every rank, got {errors}"
