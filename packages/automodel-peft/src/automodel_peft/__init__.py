"""automodel-peft."""

__all__: list[str] = []
