"""LoRA / DoRA under FSDP2 and TP on real gloo ranks, against single-process Hugging Face ``peft``.

One 2-rank launch runs every case. A case builds the reference with plain ``peft.get_peft_model`` on a
real tiny Llama and makes every adapter non-zero (peft starts B at zero, which would hide a wrong
adapter); the sharded model is built on the meta device, adapted with `apply_lora`, sharded by
``FSDP2Manager`` (FSDP2 over 2 ranks, or TP over 2 ranks), materialised with ``to_empty`` and loaded
from the reference's weights. Both train 3 AdamW steps on the same global batch; the case reports the
largest differences of logits, loss, adapter gradients, per-step losses and final adapters. Save cases
then write the adapters with `save_adapters` (every rank gathers, rank 0 writes) and load them into a
fresh base model with plain ``PeftModel.from_pretrained`` on rank 0.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel_testing import make_batch, normalize_fqn, run_distributed, to_full

pytestmark = pytest.mark.distributed

ATOL = 1e-5  # fp32 logits, loss and gradients
STEP_ATOL = 1e-4  # per-step training losses
# AdamW's first update is lr * g / (|g| + eps): a ~1e-8 gradient element turns last-bit noise of a sharded
# matmul into a step of up to lr, so the final adapters are compared loosely.
PARAM_ATOL = 1e-3
VOCAB, BATCH, SEQ, STEPS, LR = 128, 4, 16, 3, 1e-2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _reference(use_dora: bool) -> nn.Module:
    import peft

    from automodel_testing import build_tiny_model

    torch.manual_seed(0)  # peft draws lora_A from the global RNG: the same reference on every rank
    model = peft.get_peft_model(
        build_tiny_model("llama", seed=0),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=use_dora),
    )
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-zero adapters, identical on every rank
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            param.copy_(distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements))
        else:
            param.copy_(full)


def _sharded(
    use_dora: bool, parallelize: Callable[[nn.Module], nn.Module], reference: nn.Module
) -> dict[str, Any]:
    """Meta build -> apply_lora -> shard -> to_empty -> load the reference; checks init_adapter_weights."""
    from automodel_peft import PeftConfig, apply_lora, init_adapter_weights
    from automodel_testing import build_tiny_model

    model = build_tiny_model("llama", meta=True)
    apply_lora(model, PeftConfig(target_modules=TARGETS, dim=4, alpha=8, use_dora=use_dora))
    parallelize(model)
    model.to_empty(device="cpu")
    ref_params = {normalize_fqn(n): p.detach() for n, p in reference.named_parameters()}
    ref_buffers = {normalize_fqn(n): b for n, b in reference.named_buffers()}
    for name, param in model.named_parameters():
        if "lora_" not in name:
            _assign(param, ref_params[normalize_fqn(name)])
    for name, buffer in model.named_buffers():
        buffer.copy_(ref_buffers[normalize_fqn(name)])  # rotary inv_freq is not in any checkpoint
    # After the base load: init_adapter_weights on the sharded model (DoRA magnitudes = row norms).
    init_adapter_weights(model)
    init = {"b_zero": True, "magnitude": 0.0}
    for name, param in model.named_parameters():
        full = to_full(param)
        if "lora_B" in name:
            init["b_zero"] = init["b_zero"] and bool((full == 0).all())
        if "lora_magnitude_vector" in name:  # the reference's magnitude is the row norm of the base weight
            diff = float((full - ref_params[normalize_fqn(name)]).abs().max())
            init["magnitude"] = max(init["magnitude"], diff)
    for name, param in model.named_parameters():
        if "lora_" in name:
            _assign(param, ref_params[normalize_fqn(name)])
    return {"model": model, "init": init}


@contextlib.contextmanager
def _maybe_loss_parallel(tp: bool) -> Iterator[None]:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel() if tp else contextlib.nullcontext():
        yield


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # One loss_parallel context must hold forward and backward (nesting a second one would end it early).
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))


def _train(reference: nn.Module, model: nn.Module, *, dp_rank: int, dp_size: int, tp: bool) -> dict[str, Any]:
    batch = make_batch(VOCAB, BATCH, SEQ, seed=1)
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    local = {k: v[rows] for k, v in batch.items()}
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    out: dict[str, Any] = {
        "losses": [],
        "ref_losses": [],
        "trainable": sum(p.requires_grad for p in model.parameters()),
    }
    for step in range(STEPS):
        ref_logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        ref_loss = causal_lm_loss(ref_logits, batch["labels"])
        ref_loss.backward()
        with _maybe_loss_parallel(tp):
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            loss = causal_lm_loss(logits, local["labels"])
            loss.backward()
        loss_value = to_full(loss).float()
        if dp_size > 1:
            dist.all_reduce(loss_value, op=dist.ReduceOp.AVG)
        out["losses"].append(float(loss_value))
        out["ref_losses"].append(float(ref_loss.detach()))
        if step == 0:
            out["logits"] = float((to_full(logits) - ref_logits.detach()[rows]).abs().max())
            out["loss"] = abs(float(loss_value) - float(ref_loss))
            ref_grads = {normalize_fqn(n): p.grad for n, p in reference.named_parameters() if p.requires_grad}
            grads = {normalize_fqn(n): p.grad for n, p in model.named_parameters() if p.requires_grad}
            out["grad_names"] = sorted(grads) == sorted(ref_grads)
            out["num_grads"] = len(grads)
            out["grads"] = max(float((to_full(grads[k]) - ref_grads[k]).abs().max()) for k in grads)
            out["grad_norm"] = max(float(g.abs().max()) for g in ref_grads.values())
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    ref_params = {normalize_fqn(n): p for n, p in reference.named_parameters() if p.requires_grad}
    out["params"] = max(
        float((to_full(p) - ref_params[normalize_fqn(n)].detach()).abs().max())
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    out["steps"] = max(abs(a - b) for a, b in zip(out["losses"], out["ref_losses"], strict=True))
    return out


def _save_and_load(model: nn.Module, folder: Path) -> dict[str, Any]:
    """save_adapters from the sharded model; rank 0 loads them into a fresh base with plain peft."""
    from peft import PeftModel

    from automodel_peft import save_adapters
    from automodel_testing import build_tiny_model

    batch = make_batch(VOCAB, BATCH, SEQ, seed=2)
    with torch.no_grad():
        logits = to_full(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits)
    save_adapters(model, folder)
    if dist.get_rank() != 0:
        return {}
    loaded = PeftModel.from_pretrained(build_tiny_model("llama", seed=0), str(folder))
    with torch.no_grad():
        peft_logits = loaded(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return {
        "saved_logits": float((peft_logits - logits).abs().max()),
        "files": sorted(p.name for p in folder.iterdir()),
    }


def _case(kind: str, use_dora: bool, folder: Path | None, **config_fields: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed import FSDP2Config, FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    config = FSDP2Config(mp_policy=fp32, **config_fields)
    tp = kind == "tp"
    ctx = MeshContext.build(config, ParallelismSizes(tp_size=2) if tp else ParallelismSizes())
    manager = FSDP2Manager(config, ctx.device_mesh)
    reference = _reference(use_dora)
    built = _sharded(use_dora, manager.parallelize, reference)
    model = built["model"]
    dp_size = 1 if tp else 2
    result = _train(reference, model, dp_rank=0 if tp else dist.get_rank(), dp_size=dp_size, tp=tp)
    result["init"] = built["init"]
    result["model_class"] = type(model).__name__
    result["dtensor_adapters"] = sum(
        type(p).__name__ == "DTensor" for n, p in model.named_parameters() if "lora_" in n
    )
    if folder is not None:
        result.update(_save_and_load(model, folder))
    return result


def _run(tmp: str) -> dict[str, Any]:
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "lora-fsdp2": lambda: _case("fsdp2", False, Path(tmp) / "lora-fsdp2"),
        "dora-fsdp2": lambda: _case("fsdp2", True, Path(tmp) / "dora-fsdp2"),
        # checkpoint wrappers add ``_checkpoint_wrapped_module.`` to every name; saving must drop it
        "lora-fsdp2+ac": lambda: _case("fsdp2", False, Path(tmp) / "lora-ac", activation_checkpointing=True),
        "lora-tp2": lambda: _case("tp", False, Path(tmp) / "lora-tp2"),
        "dora-tp2": lambda: _case("tp", True, None),  # refused by tensor_parallel: DoRA cannot be TP-sharded
    }
    results: dict[str, Any] = {}
    for label, case in cases.items():
        try:
            results[label] = case()
        except Exception:
            results[label] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("adapters")
    return run_distributed(_run, 2, str(tmp), timeout_s=600, pg_timeout_s=120)


def _get(results: list[dict[str, Any]], label: str, rank: int = 0) -> dict[str, Any]:
    result = results[rank][label]
    assert "error" not in result, f"rank {rank} {label}:\n{result['error']}"
    return result


@pytest.mark.parametrize("label", ["lora-fsdp2", "dora-fsdp2", "lora-fsdp2+ac", "lora-tp2"])
def test_matches_single_process_peft(results: list[dict[str, Any]], label: str) -> None:
    for rank in range(2):
        r = _get(results, label, rank)
        # A and B (and DoRA's magnitude) of 7 projections in each of 2 layers
        assert r["grad_names"] and r["num_grads"] == 14 * (3 if label.startswith("dora") else 2)
        assert r["grad_norm"] > 1e-3, "the adapters must receive real gradients"
        assert r["logits"] <= ATOL, r
        assert r["loss"] <= ATOL, r
        assert r["grads"] <= ATOL, r
        assert r["steps"] <= STEP_ATOL, r
        assert r["params"] <= PARAM_ATOL, r
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["model_class"].startswith("FSDP") or label == "lora-tp2"
        assert r["dtensor_adapters"] == r["num_grads"], "every adapter is sharded with its model"


def test_init_adapter_weights_on_the_sharded_model(results: list[dict[str, Any]]) -> None:
    for label in ("lora-fsdp2", "dora-fsdp2", "lora-tp2"):
        init = _get(results, label)["init"]
        assert init["b_zero"], label
        assert init["magnitude"] <= 1e-6, (label, init)


def test_dora_under_tensor_parallelism_is_refused_clearly(results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        error = results[rank]["dora-tp2"].get("error", "")
        assert "ValueError" in error and "uses a LoRA variant (e.g. DoRA" in error, error[-800:]


@pytest.mark.parametrize("label", ["lora-fsdp2", "dora-fsdp2", "lora-fsdp2+ac", "lora-tp2"])
def test_saved_adapters_load_into_plain_peft(results: list[dict[str, Any]], label: str) -> None:
    r = _get(results, label)
    assert r["files"] == ["adapter_config.json", "adapter_model.safetensors", "automodel_adapter.json"]
    assert r["saved_logits"] <= ATOL, r
