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
from automodel_distributed.cp_document_attention import CP_DOCUMENT_ATTENTION, _DocumentLayout, document_ids
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


def test_packed_positions_are_kept_for_the_document_path() -> None:
    batch = make_batch(128, 2, 8)
    batch["position_ids"] = torch.arange(8).expand(2, 8).clone()
    assert torch.equal(context_parallel_inputs(batch)["position_ids"], batch["position_ids"])
    assert document_ids(batch["position_ids"]) is None  # no restart: ring attention
    batch["position_ids"][1] = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2])  # three documents in row 1
    assert torch.equal(context_parallel_inputs(batch)["position_ids"], batch["position_ids"])
    assert document_ids(batch["position_ids"]).tolist() == [[0] * 8, [0, 0, 0, 1, 1, 2, 2, 2]]


@pytest.mark.parametrize(("cp_size", "window"), [(2, None), (2, 3), (3, None), (4, 5)])
def test_document_mask_is_same_document_causal_and_windowed_in_the_original_order(
    cp_size: int, window: int | None
) -> None:
    seq = 8 * cp_size
    gen = torch.Generator().manual_seed(cp_size)
    starts = torch.rand(2, seq, generator=gen) < 0.25
    starts[:, 0] = True
    docs = starts.long().cumsum(-1) - 1  # [2, seq] document of each original position
    order = load_balance_indices(seq, cp_size)
    gathered = []
    for rank in range(cp_size):
        mask = _DocumentLayout(None, order, rank, cp_size, docs).mask(window)  # type: ignore[arg-type]
        assert mask.shape == (2, 1, seq // cp_size, seq)
        gathered.append(mask[:, 0])
    # Rank r's query i is original position order[r * seq/cp + i]; gathered key j is order[j].
    by_order = torch.cat(gathered, dim=1)  # [2, seq, seq] in load-balanced order on both sides
    restored = torch.empty_like(by_order)
    restored[:, order[:, None], order[None, :]] = by_order
    q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    expected = (docs[:, :, None] == docs[:, None, :]) & (k <= q)
    if window is not None:
        expected &= q - k < window
    assert torch.equal(restored, expected)


def test_the_registered_attention_is_sdpa_outside_a_document_region() -> None:
    batch = make_batch(128, 2, 12)
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], list(range(12))])
    plain = build_tiny_model("mistral", sliding_window=3)
    expected = plain(**batch).logits
    model = apply_context_parallel(build_tiny_model("mistral", sliding_window=3))
    assert model.config._attn_implementation == CP_DOCUMENT_ATTENTION
    assert apply_context_parallel(model).config._attn_implementation == CP_DOCUMENT_ATTENTION
    assert torch.equal(model(**batch).logits, expected)  # packed rows isolated outside CP too


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
                with pytest.raises(ValueError, match=r"window 8.*16 tokens"):
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


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        ("llama", None),
        ("qwen3_moe", None),
        ("jetmoe", None),  # its MoE dispatch sizes by nonzero(): traced with unbacked sizes
        ("longcat_flash", r"does not run on fake tensors"),  # Python control flow on those sizes
        ("mamba", r"uses attn_implementation="),  # no attention at all
        ("qwen3_next", r"layers of kind \['linear_attention'\]"),  # a scan over time beside attention
        ("llama4_text", r"chunked_attention"),  # a mask ring attention cannot apply
        ("doge", r"an SDPA mask computed from activations"),  # a learned, content-dependent mask
    ],
)
def test_only_models_that_mix_positions_in_sdpa_alone_are_accepted(family: str, refusal: str | None) -> None:
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(derive_tiny_config(family))
    if refusal is None:
        assert apply_context_parallel(model) is model
    else:
        with pytest.raises(ValueError, match=refusal):
            apply_context_parallel(model)


def test_attention_computed_by_hand_is_found_whatever_the_config_says() -> None:
    from transformers import AutoModelForCausalLM

    from automodel_distributed.context_parallel import _check_positions_mix_only_in_sdpa
    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):  # GPT-OSS's attention sinks: scores computed with matmul, outside SDPA
        model = AutoModelForCausalLM.from_config(derive_tiny_config("gpt_oss"))
    with pytest.raises(ValueError, match=r"outside scaled_dot_product_attention \(matmul:"):
        _check_positions_mix_only_in_sdpa(model)


def test_soft_capped_attention_is_refused() -> None:
    from transformers import AutoModelForCausalLM

    from automodel_distributed import cp_document_attention as documents
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config("gemma2")
    assert config.attn_logit_softcapping
    with torch.device("meta"):  # transformers has no SDPA for soft-capped Gemma-2: it loads eager
        model = AutoModelForCausalLM.from_config(config)
    # (transformers before 5.2x loads SDPA and drops the cap itself; CP then computes what it does.)
    if model.config._attn_implementation == "eager":
        with pytest.raises(ValueError, match="attn_implementation='eager'"):
            apply_context_parallel(model)
    # A soft-capping model reaching the document path is refused there, before any collective.
    order = load_balance_indices(8, 2)
    layout = _DocumentLayout(None, order, 0, 2, torch.zeros(1, 8, dtype=torch.long))  # type: ignore[arg-type]
    q = torch.zeros(1, 2, 4, 8)
    documents._ACTIVE.append(layout)
    try:
        with pytest.raises(ValueError, match=r"soft-caps its attention scores \(softcap=50.0\)"):
            documents.cp_document_attention_forward(torch.nn.Module(), q, q, q, None, softcap=50.0)
        with pytest.raises(ValueError, match=r"only self-attention over the sharded rows"):
            documents.cp_document_attention_forward(torch.nn.Module(), q, q[:, :, :2], q[:, :, :2], None)
    finally:
        documents._ACTIVE.clear()


def test_a_layers_sliding_window_is_read_as_transformers_applies_it() -> None:
    """The window context parallelism applies (or refuses ring attention for) per attention module."""
    from automodel_distributed.cp_document_attention import attention_window

    def windows(family: str, **overrides: Any) -> list[int | None]:
        from transformers import AutoModelForCausalLM

        from automodel_testing.tiny import derive_tiny_config

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(derive_tiny_config(family, **overrides))
        return [attention_window(layer.self_attn) for layer in model.model.layers]

    assert windows("mistral", sliding_window=5) == [5] * 4
    # Qwen2: layer_types says which layers slide. Qwen2-MoE's modules have the attribute only on sliding
    # layers, and without use_sliding_window its config.sliding_window is 0: no window anywhere.
    kinds = ["full_attention", "sliding_attention"] * 2
    assert windows("qwen2", use_sliding_window=True, sliding_window=4, layer_types=kinds) == [None, 4] * 2
    assert windows("qwen2_moe") == [None] * 4
    assert windows("llama") == [None] * 4
