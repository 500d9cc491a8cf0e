"""automodel-testing."""

__all__: list[str] = []
