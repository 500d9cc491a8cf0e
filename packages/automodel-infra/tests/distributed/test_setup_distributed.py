"""DistributedSetup.build on 2 real gloo ranks: the meshes MeshContext.build makes, default configs, and
the runtime objects instantiate_infrastructure returns from it."""

from __future__ import annotations

from typing import Any

import pytest

from automodel_testing import run_distributed

pytestmark = pytest.mark.distributed


def _facts() -> dict[str, Any]:
    from automodel_distributed import FSDP2Manager
    from automodel_infra import DistributedSetup
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe.config import MoEParallelizerConfig
    from automodel_pipelining import AutoPipeline, PipelineConfig

    out: dict[str, Any] = {}
    default = DistributedSetup.build("FSDP2", {"pp_size": 2}, world_size=2)
    out["pp_default_config"] = (
        default.pipeline_config == PipelineConfig() and default.moe_parallel_config is None
    )
    # 1F1B over 2 stages needs 2 microbatches (the default PipelineConfig has one).
    pp = DistributedSetup.build("FSDP2", {"pp_size": 2}, {"pp_batch_size": 2}, activation_checkpointing=True)
    reference = MeshContext.build(pp.strategy_config, ParallelismSizes(pp_size=2))  # type: ignore[arg-type]
    out["pp_mesh"] = (pp.mesh_context.pp_size, pp.mesh_context.axis_names() == reference.axis_names())
    wrapper, autopipeline, parallelize_fn, _ = pp.instantiate_infrastructure()
    out["pp_runtime"] = (
        isinstance(wrapper, FSDP2Manager),
        isinstance(autopipeline, AutoPipeline) and autopipeline.pp_size == 2,
        callable(parallelize_fn),
        wrapper.config.activation_checkpointing if wrapper is not None else None,
    )
    ep = DistributedSetup.build(
        "fsdp2", ParallelismSizes(ep_size=2), moe_parallel_config={"wrap_outer_model": False}
    )
    out["ep"] = (
        ep.mesh_context.ep_size,
        ep.moe_parallel_config == MoEParallelizerConfig(wrap_outer_model=False),
    )
    ddp = DistributedSetup.build("ddp")
    out["ddp"] = (ddp.mesh_context.device_mesh is None, ddp.mesh_context.dp_size)
    return out


def test_build_on_two_ranks() -> None:
    results = run_distributed(_facts, 2, timeout_s=300)
    for facts in results:
        assert facts["pp_mesh"] == (2, True)
        assert facts["pp_default_config"]
        assert facts["pp_runtime"] == (True, True, True, True)
        assert facts["ep"] == (2, True)
        assert facts["ddp"] == (True, 2)
