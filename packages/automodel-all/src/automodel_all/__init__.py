"""automodel-all."""

__all__: list[str] = []
