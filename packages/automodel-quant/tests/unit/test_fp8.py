"""FP8Config and apply_fp8_to_model (torchao float8, emulated and not, on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import automodel_quant.fp8.apply as fp8_apply
from automodel_quant.fp8 import (
    FP8Config,
    apply_fp8_to_model,
    build_fp8_config,
    precompute_fp8_scales_for_fsdp,
    resolve_fp8_targets,
    verify_fp8_conversion,
)
from automodel_testing import build_tiny_model


def test_reference_fields_and_defaults() -> None:
    config = FP8Config()
    assert config.to_dict() == {
        "enabled": False,
        "fp8_recipe_name": None,
        "enable_fsdp_float8_all_gather": False,
        "precompute_float8_dynamic_scale_for_fsdp": False,
        "force_recompute_fp8_weight_in_bwd": False,
        "fp8_filter_fqns": [],
        "fp8_emulate": False,
        "convert_output_head": False,
    }


def test_dict_round_trip_with_either_key_names() -> None:
    config = FP8Config(enabled=True, recipe_name="rowwise", filter_fqns=["router"], emulate=True)
    assert FP8Config.from_dict(config.to_dict()) == config
    assert (
        FP8Config.from_dict(
            {"enabled": True, "recipe_name": "rowwise", "filter_fqns": ["router"], "emulate": True}
        )
        == config
    )
    assert build_fp8_config(None) is None
    assert build_fp8_config(config) is config
    assert build_fp8_config({"enabled": True}) == FP8Config(enabled=True)
    with pytest.raises(ValueError, match=r"unknown FP8Config field\(s\) \['fp8_typo'\]"):
        FP8Config.from_dict({"fp8_typo": 1})
    with pytest.raises(ValueError, match="given twice"):
        FP8Config.from_dict({"emulate": True, "fp8_emulate": True})


def test_validation() -> None:
    with pytest.raises(ValueError, match=r"recipe_name='blockwise' is unknown"):
        FP8Config(recipe_name="blockwise")
    with pytest.raises(ValueError, match="all_gather=True works with the tensorwise recipe only"):
        FP8Config(recipe_name="rowwise", enable_fsdp_float8_all_gather=True)
    with pytest.warns(UserWarning, match="precompute_float8_dynamic_scale_for_fsdp is ignored"):
        FP8Config(precompute_float8_dynamic_scale_for_fsdp=True)
    with pytest.raises(ValueError, match="non-empty strings"):
        FP8Config(filter_fqns=[""])


def test_plan_excludes_head_filters_adapters_and_odd_dims() -> None:
    import peft

    model = build_tiny_model("llama", hidden_size=48, head_dim=12, intermediate_size=100)
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules=["q_proj"]), model)
    plan = resolve_fp8_targets(model, FP8Config(enabled=True, filter_fqns=["v_proj"]))
    assert plan.excluded["lm_head"].startswith("output head")
    assert plan.excluded["model.layers.0.self_attn.v_proj"] == "matches filter_fqns"
    assert plan.excluded["model.layers.0.self_attn.q_proj.lora_A.default"] == "LoRA adapter"
    assert plan.unsupported_dims["model.layers.0.mlp.up_proj"] == (100, 48)
    assert "model.layers.0.self_attn.q_proj.base_layer" in plan.convert
    assert plan.unsupported_dims["model.layers.0.self_attn.k_proj"] == (24, 48)  # 2 kv heads of 12
    with_head = resolve_fp8_targets(model, FP8Config(enabled=True, convert_output_head=True))
    assert "lm_head" in with_head.convert


@pytest.mark.parametrize("recipe", [None, "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("emulate", [True, False])
def test_convert_and_train_step(recipe: str | None, emulate: bool, batch: dict[str, torch.Tensor]) -> None:
    reference = build_tiny_model("llama")
    model = build_tiny_model("llama")
    apply_fp8_to_model(model, FP8Config(enabled=True, recipe_name=recipe, emulate=emulate))
    stats = verify_fp8_conversion(model)
    assert stats["float8_linears"] == 14 and stats["linears"] == 15
    assert type(model.lm_head) is nn.Linear
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - reference(**batch).loss.item()) < 2e-2
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None
    assert model.precompute_float8_dynamic_scale_for_fsdp is False


def test_odd_dims_give_one_warning_listing_them() -> None:
    model = build_tiny_model("llama", intermediate_size=100)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        apply_fp8_to_model(model, FP8Config(enabled=True, emulate=True))
    messages = [str(w.message) for w in record if "FP8" in str(w.message)]
    assert len(messages) == 1, messages
    assert "6 linear layer(s) stay in high precision" in messages[0]
    assert "model.layers.1.mlp.down_proj [64, 100]" in messages[0]
    assert verify_fp8_conversion(model)["float8_linears"] == 8


def test_disabled_is_a_no_op_and_legacy_keywords_enable() -> None:
    model = build_tiny_model("llama")
    assert apply_fp8_to_model(model, FP8Config()) is model
    assert verify_fp8_conversion(model)["float8_linears"] == 0
    apply_fp8_to_model(model, emulate=True, filter_fqns=["mlp"])
    assert verify_fp8_conversion(model)["float8_linears"] == 8
    with pytest.raises(ValueError, match="not both"):
        apply_fp8_to_model(model, FP8Config(), emulate=True)


def test_precompute_flag_and_hook() -> None:
    config = FP8Config(
        enabled=True,
        emulate=True,
        enable_fsdp_float8_all_gather=True,
        precompute_float8_dynamic_scale_for_fsdp=True,
    )
    model = apply_fp8_to_model(build_tiny_model("llama"), config)
    assert model.precompute_float8_dynamic_scale_for_fsdp is True
    plain = apply_fp8_to_model(build_tiny_model("llama"), FP8Config(enabled=True, emulate=True))
    assert precompute_fp8_scales_for_fsdp(plain) is False


def test_meta_device_conversion() -> None:
    model = build_tiny_model("llama", meta=True)
    apply_fp8_to_model(model, FP8Config(enabled=True, emulate=True))
    assert verify_fp8_conversion(model)["float8_linears"] == 14


def test_failed_conversion_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchao.float8

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(torchao.float8, "convert_to_float8_training", broken)
    with pytest.raises(RuntimeError, match=r"FP8 conversion failed \(RuntimeError: boom\)"):
        apply_fp8_to_model(build_tiny_model("llama"), FP8Config(enabled=True, emulate=True))


def test_old_gpu_without_emulate_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*8.0.*emulate=True"):
        fp8_apply.apply_fp8_to_model(build_tiny_model("llama"), FP8Config(enabled=True))
