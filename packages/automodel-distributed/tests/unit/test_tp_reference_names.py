"""The reference system's tensor-parallel names: LoRA styles, translate_to_lora, get_hf_tp_shard_plan."""

from __future__ import annotations

import peft
import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from automodel_distributed.tensor_parallel import (
    ColwiseParallelLora,
    ReplicateParallel,
    RowwiseParallelLora,
    SequenceParallelLora,
    expand_lora_plan,
    get_hf_tp_shard_plan,
    resolve_tp_plan,
    translate_hf_tp_plan,
    translate_to_lora,
)
from automodel_testing import build_tiny_model


def test_lora_styles_are_the_torch_styles_and_translation_is_the_identity() -> None:
    assert issubclass(ColwiseParallelLora, ColwiseParallel) and issubclass(
        RowwiseParallelLora, RowwiseParallel
    )
    assert issubclass(SequenceParallelLora, SequenceParallel)
    style = ColwiseParallel(output_layouts=Shard(1))
    assert translate_to_lora(style) is style and translate_to_lora(translate_to_lora(style)) is style
    other = ReplicateParallel()
    assert translate_to_lora(other) is other


def test_a_plan_with_the_lora_styles_is_split_over_the_adapters() -> None:
    # What makes the aliases sound: the plain styles on a LoRA wrapper become per-part entries.
    model = peft.get_peft_model(
        build_tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"])
    )
    prefix = "base_model.model.model.layers.0.self_attn"
    plan = expand_lora_plan(
        model,
        {
            f"{prefix}.q_proj": translate_to_lora(ColwiseParallelLora()),
            f"{prefix}.o_proj": translate_to_lora(RowwiseParallelLora()),
        },
    )
    assert isinstance(plan[f"{prefix}.q_proj.lora_A.default"], ReplicateParallel)
    assert plan[f"{prefix}.q_proj.lora_B.default"].input_layouts == (Replicate(),)
    assert isinstance(plan[f"{prefix}.o_proj.lora_A.default"], RowwiseParallel)
    assert isinstance(plan[f"{prefix}.o_proj.lora_B.default"], ReplicateParallel)


def test_get_hf_tp_shard_plan_is_transformers_plan_as_styles() -> None:
    model = build_tiny_model("llama", meta=True)
    plan = get_hf_tp_shard_plan(model)
    names, _ = translate_hf_tp_plan(model)
    assert names is not None and plan.keys() == names.keys()
    # The registered plan is transformers' with attention and the MLP taking their input as a DTensor.
    blocks = {"model.layers.*.self_attn", "model.layers.*.mlp"}
    assert resolve_tp_plan(model, tp_size=2).keys() == plan.keys() | blocks
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert isinstance(plan["lm_head"], ColwiseParallel) and plan["lm_head"].output_layouts == (Shard(-1),)
    with pytest.raises(
        ValueError, match=r"Hugging Face TP plan is not supported for Linear.*FSDP2Config.tp_plan"
    ):
        get_hf_tp_shard_plan(nn.Linear(4, 4))
