"""DistributedSetup in one process: construction, validation, build by name, and what it hands on."""

from __future__ import annotations

import dataclasses

import pytest

from automodel_distributed.config import DDPConfig, FSDP2Config, MegatronFSDPConfig
from automodel_infra import DistributedSetup
from automodel_mesh import MeshContext, ParallelismSizes
from automodel_moe.config import MoEParallelizerConfig
from automodel_pipelining.config import PipelineConfig


def test_bundle_of_mesh_and_configs() -> None:
    setup = DistributedSetup(
        mesh_context=MeshContext(), strategy_config=FSDP2Config(activation_checkpointing=True)
    )
    assert setup.strategy_config is not None and setup.strategy_config.activation_checkpointing is True
    assert (setup.pipeline_config, setup.moe_parallel_config, setup.activation_checkpointing) == (
        None,
        None,
        False,
    )
    assert setup.mesh_context == MeshContext()  # not rewritten to carry the policies
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.activation_checkpointing = True  # type: ignore[misc]
    positional = DistributedSetup(MeshContext(), DDPConfig())
    assert isinstance(positional.strategy_config, DDPConfig)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mesh_context": None}, "mesh_context must be an automodel_mesh.MeshContext"),
        ({"mesh_context": MeshContext(), "strategy_config": "fsdp2"}, "strategy_config must be"),
        (
            {"mesh_context": MeshContext(), "pipeline_config": {"pp_schedule": "gpipe"}},
            "pipeline_config must be",
        ),
        ({"mesh_context": MeshContext(), "moe_parallel_config": 3}, "moe_parallel_config must be"),
        ({"mesh_context": MeshContext(), "activation_checkpointing": "partial"}, "activation_checkpointing"),
    ],
)
def test_construction_checks_the_types(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedSetup(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "cls"),
    [("fsdp2", FSDP2Config), ("FSDP2", FSDP2Config), ("megatron_fsdp", MegatronFSDPConfig),
     ("megatron-fsdp", MegatronFSDPConfig), ("MFSDP", MegatronFSDPConfig), ("ddp", DDPConfig)],
)  # fmt: skip
def test_build_by_name_on_one_process(name: str, cls: type) -> None:
    setup = DistributedSetup.build(strategy=name)
    assert type(setup.strategy_config) is cls
    assert setup.mesh_context == MeshContext() and setup.pipeline_config is None


def test_build_validates_before_building() -> None:
    config = FSDP2Config(sequence_parallel=False)
    assert DistributedSetup.build(config, ParallelismSizes()).strategy_config is config
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        DistributedSetup.build("zero3")
    with pytest.raises(ValueError, match="pipeline_config needs pp_size > 1, got pp_size=1"):
        DistributedSetup.build("fsdp2", pipeline_config=PipelineConfig())
    with pytest.raises(ValueError, match="moe_parallel_config needs ep_size > 1"):
        DistributedSetup.build("fsdp2", moe_parallel_config={"wrap_outer_model": False})
    with pytest.raises(ValueError, match=r"unknown ParallelismSizes|pp_sise"):
        DistributedSetup.build("fsdp2", {"pp_sise": 2})
    # pp/ep > 1 on one process: the default configs are made, then the mesh needs a process group.
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedSetup.build("fsdp2", {"pp_size": 2}, world_size=2)
    with pytest.raises(ValueError, match="PipelineConfig"):
        DistributedSetup.build("fsdp2", {"pp_size": 2}, pipeline_config={"pp_schedul": "gpipe"}, world_size=2)


def test_moe_dict_is_coerced() -> None:
    setup = DistributedSetup(
        mesh_context=MeshContext(), moe_parallel_config=MoEParallelizerConfig(wrap_outer_model=False)
    )
    assert setup.moe_parallel_config is not None and setup.moe_parallel_config.wrap_outer_model is False


def test_instantiate_infrastructure_single_device() -> None:
    model_wrapper, autopipeline, _, qat = DistributedSetup.build("fsdp2").instantiate_infrastructure()
    assert model_wrapper is not None and autopipeline is None and qat is None
