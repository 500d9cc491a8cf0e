"""automodel-pipelining."""

__all__: list[str] = []
