"""The orchestration layer on one CUDA device (NCCL, bf16, real FP8): runs in the nox ``gpu`` sessions only.

Each case goes through `instantiate_infrastructure` + `apply_model_infrastructure` from a meta model and
an HF checkpoint written by the test, on a process group of one NCCL rank, and compares with plain
transformers (or with the leaf function applied to a plain model, for FP8 and QAT) on the same GPU.

Tolerances: bf16 logits after loading must match transformers exactly (the same kernels run on the same
weights); FP8 (real float8 matmuls on SM 8.9+) and QAT (fake-quantized int4 weights) are compared with
the same conversion applied by the leaf package to a plain transformers model in the same process:
losses over 4 AdamW steps within 2e-2 absolute (bf16 and float8 rounding differ between the two runs only
in the order of operations).
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch

from automodel_testing import make_batch, run_distributed, save_tiny_checkpoint, skip_unless_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, skip_unless_gpus(1)]

STEPS = 4
# FP8 needs every linear's dims to divide by 16: the tiny config's dims (64, 128, 128) do.
FAMILY = "llama"


def _plain(ckpt: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(device)
    model.train()
    return model


def _train(model: Any, batch: dict[str, torch.Tensor], device: torch.device) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(STEPS):
        out = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss))
    return losses


def _through_infra(ckpt: str, device: torch.device, **apply_kwargs: Any) -> Any:
    from automodel_distributed.config import CompileConfig, FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext
    from automodel_testing import build_tiny_model

    qat_config = apply_kwargs.pop("qat_config", None)
    config = FSDP2Config()
    mesh = MeshContext.build(config)
    infra = instantiate_infrastructure(
        distributed_config=config, qat_config=qat_config, device=device, mesh=mesh
    )
    model = build_tiny_model(FAMILY, meta=True, dtype=torch.bfloat16)
    compile_config = apply_kwargs.pop("compile_config", None)
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=device,
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        qat_quantizer=infra.qat_quantizer,
        compile_config=CompileConfig(**compile_config) if compile_config else None,
        load_base_model=True,
        pretrained_model_name_or_path=ckpt,
        **apply_kwargs,
    )


def _cases(ckpt: str) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    warnings.simplefilter("ignore")
    device = torch.device("cuda", torch.cuda.current_device())
    batch = make_batch(128, 4, 32, seed=3)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "capability": torch.cuda.get_device_capability(),
    }

    # bf16 load: logits equal transformers'.
    plain = _plain(ckpt, device)
    model = _through_infra(ckpt, device)
    with torch.no_grad():
        ids = batch["input_ids"].to(device)
        out["bf16_logits"] = float((model(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max())
    out["bf16_steps"] = (_train(model, batch, device), _train(plain, batch, device))

    # FP8 training (real float8 matmuls) against the leaf conversion of a plain model.
    from automodel_quant.fp8 import FP8Config, apply_fp8_to_model

    fp8 = FP8Config(enabled=True, emulate=False)
    ref = apply_fp8_to_model(_plain(ckpt, device), config=fp8)
    model = _through_infra(ckpt, device, fp8_config=fp8)
    out["fp8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    out["fp8_steps"] = (_train(model, batch, device), _train(ref, batch, device))

    # QAT (int8 dynamic activations, int4 weights) against the leaf preparation of a plain model.
    from automodel_quant.qat import QATConfig, prepare_qat_model

    qat = QATConfig()
    ref, _ = prepare_qat_model(_plain(ckpt, device), qat.create_quantizer())
    model = _through_infra(ckpt, device, qat_config=qat)
    out["qat_steps"] = (_train(model, batch, device), _train(ref, batch, device))

    # compile_config under FSDP2: blocks compiled in place, parameter names unchanged, same logits.
    model = _through_infra(ckpt, device, compile_config={"enabled": True})
    plain = _plain(ckpt, device)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits.float() - plain(input_ids=ids).logits.float()).abs().max()
    out["compile_logits"] = float(diff)
    out["compile_names_clean"] = not any("_orig_mod" in n for n, _ in model.named_parameters())
    return out


def test_infra_on_one_gpu(tmp_path: Any) -> None:
    ckpt = str(save_tiny_checkpoint(FAMILY, tempfile.mkdtemp(dir=tmp_path), dtype=torch.bfloat16))
    (out,) = run_distributed(_cases, 1, ckpt, device="cuda", timeout_s=600)
    print(out)
    assert out["bf16_logits"] == 0.0
    for name in ("bf16_steps", "fp8_steps", "qat_steps"):
        ours, ref = out[name]
        assert all(abs(a - b) <= 2e-2 for a, b in zip(ours, ref, strict=True)), (name, ours, ref)
        assert ours[-1] < ours[0], (name, ours)
    assert out["fp8_linears"] == 14  # 7 linears per block x 2 blocks; the LM head stays high precision
    assert out["compile_logits"] <= 3e-2
    assert out["compile_names_clean"]
