"""Pipeline parallelism under FSDP2's default mixed precision, through the two documented functions.

Two pipeline ranks, one data-parallel rank each: FSDP2 wraps each stage over its one-rank mesh for the
bf16 compute alone (the policy casts fp32 parameters), and with static stage shapes (``pp_seq_len``) the
stages declare the dtype that actually flows between them, bf16, not the parameters' fp32. The losses of
three AdamW steps stay within bf16 error of single-process transformers in fp32, and the stage receives
bf16 hidden states. The loss comes from ``PipelineConfig.loss_fn`` alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from automodel_testing import run_distributed

pytestmark = pytest.mark.distributed

BATCH, SEQ, STEPS = 2, 16, 3
BF16_ATOL = 5e-2  # bf16 compute against an fp32 reference: a few bf16 ulps of the loss


def _two_stages() -> dict[str, Any]:
    import copy

    from torch.distributed.fsdp import FSDPModule

    from automodel_distributed import FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_pipelining import PipelineConfig
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    strategy = FSDP2Config()  # the default policy: bf16 compute and outputs, fp32 reduction
    ctx = MeshContext.build(strategy, ParallelismSizes(pp_size=2))
    # The loss in the pipeline's config (apply_model_infrastructure is given none): the stages use it.
    config = PipelineConfig(
        pp_schedule="1f1b", pp_batch_size=BATCH, pp_microbatch_size=1, pp_seq_len=SEQ, loss_fn=causal_lm_loss
    )
    infra = instantiate_infrastructure(
        distributed_config=strategy, pipeline_config=config, device=torch.device("cpu"), mesh=ctx
    )
    model = build_tiny_model("llama", num_hidden_layers=4)
    reference = copy.deepcopy(model)
    pipe = apply_model_infrastructure(
        model,
        is_meta_device=False,
        device=torch.device("cpu"),
        model_wrapper=infra.model_wrapper,
        mesh=ctx,
        autopipeline=infra.autopipeline,
        parallelize_fn=infra.parallelize_fn,
    )
    received: list[str] = []
    for part in pipe.parts:
        part.register_forward_pre_hook(lambda _m, args: received.append(str(args[0].dtype)))
    batch = make_batch(reference.config.vocab_size, BATCH, SEQ, seed=3)
    optimizer = torch.optim.AdamW([p for part in pipe.parts for p in part.parameters()], lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gaps = []
    for _ in range(STEPS):
        losses = pipe.step(batch["input_ids"], target=batch["labels"], position_ids=batch["position_ids"])
        pipe.scale_grads()
        loss = pipe.mean_loss(losses)
        ref_loss = causal_lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"])
        ref_loss.backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        gaps.append(abs(float(loss) - float(ref_loss)))
    return {
        "fsdp": [isinstance(part, FSDPModule) for part in pipe.parts],
        "stage_dtype": str(infra.autopipeline._io_shapes["dtype"]),
        "received": sorted(set(received)),
        "has_first": pipe.info.has_first_stage,
        "gap": max(gaps),
    }


def test_stages_send_the_dtype_fsdp2_computes_in() -> None:
    first, last = run_distributed(_two_stages, 2, timeout_s=300)
    assert first["has_first"] and not last["has_first"]
    for result in (first, last):
        assert result["fsdp"] == [True] and result["stage_dtype"] == "torch.bfloat16", result
        assert result["gap"] <= BF16_ATOL, result
    assert first["received"] == ["torch.int64"] and last["received"] == ["torch.bfloat16"], (first, last)
