"""Layout resolution: every valid layout's sizes, and every impossible one's error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel_mesh import (
    MeshAxisName,
    MeshContext,
    MeshKind,
    MeshLayout,
    ParallelismSizes,
    mesh_kind_of,
    resolve_layout,
)

FSDP2, MFSDP, DDP = MeshKind.FSDP2, MeshKind.MEGATRON_FSDP, MeshKind.DDP


def _sizes(layout: MeshLayout) -> dict[str, int]:
    keys = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "ep_shard", "dp", "dp_shard_cp", "dp_cp")
    return {k: getattr(layout, k) for k in keys}


VALID = [
    # (kind, sizes, world, expected subset of sizes)
    (FSDP2, {}, 1, {"dp": 1, "dp_shard": 1, "tp": 1}),
    (FSDP2, {}, 2, {"dp": 2, "dp_shard": 2, "dp_replicate": 1}),
    (FSDP2, {"tp_size": 2}, 4, {"dp": 2, "dp_shard": 2, "tp": 2, "dp_shard_cp": 2}),
    (FSDP2, {"cp_size": 2}, 4, {"dp": 2, "cp": 2, "dp_shard_cp": 4, "dp_cp": 4}),
    (FSDP2, {"pp_size": 2, "tp_size": 2}, 8, {"pp": 2, "dp": 2, "tp": 2}),
    (FSDP2, {"dp_replicate_size": 2}, 8, {"dp_replicate": 2, "dp_shard": 4, "dp": 8}),
    (FSDP2, {"dp_replicate_size": 2, "tp_size": 2}, 8, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
    (FSDP2, {"dp_size": 4}, 4, {"dp": 4, "dp_shard": 4}),
    (FSDP2, {"dp_size": -1, "tp_size": 4}, 8, {"dp": 2, "tp": 4}),
    (FSDP2, {"ep_size": 2}, 2, {"ep": 2, "ep_shard": 1}),
    (FSDP2, {"ep_size": 2}, 4, {"ep": 2, "ep_shard": 2}),
    (FSDP2, {"ep_size": 4, "tp_size": 2}, 8, {"ep": 4, "ep_shard": 2, "dp": 4}),
    (FSDP2, {"ep_size": 4, "pp_size": 2}, 8, {"ep": 4, "ep_shard": 1, "dp": 4, "pp": 2}),
    (MFSDP, {}, 4, {"dp": 4, "cp": 1, "tp": 1}),
    (MFSDP, {"tp_size": 2, "cp_size": 2}, 8, {"dp": 2, "cp": 2, "tp": 2, "dp_cp": 4}),
    (DDP, {}, 4, {"dp": 4, "dp_replicate": 4, "dp_shard": 1}),
    (DDP, {"dp_size": 2}, 2, {"dp": 2}),
]


@pytest.mark.parametrize(("kind", "sizes", "world", "expected"), VALID)
def test_valid_layouts(kind: MeshKind, sizes: dict[str, int], world: int, expected: dict[str, int]) -> None:
    layout = resolve_layout(kind, ParallelismSizes(**sizes), world)
    got = _sizes(layout)
    assert {k: got[k] for k in expected} == expected
    assert layout.pp * layout.dp * layout.cp * layout.tp == world
    if layout.has_device_mesh:
        prod = 1
        for _, size in layout.dense_shape():
            prod *= size
        assert prod == world
    if layout.has_moe_mesh:
        assert [a for a, _ in layout.moe_shape()] == [MeshAxisName.PP, MeshAxisName.EP_SHARD, MeshAxisName.EP]
        assert layout.pp * layout.ep_shard * layout.ep == world


def test_dense_shapes_and_flattened_axes() -> None:
    fsdp = resolve_layout(FSDP2, ParallelismSizes(tp_size=2, pp_size=2), 8)
    assert [(a.value, s) for a, s in fsdp.dense_shape()] == [
        ("pp", 2), ("dp_replicate", 1), ("dp_shard", 2), ("cp", 1), ("tp", 2),
    ]  # fmt: skip
    assert {k.value: [a.value for a in v] for k, v in fsdp.flattened_axes().items()} == {
        "dp": ["dp_replicate", "dp_shard"],
        "dp_shard_cp": ["dp_shard", "cp"],
        "dp_cp": ["dp_replicate", "dp_shard", "cp"],
    }
    assert fsdp.moe_shape() == ()
    mfsdp = resolve_layout(MFSDP, ParallelismSizes(tp_size=2), 4)
    assert [(a.value, s) for a, s in mfsdp.dense_shape()] == [("dp", 2), ("cp", 1), ("tp", 2)]
    assert list(mfsdp.flattened_axes()) == [MeshAxisName.DP_CP]
    ddp = resolve_layout(DDP, ParallelismSizes(), 4)
    assert ddp.dense_shape() == () and not ddp.has_device_mesh
    assert "no device mesh" in ddp.describe()
    assert (
        "moe mesh   (pp=1, ep_shard=2, ep=4)"
        in resolve_layout(FSDP2, ParallelismSizes(ep_size=4, tp_size=2), 8).describe()
    )


INVALID = [
    # (kind, sizes, world, fragments the message must contain)
    (FSDP2, {"tp_size": 3}, 4, ["world_size=4", "pp_size * cp_size * tp_size = 1 * 1 * 3 = 3"]),
    (FSDP2, {"pp_size": 2, "cp_size": 2}, 6, ["world_size=6", "= 4"]),
    (FSDP2, {"dp_size": 2, "tp_size": 2}, 8, ["dp_size", "= 4", "world_size=8"]),
    (FSDP2, {"dp_replicate_size": 3}, 4, ["dp_size=4", "dp_replicate_size=3"]),
    (FSDP2, {"dp_replicate_size": 2}, 2, ["dp_replicate_size=2", "DDPConfig"]),
    (FSDP2, {"ep_size": 3}, 4, ["ep_size=3", "dp_size * cp_size * tp_size = 4 * 1 * 1 = 4"]),
    (FSDP2, {"ep_size": 4, "pp_size": 2}, 4, ["ep_size=4", "= 2"]),
    (FSDP2, {"dp_replicate_size": -1}, 4, ["dp_replicate_size", "cannot be inferred"]),
    (MFSDP, {"dp_replicate_size": 2}, 4, ["dp_replicate_size=2", "FSDP2Config"]),
    (MFSDP, {"pp_size": 2}, 4, ["pp_size=2", "Megatron-FSDP"]),
    (MFSDP, {"ep_size": 2}, 4, ["ep_size=2", "Megatron-FSDP"]),
    (MFSDP, {"tp_size": 3}, 4, ["tp_size = 1 * 1 * 3 = 3"]),
    (DDP, {"dp_replicate_size": 2}, 4, ["dp_replicate_size=2", "HSDP"]),
    (DDP, {"tp_size": 2}, 4, ["tp_size=2", "DDP"]),
    (DDP, {"pp_size": 2}, 4, ["pp_size=2"]),
    (DDP, {"cp_size": 2}, 4, ["cp_size=2"]),
    (DDP, {"ep_size": 2}, 4, ["ep_size=2"]),
    (DDP, {"dp_size": 2}, 4, ["dp_size=2", "world_size=4"]),
]


@pytest.mark.parametrize(("kind", "sizes", "world", "fragments"), INVALID)
def test_impossible_layouts_name_the_sizes(
    kind: MeshKind, sizes: dict[str, int], world: int, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        resolve_layout(kind, ParallelismSizes(**sizes), world)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("world", [0, -2, 1.5, True])
def test_bad_world_size(world: object) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        resolve_layout(FSDP2, ParallelismSizes(), world)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("tp_size", 0, "ParallelismSizes.tp_size must be >= 1, got 0"),
        ("pp_size", -1, "ParallelismSizes.pp_size must be >= 1"),
        ("cp_size", 2.0, "ParallelismSizes.cp_size must be an int"),
        ("ep_size", True, "ParallelismSizes.ep_size must be an int"),
        ("dp_size", 0, "or None / -1 to infer it"),
        ("dp_replicate_size", "2", "ParallelismSizes.dp_replicate_size must be an int"),
    ],
)
def test_parallelism_sizes_validation(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        ParallelismSizes(**{field: value})  # type: ignore[arg-type]
    assert fragment in str(err.value)


def test_parallelism_sizes_dict_round_trip() -> None:
    sizes = ParallelismSizes(tp_size=2, dp_replicate_size=2)
    assert ParallelismSizes.from_dict(sizes.to_dict()) == sizes
    with pytest.raises(ValueError, match=r"unknown ParallelismSizes field\(s\) \['tp'\]"):
        ParallelismSizes.from_dict({"tp": 2})


class _Strategy:
    def __init__(self, kind: object) -> None:
        self._kind = kind

    def mesh_kind(self) -> object:
        return self._kind


def test_mesh_kind_of_protocol_enum_and_string() -> None:
    assert mesh_kind_of(MeshKind.DDP) is MeshKind.DDP
    assert mesh_kind_of("FSDP2") is MeshKind.FSDP2
    assert mesh_kind_of(_Strategy(MeshKind.MEGATRON_FSDP)) is MeshKind.MEGATRON_FSDP  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a known mesh kind"):
        mesh_kind_of("zero3")
    with pytest.raises(ValueError, match=r"_Strategy.mesh_kind\(\) returned 'fsdp2'"):
        mesh_kind_of(_Strategy("fsdp2"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not say which mesh it needs"):
        mesh_kind_of(42)  # type: ignore[arg-type]


def test_axis_names_are_strings() -> None:
    assert MeshAxisName.TP == "tp"
    assert str(MeshAxisName.DP_SHARD_CP) == "dp_shard_cp"
    assert {a.value for a in MeshAxisName} == {
        "pp", "dp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "cp", "tp", "ep", "ep_shard",
    }  # fmt: skip


def test_empty_context_is_a_single_device() -> None:
    ctx = MeshContext()
    assert (ctx.world_size, ctx.pp_size, ctx.tp_size, ctx.cp_size, ctx.ep_size, ctx.dp_shard_size) == (1,) * 6
    assert ctx.dp_size is None and ctx.dp_replicate_size is None  # as in NeMo AutoModel
    assert not ctx.pp_enabled and ctx.kind is None and ctx.is_member
    # The reference system's ("dp_shard_cp",) without a mesh, although there is no such axis to slice.
    assert ctx.dp_axis_names() == ("dp_shard_cp",) and ctx.axis_names() == ()
    assert ctx.parallelize_axis_kwargs() == {
        "dp_axis_names": ("dp_shard_cp",), "cp_axis_name": None, "tp_axis_name": None,
        "ep_axis_name": None, "ep_shard_axis_names": None,
    }  # fmt: skip
    assert ctx.pipeline_axis_kwargs()["pp_axis_name"] == "pp"
    with pytest.raises(ValueError, match="no mesh has axes"):
        ctx.submesh("tp")


def test_build_without_process_group() -> None:
    # A single process without init_process_group gets a single-device context ...
    assert MeshContext.build(MeshKind.FSDP2) == MeshContext()
    # ... but a layout that is impossible on one rank still raises, as does asking for more ranks.
    with pytest.raises(ValueError, match="tp_size = 1 \\* 1 \\* 2"):
        MeshContext.build(MeshKind.FSDP2, ParallelismSizes(tp_size=2))
    with pytest.raises(ValueError, match="init_process_group"):
        MeshContext.build(MeshKind.FSDP2, world_size=2)
    with pytest.raises(ValueError, match="timeout_minutes must be a positive number"):
        MeshContext.build(MeshKind.FSDP2, timeout_minutes=0)
    with pytest.raises(ValueError, match="parallelism_sizes must be a ParallelismSizes"):
        MeshContext.build(MeshKind.FSDP2, {"tp_size": 2})  # type: ignore[arg-type]
    assert MeshContext.resolve("ddp", None, 3).dp == 3


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(list(MeshKind)),
    world=st.integers(1, 64),
    dp=st.one_of(st.none(), st.just(-1), st.integers(-3, 16)),
    dp_replicate=st.one_of(st.none(), st.integers(-2, 8)),
    tp=st.integers(-1, 8),
    pp=st.integers(-1, 8),
    cp=st.integers(-1, 4),
    ep=st.integers(-1, 16),
)
def test_any_sizes_give_a_layout_or_a_value_error(
    kind: MeshKind, world: int, dp: int | None, dp_replicate: int | None, tp: int, pp: int, cp: int, ep: int
) -> None:
    try:
        sizes = ParallelismSizes(
            dp_size=dp, dp_replicate_size=dp_replicate, tp_size=tp, pp_size=pp, cp_size=cp, ep_size=ep
        )
        layout = resolve_layout(kind, sizes, world)
    except ValueError as err:
        message = str(err)
    else:
        assert layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp == world
        assert layout.ep * layout.ep_shard == layout.dp * layout.cp * layout.tp
        assert layout.ep == sizes.ep_size
        assert layout.tp == sizes.tp_size
        return
    assert "size" in message, message  # every message names the offending size field


def test_a_group_is_its_size_and_the_stride_between_its_ranks() -> None:
    """tp innermost (stride 1), then cp, dp_shard, dp_replicate; pp's neighbours are world/pp apart."""
    layout = resolve_layout(
        MeshKind.FSDP2, ParallelismSizes(dp_replicate_size=2, tp_size=4, cp_size=2, pp_size=2), 64
    )
    assert (layout.dp_replicate, layout.dp_shard) == (2, 2)
    assert layout.group("tp") == (4, 1)
    assert layout.group("cp") == (2, 4)  # ranks 0 and 4
    assert layout.group("dp_shard") == (2, 8)
    assert layout.group("dp_shard_cp") == (4, 4)  # cp is dp_shard_cp's inner part: ranks 0, 4, 8, 12
    assert layout.group("dp_replicate") == (2, 16)
    assert layout.group("pp") == (2, 32)
    moe = resolve_layout(MeshKind.FSDP2, ParallelismSizes(ep_size=4), 16)
    assert moe.group("ep") == (4, 1) and moe.group("ep_shard") == (4, 4)
    assert resolve_layout(MeshKind.DDP, ParallelismSizes(), 8).group("dp") == (8, 1)
    with pytest.raises(ValueError, match="not an axis"):
        resolve_layout(MeshKind.MEGATRON_FSDP, ParallelismSizes(), 8).group("pp")
