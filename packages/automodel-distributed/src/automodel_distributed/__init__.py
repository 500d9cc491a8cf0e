"""automodel-distributed."""

__all__: list[str] = []
