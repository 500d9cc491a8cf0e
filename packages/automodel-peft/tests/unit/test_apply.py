"""apply_lora: peft injection, freezing, initialisation, dtype, dropout placement, meta device, DoRA."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from automodel_peft import (
    PeftConfig,
    apply_lora,
    apply_lora_to_linear_modules,
    freeze_base,
    hf_checkpoint_key,
    hf_key_mapping,
    init_adapter_weights,
)
from automodel_testing import build_tiny_model, save_tiny_checkpoint

Perturb = Callable[[nn.Module], None]


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"]).logits


def test_injects_peft_layers_and_freezes_the_base(batch: dict[str, torch.Tensor]) -> None:
    from peft.tuners.lora import LoraLayer

    base = build_tiny_model("llama")
    model = build_tiny_model("llama")
    count = apply_lora_to_linear_modules(
        model, PeftConfig(target_modules=["q_proj", "down_proj"], dim=4, alpha=8)
    )
    assert count == 4
    assert type(model).__name__ == "LlamaForCausalLM", "the model keeps its class"
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoraLayer)
    assert q_proj.scaling["default"] == 2.0
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert len(trainable) == 8 and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in dict(model.named_parameters())
    assert torch.equal(q_proj.lora_B["default"].weight, torch.zeros(64, 4))
    assert torch.equal(_logits(model, batch), _logits(base, batch)), (
        "B = 0: the adapted model starts as the base"
    )


def test_lora_a_init_methods() -> None:
    xavier = build_tiny_model("llama")
    apply_lora(xavier, PeftConfig(target_modules=["down_proj"], dim=8))
    a = xavier.model.layers[0].mlp.down_proj.lora_A["default"].weight  # [8, 128]
    assert a.abs().max() <= math.sqrt(6 / (8 + 128)) and a.abs().max() > 0.8 * math.sqrt(6 / (8 + 128))
    kaiming = build_tiny_model("llama")
    apply_lora(kaiming, PeftConfig(target_modules=["down_proj"], dim=8, lora_A_init="kaiming"))
    k = kaiming.model.layers[0].mlp.down_proj.lora_A["default"].weight
    assert k.abs().max() <= 1 / math.sqrt(128) and k.abs().max() > 0.8 / math.sqrt(128)


def test_peft_lora_config_is_accepted_as_is() -> None:
    import peft

    model = build_tiny_model("llama")
    count = apply_lora_to_linear_modules(model, peft.LoraConfig(r=2, target_modules=["k_proj"]))
    assert count == 2
    assert model.model.layers[1].self_attn.k_proj.lora_A["default"].weight.shape == (2, 64)


def test_lora_dtype_and_skip_freeze() -> None:
    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(target_modules=["o_proj"], lora_dtype="bfloat16"), skip_freeze=True)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.lora_A["default"].weight.dtype == torch.bfloat16
    assert o_proj.base_layer.weight.requires_grad, "skip_freeze keeps the base trainable"
    assert model.model.embed_tokens.weight.requires_grad
    trainable = freeze_base(model)
    assert trainable == 2 * (8 * 64 + 64 * 8)
    assert not o_proj.base_layer.weight.requires_grad and o_proj.lora_B["default"].weight.requires_grad


def test_errors() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match=r"matches no linear layer.*target_modules=\['qkv'\]"):
        apply_lora(model, PeftConfig(target_modules=["qkv"]))
    apply_lora(model, PeftConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already has a LoRA adapter 'default'"):
        apply_lora(model, PeftConfig(target_modules=["k_proj"]))
    with pytest.raises(ValueError, match="needs a PeftConfig"):
        apply_lora(build_tiny_model("llama"), 42)  # type: ignore[arg-type]


def test_use_triton_is_accepted_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="use_triton=True is ignored"):
        apply_lora(build_tiny_model("llama"), PeftConfig(target_modules=["q_proj"], use_triton=True))


def _branch(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    layer = model.model.layers[0].mlp.down_proj
    return layer(x) - layer.base_layer(x)


@pytest.mark.parametrize("position", ["pre", "post"])
def test_dropout_position(position: str, perturb: Perturb) -> None:
    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(target_modules=["down_proj"], dropout=0.5, dropout_position=position))
    perturb(model)
    x = torch.randn(4, 128)
    model.eval()
    full = _branch(model, x).detach()
    model.train()
    torch.manual_seed(0)
    dropped = _branch(model, x).detach()
    kept = dropped != 0
    # post: each output element is either dropped or scaled by 1/(1-p); pre mixes dropped inputs instead.
    is_post = bool(torch.allclose(dropped[kept], 2 * full[kept], atol=1e-5)) and bool((~kept).any())
    assert is_post == (position == "post")


def test_meta_build_then_materialise_and_load_hf_checkpoint(
    tmp_path: object, batch: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import load_file

    path = save_tiny_checkpoint("llama", tmp_path)  # type: ignore[arg-type]
    base = build_tiny_model("llama")
    model = build_tiny_model("llama", meta=True)
    apply_lora(model, PeftConfig(match_all_linear=True, use_dora=True, dim=4))
    assert all(p.is_meta for p in model.parameters())
    mapping = hf_key_mapping(model)
    assert mapping["model.layers.1.mlp.up_proj.base_layer.weight"] == "model.layers.1.mlp.up_proj.weight"
    assert hf_checkpoint_key("model._checkpoint_wrapped_module.layers.0.q_proj.base_layer.weight") == (
        "model.layers.0.q_proj.weight"
    )
    model.to_empty(device="cpu")
    checkpoint = load_file(str(path / "model.safetensors"))
    inverse = {hf: key for key, hf in mapping.items()}
    state = {inverse.get(k, k): v for k, v in checkpoint.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and all("lora_" in k for k in missing)
    for name, buffer in base.named_buffers():
        model.get_buffer(name).copy_(buffer)  # rotary inv_freq is not in any checkpoint
    init_adapter_weights(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    row_norms = torch.linalg.norm(base.model.layers[0].self_attn.q_proj.weight, dim=1)
    assert torch.allclose(q_proj.lora_magnitude_vector["default"].weight, row_norms)
    assert torch.allclose(_logits(model, batch), _logits(base, batch), atol=1e-5)
    assert not q_proj.base_layer.weight.requires_grad and q_proj.lora_A["default"].weight.requires_grad


def test_init_refuses_meta_adapters() -> None:
    model = build_tiny_model("llama", meta=True)
    apply_lora(model, PeftConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="still on the meta device"):
        init_adapter_weights(model)


def test_dora_starts_at_the_base_model(batch: dict[str, torch.Tensor], perturb: Perturb) -> None:
    base = build_tiny_model("llama")
    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(target_modules=["q_proj", "up_proj"], use_dora=True))
    assert sum("lora_magnitude_vector" in n for n, p in model.named_parameters() if p.requires_grad) == 4
    assert torch.allclose(_logits(model, batch), _logits(base, batch), atol=1e-5)
    perturb(model)
    loss = model(**batch).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.lora_magnitude_vector["default"].weight.grad is not None


def test_conv1d_and_linear_targets_in_one_config_are_refused() -> None:
    from transformers.pytorch_utils import Conv1D

    from automodel_peft import apply_lora

    model = nn.Sequential()
    model.add_module("conv", Conv1D(4, 4))
    model.add_module("linear", nn.Linear(4, 4))
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        apply_lora(model, PeftConfig(target_modules=["conv", "linear"]))
    assert not any("lora_" in n for n, _ in model.named_parameters())  # refused before any change


def test_linear_lora_is_the_class_of_adapted_layers() -> None:
    # The reference system's name: isinstance(module, LinearLoRA) finds the adapted layers.
    from automodel_peft import LinearLoRA, apply_lora_to_linear_modules

    model = nn.Sequential()
    model.add_module("linear1", nn.Linear(16, 16))
    model.add_module("linear2", nn.Linear(16, 16))
    assert apply_lora_to_linear_modules(model, PeftConfig(target_modules=["linear1"], dim=4, alpha=8)) == 1
    assert isinstance(model.linear1, LinearLoRA) and not isinstance(model.linear2, LinearLoRA)
    fresh = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    assert apply_lora_to_linear_modules(fresh, PeftConfig(target_modules=[".*"], dim=4, alpha=8)) == 2
    assert isinstance(fresh[0], LinearLoRA) and isinstance(fresh[2], LinearLoRA)
