"""automodel-quant."""

__all__: list[str] = []
