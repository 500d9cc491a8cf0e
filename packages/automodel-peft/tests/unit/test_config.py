"""PeftConfig: the reference fields and defaults, validation, dict round trip, peft.LoraConfig form."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from automodel_peft import PeftConfig


def test_reference_fields_and_defaults() -> None:
    defaults = {
        f.name: f.default for f in dataclasses.fields(PeftConfig) if f.default is not dataclasses.MISSING
    }
    assert defaults == {
        "match_all_linear": False,
        "dim": 8,
        "alpha": 32,
        "use_dora": False,
        "dropout": 0.0,
        "dropout_position": "post",
        "lora_A_init": "xavier",
        "lora_dtype": None,
        "use_memory_efficient_lora": True,
        "use_triton": False,
        "moe_rank_scaling": False,
    }
    config = PeftConfig(target_modules=["q_proj"])
    assert config.exclude_modules == [] and config.scaling == 4.0


def test_empty_selection_defaults_to_proj_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"adapting \['\*_proj'\]"):
        config = PeftConfig()
    assert config.target_modules == ["*_proj"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_modules": ["q_proj"], "exclude_modules": ["k_proj"]}, "mutually exclusive"),
        (
            {"match_all_linear": True, "target_modules": ["q_proj"]},
            "match_all_linear=True adapts every linear",
        ),
        ({"match_all_linear": True, "exclude_modules": ["lm_head"]}, "cannot be combined"),
        ({"match_all_linear": True, "dim": 0}, r"dim=0 must be a positive int"),
        ({"match_all_linear": True, "alpha": -1}, r"alpha=-1 must be a positive number"),
        ({"match_all_linear": True, "dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
        ({"match_all_linear": True, "dropout_position": "mid"}, r"dropout_position='mid'"),
        ({"match_all_linear": True, "lora_A_init": "normal"}, r"lora_A_init='normal'"),
        ({"match_all_linear": True, "lora_dtype": "int8"}, "must be a floating-point dtype"),
        ({"match_all_linear": True, "lora_dtype": "bf17"}, "'bf17' is not a torch dtype"),
        ({"target_modules": [""]}, "non-empty module names"),
        (
            {"match_all_linear": True, "use_dora": True, "dropout": 0.1},
            "DoRA applies dropout to the adapter's input only",
        ),
        (
            {"match_all_linear": True, "target_parameters": ["experts.down_proj"], "use_dora": True},
            "no DoRA and no dropout",
        ),
        ({"match_all_linear": True, "target_parameters": [3]}, "non-empty module names"),
    ],
)
def test_bad_configs_name_the_fields(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PeftConfig(**kwargs)  # type: ignore[arg-type]


def test_strings_and_dtype_names_are_accepted() -> None:
    config = PeftConfig(target_modules="q_proj", lora_dtype="torch.bfloat16")
    assert config.target_modules == ["q_proj"]
    assert config.lora_dtype is torch.bfloat16
    assert PeftConfig(match_all_linear=True, use_dora=True, dropout=0.1, dropout_position="pre").use_dora


def test_dict_round_trip() -> None:
    config = PeftConfig(exclude_modules=["*.mlp.*"], dim=4, alpha=16, lora_dtype=torch.float32, dropout=0.1)
    data = config.to_dict()
    assert data["lora_dtype"] == "float32" and data["exclude_modules"] == ["*.mlp.*"]
    assert PeftConfig.from_dict(data) == config
    assert (
        PeftConfig.from_dict({"match_all_linear": True, "lora_A_init_method": "kaiming"}).lora_A_init
        == "kaiming"
    )
    with pytest.raises(ValueError, match=r"unknown PeftConfig field\(s\) \['rank'\]"):
        PeftConfig.from_dict({"rank": 4})


def test_to_lora_config() -> None:
    import re

    import peft

    config = PeftConfig(
        target_modules=["q_proj", "*.mlp.*_proj"], dim=4, alpha=16, dropout=0.1, dropout_position="pre"
    )
    lora = config.to_lora_config()
    assert isinstance(lora, peft.LoraConfig)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.use_dora) == (4, 16, 0.1, False)
    pattern = re.compile(lora.target_modules)
    assert pattern.fullmatch("model.layers.0.self_attn.q_proj")
    assert pattern.fullmatch("model.layers.3.mlp.up_proj")
    assert not pattern.fullmatch("model.layers.0.self_attn.k_proj")
    assert PeftConfig(match_all_linear=True).to_lora_config().target_modules == "all-linear"
    excluded = PeftConfig(exclude_modules=["down_proj"]).to_lora_config()
    assert excluded.target_modules == "all-linear" and re.fullmatch(
        excluded.exclude_modules, "a.mlp.down_proj"
    )
    post = PeftConfig(target_modules=["q_proj"], dropout=0.2).to_lora_config(
        ["x.q_proj"], task_type="CAUSAL_LM"
    )
    assert post.lora_dropout == 0.0, "post dropout is installed by apply_lora, not by peft"
    assert post.target_modules == {"x.q_proj"} and post.task_type == "CAUSAL_LM"
    experts = PeftConfig(match_all_linear=True, target_parameters=["experts.gate_up_proj"]).to_lora_config()
    assert experts.target_parameters == ["experts.gate_up_proj"]


def test_ignored_fields_warn() -> None:
    config = PeftConfig(target_modules=["q_proj"], use_triton=True, moe_rank_scaling=True)
    with pytest.warns(UserWarning, match="is ignored") as record:
        config.warn_ignored()
    messages = " ".join(str(w.message) for w in record)
    assert "use_triton=True is ignored" in messages and "moe_rank_scaling=True is ignored" in messages
