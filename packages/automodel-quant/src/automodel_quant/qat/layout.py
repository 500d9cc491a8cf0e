"""Choose torchao QAT group sizes from a model's linear layers (pure decisions, no torchao import).

torchao quantizes a linear only when its input size ``K`` divides by the group size, and int4 weight-only
QAT also needs ``K`` to divide by ``inner_k_tiles * 16`` (its packed kernel) and a bias-free layer. One
quantizer applies one setting to every layer, so the setting must fit them all: `resolve_qat_layout`
picks the one that fits the most layers (ties go to larger groups and tiles, torchao's defaults) and
lists the layers no setting reaches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["GROUP_SIZES", "INNER_K_TILES", "LinearShape", "QATLayout", "resolve_qat_layout"]

GROUP_SIZES: tuple[int, ...] = (256, 128, 64, 32)
INNER_K_TILES: tuple[int, ...] = (8, 4, 2)


@dataclass(frozen=True)
class LinearShape:
    """What the layout decision needs to know about one linear layer."""

    fqn: str
    in_features: int
    has_bias: bool = False


@dataclass(frozen=True)
class QATLayout:
    """The chosen quantizer setting and which layers it quantizes.

    Attributes:
        groupsize: Group size of the weight quantization.
        inner_k_tiles: int4 packing tiles (int4 weight-only only; None for 8da4w).
        quantized: Layers the quantizer will swap.
        unsupported: Layer -> why it stays in high precision.
    """

    groupsize: int
    inner_k_tiles: int | None
    quantized: tuple[str, ...]
    unsupported: dict[str, str] = field(default_factory=dict)


def _problem(layer: LinearShape, int4: bool, groupsize: int, tiles: int | None, padding: bool) -> str | None:
    if int4 and layer.has_bias:
        return "has a bias (torchao's int4 weight-only QAT takes bias-free linears only)"
    if padding:
        return None
    k = layer.in_features
    if k % groupsize:
        return f"in_features={k} does not divide by groupsize={groupsize}"
    if int4 and tiles is not None and k % (tiles * 16):
        return f"in_features={k} does not divide by inner_k_tiles*16={tiles * 16}"
    return None


def resolve_qat_layout(
    layers: Sequence[LinearShape],
    quantizer_type: str,
    *,
    groupsize: int | None = None,
    inner_k_tiles: int | None = None,
    padding_allowed: bool = False,
) -> QATLayout:
    """Pick ``groupsize`` (and ``inner_k_tiles`` for int4 weight-only) for ``layers``. Pure.

    A value given by the caller is kept; only the missing ones are searched. Among the candidates
    (group sizes 256, 128, 64, 32; tiles 8, 4, 2) the setting that fits the most layers wins, ties
    going to the larger group size, then the larger tile count.

    Args:
        layers: The linear layers the quantizer would see.
        quantizer_type: ``"int8_dynact_int4weight"`` or ``"int4_weight_only"``.
        groupsize: A fixed group size, or None to choose one.
        inner_k_tiles: A fixed tile count (int4 weight-only), or None to choose one.
        padding_allowed: 8da4w pads ``K`` itself, so every layer fits.

    Returns:
        The layout; ``unsupported`` names each layer left out and why.
    """
    int4 = quantizer_type == "int4_weight_only"
    groups = (groupsize,) if groupsize is not None else GROUP_SIZES
    tiles_options: tuple[int | None, ...] = (
        ((inner_k_tiles,) if inner_k_tiles is not None else INNER_K_TILES) if int4 else (None,)
    )
    pad = padding_allowed and not int4
    best: QATLayout | None = None
    for g in groups:  # larger first: a tie keeps the earlier (larger) candidate
        for t in tiles_options:
            problems = {
                layer.fqn: why for layer in layers if (why := _problem(layer, int4, g, t, pad)) is not None
            }
            fits = tuple(layer.fqn for layer in layers if layer.fqn not in problems)
            if best is None or len(fits) > len(best.quantized):
                best = QATLayout(groupsize=g, inner_k_tiles=t, quantized=fits, unsupported=problems)
    assert best is not None
    return best
