"""LoRA on the stacked expert weights under expert parallelism: a distributed checkpoint resumes exactly.

peft's ``lora_B`` of fused experts is cut over ``ep`` as ``_StridedShard`` (expert-minor columns), which
DCP cannot describe as one box; `automodel_checkpoint.storage_view` hands it DCP as the contiguous shard
it is. On 4 gloo ranks, a Qwen3-MoE with LoRA on every linear and on both expert weights
(`automodel_moe.expert_weight_targets`), ep 2 x ep_shard 2, through the public API: one AdamW step,
a DCP save (synchronous, and asynchronous), then a second step and an evaluation. Fresh models load the
checkpoint under ep 2 and under ep 4 and must give the same loss after the second step and the same
evaluation loss (1e-5: another ep size sums in another order). Negative control: the adapter factors of
a fresh model before loading give another evaluation loss.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing import make_batch, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.extended]  # 4 ranks

SEQ = 16


def _model(ep: int) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from automodel_distributed import FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe import MoEParallelizerConfig, expert_weight_targets
    from automodel_peft import PeftConfig
    from automodel_testing.tiny import derive_tiny_config

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    config = FSDP2Config(mp_policy=fp32)
    mesh = MeshContext.build(config, ParallelismSizes(ep_size=ep))
    infra = instantiate_infrastructure(
        distributed_config=config, moe_config=MoEParallelizerConfig(), mesh=mesh, device=torch.device("cpu")
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(derive_tiny_config("qwen3_moe", attn_implementation="sdpa"))
    peft = PeftConfig(match_all_linear=True, dim=4, alpha=8, target_parameters=expert_weight_targets(model))
    torch.manual_seed(0)  # the same initial weights on every rank and in every build
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=torch.device("cpu"),
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        peft_config=peft,
        parallelize_fn=infra.parallelize_fn,
    )


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten()
    )
    total = loss.detach().clone()
    dist.all_reduce(total)
    return loss, float(total) / dist.get_world_size()


def _step(model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> float:
    loss, mean = _loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return mean


def _evaluate(model: Any, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        return _loss(model, batch)[1]


def _rank_main(work: str) -> dict[str, Any]:
    from automodel_checkpoint import (
        AsyncCheckpointer,
        load_distributed_checkpoint,
        save_distributed_checkpoint,
    )

    rank = dist.get_rank()
    batches = [make_batch(128, 2, SEQ, seed=s + 10 * rank) for s in (1, 2, 3)]
    model = _model(2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    _step(model, opt, batches[0])
    sync, background = os.path.join(work, "sync"), os.path.join(work, "async")
    save_distributed_checkpoint(model, opt, sync, step=1)
    with AsyncCheckpointer() as checkpointer:
        checkpointer.save(model, opt, background, step=1)
        expected = (_step(model, opt, batches[1]), _evaluate(model, batches[2]))
    out: dict[str, Any] = {"expected": expected}
    for ep, folder in ((2, sync), (2, background), (4, sync)):
        fresh = _model(ep)
        fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=5e-2)
        if ep == 4 and folder == sync:
            out["before_load"] = _evaluate(fresh, batches[2])
        load_distributed_checkpoint(fresh, fresh_opt, folder)
        out[f"ep{ep} {os.path.basename(folder)}"] = (
            _step(fresh, fresh_opt, batches[1]),
            _evaluate(fresh, batches[2]),
        )
    return out


def test_expert_adapters_resume_exactly_on_the_same_and_another_ep_size(tmp_path: Any) -> None:
    results = run_distributed(_rank_main, 4, str(tmp_path), timeout_s=600)
    for rank, result in enumerate(results):
        step, evaluation = result["expected"]
        for case in ("ep2 sync", "ep2 async", "ep4 sync"):
            got = result[case]
            assert got == pytest.approx((step, evaluation), abs=1e-5), (rank, case, got, (step, evaluation))
        assert abs(result["before_load"] - evaluation) > 1e-3, (rank, result)
