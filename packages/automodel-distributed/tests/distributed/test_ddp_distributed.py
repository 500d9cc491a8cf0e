"""DDPManager on two real gloo ranks against the single-process transformers model.

One launch runs every case: four families, each without, with full and with selective activation
checkpointing (loss, logits and gradients within 1e-5 in fp32, the loss after three AdamW steps within
1e-4), DDP's own knobs, autocast, and a negative control showing the ranks' local gradients really
differ from the reference until DDP averages them.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from automodel_distributed.config import DDPConfig
from automodel_distributed.ddp import DDPManager
from automodel_testing import ParityReport, build_tiny_model, make_batch, run_distributed, train_parity

pytestmark = pytest.mark.distributed

FAMILIES = ("llama", "qwen2", "mistral", "llama_tied")
AC_MODES: tuple[Any, ...] = (False, "full", "selective")
FP32_ATOL = 1e-5
STEP_ATOL = 1e-4
KNOBS: dict[str, Any] = {
    "static_graph": True,
    "gradient_as_bucket_view": True,
    "bucket_cap_mb": 1,
    "broadcast_buffers": True,
}


def _parallelize(config: DDPConfig, model: nn.Module) -> nn.Module:
    return DDPManager(config).parallelize(model)


def _local_grads_without_sync(family: str) -> float:
    """Largest gap between this rank's un-averaged gradients and the full-batch reference gradients."""
    batch = make_batch(128, 4, 16, seed=1)
    reference = build_tiny_model(family)
    reference(**batch).loss.backward()
    model = DDPManager(DDPConfig()).parallelize(build_tiny_model(family))
    rank = dist.get_rank()
    local = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    assert isinstance(model, DistributedDataParallel)
    with model.no_sync():
        model(**local).loss.backward()
    ref = dict(reference.named_parameters())
    return max(
        float((p.grad - ref[n.removeprefix("module.")].grad).abs().max()) for n, p in model.named_parameters()
    )


def _autocast_case() -> dict[str, float | str]:
    batch = make_batch(128, 4, 16, seed=1)
    rank = dist.get_rank()
    local = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    reference = build_tiny_model("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**local)
    model = DDPManager(DDPConfig(autocast_dtype=torch.bfloat16)).parallelize(build_tiny_model("llama"))
    out = model(**local)
    out.loss.backward()
    return {
        "dtype": str(out.logits.dtype),
        "logits": float((out.logits.detach().float() - expected.logits.detach().float()).abs().max()),
        "param_dtype": str(next(model.parameters()).dtype),
    }


def _ddp_knobs() -> dict[str, Any]:
    model = DDPManager(DDPConfig(**KNOBS)).parallelize(build_tiny_model("llama"))
    assert isinstance(model, DistributedDataParallel)
    return {
        "static_graph": model.static_graph,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "bucket_bytes_cap": model.bucket_bytes_cap,
        # torch >= 2.13 names it forward_sync_buffers, older torch broadcast_buffers.
        "forward_sync_buffers": (
            model.forward_sync_buffers if hasattr(model, "forward_sync_buffers") else model.broadcast_buffers
        ),
        "wrapped": type(model.module).__name__,
    }


def _rank_main() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reports: dict[str, ParityReport] = {}
    for family in FAMILIES:
        for mode in AC_MODES:
            config = DDPConfig(activation_checkpointing=mode)
            reports[f"{family}/ac={mode}"] = train_parity(
                family,
                functools.partial(_parallelize, config),
                dp_rank=rank,
                dp_size=world,
                dp_group=dist.group.WORLD,
            )
    reports["qwen2/knobs+selective"] = train_parity(
        "qwen2",
        functools.partial(_parallelize, DDPConfig(activation_checkpointing="selective", **KNOBS)),
        dp_rank=rank,
        dp_size=world,
        dp_group=dist.group.WORLD,
    )
    return {
        "reports": reports,
        "unsynced": {family: _local_grads_without_sync(family) for family in ("llama", "llama_tied")},
        "autocast": _autocast_case(),
        "knobs": _ddp_knobs(),
    }


def test_ddp_parity_on_two_ranks() -> None:
    results = run_distributed(_rank_main, 2, timeout_s=240)
    for rank, result in enumerate(results):
        for label, report in result["reports"].items():
            assert report.model_class == "DistributedDataParallel", label
            report.check(atol=FP32_ATOL, step_atol=STEP_ATOL, label=f"rank {rank} {label}")
        # Negative control: without DDP's averaging the local gradients are far from the reference, so
        # the parity above really measures the synchronisation.
        for family, gap in result["unsynced"].items():
            assert gap > 1e-3, f"rank {rank} {family}: local grads already equal the reference ({gap:.2e})"
        autocast = result["autocast"]
        assert autocast["dtype"] == "torch.bfloat16"
        assert autocast["param_dtype"] == "torch.float32"
        assert autocast["logits"] == 0.0
        assert result["knobs"] == {
            "static_graph": True,
            "gradient_as_bucket_view": True,
            "bucket_bytes_cap": 1024 * 1024,
            "forward_sync_buffers": True,
            "wrapped": "LlamaForCausalLM",
        }
    # Both ranks trained the same replica: identical step losses.
    for label in results[0]["reports"]:
        assert results[0]["reports"][label].step_losses == results[1]["reports"][label].step_losses
