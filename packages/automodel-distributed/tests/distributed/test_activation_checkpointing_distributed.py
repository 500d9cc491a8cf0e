"""Activation checkpointing under FSDP2 mixed precision (bf16 parameters, fp32 reduction) on two gloo ranks.

The blocks are wrapped first, then every block and the root get ``fully_shard``. The recompute in
backward must see the same bf16 parameters as the forward (a dtype mismatch there was a known FSDP2 +
checkpointing bug), and the gradients must equal those of the same FSDP2 setup without checkpointing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from automodel_distributed.activation_checkpointing import apply_activation_checkpointing
from automodel_distributed.blocks import find_transformer_blocks
from automodel_testing import build_tiny_model, grads_by_name, make_batch, run_distributed

pytestmark = pytest.mark.distributed

FAMILIES = ("llama", "qwen2")
MODES: tuple[Any, ...] = (None, "full", "selective")
STEPS = 2


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard_cp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for _, block in find_transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _train(family: str, mode: Any) -> dict[str, Any]:
    model = build_tiny_model(family)
    if mode is not None:
        apply_activation_checkpointing(model, mode=mode)
    _shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch(128, 4, 16, seed=2)
    rank = dist.get_rank()
    local = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    losses, grads = [], {}
    for step in range(STEPS):
        out = model(**local)
        out.loss.backward()
        loss = out.loss.detach().float()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(float(loss))
        if step == 0:
            grads = grads_by_name(model)  # gathers the sharded gradients (collective)
            logits_dtype = str(out.logits.dtype)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "grads": grads,
        "logits_dtype": logits_dtype,
        "wrappers": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
        # Blocks are still found after fully_shard swapped their classes (compile_blocks relies on it).
        "blocks_after_shard": [fqn for fqn, _ in find_transformer_blocks(model)],
        "block_class": type(find_transformer_blocks(model)[0][1]).__name__,
    }


def _fp32_reference_losses(family: str) -> list[float]:
    model = build_tiny_model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch(128, 4, 16, seed=2)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _rank_main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family in FAMILIES:
        out[family] = {str(mode): _train(family, mode) for mode in MODES}
        out[family]["fp32"] = _fp32_reference_losses(family)
    return out


def test_checkpointing_under_fsdp2_bf16_mixed_precision() -> None:
    results = run_distributed(_rank_main, 2, timeout_s=240)
    for rank, result in enumerate(results):
        for family in FAMILIES:
            plain = result[family]["None"]
            assert plain["logits_dtype"] == "torch.bfloat16"  # the bf16 policy is really in force
            assert plain["wrappers"] == 0
            assert plain["blocks_after_shard"] == ["model.layers.0", "model.layers.1"]
            assert plain["block_class"].startswith("FSDP")  # fully_shard's class swap
            for mode in ("full", "selective"):
                checkpointed = result[family][mode]
                label = f"rank {rank} {family} {mode}"
                assert checkpointed["wrappers"] == 2, label
                assert checkpointed["blocks_after_shard"] == ["model.layers.0", "model.layers.1"], label
                # Same bf16 kernels on the same inputs: recompute reproduces the forward bit for bit.
                assert checkpointed["losses"] == plain["losses"], label
                assert checkpointed["grads"].keys() == plain["grads"].keys(), label
                for name, grad in checkpointed["grads"].items():
                    assert torch.equal(grad, plain["grads"][name]), f"{label}: grad of {name}"
            # Sanity: bf16 training tracks the fp32 single-process run to bf16 precision.
            for got, want in zip(plain["losses"], result[family]["fp32"], strict=True):
                assert abs(got - want) < 5e-2, f"rank {rank} {family}: bf16 loss {got} vs fp32 {want}"
