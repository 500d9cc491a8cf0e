"""The tensors transformers keeps out of the compute dtype (`automodel_distributed.kept_precision`)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoModelForCausalLM

from automodel_distributed.fsdp2_units import plan_fsdp_units
from automodel_distributed.kept_precision import (
    cast_buffers_to_reference,
    kept_precision_units,
    reference_dtypes,
)

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _meta(model_type: str) -> torch.nn.Module:
    from automodel_testing.tiny import derive_tiny_config

    try:
        config = derive_tiny_config(model_type)
    except ValueError as exc:  # a transformers older than the lock may not ship the family
        pytest.skip(f"{model_type}: {exc}")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_reference_reads_what_transformers_keeps_in_fp32() -> None:
    model = _meta("ernie4_5_moe")  # routers in `_keep_in_fp32_modules_strict`; rotary inv_freq in fp32
    dtypes = reference_dtypes(model, torch.bfloat16)
    routers = {k for k, v in dtypes.items() if k.endswith("mlp.gate.weight")}
    assert routers and all(dtypes[k] == torch.float32 for k in routers)
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.rotary_emb.inv_freq"] == torch.float32
    assert reference_dtypes(model, torch.float32)["model.rotary_emb.inv_freq"] == torch.float32
    assert reference_dtypes(torch.nn.Linear(2, 2), torch.bfloat16) == {}  # not a transformers model


def test_routers_become_units_that_compute_in_fp32() -> None:
    model = _meta("ernie4_5_moe")
    dense = plan_fsdp_units(model, reshard_after_forward=None)
    units = kept_precision_units(model, BF16, reference_dtypes(model, torch.bfloat16), dense)
    moe_layers = [
        f"model.layers.{i}" for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")
    ]
    assert moe_layers and [u.fqn for u in units] == [f"{layer}.mlp.gate" for layer in moe_layers]
    for unit in units:
        assert unit.mp_policy is not None and unit.mp_policy.param_dtype is None
        assert not unit.mp_policy.cast_forward_inputs and unit.mp_policy.reduce_dtype == torch.float32
        assert unit.reshard_after_forward is None  # as the block that contains it
    assert (
        kept_precision_units(model, MixedPrecisionPolicy(), reference_dtypes(model, torch.bfloat16), dense)
        == []
    )


def test_a_parent_reading_its_childs_weight_is_the_unit() -> None:
    # The short convolution passes `self.conv1d.weight` to a kernel without calling `conv1d`: FSDP must
    # gather it around the convolution module's forward, so the unit is the largest all-kept module.
    parent = torch.nn.Module()
    parent.conv = torch.nn.Module()
    parent.conv.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4, bias=False)
    parent.proj = torch.nn.Linear(4, 4)
    reference = {
        "conv.conv1d.weight": torch.float32,
        "proj.weight": torch.bfloat16,
        "proj.bias": torch.bfloat16,
    }
    units = kept_precision_units(parent, BF16, reference, [])
    assert [u.fqn for u in units] == ["conv"]


def test_a_kept_parameter_beside_others_is_named() -> None:
    attention = torch.nn.Module()
    attention.q_proj = torch.nn.Linear(4, 4, bias=False)
    attention.sinks = torch.nn.Parameter(torch.zeros(2))
    root = torch.nn.Module()
    root.attn = attention
    reference = {"attn.q_proj.weight": torch.bfloat16, "attn.sinks": torch.float32}
    with pytest.warns(UserWarning, match=r"attn\.sinks compute in torch\.bfloat16 .*mp_policy\.param_dtype"):
        assert kept_precision_units(root, BF16, reference, []) == []


def test_buffers_take_the_dtype_transformers_computes_them_in() -> None:
    model = _meta("minimax")  # decay tables in the default dtype; inv_freq in fp32
    reference = reference_dtypes(model, torch.bfloat16)
    cast = cast_buffers_to_reference(model, reference, torch.bfloat16)
    assert any(name.endswith("diagonal_decay") for name in cast)
    buffers = dict(model.named_buffers())
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    # The decay tables are persistent (saved, exported): stored in fp32, bf16 only inside forward.
    assert all(buffers[name].dtype == torch.float32 for name in cast)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # parameters are FSDP's to cast


class _Tables(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.saved = torch.nn.Buffer(torch.full((2,), 1 / 3))
        self.scratch = torch.nn.Buffer(torch.full((2,), 1 / 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.saved.dtype == self.scratch.dtype == x.dtype, (self.saved.dtype, x.dtype)
        return x * self.saved + self.scratch


def test_a_persistent_buffer_is_cast_only_while_forward_runs() -> None:
    tables = _Tables()
    reference = {"saved": torch.bfloat16, "scratch": torch.bfloat16}
    assert cast_buffers_to_reference(tables, reference, torch.bfloat16) == ["saved", "scratch"]
    assert tables.scratch.dtype == torch.bfloat16  # never saved: cast once
    out = tables(torch.ones(2, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert tables.saved.dtype == torch.float32 and torch.equal(tables.saved, torch.full((2,), 1 / 3))
    assert tables.state_dict()["saved"].dtype == torch.float32
    with pytest.raises(AssertionError):  # a failed forward still restores the stored buffer
        tables(torch.ones(2))
    assert tables.saved.dtype == torch.float32


def test_a_child_its_parent_reads_directly_is_not_a_unit() -> None:
    # transformers marks such a forward (`force_accelerate_hooks`): FSDP would never gather the child.
    force_accelerate_hooks = pytest.importorskip(
        "transformers.integrations.accelerate"
    ).force_accelerate_hooks

    class Mixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4, bias=False)

        @force_accelerate_hooks("conv1d")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * self.conv1d.weight.sum()

    root = torch.nn.Module()
    root.mixer = Mixer()
    reference = {"mixer.proj.weight": torch.bfloat16, "mixer.proj.bias": torch.bfloat16}
    reference["mixer.conv1d.weight"] = torch.float32
    with pytest.warns(
        UserWarning, match=r"mixer\.conv1d\.weight compute in torch\.bfloat16 .*read by its parent"
    ):
        assert kept_precision_units(root, BF16, reference, []) == []


def test_the_keep_lists_apply_to_what_a_checkpoint_loads() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    class Scaled(LlamaForCausalLM):
        _keep_in_fp32_modules_strict = ["saved_scale", "scratch_scale"]

        def __init__(self, config: LlamaConfig) -> None:
            super().__init__(config)
            self.saved_scale = torch.nn.Buffer(torch.ones(2))  # in the default dtype, as built
            self.scratch_scale = torch.nn.Buffer(torch.ones(2), persistent=False)

    with torch.device("meta"):
        model = Scaled(derive_tiny_config("llama"))
    dtypes = reference_dtypes(model, torch.bfloat16)
    assert dtypes["saved_scale"] == torch.float32  # loaded from the checkpoint: kept in fp32
    assert dtypes["scratch_scale"] == torch.bfloat16  # never loaded: as built
    assert dtypes["lm_head.weight"] == torch.bfloat16


def test_a_model_its_config_cannot_build_again_is_warned_and_follows_the_policy() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    class NeedsMore(LlamaForCausalLM):  # a custom class whose constructor wants more than the config
        def __init__(self, config: LlamaConfig, vocab_file: str) -> None:
            super().__init__(config)
            self.vocab_file = vocab_file

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.vocab_size = 64
    with torch.device("meta"):
        model = NeedsMore(config, "vocab.txt")
    with pytest.warns(UserWarning, match="NeedsMore cannot be built again from its config"):
        assert reference_dtypes(model, torch.bfloat16) == {}
