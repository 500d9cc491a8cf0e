"""MegatronFSDPManager decisions that need no GPU: unit modules, config mapping, errors, warnings."""

from __future__ import annotations

import importlib
import inspect
import logging
import pathlib
import sys
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import automodel_distributed.megatron_fsdp as mfsdp
from automodel_distributed.config import MegatronFSDPConfig
from automodel_distributed.megatron_fsdp import (
    MegatronFSDPManager,
    derive_megatron_fsdp_unit_modules,
    megatron_fsdp_kwargs,
    megatron_fsdp_shard_axis,
)
from automodel_testing import TINY_FAMILIES, build_tiny_model


@pytest.fixture
def mesh(tmp_path: pathlib.Path) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_unit_modules_are_importable_block_classes(family: str) -> None:
    model = build_tiny_model(family, meta=True)
    paths = derive_megatron_fsdp_unit_modules(model)
    assert len(paths) == 1
    module_path, name = paths[0].rsplit(".", 1)
    cls = getattr(importlib.import_module(module_path), name)
    assert cls is type(model.model.layers[0])


def test_unit_modules_of_a_peft_model() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert derive_megatron_fsdp_unit_modules(model) == [
        "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    ]


def test_unit_modules_need_no_split_modules() -> None:
    with pytest.raises(ValueError, match=r"declares no _no_split_modules.*megatron_fsdp_unit_modules"):
        derive_megatron_fsdp_unit_modules(nn.Sequential(nn.Linear(2, 2)))
    model = nn.Sequential(nn.Linear(2, 2))
    model._no_split_modules = ["DecoderLayer"]  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"\['DecoderLayer'\].*megatron_fsdp_unit_modules"):
        derive_megatron_fsdp_unit_modules(model)


def test_default_config_maps_to_fully_shard_model_kwargs(caplog: pytest.LogCaptureFixture) -> None:
    mfsdp._warned.clear()
    with caplog.at_level(logging.WARNING, logger="automodel_distributed.megatron_fsdp"):
        kwargs = megatron_fsdp_kwargs(MegatronFSDPConfig(), unit_modules=["pkg.Block"], dp_shard_dim="dp")
        megatron_fsdp_kwargs(MegatronFSDPConfig(), unit_modules=["pkg.Block"], dp_shard_dim="dp")
    assert kwargs == {
        "zero_dp_strategy": 3,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
        "report_nan_in_param_grad": False,
        "average_in_collective": False,
        "disable_bucketing": False,
        "calculate_per_token_loss": False,
        "keep_fp8_transpose_cache": False,
        "nccl_ub": False,
        "fsdp_double_buffer": False,
        "fsdp_unit_modules": ["pkg.Block"],
        "dp_shard_dim": "dp",
        "tp_dim": "tp",
        "init_model_with_meta_device": False,
        "mixed_precision": {"main_params_dtype": None, "main_grads_dtype": None, "grad_comm_dtype": None},
    }
    # check_for_nan_in_grad defaults to True and has no counterpart any more: said once, not silently.
    assert caplog.text.count("check_for_nan_in_grad=True is ignored") == 1


def test_precision_flags_and_passthrough() -> None:
    config = MegatronFSDPConfig(
        preserve_fp32_weights=True,
        grad_reduce_in_fp32=True,
        zero_dp_strategy=2,
        init_fsdp_with_meta_device=True,
        nccl_ub=True,
        check_for_nan_in_grad=False,
    )
    kwargs = megatron_fsdp_kwargs(config, unit_modules=[], dp_shard_dim="dp_cp")
    assert kwargs["mixed_precision"] == {
        "main_params_dtype": torch.float32,
        "main_grads_dtype": torch.float32,
        "grad_comm_dtype": None,
    }
    assert kwargs["zero_dp_strategy"] == 2
    assert kwargs["init_model_with_meta_device"] is True
    assert kwargs["nccl_ub"] is True
    assert kwargs["dp_shard_dim"] == "dp_cp"


def test_kwargs_match_the_installed_megatron_fsdp_api() -> None:
    megatron_fsdp = pytest.importorskip("megatron_fsdp")
    kwargs = megatron_fsdp_kwargs(MegatronFSDPConfig(), unit_modules=["pkg.Block"], dp_shard_dim="dp")
    precision = megatron_fsdp.MixedPrecisionPolicy(**kwargs.pop("mixed_precision"))
    assert precision.main_params_dtype is None
    accepted = set(inspect.signature(megatron_fsdp.fully_shard_model).parameters)
    assert set(kwargs) | {"device_mesh", "device", "mixed_precision_policy"} <= accepted
    assert set(kwargs) <= set(inspect.signature(megatron_fsdp.fully_shard).parameters)


def test_shard_axis_follows_context_parallelism() -> None:
    assert megatron_fsdp_shard_axis(SimpleNamespace(cp_size=1)) == "dp"  # type: ignore[arg-type]
    assert megatron_fsdp_shard_axis(SimpleNamespace(cp_size=2)) == "dp_cp"  # type: ignore[arg-type]


def test_manager_mirrors_the_config_and_warns_about_zero_dp_strategy(
    mesh: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = MegatronFSDPConfig(zero_dp_strategy=1, overlap_grad_reduce=False)
    with caplog.at_level(logging.WARNING, logger="automodel_distributed.megatron_fsdp"):
        manager = MegatronFSDPManager(config, mesh)
    for name, value in config.to_dict().items():
        assert getattr(manager, name) == value, name
    assert "zero_dp_strategy=1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="automodel_distributed.megatron_fsdp"):
        MegatronFSDPManager(MegatronFSDPConfig(), mesh)
    assert "zero_dp_strategy" not in caplog.text


def test_manager_rejects_wrong_configs_and_meshes(mesh: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="needs a MegatronFSDPConfig"):
        MegatronFSDPManager(object(), mesh)  # type: ignore[arg-type]
    fsdp2_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    with pytest.raises(ValueError, match=r"axes \('dp', 'cp', 'tp'\).*missing \['dp', 'cp'\]"):
        MegatronFSDPManager(MegatronFSDPConfig(), fsdp2_mesh)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_parallelize_on_cpu_fails_first_and_points_to_fsdp2(mesh: Any) -> None:
    model = build_tiny_model("llama")
    before = {name: p.clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = MegatronFSDPManager(MegatronFSDPConfig(activation_checkpointing=True), mesh)
    with pytest.raises(RuntimeError, match=r"Megatron-FSDP needs CUDA devices.*FSDP2Config"):
        manager.parallelize(model, optimizer)
    # Nothing was touched: no wrappers, same parameters, same optimizer groups.
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())


def _pretend_cuda(monkeypatch: pytest.MonkeyPatch, manager: MegatronFSDPManager) -> None:
    monkeypatch.setattr(manager, "_check_can_run", lambda: None)


def test_missing_package_names_the_extra(mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = MegatronFSDPManager(MegatronFSDPConfig(), mesh)
    _pretend_cuda(monkeypatch, manager)
    monkeypatch.setitem(sys.modules, "megatron_fsdp", None)  # makes `import megatron_fsdp` fail
    with pytest.raises(ImportError, match=r"pip install 'automodel-distributed\[megatron\]'"):
        manager.parallelize(build_tiny_model("llama"))


def test_tensor_parallel_axis_is_refused(mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = MegatronFSDPManager(MegatronFSDPConfig(), mesh)
    _pretend_cuda(monkeypatch, manager)
    monkeypatch.setitem(sys.modules, "megatron_fsdp", SimpleNamespace())
    manager.mesh = SimpleNamespace(tp_size=2, cp_size=1)  # type: ignore[assignment]
    with pytest.raises(NotImplementedError, match="tp_size=2"):
        manager.parallelize(build_tiny_model("llama"))


def test_one_rank_keeps_a_meta_model_on_meta_and_names_the_wrapper_settings(mesh: Any) -> None:
    config = MegatronFSDPConfig(
        init_fsdp_with_meta_device=True, overlap_grad_reduce=False, activation_checkpointing=True
    )
    manager = MegatronFSDPManager(config, mesh)
    model = build_tiny_model("llama", meta=True)
    message = r"MegatronFSDPConfig.overlap_grad_reduce ignored: the 'dp' axis has one rank, so Megatron-FSDP"
    with pytest.warns(UserWarning, match=message):
        # The CPU stands for this rank's GPU: the one-rank path makes no CUDA call of its own.
        out = manager._one_rank(model, torch.device("cpu"), "dp")
    # `model.to(device)` cannot copy meta tensors: the model stays on meta for the materialise step.
    assert out is model and all(p.is_meta for p in out.parameters())
    assert "CheckpointWrapper" in type(out.model.layers[0]).__name__
    real = build_tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults name nothing
        assert (
            MegatronFSDPManager(MegatronFSDPConfig(), mesh)._one_rank(real, torch.device("cpu"), "dp") is real
        )


def test_keep_fp8_transpose_cache_needs_transformer_engine_layers() -> None:
    model = build_tiny_model("llama")
    with pytest.warns(UserWarning, match="keep_fp8_transpose_cache ignored: .* Transformer Engine layers"):
        mfsdp.warn_transformer_engine_settings(MegatronFSDPConfig(keep_fp8_transpose_cache=True), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mfsdp.warn_transformer_engine_settings(MegatronFSDPConfig(), model)
