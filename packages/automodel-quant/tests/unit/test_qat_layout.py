"""resolve_qat_layout: pick group size / inner_k_tiles that fit the layers; report the ones none fits."""

from __future__ import annotations

from automodel_quant.qat import LinearShape, resolve_qat_layout


def _layers(*ks: int, bias: bool = False) -> list[LinearShape]:
    return [LinearShape(f"l{i}", k, bias) for i, k in enumerate(ks)]


def test_8da4w_picks_the_largest_group_that_fits_everything() -> None:
    layout = resolve_qat_layout(_layers(64, 128, 64), "int8_dynact_int4weight")
    assert (layout.groupsize, layout.inner_k_tiles) == (64, None)
    assert layout.quantized == ("l0", "l1", "l2")
    assert layout.unsupported == {}
    assert resolve_qat_layout(_layers(4096, 11008), "int8_dynact_int4weight").groupsize == 256


def test_int4_needs_k_to_divide_by_tiles_times_16_too() -> None:
    layout = resolve_qat_layout(_layers(64, 128), "int4_weight_only")
    # 64 divides by groupsize 64 and by 4 * 16; tiles 8 (128) would leave K=64 out.
    assert (layout.groupsize, layout.inner_k_tiles) == (64, 4)
    assert layout.unsupported == {}
    assert resolve_qat_layout(_layers(4096, 11008), "int4_weight_only").inner_k_tiles == 8


def test_the_setting_that_fits_most_wins_and_the_rest_is_reported() -> None:
    layout = resolve_qat_layout(_layers(256, 256, 48), "int8_dynact_int4weight")
    assert layout.groupsize == 256
    assert layout.unsupported == {"l2": "in_features=48 does not divide by groupsize=256"}


def test_a_fixed_groupsize_is_kept() -> None:
    layout = resolve_qat_layout(_layers(64, 96), "int8_dynact_int4weight", groupsize=64)
    assert layout.groupsize == 64
    assert layout.unsupported == {"l1": "in_features=96 does not divide by groupsize=64"}


def test_int4_reports_tiles_and_bias() -> None:
    layout = resolve_qat_layout(_layers(64, 64), "int4_weight_only", groupsize=32, inner_k_tiles=8)
    assert layout.unsupported == {
        "l0": "in_features=64 does not divide by inner_k_tiles*16=128",
        "l1": "in_features=64 does not divide by inner_k_tiles*16=128",
    }
    biased = resolve_qat_layout(_layers(64, bias=True), "int4_weight_only")
    assert "has a bias" in biased.unsupported["l0"]


def test_padding_lets_8da4w_take_any_size() -> None:
    layout = resolve_qat_layout(_layers(48, 100), "int8_dynact_int4weight", padding_allowed=True)
    assert layout.unsupported == {}
    assert layout.groupsize == 256
