"""MeshContext.build on real gloo process groups: 1, 2, 4 and 8 ranks, one launch per world size.

Each launch builds every layout of its world size on every rank and reports, per axis, the ranks of
this rank's process group and the result of an all-reduce over it. The test derives the expected
groups independently from the layout (ranks laid out row-major over the mesh shape).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_mesh import MeshContext, MeshKind, ParallelismSizes, resolve_layout
from automodel_testing import available_gpus, run_distributed

pytestmark = pytest.mark.distributed

Case = tuple[str, dict[str, int]]

VALID: dict[int, list[Case]] = {
    1: [("fsdp2", {}), ("megatron_fsdp", {}), ("ddp", {})],
    2: [
        ("fsdp2", {}),
        ("fsdp2", {"tp_size": 2}),
        ("fsdp2", {"cp_size": 2}),
        ("fsdp2", {"pp_size": 2}),
        ("fsdp2", {"ep_size": 2}),
        ("megatron_fsdp", {"tp_size": 2}),
        ("ddp", {}),
    ],
    4: [
        ("fsdp2", {"tp_size": 2}),
        ("fsdp2", {"dp_replicate_size": 2}),
        ("fsdp2", {"pp_size": 2, "cp_size": 2}),
        ("fsdp2", {"ep_size": 2}),
        ("fsdp2", {"ep_size": 4}),
        ("fsdp2", {"tp_size": 2, "ep_size": 2}),
        ("megatron_fsdp", {"cp_size": 2}),
        ("ddp", {}),
    ],
    8: [
        ("fsdp2", {"pp_size": 2, "tp_size": 2}),
        ("fsdp2", {"dp_replicate_size": 2, "tp_size": 2}),
        ("fsdp2", {"cp_size": 2, "tp_size": 2}),
        ("fsdp2", {"ep_size": 4, "tp_size": 2}),
        ("fsdp2", {"pp_size": 2, "ep_size": 4}),
        ("fsdp2", {"dp_replicate_size": 2, "cp_size": 2}),
        ("megatron_fsdp", {"tp_size": 2, "cp_size": 2}),
        ("ddp", {}),
    ],
}

INVALID: dict[int, list[tuple[str, dict[str, int], str]]] = {
    1: [("fsdp2", {"tp_size": 2}, "world_size=1 is not divisible")],
    2: [("ddp", {"tp_size": 2}, "ParallelismSizes.tp_size=2 needs a device mesh"),
        ("fsdp2", {"dp_replicate_size": 2}, "leaves nothing to shard")],
    4: [("fsdp2", {"tp_size": 3}, "pp_size * cp_size * tp_size = 1 * 1 * 3 = 3"),
        ("fsdp2", {"ep_size": 3}, "ParallelismSizes.ep_size=3 does not divide"),
        ("megatron_fsdp", {"dp_replicate_size": 2}, "only supported by FSDP2Config"),
        ("ddp", {"dp_replicate_size": 2}, "HSDP")],
    8: [("fsdp2", {"dp_size": 2, "tp_size": 2}, "does not equal world_size=8"),
        ("megatron_fsdp", {"pp_size": 2}, "not supported by Megatron-FSDP")],
}  # fmt: skip

SIZE_PROPS = ("world_size", "pp_size", "tp_size", "cp_size", "ep_size", "ep_shard_size", "dp_size",
              "dp_replicate_size", "dp_shard_size", "dp_shard_cp_size", "dp_cp_size")  # fmt: skip


def _device() -> str:
    # nccl collectives need CUDA tensors; the mesh's device type follows the backend the same way.
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _facts(ctx: MeshContext) -> dict[str, Any]:
    """Sizes, axis names and, for each axis, this rank's group and an all-reduce over it."""
    rank = dist.get_rank()
    groups: dict[str, list[int]] = {}
    sums: dict[str, int] = {}
    for axis in ctx.axis_names():
        group = ctx.get_group(axis)
        groups[axis] = sorted(dist.get_process_group_ranks(group))
        t = torch.tensor([rank], dtype=torch.int64, device=_device())
        dist.all_reduce(t, group=group)
        sums[axis] = int(t.item())
    return {
        "sizes": {p: getattr(ctx, p) for p in SIZE_PROPS},
        "axes": ctx.axis_names(),
        "groups": groups,
        "sums": sums,
        "kind": ctx.kind.value if ctx.kind else None,
        "device_type": ctx.device_type,
        "dp_axis_names": ctx.dp_axis_names(),
        "kwargs": ctx.parallelize_axis_kwargs(),
        "describe": ctx.describe(),
        "layout": ctx.layout,
    }


def _run_cases(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"valid": [], "invalid": []}
    for kind, sizes in VALID[world]:
        ctx = MeshContext.build(kind, ParallelismSizes(**sizes), world_size=world)
        out["valid"].append(_facts(ctx))
    for kind, sizes, _ in INVALID[world]:
        try:
            MeshContext.build(kind, ParallelismSizes(**sizes))
        except ValueError as err:
            out["invalid"].append(str(err))
        else:
            out["invalid"].append(None)
    # After every rejected layout the default group is still healthy: nothing was half-built.
    t = torch.ones(1, device=_device())
    dist.all_reduce(t)
    out["healthy"] = t.item() == world
    if world == 4:
        out["subset"] = _subset_and_from_meshes()
    if world == 2 and _device() == "cpu":  # a timed-out NCCL collective aborts the process instead
        out["timeout"] = _timeout_fires()
    return out


def _subset_and_from_meshes() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    res: dict[str, Any] = {}
    # A mesh over ranks 1 and 3 only; ranks 0 and 2 call build too (it is collective) but are not members.
    ctx = MeshContext.build("fsdp2", ParallelismSizes(tp_size=2), ranks=[1, 3], timeout_minutes=1)
    res["member"] = ctx.is_member
    res["world"] = ctx.world_size
    if ctx.is_member:
        t = torch.tensor([rank], device=_device())
        dist.all_reduce(t, group=ctx.get_group("tp"))
        res["tp_sum"] = int(t.item())
    for bad, fragment in (([1, 1], "distinct"), ([0, 4], "outside"), ([], "at least one")):
        try:
            MeshContext.build("fsdp2", ranks=bad)
        except ValueError as err:
            res[f"bad_{fragment}"] = fragment in str(err)
    try:
        MeshContext.build("fsdp2", world_size=2)
    except ValueError as err:
        res["world_mismatch"] = str(err)
    # from_meshes wraps a user-built mesh; sizes come from it, flattened axes are derived when absent.
    mesh = init_device_mesh(_device(), (2, 2), mesh_dim_names=("dp_shard", "tp"))
    wrapped = MeshContext.from_meshes(mesh)
    res["wrapped"] = (wrapped.dp_shard_size, wrapped.tp_size, wrapped.dp_size, wrapped.dp_shard_cp_size)
    bad_mesh = init_device_mesh(_device(), (4,), mesh_dim_names=("data",))
    try:
        MeshContext.from_meshes(bad_mesh)
    except ValueError as err:
        res["bad_names"] = str(err)
    return res


def _timeout_fires() -> dict[str, Any]:
    # Rank 0 enters an all-reduce on the tp group that rank 1 never joins. With timeout_minutes=0.05 the
    # group gives up after 3 s; without it rank 0 would wait until rank 1 exits (10 s) or for the
    # default group's 60 s. A gloo timeout closes the connection between the two ranks, so nothing
    # collective may follow: this check runs last.
    ctx = MeshContext.build("fsdp2", ParallelismSizes(tp_size=2), timeout_minutes=0.05)
    res: dict[str, Any] = {}
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=ctx.get_group("tp"))
            res["raised"] = False
        except RuntimeError:
            res["raised"] = True
        res["elapsed"] = time.monotonic() - start
    else:
        time.sleep(10)
    return res


def _expected_group(world: int, shape: list[tuple[str, int]], axes: tuple[str, ...], rank: int) -> list[int]:
    grid = torch.arange(world).reshape([s for _, s in shape])
    coord = (grid == rank).nonzero()[0].tolist()
    index = tuple(slice(None) if name in axes else c for (name, _), c in zip(shape, coord, strict=True))
    return sorted(grid[index].flatten().tolist())


def _check_world(world: int, results: list[dict[str, Any]], device: str = "cpu") -> None:
    for case_index, (kind, sizes) in enumerate(VALID[world]):
        layout = resolve_layout(MeshKind(kind), ParallelismSizes(**sizes), world)
        dense = [(a.value, s) for a, s in layout.dense_shape()]
        moe = [(a.value, s) for a, s in layout.moe_shape()]
        spans = {name.value: tuple(a.value for a in axes) for name, axes in layout.flattened_axes().items()}
        for rank, res in enumerate(results):
            facts = res["valid"][case_index]
            label = f"{kind} {sizes} rank {rank}"
            assert facts["device_type"] == device, label
            assert facts["kind"] == kind, label
            assert facts["layout"] == layout, label  # what a dry run of the same job resolves
            got = facts["sizes"]
            assert got["world_size"] == world, label
            assert (got["pp_size"], got["tp_size"], got["cp_size"]) == (layout.pp, layout.tp, layout.cp), (
                label
            )
            assert (got["ep_size"], got["ep_shard_size"]) == (
                (layout.ep, layout.ep_shard) if layout.ep > 1 else (1, 1)
            )
            assert got["dp_size"] == layout.dp, label
            if kind == "fsdp2":
                assert got["dp_replicate_size"] == layout.dp_replicate, label
                assert got["dp_shard_size"] == layout.dp_shard, label
                assert got["dp_shard_cp_size"] == layout.dp_shard_cp, label
                assert facts["dp_axis_names"] == ("dp_replicate", "dp_shard_cp"), label
            if kind != "ddp":
                assert got["dp_cp_size"] == layout.dp_cp, label
            expected_axes = [n for n, _ in dense] + [n for n, _ in moe if n != "pp"] + list(spans)
            assert sorted(facts["axes"]) == sorted(expected_axes), label
            for axis, members in facts["groups"].items():
                if axis in spans:
                    want = _expected_group(world, dense, spans[axis], rank)
                elif axis in ("ep", "ep_shard"):
                    want = _expected_group(world, moe, (axis,), rank)
                else:
                    want = _expected_group(world, dense, (axis,), rank)
                assert members == want, (label, axis, members, want)
                assert facts["sums"][axis] == sum(want), (label, axis)
            kwargs = facts["kwargs"]
            assert kwargs["ep_axis_name"] == ("ep" if layout.ep > 1 else None), label
            assert kwargs["tp_axis_name"] == ("tp" if kind != "ddp" else None), label
    for case_index, (_, _, fragment) in enumerate(INVALID[world]):
        for rank, res in enumerate(results):
            message = res["invalid"][case_index]
            assert message is not None and fragment in message, (rank, fragment, message)
    assert all(res["healthy"] for res in results)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_build_every_layout(world: int) -> None:
    results = run_distributed(_run_cases, world, world, pg_timeout_s=60, timeout_s=240)
    _check_world(world, results)
    if world == 4:
        subset = [r["subset"] for r in results]
        assert [s["member"] for s in subset] == [False, True, False, True]
        assert all(s["world"] == 2 for s in subset)
        assert [s.get("tp_sum") for s in subset] == [None, 4, None, 4]
        for s in subset:
            assert s["bad_distinct"] and s["bad_outside"] and s["bad_at least one"]
            assert "world_size=2 does not match the default process group's size 4" in s["world_mismatch"]
            assert s["wrapped"] == (2, 2, 2, 2)
            assert "axis name(s) ['data']" in s["bad_names"]
    if world == 2:
        fired = results[0]["timeout"]
        assert fired["raised"], fired
        assert fired["elapsed"] < 6.0, (
            f"timeout_minutes=0.05 should fire near 3 s, took {fired['elapsed']:.1f} s"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_build_every_layout_on_cuda(world: int) -> None:
    if available_gpus() < world:
        pytest.skip(f"needs {world} CUDA devices, found {available_gpus()}")
    results = run_distributed(_run_cases, world, world, device="cuda", pg_timeout_s=60, timeout_s=240)
    _check_world(world, results, device="cuda")
