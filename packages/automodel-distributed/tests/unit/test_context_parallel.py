"""Context-parallel helpers that need no second rank: load-balancing order, batch preparation, hooks."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import automodel_distributed.context_parallel as cp
from automodel_distributed.activation_checkpointing import apply_activation_checkpointing
from automodel_distributed.context_parallel import (
    apply_context_parallel,
    context_parallel_inputs,
    context_parallel_region,
    context_parallel_unshard,
    load_balance_indices,
)
from automodel_distributed.cpu_ring_attention import cpu_ring_attention_available
from automodel_testing import build_tiny_model, make_batch


@pytest.mark.parametrize(("seq_len", "cp_size"), [(8, 2), (16, 2), (24, 3), (32, 4), (6, 1)])
def test_load_balance_order_is_torchs_head_tail_order(seq_len: int, cp_size: int) -> None:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    ours = load_balance_indices(seq_len, cp_size)
    torchs = _HeadTailLoadBalancer(seq_len, cp_size, torch.device("cpu"))._generate_indices(restore=False)
    assert torch.equal(ours, torchs[0])
    assert sorted(ours.tolist()) == list(range(seq_len))


def test_load_balance_order_by_hand() -> None:
    # 2 ranks, 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert load_balance_indices(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_sequence_length_must_divide_by_twice_the_cp_size() -> None:
    with pytest.raises(ValueError, match=r"divisible by 2 \* cp_size = 4, got 10; pad"):
        load_balance_indices(10, 2)


def test_inputs_gain_position_ids_and_pre_shifted_labels() -> None:
    batch = make_batch(128, 2, 8)
    del batch["position_ids"]
    batch["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    original = {k: v.clone() for k, v in batch.items()}
    out = context_parallel_inputs(batch)
    assert set(out) == {"input_ids", "position_ids", "shift_labels"}
    assert torch.equal(out["position_ids"], torch.arange(8).expand(2, 8))
    assert torch.equal(out["shift_labels"][:, :-1], batch["labels"][:, 1:])
    assert (out["shift_labels"][:, -1] == -100).all()
    assert all(torch.equal(batch[k], original[k]) for k in original)  # the input is not modified


def test_padding_masks_and_missing_ids_are_rejected() -> None:
    batch = make_batch(128, 2, 8)
    batch["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    batch["attention_mask"][1, -3:] = 0
    with pytest.raises(ValueError, match="masks 3 position"):
        context_parallel_inputs(batch)
    with pytest.raises(ValueError, match="input_ids"):
        context_parallel_inputs({"labels": batch["labels"]})


def test_packed_rows_are_refused_and_contiguous_positions_pass() -> None:
    batch = make_batch(128, 2, 8)
    batch["position_ids"] = torch.arange(8).expand(2, 8).clone()
    assert torch.equal(context_parallel_inputs(batch)["position_ids"], batch["position_ids"])
    batch["position_ids"][1] = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2])  # three documents in row 1
    with pytest.raises(ValueError, match=r"restart 2 time\(s\) inside rows \(packed sequences"):
        context_parallel_inputs(batch)


def test_cpu_ring_attention_internals_exist_in_this_torch() -> None:
    assert cpu_ring_attention_available() == (True, "")


def test_eager_attention_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"attn_implementation='eager'.*'sdpa'"):
        apply_context_parallel(build_tiny_model("llama", attn_implementation="eager"))


def _mask_seen_by_attention(model: Any, batch: dict[str, torch.Tensor]) -> list[bool]:
    seen: list[bool] = []

    def spy(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(kwargs.get("attention_mask") is not None)

    handles = [
        layer.self_attn.register_forward_pre_hook(spy, with_kwargs=True) for layer in model.model.layers
    ]
    model(**batch)
    for handle in handles:
        handle.remove()
    return seen


def test_hooks_strip_the_mask_only_inside_a_region() -> None:
    model = build_tiny_model("llama")
    apply_context_parallel(model)
    apply_context_parallel(model)  # idempotent: one hook per attention module
    assert all(len(layer.self_attn._forward_pre_hooks) == 1 for layer in model.model.layers)
    batch = make_batch(128, 2, 8)
    batch["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    batch["attention_mask"][0, :2] = 0  # left padding: transformers builds a mask
    assert _mask_seen_by_attention(model, batch) == [True, True]
    token = cp._ACTIVE_CP_SIZE.set(2)  # what an open region of two cp ranks sets
    try:
        assert _mask_seen_by_attention(model, batch) == [False, False]
    finally:
        cp._ACTIVE_CP_SIZE.reset(token)


def test_sliding_windows_shorter_than_the_sequence_are_refused() -> None:
    model = build_tiny_model("mistral", sliding_window=8)
    apply_context_parallel(model)
    batch = make_batch(128, 1, 8)  # local shard of 8 tokens; with cp_size=2 the sequence has 16
    for cp_size, refused in ((2, True), (1, False)):  # 8 tokens fit in the window
        token = cp._ACTIVE_CP_SIZE.set(cp_size)
        try:
            if refused:
                with pytest.raises(NotImplementedError, match=r"window 8.*16 tokens"):
                    model(**batch)
            else:
                model(**batch)
        finally:
            cp._ACTIVE_CP_SIZE.reset(token)


def test_hooks_reach_attention_inside_checkpoint_wrappers() -> None:
    model = apply_activation_checkpointing(build_tiny_model("qwen2"), mode="full")
    apply_context_parallel(model)
    attentions = [layer._checkpoint_wrapped_module.self_attn for layer in model.model.layers]
    assert all(getattr(a, "_automodel_cp_hooked", False) for a in attentions)


@pytest.fixture
def one_rank_cp_mesh(tmp_path: pathlib.Path) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def test_cp_size_one_is_a_no_op(one_rank_cp_mesh: Any) -> None:
    batch = context_parallel_inputs(make_batch(128, 2, 6))  # 6 is not a multiple of anything needed
    with context_parallel_region(one_rank_cp_mesh, batch) as local:
        assert all(local[k] is batch[k] for k in batch)
    (full,) = context_parallel_unshard(one_rank_cp_mesh, [batch["input_ids"]], [1])
    assert torch.equal(full, batch["input_ids"])


def test_a_mesh_without_a_cp_axis_is_rejected(tmp_path: pathlib.Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="no 'cp' axis"), context_parallel_region(mesh, {}):
            pass
        cp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        batch = make_batch(128, 1, 4)
        with (
            pytest.raises(ValueError, match=r"got 'labels'.*context_parallel_inputs"),
            context_parallel_region(cp_mesh, batch),
        ):
            pass  # even with one cp rank, so that raising cp_size later changes nothing
    finally:
        dist.destroy_process_group()
