"""Model names to checkpoint keys: wrapper segments, peft, tied weights, regex key mappings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel_checkpoint.keys import (
    DEFAULT_KEY_RULES,
    KeyRules,
    apply_key_mapping,
    checkpoint_key,
    collect_tensor_slots,
)
from automodel_modules import ADAPTER_SEGMENTS, is_adapter_fqn
from automodel_testing import build_tiny_model


@pytest.mark.parametrize(
    ("fqn", "key"),
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("_orig_mod.model.norm.weight", "model.norm.weight"),
        ("module.lm_head.weight", "lm_head.weight"),
        (
            "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ),
        ("module._orig_mod.base_model.model.lm_head.weight", "lm_head.weight"),
        ("model.layers.0._fsdp_wrapped_module.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ],
)
def test_checkpoint_key(fqn: str, key: str) -> None:
    assert checkpoint_key(fqn) == key


def test_adapter_keys_follow_the_one_adapter_rule_and_custom_rules() -> None:
    # Which parameters are adapters is one rule for every package: the segments peft's LoRA layers
    # declare (automodel_modules; automodel-peft's tests check it against peft).
    assert is_adapter_fqn("base_model.model.x.q_proj.lora_A.default.weight")
    assert is_adapter_fqn("x.embed.lora_embedding_B.default")
    assert not is_adapter_fqn("model.layers.0.self_attn.q_proj.weight")
    assert not is_adapter_fqn("model.lora_like_name.weight")  # whole segments, not prefixes
    assert "lora_magnitude_vector" in ADAPTER_SEGMENTS
    rules = KeyRules(drop_segments=frozenset({"wrapped"}), drop_prefixes=(("net",),))
    assert checkpoint_key("net.a.wrapped.b", rules) == "a.b"
    assert checkpoint_key("module.a", rules) == "module.a"


def test_apply_key_mapping() -> None:
    renamed = apply_key_mapping(["transformer.h.0.w", "lm_head.weight"], {r"^transformer\.": "model."})
    assert renamed == {"model.h.0.w": "transformer.h.0.w", "lm_head.weight": "lm_head.weight"}
    with pytest.raises(ValueError, match="both checkpoint keys"):
        apply_key_mapping(["a.x", "b.x"], {r"^[ab]\.": ""})


def test_tied_weights_are_one_slot() -> None:
    model = build_tiny_model("llama_tied", meta=True)
    slots = collect_tensor_slots(model)
    tied = [s for s in slots if len(s.keys) > 1]
    assert len(tied) == 1
    assert tied[0].keys == ["model.embed_tokens.weight", "lm_head.weight"]
    assert len(tied[0].owners) == 2
    keys = {k for s in slots for k in s.keys}
    assert not any("inv_freq" in k for k in keys)  # non-persistent buffers are not checkpoint tensors


def test_peft_model_slots() -> None:
    import peft

    model = peft.get_peft_model(build_tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    base = collect_tensor_slots(model)
    plain = collect_tensor_slots(build_tiny_model("llama"))
    assert [s.keys for s in base] == [s.keys for s in plain]
    with_adapters = collect_tensor_slots(model, include_adapters=True)
    assert len(with_adapters) == len(base) + 4  # lora_A and lora_B of q_proj in 2 layers


def test_two_tensors_on_one_key_is_an_error() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.module = nn.Module()
            self.module.a = nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"both map to checkpoint key 'a\.weight'"):
        collect_tensor_slots(Twice(), DEFAULT_KEY_RULES)


def test_buffers() -> None:
    m = nn.BatchNorm1d(3)
    keys = [s.keys[0] for s in collect_tensor_slots(m)]
    assert keys == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert all(isinstance(s.tensor, torch.Tensor) for s in collect_tensor_slots(m))
