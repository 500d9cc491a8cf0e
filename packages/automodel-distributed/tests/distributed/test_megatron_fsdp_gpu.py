"""MegatronFSDPManager's real wrap path (CUDA only): training parity with the single-process model.

Megatron-FSDP allocates CUDA streams and buffers, so these tests run only in the nox ``gpu`` sessions;
on CPU machines they skip with the number of GPUs found.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_distributed.config import MegatronFSDPConfig
from automodel_distributed.megatron_fsdp import MegatronFSDPManager
from automodel_mesh import MeshContext, ParallelismSizes
from automodel_testing import build_tiny_model, make_batch, run_distributed, skip_unless_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]

STEPS = 3


def _reference_losses(family: str, batch: dict[str, torch.Tensor], device: torch.device) -> list[float]:
    model = build_tiny_model(family, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _train(family: str, optimizer_first: bool) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    config = MegatronFSDPConfig(check_for_nan_in_grad=False)
    mesh = MeshContext.build(config, ParallelismSizes())
    assert mesh.device_mesh is not None
    manager = MegatronFSDPManager(config, mesh.device_mesh)
    model = build_tiny_model(family, device=device)
    if optimizer_first:
        model, optimizer = manager.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert optimizer is not None
    else:
        model, none = manager.parallelize(model)
        assert none is None
        optimizer = manager.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(128, 2 * world, 16, seed=1)
    local = {k: v[2 * rank : 2 * rank + 2].to(device) for k, v in batch.items()}
    losses = []
    for _ in range(STEPS):
        loss = model(**local).loss
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(float(global_loss))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "wrapper": type(model).__name__,
        "losses": losses,
        "reference": _reference_losses(family, batch, device),
    }


def _rank_main() -> dict[str, Any]:
    return {
        "llama/optimizer-first": _train("llama", True),
        "qwen2/optimizer-after": _train("qwen2", False),
    }


@skip_unless_gpus(2)
def test_megatron_fsdp_training_parity_on_two_gpus() -> None:
    pytest.importorskip("megatron_fsdp")
    results = run_distributed(_rank_main, 2, device="cuda", timeout_s=600)
    for rank, result in enumerate(results):
        for label, case in result.items():
            assert case["wrapper"] == "MegatronFSDP", f"rank {rank} {label}"
            for got, want in zip(case["losses"], case["reference"], strict=True):
                assert abs(got - want) < 1e-4, f"rank {rank} {label}: {case['losses']} vs {case['reference']}"


def _single_rank() -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    config = MegatronFSDPConfig(activation_checkpointing=True)
    mesh = MeshContext.build(config, ParallelismSizes())
    assert mesh.device_mesh is not None
    model = build_tiny_model("llama")
    out, optimizer = MegatronFSDPManager(config, mesh.device_mesh).parallelize(model)
    return {
        "same_object": out is model,
        "device": str(next(out.parameters()).device),
        "dtype": str(next(out.parameters()).dtype),
        "optimizer": optimizer,
        "checkpointed": type(out.model.layers[0]).__name__,
        "expected_device": str(device),
    }


@skip_unless_gpus(1)
def test_one_data_parallel_rank_returns_the_model_unsharded() -> None:
    pytest.importorskip("megatron_fsdp")
    (result,) = run_distributed(_single_rank, 1, device="cuda", timeout_s=300)
    assert result["same_object"] is True
    assert result["device"] == result["expected_device"]
    assert result["dtype"] == "torch.float32"  # no silent bf16 cast
    assert result["optimizer"] is None
    assert result["checkpointed"] == "CheckpointWrapper"
