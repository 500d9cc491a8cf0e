"""BnBQuantizationConfig and its CPU-side decisions; real quantization on bitsandbytes' CPU backend
(opt-in) and, marked gpu, on CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from automodel_quant.bnb import (
    BnBQuantizationConfig,
    apply_bnb_quantization,
    check_bnb_device,
    is_bnb_quantized,
    resolve_bnb_device,
    resolve_bnb_targets,
)
from automodel_testing import build_tiny_model


def test_defaults_are_the_qlora_recipe() -> None:
    config = BnBQuantizationConfig()
    assert (config.load_in_4bit, config.load_in_8bit, config.bits) == (True, False, 4)
    assert config.to_hf_kwargs() == {
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": torch.bfloat16,
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_quant_storage": torch.bfloat16,
    }
    eight = BnBQuantizationConfig(load_in_4bit=False, load_in_8bit=True, llm_int8_skip_modules=["router"])
    assert eight.to_hf_kwargs() == {
        "load_in_4bit": False,
        "load_in_8bit": True,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": ["router"],
    }
    assert eight.compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"load_in_8bit": True}, r"exactly one of load_in_4bit / load_in_8bit.*True, load_in_8bit=True"),
        ({"load_in_4bit": False}, r"exactly one.*load_in_4bit=False, load_in_8bit=False"),
        ({"bnb_4bit_quant_type": "int4"}, r"bnb_4bit_quant_type='int4'.*nf4"),
        ({"bnb_4bit_compute_dtype": "int8"}, r"compute_dtype=torch.int8 must be a floating-point"),
        ({"llm_int8_threshold": 0}, r"llm_int8_threshold=0 must be > 0"),
    ],
)
def test_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BnBQuantizationConfig(**kwargs)  # type: ignore[arg-type]


def test_dtype_names_and_dict_round_trip() -> None:
    config = BnBQuantizationConfig(bnb_4bit_compute_dtype="float16", bnb_4bit_quant_storage="uint8")
    assert (config.bnb_4bit_compute_dtype, config.bnb_4bit_quant_storage) == (torch.float16, torch.uint8)
    data = config.to_dict()
    assert data["bnb_4bit_compute_dtype"] == "float16" and data["bnb_4bit_quant_storage"] == "uint8"
    assert BnBQuantizationConfig.from_dict(data) == config
    with pytest.raises(ValueError, match=r"unknown BnBQuantizationConfig field\(s\) \['bits'\]"):
        BnBQuantizationConfig.from_dict({"bits": 4})


def test_targets_skip_head_adapters_and_named_modules() -> None:
    import peft

    model = build_tiny_model("llama")
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), model)
    plan = resolve_bnb_targets(
        model, BnBQuantizationConfig(llm_int8_skip_modules=["down_proj", "layers.1.self_attn.o_proj"])
    )
    assert plan.skipped["lm_head"] == "output head"
    assert plan.skipped["model.layers.0.self_attn.q_proj.lora_A.default"] == "LoRA adapter"
    assert plan.skipped["model.layers.0.mlp.down_proj"] == "in llm_int8_skip_modules"
    assert plan.skipped["model.layers.1.self_attn.o_proj"] == "in llm_int8_skip_modules"
    assert "model.layers.0.self_attn.o_proj" in plan.quantize
    assert "model.layers.0.self_attn.q_proj.base_layer" in plan.quantize
    assert len(plan.quantize) == 14 - 3


def test_device_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_bnb_device(None) == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"bitsandbytes quantization needs CUDA.*allow_cpu=True"):
        check_bnb_device(BnBQuantizationConfig(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"needs CUDA, and torch\.cuda\.is_available"):
        check_bnb_device(BnBQuantizationConfig(), torch.device("cuda"))
    check_bnb_device(BnBQuantizationConfig(allow_cpu=True), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not mps"):
        check_bnb_device(BnBQuantizationConfig(allow_cpu=True), torch.device("mps"))


def test_cpu_host_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="bitsandbytes quantization needs CUDA"):
        apply_bnb_quantization(build_tiny_model("llama"), BnBQuantizationConfig())


def test_missing_bitsandbytes_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"pip install automodel-quant\[bnb\]"):
        apply_bnb_quantization(build_tiny_model("llama"), BnBQuantizationConfig(allow_cpu=True), device="cpu")


def test_meta_weights_are_refused() -> None:
    pytest.importorskip("bitsandbytes")
    with pytest.raises(ValueError, match=r"needs loaded weights.*meta device"):
        apply_bnb_quantization(
            build_tiny_model("llama", meta=True), BnBQuantizationConfig(allow_cpu=True), device="cpu"
        )


def _quantize_and_check(device: str, config: BnBQuantizationConfig) -> None:
    from automodel_testing import make_batch

    batch = {k: v.to(device) for k, v in make_batch(128, 2, 16, seed=1).items()}
    model = build_tiny_model("llama", dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        reference = model(**batch).loss.item()
    apply_bnb_quantization(model, config, device=device)
    assert is_bnb_quantized(model)
    kind = "Linear4bit" if config.load_in_4bit else "Linear8bitLt"
    assert type(model.model.layers[0].mlp.down_proj).__name__ == kind
    assert type(model.lm_head) is nn.Linear
    assert model.is_loaded_in_4bit is config.load_in_4bit
    with torch.no_grad():
        loss = model(**batch).loss.item()
    assert abs(loss - reference) < 5e-2, (loss, reference)


@pytest.mark.parametrize("bits", [4, 8])
def test_real_quantization_on_the_cpu_backend(bits: int) -> None:
    pytest.importorskip("bitsandbytes")
    config = BnBQuantizationConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8, allow_cpu=True)
    _quantize_and_check("cpu", config)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_real_quantization_on_cuda(bits: int) -> None:
    pytest.importorskip("bitsandbytes")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _quantize_and_check("cuda", BnBQuantizationConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8))


def test_settings_of_the_other_bit_width_warn() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        BnBQuantizationConfig(load_in_4bit=False, load_in_8bit=True, bnb_4bit_quant_type="fp4")
        BnBQuantizationConfig(llm_int8_threshold=4.0)
        BnBQuantizationConfig(llm_int8_skip_modules=["router"])  # both widths read it: quiet
    assert [str(w.message) for w in seen] == [
        "BnBQuantizationConfig.bnb_4bit_quant_type ignored: load_in_8bit is True",
        "BnBQuantizationConfig.llm_int8_threshold ignored: load_in_4bit is True",
    ]
