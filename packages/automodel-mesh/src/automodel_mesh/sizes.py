"""`ParallelismSizes`: the parallel degrees a user asks for."""

from __future__ import annotations

from dataclasses import dataclass, fields

from automodel_mesh.config_dict import ConfigDict

__all__ = ["ParallelismSizes"]


@dataclass(frozen=True, kw_only=True)
class ParallelismSizes(ConfigDict):
    """The parallel degrees a user asks for (intent, not a built mesh).

    Every size is a positive integer. ``dp_size`` may be left to ``None`` (or ``-1``) to infer it from the
    world size; ``dp_replicate_size`` ``None`` means 1 (plain FSDP, no HSDP replicas).
    """

    dp_size: int | None = None
    """Total data-parallel degree ``dp_replicate x dp_shard``. ``None`` or ``-1``: ``world / (pp*cp*tp)``."""
    dp_replicate_size: int | None = None
    """HSDP replicas (FSDP2 only). ``None`` or 1: no replication, every dp rank holds a shard."""
    tp_size: int = 1
    """Tensor-parallel degree. 1 disables tensor parallelism."""
    pp_size: int = 1
    """Pipeline-parallel degree (number of pipeline ranks). 1 disables pipelining."""
    cp_size: int = 1
    """Context-parallel degree. 1 disables context parallelism."""
    ep_size: int = 1
    """Expert-parallel degree of the MoE mesh. 1 disables expert parallelism."""
    cp_ulysses_degree: int = 1
    """Of the ``cp_size`` ranks, how many split attention by heads through all-to-all (Ulysses)
    exchanges instead of passing keys and values around a ring: 1 is ring attention,
    ``cp_size`` all-to-all attention (which needs the query heads divisible by it), a divisor between
    ring attention between groups of that many consecutive all-to-all ranks. Not a mesh axis:
    `automodel_distributed.context_parallel_region` reads it (and splits the ``cp`` mesh itself)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            optional = f.name in ("dp_size", "dp_replicate_size")
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"ParallelismSizes.{f.name} must be an int, got {value!r} ({type(value).__name__})"
                )
            if optional and value == -1:
                continue
            if value < 1:
                hint = " (or None / -1 to infer it)" if f.name == "dp_size" else ""
                raise ValueError(f"ParallelismSizes.{f.name} must be >= 1{hint}, got {value}")

        if self.cp_size % self.cp_ulysses_degree:
            raise ValueError(
                f"ParallelismSizes.cp_ulysses_degree={self.cp_ulysses_degree} must divide "
                f"cp_size={self.cp_size} (1: ring attention, {self.cp_size}: all-to-all attention, a divisor "
                "between: ring attention between all-to-all groups)"
            )

    @property
    def inferred_dp(self) -> bool:
        """Whether ``dp_size`` is to be inferred from the world size."""
        return self.dp_size is None or self.dp_size == -1
