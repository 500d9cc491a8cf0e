"""`ExpertLoad`: how many tokens each expert got in a step, over the ranks (load balance made visible).

Forward pre-hooks on every experts module `find_experts` finds count the routing the block hands it
(``top_k_index`` for routed experts; for experts that take every token, the rows of each expert that
are not zero, i.e. the tokens its router picked), summed over the layers this rank holds and the
micro-batches of the step. Activation-checkpointing recomputes (which run inside backward) are not
counted twice. `ExpertLoad.summary` reduces the counts over the ranks once per step. The counts stay on
the device of the routing tensors (no host sync per layer). Works with and without expert parallelism
(the hooks see the routing before any exchange).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_modules import collective_device
from automodel_moe.registry import ExpertsCall, ExpertsSite, find_experts

__all__ = ["ExpertLoad"]


class ExpertLoad:
    """Tokens per expert of a mixture-of-experts model, per step: per expert min / max / mean over ranks.

    Args:
        sites: The experts modules to count (`find_experts` of the model or of each pipeline stage).
        ep_size: Expert-parallel size: the experts form ``ep_size`` consecutive blocks, one per ep rank, and
            `summary` also gives the tokens each block received. 1: no such entry.
        num_experts: The model's expert count, needed when ``sites`` is empty (a pipeline stage without
            MoE layers still joins `summary`'s collective).

    Raises:
        ValueError: No site and no ``num_experts``, or different expert counts.
    """

    def __init__(
        self, sites: Sequence[ExpertsSite], *, ep_size: int = 1, num_experts: int | None = None
    ) -> None:
        counts = {site.num_experts for site in sites} | ({num_experts} if num_experts is not None else set())
        if len(counts) != 1:
            raise ValueError(f"ExpertLoad needs experts modules of one expert count, got {sorted(counts)}")
        self.num_experts = counts.pop()
        if ep_size < 1 or self.num_experts % ep_size:
            raise ValueError(f"ExpertLoad: ep_size={ep_size} does not divide num_experts={self.num_experts}")
        self.ep_size = ep_size
        self.counts: torch.Tensor | None = None
        self.active = True
        self._handles = [site.module.register_forward_pre_hook(self._hook(site)) for site in sites]

    @classmethod
    def attach(
        cls, parts: Sequence[nn.Module], *, ep_size: int = 1, num_experts: int | None = None
    ) -> ExpertLoad | None:
        """Hook the experts of ``parts`` (a model, or this rank's pipeline stages).

        None when they have no experts and ``num_experts`` is None (a dense model). Give ``num_experts``
        (from the whole model, e.g. `find_experts` of its meta copy) when every rank must take part in
        `summary`, also a rank whose pipeline stages hold no MoE layer.
        """
        sites = [site for part in parts for site in find_experts(part)]
        if not sites and num_experts is None:
            return None
        return cls(sites, ep_size=ep_size, num_experts=num_experts)

    def _hook(self, site: ExpertsSite) -> Any:
        num_experts = self.num_experts

        def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
            # A checkpoint recompute runs inside backward (a graph task is running): already counted.
            if not self.active or torch._C._current_graph_task_id() != -1 or not args:
                return
            with torch.no_grad():
                if site.call is ExpertsCall.EVERY_TOKEN:
                    rows = _local(args[0])
                    picked = (rows.reshape(num_experts, -1, rows.shape[-1]) != 0).any(-1).sum(1)
                elif site.call is ExpertsCall.GROUPED_ROWS:
                    if len(args) < 2:
                        return
                    sizes = args[1]  # a tensor stays where it is; a list becomes a host tensor
                    if not isinstance(sizes, torch.Tensor):
                        sizes = torch.tensor(sizes, device="cpu")
                    picked = sizes.reshape(-1)[:num_experts]
                else:
                    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
                        return
                    picked = torch.bincount(_local(args[1]).reshape(-1), minlength=num_experts)[:num_experts]
                picked = picked.to(torch.float64)
                self.counts = picked if self.counts is None else self.counts + picked.to(self.counts.device)

        return count

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count inside the block (evaluation forwards)."""
        before, self.active = self.active, False
        try:
            yield
        finally:
            self.active = before

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def summary(self, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Reduce this step's counts over the ranks of ``group`` (default: all) and reset them.

        Collective: one ``all_gather_into_tensor`` of ``num_experts`` numbers per rank (every rank of the
        group must call it, also a rank whose stages have no experts: it then contributes zeros).

        Returns:
            ``tokens_per_expert``: each expert's count, mean over ranks (the histogram);
            ``min_over_ranks`` / ``max_over_ranks``: each expert's lowest and highest count on a rank;
            ``imbalance``: the busiest expert's mean count over the average expert's (1.0 is even);
            with ``ep_size > 1`` also ``tokens_per_ep_rank``: ``min`` / ``max`` / ``mean`` over the ep
            blocks of the tokens one rank holding that block receives per step.
        """
        local = self.counts
        if local is None:  # no expert ran here: zeros on the host (the default device may be meta)
            local = torch.zeros(self.num_experts, dtype=torch.float64, device="cpu")
        self.counts = None
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(group)
            # Counts live where the routing ran (or on the CPU: a list of grouped-row counts, a rank
            # without experts); the gather needs them on the group's device.
            local = local.to(collective_device(group))
            # Flat: gloo wants each rank's slot of the output shaped like the input.
            flat = local.new_empty(world * self.num_experts)
            dist.all_gather_into_tensor(flat, local.contiguous(), group=group)
            table = flat.view(world, self.num_experts)
        else:
            world, table = 1, local[None]
        table = table.cpu()
        mean = table.mean(0)
        average = float(mean.mean())
        out: dict[str, Any] = {
            "tokens_per_expert": [round(float(v), 2) for v in mean],
            "min_over_ranks": [int(v) for v in table.min(0).values],
            "max_over_ranks": [int(v) for v in table.max(0).values],
            "imbalance": round(float(mean.max()) / average, 4) if average > 0 else 0.0,
        }
        if self.ep_size > 1:
            # Every rank's tokens for a block of experts go to one rank of its ep group: per such rank,
            # the block's total over all ranks divided by the number of ep groups.
            groups = max(1, world // self.ep_size)
            blocks = table.sum(0).reshape(self.ep_size, -1).sum(1) / groups
            out["tokens_per_ep_rank"] = {
                "min": round(float(blocks.min()), 2),
                "max": round(float(blocks.max()), 2),
                "mean": round(float(blocks.mean()), 2),
            }
        return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
