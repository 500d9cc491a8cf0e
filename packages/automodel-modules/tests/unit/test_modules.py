"""automodel-modules: names across wrappers, lookups, kinds and the data-flow tracer (single process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from automodel_modules import (
    ADAPTER_SEGMENTS,
    find_hf_model,
    fqn_of,
    is_adapter_fqn,
    is_conv1d,
    is_dtensor,
    join_fqn,
    maps_like_linear,
    output_head_fqns,
    reshard_fsdp_units,
    strip_wrapper_segments,
    unwrap,
)
from automodel_modules.dataflow import DataFlow, fake_forward


class _Peft(nn.Module):
    """A wrapper with ``get_base_model()``, as peft's ``PeftModel`` has."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = inner

    def get_base_model(self) -> nn.Module:
        return self.base_model.model


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.out = nn.Linear(4, 8)

    def get_output_embeddings(self) -> nn.Module:
        return self.out


def test_names_strip_wrappers_and_recognise_adapters() -> None:
    assert strip_wrapper_segments("layers.0._checkpoint_wrapped_module._orig_mod.mlp.weight") == (
        "layers.0.mlp.weight"
    )
    assert is_adapter_fqn("layers.0.q_proj.lora_A.default.weight")
    assert not is_adapter_fqn("layers.0.q_proj.base_layer.weight")
    assert all(is_adapter_fqn(f"x.{segment}.y") for segment in ADAPTER_SEGMENTS)
    assert join_fqn("", "a") == "a" and join_fqn("a", "") == "a" and join_fqn("a", "b") == "a.b"


def test_lookups_see_through_peft_and_checkpoint_wrappers() -> None:
    inner = _Head()
    wrapped = _Peft(inner)
    assert find_hf_model(wrapped) == ("base_model.model", inner)
    assert find_hf_model(inner) == ("", inner)
    assert fqn_of(wrapped, inner.out) == "base_model.model.out"
    assert fqn_of(wrapped, nn.Linear(1, 1)) is None
    assert output_head_fqns(inner) == {"out"}
    block = nn.Linear(2, 2)
    assert unwrap(checkpoint_wrapper(block)) is block


def test_kinds_ask_without_importing() -> None:
    linear = nn.Linear(3, 5)
    assert maps_like_linear(linear, 3, 5)
    assert not maps_like_linear(linear, 4, 5)  # the wrong input width fails on fake tensors
    assert not is_conv1d(linear)
    assert not is_dtensor(torch.zeros(1))
    # is_dtensor must not import torch.distributed.tensor (seconds) where nothing else did.
    code = (
        "import sys, torch; from automodel_modules import is_dtensor; is_dtensor(torch.zeros(1)); "
        "print('torch.distributed.tensor' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_reshard_fsdp_units_leaves_a_plain_model_alone() -> None:
    model = _Head()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reshard_fsdp_units(model)  # no FSDP2 unit: nothing to do, nothing changed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_dataflow_labels_follow_values_not_shapes_or_indices() -> None:
    flow = DataFlow()
    seen: list[str] = []
    flow.on_op = lambda name, _args, _kwargs, _labels: seen.append(name)
    with fake_forward(flow):
        x = torch.ones(2, 3)
        y = torch.ones(2, 3)
        flow.set(x, {"x"})
        flow.set(y, {"y"})
        summed = x + y
        shaped = torch.zeros_like(x)  # value-free: no label
        picked = y[torch.tensor([0])]  # the index carries no label, the indexed tensor does
        x.add_(y)  # in place: x now also holds y's values
    assert flow.labels_of(summed) == {"x", "y"}
    assert flow.labels_of(shaped) == frozenset()
    assert flow.labels_of(picked) == {"y"}
    assert flow.labels_of(x) == {"x", "y"}
    assert "add" in "".join(seen)


@pytest.mark.parametrize("package", ["automodel_modules"])
def test_import_is_torch_only(package: str) -> None:
    code = f"import sys, {package}; print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
