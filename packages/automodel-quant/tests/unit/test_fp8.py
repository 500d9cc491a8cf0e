"""FP8Config and apply_fp8_to_model (torchao float8, emulated and not, on CPU)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import automodel_quant.fp8.apply as fp8_apply
from automodel_quant.fp8 import (
    FP8Config,
    apply_fp8_to_model,
    build_fp8_config,
    create_fp8_config_from_dict,
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
    }
    # The one field the reference lacks appears only when it is set, and round-trips.
    head = FP8Config(convert_output_head=True)
    assert head.to_dict()["convert_output_head"] is True
    assert FP8Config.from_dict(head.to_dict()) == head


def test_dict_round_trip_with_either_key_names() -> None:
    config = FP8Config(enabled=True, recipe_name="rowwise", filter_fqns=["router"], emulate=True)
    assert FP8Config.from_dict(config.to_dict()) == config
    assert (
        FP8Config.from_dict(
            {"enabled": True, "recipe_name": "rowwise", "filter_fqns": ["router"], "emulate": True}
        )
        == config
    )
    assert build_fp8_config(None) == FP8Config(enabled=False)  # as in the reference, not None
    assert create_fp8_config_from_dict({"enabled": True}) == FP8Config(enabled=True)
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
    from automodel_quant.fp8.apply import cpu_rowwise_scaled_mm

    reference = build_tiny_model("llama")
    model = build_tiny_model("llama")
    config = FP8Config(enabled=True, recipe_name=recipe, emulate=emulate)
    if recipe is not None and not emulate and not cpu_rowwise_scaled_mm():  # an older torch on CPU
        with pytest.raises(ValueError, match="takes per-tensor scales only; set emulate=True"):
            apply_fp8_to_model(model, config)
        return
    apply_fp8_to_model(model, config)
    stats = verify_fp8_conversion(model)
    assert (stats["fp8_count"], stats["linear_count"], stats["success"]) == (14, 15, True)
    assert stats["conversion_rate"] == pytest.approx(100 * 14 / 15)
    assert stats["fp8_modules"][0] == {
        "name": "model.layers.0.self_attn.q_proj",
        "type": "Float8Linear",
        "weight_shape": [64, 64],
    }
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
    assert verify_fp8_conversion(model)["fp8_count"] == 8


def test_disabled_is_a_no_op_and_legacy_keywords_enable() -> None:
    model = build_tiny_model("llama")
    assert apply_fp8_to_model(model, FP8Config()) is model
    assert verify_fp8_conversion(model)["fp8_count"] == 0
    apply_fp8_to_model(model, emulate=True, filter_fqns=["mlp"])
    assert verify_fp8_conversion(model)["fp8_count"] == 8
    with pytest.raises(ValueError, match="not both"):
        apply_fp8_to_model(model, FP8Config(), emulate=True)


def test_legacy_keyword_enabled_false_is_a_no_op() -> None:
    # Issue 17: ``enabled=`` among the legacy keywords raised "multiple values for keyword 'enabled'".
    model = build_tiny_model("llama")
    out = apply_fp8_to_model(
        model, config=None, enabled=False, filter_fqns=None, recipe_name=None, emulate=True
    )
    assert out is model and verify_fp8_conversion(model)["fp8_count"] == 0
    apply_fp8_to_model(model, enabled=True, emulate=True)
    assert verify_fp8_conversion(model)["fp8_count"] == 14


def test_bare_linear_is_converted_and_returned() -> None:
    # Issue 17: a model that is itself an nn.Linear raised "converted [''] unlike planned": torchao
    # returns a new module for a root linear instead of swapping it in place.
    linear = nn.Linear(32, 64)
    converted = apply_fp8_to_model(linear, FP8Config(enabled=True, emulate=True))
    assert type(converted).__name__ == "Float8Linear" and converted is not linear
    assert converted.precompute_float8_dynamic_scale_for_fsdp is False
    stats = verify_fp8_conversion(converted)
    assert (stats["fp8_count"], stats["linear_count"], stats["fp8_modules"][0]["name"]) == (1, 1, "")
    x = torch.randn(4, 32)
    assert torch.allclose(converted(x), linear(x), atol=0.1)
    # A bare linear with unsupported dims stays as it is.
    odd = nn.Linear(15, 31)
    with pytest.warns(UserWarning, match="no linear layer qualifies"):
        assert apply_fp8_to_model(odd, FP8Config(enabled=True, emulate=True)) is odd


def test_verify_without_float8_layers() -> None:
    stats = verify_fp8_conversion(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(15, 31)))
    assert stats == {
        "linear_count": 2,
        "fp8_count": 0,
        "conversion_rate": 0.0,
        "fp8_modules": [],
        "success": False,
    }
    assert verify_fp8_conversion(nn.ReLU())["conversion_rate"] == 0.0


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
    assert verify_fp8_conversion(model)["fp8_count"] == 14


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


def test_fp8_settings_that_act_on_nothing_warn() -> None:
    import warnings

    def caught(**fields: Any) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            FP8Config(**fields)
        return [str(w.message) for w in seen]

    assert caught(emulate=True, filter_fqns=["lm_head"]) == [
        "FP8Config.filter_fqns, FP8Config.emulate ignored: enabled is False (set enabled=True)"
    ]
    assert "torchao deprecated it" in caught(enabled=True, force_recompute_fp8_weight_in_bwd=True)[0]
    assert caught() == [] and caught(enabled=True, emulate=True, filter_fqns=["lm_head"]) == []
