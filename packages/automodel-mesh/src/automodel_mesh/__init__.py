"""automodel-mesh."""

__all__: list[str] = []
