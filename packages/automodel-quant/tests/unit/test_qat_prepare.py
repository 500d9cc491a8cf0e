"""prepare_qat_model / convert_qat_model / fake-quant toggles on tiny transformers models, on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel_quant.qat import (
    QATConfig,
    convert_qat_model,
    disable_fake_quant,
    enable_fake_quant,
    get_enable_fake_quant_fn,
    get_quantizer_mode,
    prepare_qat_model,
)
from automodel_testing import build_tiny_model


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits.float()


def _types(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def test_8da4w_prepare_toggle_convert(batch: dict[str, torch.Tensor]) -> None:
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    reference = _logits(model, batch)
    quantizer = QATConfig().create_quantizer()
    model, mode = prepare_qat_model(model, quantizer)
    assert mode == "8da4w-qat" == model._qat_mode
    qat_layers = [n for n, m in model.named_modules() if type(m).__name__ == "Int8DynActInt4WeightQATLinear"]
    assert len(qat_layers) == 15  # 7 per block and the LM head: every K is 64 or 128
    assert quantizer.groupsize == 256, "the caller's quantizer must not be modified"
    assert model._qat_quantizer.groupsize == 64, "chosen from the model: 64 divides every K"

    fake = _logits(model, batch)
    assert (fake - reference).abs().max() > 1e-3, "fake quantization must change the logits"
    disable_fake_quant(model)
    assert torch.equal(_logits(model, batch), reference), "disabled fake quantization is the bf16 model"
    enable_fake_quant(model)
    assert torch.equal(_logits(model, batch), fake)

    convert_qat_model(model)
    assert "Int8DynActInt4WeightLinear" in _types(model)
    assert "Int8DynActInt4WeightQATLinear" not in _types(model)
    assert model._qat_mode is None
    assert (_logits(model, batch) - fake).abs().max() < 1e-2, (
        "converted numerics follow the fake-quantized ones"
    )


def test_4w_chooses_group_and_tiles_and_converts(batch: dict[str, torch.Tensor]) -> None:
    model = build_tiny_model("llama", dtype=torch.bfloat16)
    model, mode = prepare_qat_model(model, QATConfig(quantizer_type="int4_weight_only").create_quantizer())
    assert mode == "4w-qat"
    assert (model._qat_quantizer.groupsize, model._qat_quantizer.inner_k_tiles) == (64, 4)
    fake = _logits(model, batch)
    convert_qat_model(model)
    assert sum(type(m).__name__ == "WeightOnlyInt4Linear" for m in model.modules()) == 15
    assert (_logits(model, batch) - fake).abs().max() < 5e-2


def test_fp32_model_is_refused_with_dtype_and_fix() -> None:
    with pytest.raises(
        ValueError, match=r"QAT needs a bfloat16 model.*float32: 21 parameters.*model.to\(torch.bfloat16\)"
    ):
        prepare_qat_model(build_tiny_model("llama"), QATConfig().create_quantizer())


def test_unfitting_layers_are_skipped_with_one_warning_or_refused(toy_lm: type[nn.Module]) -> None:
    model = toy_lm([(64, 64), (64, 48), (48, 64)]).to(torch.bfloat16)
    with pytest.warns(
        UserWarning, match=r"1 linear layer\(s\) stay in high precision: layers.2 \(in_features=48"
    ) as record:
        prepare_qat_model(model, QATConfig().create_quantizer())
    assert len([w for w in record if "stay in high precision" in str(w.message)]) == 1
    assert type(model.layers[2]) is nn.Linear
    assert type(model.layers[0]).__name__ == "Int8DynActInt4WeightQATLinear"

    strict = QATConfig(on_unsupported_layer="error").create_quantizer()
    with pytest.raises(ValueError, match=r"no quantizer setting fits 1 linear layer\(s\): layers.2"):
        prepare_qat_model(toy_lm([(64, 64), (64, 48), (48, 64)]).to(torch.bfloat16), strict)


def test_int4_lists_biased_layers(toy_lm: type[nn.Module]) -> None:
    model = toy_lm([(64, 64)], bias=True).to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"layers.0 \(has a bias"):
        prepare_qat_model(model, QATConfig(quantizer_type="int4_weight_only").create_quantizer())
    assert type(model.lm_head).__name__ == "Int4WeightOnlyQATLinear"


def test_lora_adapters_stay_unquantized() -> None:
    import peft

    model = build_tiny_model("llama", dtype=torch.bfloat16)
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules=["q_proj"]), model)
    prepare_qat_model(model, QATConfig().create_quantizer())
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == "Int8DynActInt4WeightQATLinear"
    assert type(q_proj.lora_A["default"]) is nn.Linear
    assert type(q_proj.lora_B["default"]) is nn.Linear


def test_prepare_on_meta_device() -> None:
    model = build_tiny_model("llama", dtype=torch.bfloat16, meta=True)
    prepare_qat_model(model, QATConfig(quantizer_type="int4_weight_only").create_quantizer())
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Int4WeightOnlyQATLinear"
    assert q_proj.weight.is_meta


def test_torchao_qat_config_prepare_and_convert(batch: dict[str, torch.Tensor]) -> None:
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    model = build_tiny_model("llama", dtype=torch.bfloat16)
    reference = _logits(model, batch)
    config = TorchaoQATConfig(
        activation_config=IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
        weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32),
        step="prepare",
    )
    model, mode = prepare_qat_model(model, config)
    assert mode == "torchao-qat" == get_quantizer_mode(config)
    assert sum(type(m).__name__ == "FakeQuantizedLinear" for m in model.modules()) == 15
    disable_fake_quant(model)
    assert torch.equal(_logits(model, batch), reference)
    enable_fake_quant(model)
    assert not torch.equal(_logits(model, batch), reference)
    convert_qat_model(model)
    assert "FakeQuantizedLinear" not in _types(model)


def test_torchao_base_config_is_wrapped_and_converted(batch: dict[str, torch.Tensor]) -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup

    model = build_tiny_model("llama", dtype=torch.bfloat16)
    base = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    prepare_qat_model(model, base)
    fake = _logits(model, batch)
    convert_qat_model(model)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert (_logits(model, batch) - fake).abs().max() < 5e-2


def test_bad_quantizers_and_modes() -> None:
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    model = build_tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="has no prepare"):
        prepare_qat_model(model, object())
    with pytest.raises(ValueError, match="step='prepare'"):
        prepare_qat_model(model, TorchaoQATConfig(step="convert"))
    with pytest.raises(ValueError, match="unknown QAT mode 'int3'"):
        get_enable_fake_quant_fn("int3")
    with pytest.raises(ValueError, match="has no QAT mode"):
        enable_fake_quant(model)
    with pytest.raises(ValueError, match="not prepared"):
        convert_qat_model(model)
