"""QATConfig: reference-compatible construction, validation, dict round trip, quantizer creation."""

from __future__ import annotations

import pytest
import torch

from automodel_quant.qat import QAT_QUANTIZER_TYPES, QATConfig


def test_defaults_and_modes() -> None:
    config = QATConfig()
    assert config.quantizer_type == "int8_dynact_int4weight"
    assert config.quantizer_kwargs == {}
    assert config.on_unsupported_layer == "skip"
    assert config.auto_layout
    assert config.mode == "8da4w-qat"
    assert QATConfig(quantizer_type="int4_weight_only").mode == "4w-qat"
    assert QAT_QUANTIZER_TYPES == ("int8_dynact_int4weight", "int4_weight_only")


def test_reference_style_keywords_are_quantizer_kwargs() -> None:
    config = QATConfig(quantizer_type="int4_weight_only", groupsize=64, inner_k_tiles=4, precision="float32")
    assert config.quantizer_kwargs == {"groupsize": 64, "inner_k_tiles": 4, "precision": torch.float32}
    assert not config.auto_layout
    assert QATConfig(quantizer_kwargs={"groupsize": 32}).quantizer_kwargs == {"groupsize": 32}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantizer_type": "int2"}, r"quantizer_type='int2' is unknown.*int8_dynact_int4weight"),
        ({"inner_k_tiles": 4}, r"\['inner_k_tiles'\] are not arguments of the 'int8_dynact_int4weight'"),
        (
            {"quantizer_type": "int4_weight_only", "groupsize": 48},
            r"groupsize'\]=48 is not supported.*32, 64",
        ),
        ({"quantizer_type": "int4_weight_only", "inner_k_tiles": 3}, r"inner_k_tiles'\]=3"),
        ({"groupsize": 0}, r"groupsize'\]=0 must be a positive int"),
        ({"precision": torch.int8}, r"precision'\]=torch.int8 must be a floating-point dtype"),
        ({"precision": "float33"}, r"'float33' is not a torch dtype"),
        ({"padding_allowed": "yes"}, r"padding_allowed'\]='yes' must be a bool"),
        ({"on_unsupported_layer": "ignore"}, r"on_unsupported_layer='ignore'"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QATConfig(**kwargs)  # type: ignore[arg-type]


def test_same_kwarg_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="given both"):
        QATConfig(quantizer_kwargs={"groupsize": 32}, groupsize=64)


def test_dict_round_trip() -> None:
    config = QATConfig(quantizer_type="int4_weight_only", groupsize=128, scales_precision=torch.bfloat16)
    data = config.to_dict()
    assert data == {
        "quantizer_type": "int4_weight_only",
        "on_unsupported_layer": "skip",
        "groupsize": 128,
        "scales_precision": "bfloat16",
    }
    assert QATConfig.from_dict(data) == config
    nested = QATConfig.from_dict(
        {"quantizer_type": "int4_weight_only", "quantizer_kwargs": {"groupsize": 128}}
    )
    assert nested.quantizer_kwargs == {"groupsize": 128}


def test_create_quantizer_defaults_to_bf16_precision() -> None:
    from torchao.quantization.qat import Int4WeightOnlyQATQuantizer, Int8DynActInt4WeightQATQuantizer

    q8 = QATConfig().create_quantizer()
    assert isinstance(q8, Int8DynActInt4WeightQATQuantizer)
    assert (q8.precision, q8.scales_precision) == (torch.bfloat16, torch.bfloat16)
    assert q8._automodel_auto_layout is True
    q4 = QATConfig(
        quantizer_type="int4_weight_only", groupsize=32, on_unsupported_layer="error"
    ).create_quantizer()
    assert isinstance(q4, Int4WeightOnlyQATQuantizer)
    assert (q4.groupsize, q4.precision, q4.scales_precision) == (32, torch.bfloat16, torch.bfloat16)
    assert q4._automodel_auto_layout is False
    assert q4._automodel_on_unsupported_layer == "error"
