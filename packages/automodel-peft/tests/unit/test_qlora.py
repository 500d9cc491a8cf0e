"""QLoRA: LoRA over bitsandbytes base weights through automodel-quant (the [quant] extra).

bitsandbytes >= 0.46 has a CPU backend, so the real path also runs here with ``allow_cpu=True``; the
default configuration refuses a CPU host with a clear error, and the CUDA path is marked gpu.
"""

from __future__ import annotations

import sys

import pytest
import torch

from automodel_peft import PeftConfig, apply_lora, create_bnb_config
from automodel_testing import build_tiny_model, make_batch

CONFIG = PeftConfig(target_modules=["q_proj", "v_proj", "down_proj"], dim=4, alpha=8)


def test_missing_automodel_quant_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "automodel_quant", None)
    monkeypatch.setitem(sys.modules, "automodel_quant.bnb", None)
    with pytest.raises(ImportError, match=r"pip install automodel-peft\[quant\]"):
        apply_lora(build_tiny_model("llama"), CONFIG, quantization_config={"load_in_4bit": True})


def test_cpu_host_without_opt_in_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from automodel_quant.bnb import BnBQuantizationConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="bitsandbytes quantization needs CUDA"):
        apply_lora(
            build_tiny_model("llama", dtype=torch.bfloat16),
            CONFIG,
            quantization_config=BnBQuantizationConfig(),
        )


def test_dora_and_meta_are_refused() -> None:
    from automodel_quant.bnb import BnBQuantizationConfig

    quant = BnBQuantizationConfig(allow_cpu=True)
    dora = PeftConfig(target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match="DoRA on bitsandbytes-quantized base weights is not supported"):
        apply_lora(build_tiny_model("llama", dtype=torch.bfloat16), dora, quantization_config=quant)
    with pytest.raises(ValueError, match="QLoRA needs the base weights loaded"):
        apply_lora(build_tiny_model("llama", meta=True), CONFIG, quantization_config=quant)
    with pytest.raises(ValueError, match="quantization_config must be"):
        apply_lora(build_tiny_model("llama"), CONFIG, quantization_config=3)


def test_transformers_bnb_config() -> None:
    import transformers

    config = create_bnb_config({"load_in_4bit": True, "bnb_4bit_compute_dtype": "float16"})
    assert isinstance(config, transformers.BitsAndBytesConfig)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.float16 and config.bnb_4bit_use_double_quant


def _qlora_trains(device: str, bits: int) -> None:
    pytest.importorskip("bitsandbytes")
    from automodel_quant.bnb import BnBQuantizationConfig

    batch = {k: v.to(device) for k, v in make_batch(128, 4, 16, seed=1).items()}
    quant = BnBQuantizationConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8, allow_cpu=device == "cpu")
    model = build_tiny_model("llama", dtype=torch.bfloat16, device=device)
    apply_lora(model, CONFIG, quantization_config=quant)
    q_proj = model.model.layers[0].self_attn.q_proj
    kind = "Linear4bit" if bits == 4 else "Linear8bitLt"
    assert type(q_proj).__module__.startswith("peft.tuners.lora.bnb") and type(q_proj).__name__ == kind
    assert q_proj.lora_A["default"].weight.dtype == torch.bfloat16  # the compute dtype
    assert type(model.model.layers[0].self_attn.k_proj).__name__ == kind  # quantized, not adapted
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * 6
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_on_the_cpu_backend(bits: int) -> None:
    _qlora_trains("cpu", bits)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_on_cuda(bits: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _qlora_trains("cuda", bits)
