"""The training job's gradient norm and clipping over gradients that live on several meshes.

Under expert parallelism the experts' gradients are DTensors on ``ep`` (kept out of FSDP when
``ep_shard`` has one rank, `automodel_distributed.one_rank_units`) or on ``(ep_shard, ep)``, the other
gradients on the data-parallel mesh; DTensor refuses one op over two meshes, so `clip_gradients` takes
each mesh's norm apart. Checked against ``torch.nn.utils.clip_grad_norm_`` on the single-process
transformers model over the same global batch: the norm, and every gradient after clipping. One launch of
2 gloo ranks: EP 2 (experts on ``ep``) and plain FSDP2 (one mesh) of a tiny Qwen3-MoE, and TP 2 of a
tiny Llama (gradients on ``tp``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel_testing import build_tiny_model, causal_lm_loss, make_batch, run_distributed, to_full

pytestmark = pytest.mark.distributed

MAX_NORM = 0.5  # below every case's norm (about 2), so clipping scales the gradients


def _case(family: str, ep: int, tp: int) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_all.cli.steps import clip_gradients
    from automodel_distributed import FSDP2Config, FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe import ExpertParallel

    config = FSDP2Config(mp_policy=MixedPrecisionPolicy())  # fp32 throughout: exact against transformers
    ctx = MeshContext.build(config, ParallelismSizes(ep_size=ep, tp_size=tp))
    ref, model = build_tiny_model(family), build_tiny_model(family)
    manager = FSDP2Manager(config, mesh=ctx, experts=ExpertParallel() if ep > 1 else None)
    manager.parallelize(model)
    batch = make_batch(128, 4, 16, seed=4)
    dp_rank, dp = (dist.get_rank(), dist.get_world_size()) if tp == 1 else (0, 1)
    rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    causal_lm_loss(ref(input_ids=batch["input_ids"]).logits, batch["labels"]).backward()
    logits = model(input_ids=batch["input_ids"][rows]).logits
    if isinstance(logits, DTensor):  # TP: the head's output is sharded over the vocabulary
        logits = logits.full_tensor()
    causal_lm_loss(logits, batch["labels"][rows]).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    norm = clip_gradients(list(model.parameters()), MAX_NORM)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    meshes = {tuple(g.device_mesh.mesh_dim_names or ()) for g in grads.values() if isinstance(g, DTensor)}
    return {
        "norm": abs(norm - expected),
        "expected": expected,
        "grads": max((to_full(g) - ref_grads[n]).abs().max().item() for n, g in grads.items()),
        "meshes": sorted(meshes),
    }


def _all() -> dict[str, Any]:
    return {
        "ep": _case("qwen3_moe", 2, 1),
        "fsdp2": _case("qwen3_moe", 1, 1),
        "tp": _case("llama", 1, 2),
    }


def test_clip_gradients_matches_transformers_over_one_or_several_meshes() -> None:
    per_rank = run_distributed(_all, 2, timeout_s=300)
    for results in per_rank:
        for name, r in results.items():
            assert r["expected"] > 2 * MAX_NORM, (name, r)  # clipping happened
            assert r["norm"] < 1e-5 and r["grads"] < 1e-6, (name, r)
        assert results["ep"]["meshes"] == [("dp_shard_cp",), ("ep",)], results["ep"]
        assert results["fsdp2"]["meshes"] == [("dp_shard_cp",)], results["fsdp2"]
        assert results["tp"]["meshes"] == [("tp",)], results["tp"]
