"""DDPManager decisions in one process: process-group checks, DDP keyword mapping, world size 1, autocast."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from automodel_distributed.config import DDPConfig
from automodel_distributed.ddp import DDPManager, apply_autocast, ddp_kwargs
from automodel_testing import assert_tensors_close, build_tiny_model, make_batch


@pytest.fixture
def single_rank_group(tmp_path: pathlib.Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"initialised default process group.*init_process_group"):
        DDPManager(DDPConfig())


def test_rejects_other_configs() -> None:
    with pytest.raises(ValueError, match="needs a DDPConfig"):
        DDPManager(object())  # type: ignore[arg-type]


def test_ddp_kwargs_cpu_and_cuda() -> None:
    config = DDPConfig(broadcast_buffers=True, find_unused_parameters=True, static_graph=True)
    kwargs = ddp_kwargs(config, torch.device("cpu"))
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # torch >= 2.13 deprecated broadcast_buffers for forward_sync_buffers; older torch has only the former.
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    assert kwargs == {
        "device_ids": None,
        "forward_sync_buffers" if renamed else "broadcast_buffers": True,
        "find_unused_parameters": True,
        "static_graph": True,
        "gradient_as_bucket_view": False,
    }
    assert "bucket_cap_mb" not in kwargs  # torch's default applies
    cuda = ddp_kwargs(DDPConfig(bucket_cap_mb=12.5, gradient_as_bucket_view=True), torch.device("cuda", 3))
    assert cuda["device_ids"] == [3]
    assert cuda["bucket_cap_mb"] == 12.5
    assert cuda["gradient_as_bucket_view"] is True


@pytest.mark.usefixtures("single_rank_group")
def test_config_fields_are_attributes_and_device_follows_the_backend() -> None:
    config = DDPConfig(activation_checkpointing="selective", bucket_cap_mb=4, static_graph=True)
    manager = DDPManager(config)
    for name, value in config.to_dict().items():
        assert getattr(manager, name) == value, name
    assert manager.device == torch.device("cpu")  # gloo
    assert (manager.rank, manager.world_size) == (0, 1)


@pytest.mark.usefixtures("single_rank_group")
def test_world_size_one_returns_the_model_unwrapped_with_checkpointing() -> None:
    model = build_tiny_model("llama")
    out = DDPManager(DDPConfig(activation_checkpointing=True)).parallelize(model)
    assert out is model
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.model.layers)
    assert next(model.parameters()).dtype == torch.float32  # no silent bf16 cast


@pytest.mark.usefixtures("single_rank_group")
def test_meta_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        DDPManager(DDPConfig()).parallelize(build_tiny_model("llama", meta=True))


@pytest.mark.usefixtures("single_rank_group")
def test_autocast_dtype_runs_the_forward_under_autocast() -> None:
    batch = make_batch(128, 2, 16)
    reference = build_tiny_model("qwen2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**batch)
    model = DDPManager(DDPConfig(autocast_dtype=torch.bfloat16)).parallelize(build_tiny_model("qwen2"))
    out = model(**batch)
    assert out.logits.dtype == torch.bfloat16
    assert_tensors_close(out.logits, expected.logits, atol=0.0, name="autocast logits")
    assert abs(out.loss.item() - expected.loss.item()) == 0.0
    out.loss.backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in model.parameters())


def test_apply_autocast_twice_replaces_instead_of_nesting() -> None:
    model = build_tiny_model("llama")
    batch = make_batch(128, 1, 8)
    apply_autocast(model, torch.bfloat16, "cpu")
    apply_autocast(model, torch.float16, "cpu")  # CPU autocast supports fp16 too
    assert model(**batch).logits.dtype == torch.float16


@pytest.mark.usefixtures("single_rank_group")
def test_ddp_options_at_world_size_one_warn_that_they_are_ignored() -> None:
    config = DDPConfig(find_unused_parameters=True, bucket_cap_mb=10)
    with pytest.warns(
        UserWarning, match="find_unused_parameters, DDPConfig.bucket_cap_mb ignored: world size 1"
    ):
        DDPManager(config).parallelize(torch.nn.Linear(2, 2))
