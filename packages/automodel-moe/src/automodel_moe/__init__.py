"""automodel-moe."""

__all__: list[str] = []
