"""`ExpertParallelExperts`: the fused-experts module of an HF MoE block, sharded over the ``ep`` axis.

Each ep rank holds ``num_experts / ep`` consecutive experts. A forward call:

1. sorts the ``T*K`` (token, choice) pairs by expert and counts them per destination rank;
2. exchanges the counts (``all_to_all_single``, equal splits) and then the token rows
   (``all_to_all_single`` with uneven splits, differentiable via ``all_to_all_single_autograd``);
3. regroups the received rows by local expert and runs the SwiGLU experts as grouped matmuls
   (``torch._grouped_mm`` when the dtype/strides allow it, else a per-expert loop);
4. sends the results back (the inverse all-to-all), weights them by the router's top-k weights and sums
   them per token, exactly as the transformers experts module does.

Parameters keep the HF names and shapes: ``gate_up_proj`` ``[E, 2*I, H]`` and ``down_proj`` ``[E, H, I]``
as DTensors ``Shard(0)`` over the ep mesh, so ``full_tensor()`` is the HF tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["ExpertParallelExperts", "grouped_swiglu"]


def _grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    item = x.element_size()
    return (
        (x.shape[-1] * item) % 16 == 0
        and (weight.shape[-1] * item) % 16 == 0
        and (weight.shape[-2] * item) % 16 == 0
    )


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert.

    Args:
        x: ``[N, H]`` rows, those of expert 0 first, then expert 1, ...
        counts: ``[E]`` rows per expert (sums to N).
        gate_up: ``[E, 2*I, H]`` (``F.linear`` layout, gate rows first).
        down: ``[E, H, I]`` (``F.linear`` layout).
        act_fn: Activation of the gate half.
        use_grouped_mm: Force (True) or forbid (False) ``torch._grouped_mm``; None decides by dtype/strides.
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_usable(x, gate_up) and _grouped_mm_usable(x, down)
    if use_grouped_mm and x.shape[0] > 0:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), offs=offs)
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def _a2a(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = all_to_all_single_autograd(x, out_splits, in_splits, group)
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


class ExpertParallelExperts(nn.Module):
    """Drop-in replacement of a transformers fused-experts module, its experts sharded over ``ep``.

    Called as ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.
    Mesh axis: ``ep`` (1-D ``ep_mesh``); collectives: three ``all_to_all_single`` per forward (counts,
    dispatch, combine) and two in backward.
    """

    last_dispatch: dict[str, Any]

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        ep_mesh: DeviceMesh,
        *,
        gate_up_name: str = "gate_up_proj",
        down_name: str = "down_proj",
    ) -> None:
        super().__init__()
        ep = ep_mesh.size()
        num_experts = gate_up_proj.shape[0]
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.ep_mesh = ep_mesh
        self.act_fn = act_fn
        self._gate_up_name, self._down_name = gate_up_name, down_name
        self.use_grouped_mm: bool | None = None
        self.last_dispatch = {}
        for name, full in ((gate_up_name, gate_up_proj), (down_name, down_proj)):
            if full.is_meta:
                local = torch.empty(
                    (self.num_local_experts, *full.shape[1:]), dtype=full.dtype, device="meta"
                )
                value = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            else:
                value = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(value, requires_grad=full.requires_grad))

    def extra_repr(self) -> str:
        """Expert counts and the ep size."""
        local = self.num_local_experts
        return f"num_experts={self.num_experts}, num_local_experts={local}, ep={self.ep_mesh.size()}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Send rows to their experts' ranks, apply the experts, combine (see the module docstring)."""
        group = self.ep_mesh.get_group()
        ep, local_e = self.ep_mesh.size(), self.num_local_experts
        top_k = top_k_index.shape[1]
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // top_k
        send_rows = hidden_states[token_of]

        with torch.no_grad():
            counts = torch.bincount(flat_expert, minlength=self.num_experts).to(torch.int64)
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=group)  # [ep, local_e]: from each source
            in_splits = counts.view(ep, local_e).sum(1).tolist()
            recv_by_src = recv_counts.view(ep, local_e)
            out_splits = recv_by_src.sum(1).tolist()
            local_ids = torch.arange(local_e, device=counts.device).repeat(ep)
            row_expert = torch.repeat_interleave(local_ids, recv_by_src.reshape(-1))
            perm = torch.argsort(row_expert, stable=True)
            inverse = torch.argsort(perm)
            per_expert = recv_by_src.sum(0)
        self.last_dispatch = {"send_splits": in_splits, "recv_splits": out_splits}

        recv = _a2a(send_rows, out_splits, in_splits, group)
        gate_up = getattr(self, self._gate_up_name)
        down = getattr(self, self._down_name)
        gate_up_local = gate_up.to_local() if isinstance(gate_up, DTensor) else gate_up
        down_local = down.to_local() if isinstance(down, DTensor) else down
        out = grouped_swiglu(
            recv[perm], per_expert, gate_up_local, down_local, self.act_fn, use_grouped_mm=self.use_grouped_mm
        )[inverse]
        back = _a2a(out, in_splits, out_splits, group)

        weights = top_k_weights.reshape(-1)[order]
        contrib = back * weights[:, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, token_of, contrib.to(final.dtype))
