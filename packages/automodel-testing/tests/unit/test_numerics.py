"""Numeric comparison helpers: tolerances, name normalization and gradient comparison."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from automodel_testing import (
    assert_grads_close,
    assert_tensors_close,
    build_tiny_model,
    grads_by_name,
    make_batch,
    normalize_fqn,
    params_by_name,
    reference_loss_and_grads,
    run_distributed,
    to_full,
)


def test_assert_tensors_close_passes_within_tolerance() -> None:
    expected = torch.tensor([1.0, 2.0, float("inf")])
    assert_tensors_close(expected + torch.tensor([1e-6, -1e-6, 0.0]), expected, atol=1e-5)
    assert_tensors_close(torch.tensor([110.0]), torch.tensor([100.0]), atol=0.0, rtol=0.1)
    assert_tensors_close(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0]), atol=0.0)


def test_assert_tensors_close_reports_name_and_max_diff() -> None:
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 0.5
    actual[0, 0] = 0.25
    with pytest.raises(AssertionError, match=r"logits: max abs diff 5\.000e-01 exceeds atol=0\.1") as info:
        assert_tensors_close(actual, expected, atol=0.1, name="logits")
    assert "at (1, 2): actual 0.5 vs expected 0; 2/6 elements differ" in str(info.value)


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [
        (torch.zeros(2), torch.zeros(3), r"shape \(2,\) != expected \(3,\)"),
        (torch.tensor([float("nan")]), torch.tensor([float("nan")]), "max abs diff inf"),
        (torch.tensor([1.0]), torch.tensor([float("inf")]), "max abs diff inf"),
    ],
)
def test_assert_tensors_close_failures(actual: torch.Tensor, expected: torch.Tensor, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        assert_tensors_close(actual, expected, atol=1.0)


def test_assert_tensors_close_rejects_negative_tolerance() -> None:
    with pytest.raises(ValueError, match="tolerances must be >= 0"):
        assert_tensors_close(torch.zeros(1), torch.zeros(1), atol=-1.0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        (
            "_orig_mod.model.layers.1._orig_mod.self_attn.q_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ),
        ("_fsdp_wrapped_module.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("module.model.norm.weight", "model.norm.weight"),
        ("base_model.model.model.norm.weight", "model.norm.weight"),
        ("module._orig_mod.base_model.model.lm_head.weight", "lm_head.weight"),
        ("model.module.weight", "model.module.weight"),  # `module` in the middle is a real name
        ("my_orig_mod.weight", "my_orig_mod.weight"),  # only whole segments are stripped
    ],
)
def test_normalize_fqn(name: str, expected: str) -> None:
    assert normalize_fqn(name) == expected


class _Wrapper(nn.Module):
    """Mimics DDP: the wrapped model lives under `module.`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_reference_loss_and_grads_and_grad_comparison() -> None:
    batch = make_batch(128, 2, 8)
    model = build_tiny_model("llama", seed=0)
    loss, logits, grads = reference_loss_and_grads(model, batch)
    assert isinstance(loss, float)
    assert logits.shape == (2, 8, 128)
    assert set(grads) == {name for name, _ in model.named_parameters()}

    twin = build_tiny_model("llama", seed=0)
    twin_loss, _, _ = reference_loss_and_grads(twin, batch)
    assert twin_loss == loss
    assert_grads_close(_Wrapper(twin), model, atol=0.0)  # names compared after normalize_fqn
    assert_grads_close(grads_by_name(twin), grads, atol=0.0)  # mappings work too

    twin.model.layers[1].mlp.down_proj.weight.grad[0, 0] += 1e-2
    with pytest.raises(
        AssertionError, match=r"grad of model\.layers\.1\.mlp\.down_proj\.weight: max abs diff"
    ):
        assert_grads_close(twin, model, atol=1e-4)

    twin.model.norm.weight.grad = None
    del grads["lm_head.weight"]
    with pytest.raises(AssertionError) as info:
        assert_grads_close(twin, grads, atol=1.0)
    message = str(info.value)
    assert "not in the reference: ['lm_head.weight']" in message
    assert "grad of model.norm.weight is None in the model only" in message


def test_params_by_name_are_detached_copies() -> None:
    model = nn.Linear(2, 2)
    params = params_by_name(model)
    assert set(params) == {"weight", "bias"}
    assert not params["weight"].requires_grad
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(params["weight"], model.weight)
    assert grads_by_name(model) == {}


def _gather_sharded_linear() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    linear = nn.Linear(4, 6)
    for name, param in list(linear.named_parameters()):  # what fully_shard does, minus its 3 s start-up
        linear.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
    sharded = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    return params_by_name(linear), to_full(sharded)


@pytest.mark.distributed
def test_to_full_gathers_dtensors() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    for params, gathered in run_distributed(_gather_sharded_linear, 2):
        assert torch.equal(gathered, torch.arange(12.0).reshape(6, 2))
        assert_tensors_close(params["weight"], reference.weight, atol=0.0, name="weight")
        assert_tensors_close(params["bias"], reference.bias, atol=0.0, name="bias")
