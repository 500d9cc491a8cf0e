"""automodel-infra."""

__all__: list[str] = []
