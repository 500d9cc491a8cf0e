"""Pre-collective checks without processes: head counts, shard sizes, and the LoRA plan rewrite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from automodel_distributed.tensor_parallel import (
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    expand_lora_plan,
    is_lora_linear,
    resolve_tp_plan,
    validate_tensor_parallel,
)
from automodel_testing import build_tiny_model

peft = pytest.importorskip("peft")


def test_head_counts_must_divide() -> None:
    model = build_tiny_model("llama")  # 4 heads, 2 key-value heads
    validate_tensor_parallel(model, 2)
    validate_tensor_parallel(model, 1)
    with pytest.raises(
        ValueError, match=r"num_key_value_heads=2 is not divisible by tp_size=4 \(LlamaConfig\)"
    ):
        validate_tensor_parallel(model, 4)
    with pytest.raises(ValueError) as info:
        validate_tensor_parallel(model, 3)
    assert "num_attention_heads=4 is not divisible by tp_size=3" in str(info.value)
    assert "num_key_value_heads=2 is not divisible by tp_size=3" in str(info.value)
    assert "pick a tp_size dividing num_attention_heads=4, num_key_value_heads=2" in str(info.value)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        validate_tensor_parallel(model, 0)


def test_nested_text_config_is_checked() -> None:
    text = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3)
    outer = SimpleNamespace(get_text_config=lambda decoder=True: text)
    model = nn.Linear(2, 2)
    model.config = outer  # type: ignore[assignment]
    with pytest.raises(
        ValueError, match=r"num_key_value_heads=3 is not divisible by tp_size=2 \(.*text config"
    ):
        validate_tensor_parallel(model, 2)
    validate_tensor_parallel(model, 3)


def test_local_shard_sizes_must_divide_but_vocab_need_not() -> None:
    model = build_tiny_model("llama", intermediate_size=131, vocab_size=129)
    plan = resolve_tp_plan(model, tp_size=2)
    with pytest.raises(ValueError) as info:
        validate_tensor_parallel(model, 2, plan=plan)
    message = str(info.value)
    assert "model.layers.0.mlp.gate_proj: out_features=131 (= config intermediate_size)" in message
    assert "model.layers.1.mlp.down_proj: in_features=131" in message
    assert "embed_tokens" not in message and "lm_head" not in message  # uneven vocab is fine in a DTensor
    validate_tensor_parallel(build_tiny_model("llama", vocab_size=129), 2, plan=plan)


def test_style_targets_must_be_linear_or_embedding() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(
        ValueError, match=r"model\.norm is a LlamaRMSNorm, but ColwiseParallel applies to nn\.Linear"
    ):
        validate_tensor_parallel(model, 2, plan={"model.norm": ColwiseParallel()})
    with pytest.raises(ValueError, match="lm_head gets two parameter-sharding styles"):
        validate_tensor_parallel(model, 2, plan={"lm_head": ColwiseParallel(), "lm_*": RowwiseParallel()})


def _peft_llama(**lora: object) -> nn.Module:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], **lora)
    return peft.get_peft_model(build_tiny_model("llama"), config)


def test_lora_entries_are_derived_from_the_wrapper_structure() -> None:
    model = _peft_llama()
    plan = expand_lora_plan(model, resolve_tp_plan(model, tp_size=2))
    prefix = "base_model.model.model.layers.0.self_attn"
    q_base, q_a, q_b = (
        plan[f"{prefix}.q_proj.{p}"] for p in ("base_layer", "lora_A.default", "lora_B.default")
    )
    assert isinstance(q_base, ColwiseParallel) and q_base.output_layouts == (Shard(-1),)
    assert isinstance(q_a, ReplicateParallel) and q_a.desired_input_layouts == (Replicate(),)
    assert isinstance(q_b, ColwiseParallel) and q_b.input_layouts == (Replicate(),) and q_b.use_local_output
    o_base, o_a, o_b = (
        plan[f"{prefix}.o_proj.{p}"] for p in ("base_layer", "lora_A.default", "lora_B.default")
    )
    assert isinstance(o_base, RowwiseParallel)
    assert isinstance(o_a, RowwiseParallel) and o_a.input_layouts == (Shard(-1),) and not o_a.use_local_output
    assert isinstance(o_b, ReplicateParallel) and o_b.use_local_output
    # Entries whose pattern matches no LoRA wrapper stay patterns.
    assert "base_model.model.model.layers.*.self_attn.k_proj" in plan
    assert "base_model.model.model.layers.*.self_attn.q_proj" not in plan
    validate_tensor_parallel(model, 2, plan=plan)


def test_lora_under_sequence_parallel_follows_the_base_layouts() -> None:
    model = _peft_llama()
    plan = expand_lora_plan(model, resolve_tp_plan(model, sequence_parallel=True, tp_size=2))
    prefix = "base_model.model.model.layers.1.self_attn.o_proj"
    assert plan[f"{prefix}.lora_A.default"].output_layouts == (Shard(1),)  # reduce-scattered like the base
    # lora_B acts on this rank's tokens as a plain tensor, its weight gradient summed over the ranks.
    assert isinstance(plan[f"{prefix}.lora_B.default"], ReplicatedWithGradAllReduce)


def test_lora_that_cannot_be_sharded_raises() -> None:
    with pytest.raises(
        ValueError, match=r"lora_dropout=0\.1 on adapter 'default' would draw a different mask"
    ):
        expand_lora_plan(m := _peft_llama(lora_dropout=0.1), resolve_tp_plan(m, tp_size=2))
    with pytest.raises(ValueError, match="uses a LoRA variant"):
        expand_lora_plan(m := _peft_llama(use_dora=True), resolve_tp_plan(m, tp_size=2))
    emb = peft.get_peft_model(
        build_tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["embed_tokens"])
    )
    with pytest.raises(
        ValueError, match="is a LoRA-wrapped Embedding, which cannot be tensor-parallel sharded"
    ):
        expand_lora_plan(emb, resolve_tp_plan(emb, tp_size=2))


def test_row_parallel_lora_dropout_on_sharded_input_is_allowed() -> None:
    model = peft.get_peft_model(
        build_tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["o_proj"], lora_dropout=0.1)
    )
    plan = expand_lora_plan(model, resolve_tp_plan(model, tp_size=2))
    assert any(k.endswith("o_proj.lora_A.default") for k in plan)


def test_is_lora_linear_is_structural() -> None:
    class FakeLora(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = nn.Linear(2, 2)
            self.lora_A = nn.ModuleDict({"a": nn.Linear(2, 1)})
            self.lora_B = nn.ModuleDict({"a": nn.Linear(1, 2)})

    assert is_lora_linear(FakeLora())
    assert not is_lora_linear(nn.Linear(2, 2))
