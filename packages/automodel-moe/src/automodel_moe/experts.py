"""Expert parallelism on the model's own experts modules: their weights cut by expert, tokens sent to them.

Nothing of the experts is replaced. `shard_experts` turns each stacked expert parameter of an
`ExpertsSite` (``[E, ...]``) into a DTensor ``Shard(0)`` over the ``ep`` mesh (each rank holds
``E / ep`` consecutive experts; ``full_tensor()`` is the transformers tensor, so checkpoints load and
save by slices) and sets the module's expert count to the local one. LoRA factors of peft's
``ParamWrapper`` (``target_parameters`` on fused experts) are cut the same way: ``lora_A`` ``[r*E, in]``
is expert-major (``Shard(0)``), ``lora_B`` ``[out, r*E]`` expert-minor (``_StridedShard(1, r)``), so
that peft's own reshapes see the local experts.

`install_dispatch` then replaces the module's ``forward`` (an instance attribute; the class is untouched)
by a token exchange around the module's original forward, which runs on the local experts with local
expert ids and plain local tensors (`local_parameters`): the experts' own computation (transformers'
``ExpertsInterface`` kernels, biases, interleaved or transposed layouts, GPT-OSS's clamped gate,
post-expert norms, peft's LoRA parametrization) is what runs.

- Routed experts (transformers' convention) use transformers' own ``AllToAllEP``
  (``transformers.distributed.expert_parallel``) as is: tokens of a tensor-parallel group (which share
  their batch) are split across its ranks first, then each (token, expert) pair goes to the expert's
  rank with ``all_to_all_single`` and comes back with a second one, weighted and summed on the sender.
  transformers refuses this exchange together with pipeline parallelism
  (``DistributedConfig._validate_resolved_ep_plan``: "not supported/tested yet"), a limit of its own
  orchestration (one ``DistributedConfig`` for the whole model), not of the exchange: our pipeline
  stages hold whole layers and the ranks of one ``ep`` group are one stage running the same schedule,
  so every exchange pairs up. The model matrix's ``ep2_pp2`` layout measures it (exact parity).
- Experts called with rows grouped by expert (`ExpertsCall.EVERY_TOKEN`: Llama 4's, every token for every
  expert; `ExpertsCall.GROUPED_ROWS`: JetMoE's, each expert's routed rows and their counts) use
  `GroupedRowsEP`: each rank sends every other rank the rows of that rank's experts and gets its experts'
  outputs back.

Mesh axes: ``ep`` (the exchanges), ``tp`` (the ranks that share a batch; size 1 without TP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from automodel_moe.registry import SHARDED_ATTR, ExpertsCall, ExpertsSite, wrapper_chain

__all__ = [
    "GroupedRowsEP",
    "install_dispatch",
    "local_parameters",
    "routed_exchange_available",
    "shard_experts",
    "unsupported_parts",
]


def routed_exchange_available() -> bool:
    """Whether the installed transformers has the routed experts' token exchange (``AllToAllEP``)."""
    import importlib.util

    return importlib.util.find_spec("transformers.distributed.expert_parallel") is not None


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """Swap every DTensor parameter under ``module`` for its local tensor for the duration, in place.

    The local tensor is a differentiable view (``to_local``), so gradients reach the DTensor (FSDP's
    unsharded parameter during forward/backward). peft's LoRA parametrization registers what it finds as
    the parameter's ``original`` and hands it back as a buffer when it removes itself: the buffer is
    dropped and the DTensor restored. No collective.
    """
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if isinstance(param, DTensor):
                sub._parameters[name] = param.to_local()
                swapped.append((sub, name, param))
    try:
        yield
    finally:
        for sub, name, param in swapped:
            sub._buffers.pop(name, None)
            sub._parameters[name] = param


def _ep_dtensor(
    full: torch.Tensor, ep_mesh: DeviceMesh, placement: Placement, local: torch.Tensor
) -> nn.Parameter:
    value = DTensor.from_local(
        local, ep_mesh, [placement], run_check=False, shape=full.shape, stride=full.stride()
    )
    return nn.Parameter(value, requires_grad=full.requires_grad)


def _expert_rows(full: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    if full.is_meta:
        return torch.empty((stop - start, *full.shape[1:]), dtype=full.dtype, device="meta")
    return full.detach()[start:stop].clone()


def _shard_lora_factors(wrapper: Any, ep_mesh: DeviceMesh, num_experts: int) -> None:
    """Cut peft's ``ParamWrapper`` factors by expert (see the module docstring), in place."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local = num_experts // ep
    for adapter, lora_a in wrapper.lora_A.items():
        rank_r = int(wrapper.r[adapter])
        a = lora_a.weight  # [r*E, in], expert-major
        lora_a.weight = _ep_dtensor(
            a, ep_mesh, Shard(0), _expert_rows(a, rank * local * rank_r, (rank + 1) * local * rank_r)
        )
        b = wrapper.lora_B[adapter].weight  # [out, r*E], expert-minor: column r_i * E + e
        if b.is_meta:
            b_local = torch.empty((b.shape[0], rank_r * local), dtype=b.dtype, device="meta")
        else:
            b_local = b.detach().reshape(b.shape[0], rank_r, num_experts)[
                :, :, rank * local : (rank + 1) * local
            ]
            b_local = b_local.reshape(b.shape[0], rank_r * local).clone()
        wrapper.lora_B[adapter].weight = _ep_dtensor(
            b, ep_mesh, _StridedShard(1, split_factor=rank_r), b_local
        )
    wrapper.num_experts = local


def unsupported_parts(site: ExpertsSite) -> list[str]:
    """Parameters of a site that expert parallelism cannot cut by expert (empty when it can shard it).

    A parameter that every expert shares would need its gradient summed over ``ep`` as well; peft
    wrappers other than ``ParamWrapper`` (LoRA on the fused weights) are not known.
    """
    bad = [f"{name} {tuple(p.shape)}" for name, p in site.core.named_parameters() if name not in site.params]
    wrapper: Any
    for wrapper in wrapper_chain(site.module)[:-1]:
        if not (hasattr(wrapper, "lora_A") and hasattr(wrapper, "parameter_name")):
            bad.append(f"a {type(wrapper).__name__} wrapper")
        elif wrapper.parameter_name not in site.params:
            bad.append(f"LoRA on {wrapper.parameter_name}")
        else:
            known = {f"lora_A.{k}.weight" for k in wrapper.lora_A} | {
                f"lora_B.{k}.weight" for k in wrapper.lora_B
            }
            bad += [
                f"{type(wrapper).__name__}.{n}"
                for n, _ in wrapper.named_parameters()
                if n not in known and not n.startswith("base_layer.")
            ]
    return bad


def shard_experts(site: ExpertsSite, ep_mesh: DeviceMesh) -> None:
    """Cut the site's stacked expert parameters (and LoRA factors) over ``ep_mesh``, in place.

    Preconditions: nothing sharded yet; weights real and identical on every rank (each rank keeps its
    slice, no communication) or on the meta device; ``num_experts`` divisible by the ep size and
    `unsupported_parts` empty (checked by the caller before any change). Mutates the parameters and the
    expert counts of ``site.core`` and its peft wrappers.
    """
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local = site.num_experts // ep
    for name in site.params:
        full = site.core._parameters[name]
        assert full is not None and full.shape[0] == site.num_experts, (site.fqn, name)
        site.core._parameters[name] = _ep_dtensor(
            full, ep_mesh, Shard(0), _expert_rows(full, rank * local, (rank + 1) * local)
        )
    setattr(site.core, site.num_experts_attr, local)
    site.core.__dict__[SHARDED_ATTR] = site  # find_experts still tells the global layout
    for wrapper in wrapper_chain(site.module)[:-1]:
        _shard_lora_factors(wrapper, ep_mesh, site.num_experts)


def _a2a(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = all_to_all_single_autograd(x, out_splits, in_splits, group)
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ``tp`` group.

    Each rank of a ``tp`` group keeps a slice of the rows every rank holds; the gradient of the rows it
    dropped is computed by the other ranks, so the full gradient is the sum.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _pieces(count: int, parts: int) -> list[int]:
    # torch.tensor_split's sizes: the first ``count % parts`` pieces get one row more.
    return [count // parts + (1 if p < count % parts else 0) for p in range(parts)]


class GroupedRowsEP:
    """The exchange of experts called with rows grouped by expert (``EVERY_TOKEN``, ``GROUPED_ROWS``).

    The block hands ``rows [N, H]``, expert ``e``'s rows contiguous and in expert order: ``counts[e]`` of
    them (JetMoE's parallel experts are called with those counts; Llama 4's with ``T`` rows for every
    expert, the counts implied). Rank ``s`` of the ``ep`` group holds experts ``s*L:(s+1)*L``: this rank
    sends it those experts' rows, receives the rows of its own experts from every rank (after exchanging
    the counts), regroups them expert-major, runs the experts' own forward on the local experts (with the
    local counts where the call takes them), and sends the results back (``all_to_all_single``: one
    count exchange and two differentiable exchanges per call).

    The ranks of a ``tp`` group hold the same rows: each first keeps its piece of every expert's rows
    (``tensor_split`` over ``tp``), so no row is computed twice, and the results are gathered back over
    ``tp`` (an all-gather; in backward each rank's piece of the gradient, and the gradient of the rows
    summed over ``tp``).

    Args:
        num_local: Experts per rank.
        ep_mesh: The ``ep`` mesh.
        forward: The experts' original forward (on the local experts).
        tp_mesh: The ``tp`` mesh (the ranks sharing a batch); ``None`` or size 1 without TP.
        takes_counts: Whether ``forward`` takes the per-expert row counts after the rows.
    """

    def __init__(
        self,
        num_local: int,
        ep_mesh: DeviceMesh,
        forward: Callable[..., torch.Tensor],
        tp_mesh: DeviceMesh | None = None,
        *,
        takes_counts: bool,
    ) -> None:
        self.ep_mesh = ep_mesh
        self.forward = forward
        self.num_local = num_local
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.takes_counts = takes_counts

    def __call__(self, rows: torch.Tensor, counts: Any = None) -> torch.Tensor:
        """Send each rank its experts' rows, run the local experts, bring the results back.

        Host syncs: one per call on an accelerator, reading the table of every rank's per-expert counts
        (`_count_table`), since ``all_to_all_single`` takes its split sizes as host integers (as in
        transformers' ``AllToAllEP`` and torchtitan); counts given as a device tensor are gathered as
        they are, not read first. Under TP two: this rank's counts, then the table of the pieces. An
        activation-checkpointing recompute runs the call, and its syncs, again.
        """
        experts = self.num_local * self.ep_mesh.size()
        if counts is None:
            counts = [rows.shape[0] // experts] * experts
        table = None
        if self.tp_mesh is None:
            table = self._count_table(counts, rows.device)
            per_expert = table[self.ep_mesh.get_local_rank()]
        else:  # each tp rank exchanges its own piece: `_exchange` gathers the pieces' table
            per_expert = [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
        assert len(per_expert) == experts and sum(per_expert) == rows.shape[0], (len(per_expert), rows.shape)
        if table is not None:
            return self._exchange(rows, per_expert, table)
        return self._tp_exchange(rows, per_expert)

    def _count_table(self, counts: torch.Tensor | list[int], device: torch.device) -> list[list[int]]:
        """Every ``ep`` rank's per-expert row counts, ``[rank][expert]``: one all-gather, one host read."""
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        with torch.no_grad():
            mine = torch.as_tensor(counts, dtype=torch.int64, device=device).reshape(-1)
            table = torch.empty(ep * mine.numel(), dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(table, mine, group=group)
            return table.view(ep, -1).tolist()

    def _tp_exchange(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        assert self.tp_mesh is not None
        parts, me = self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        pieces = [_pieces(c, parts) for c in per_expert]  # [expert][tp rank]
        starts = [0]
        for c in per_expert:
            starts.append(starts[-1] + c)
        # Row indices of each tp rank's pieces, expert by expert (the same on every rank of the group).
        taken = [
            torch.cat(
                [
                    torch.arange(
                        starts[e] + sum(sizes[:p]), starts[e] + sum(sizes[: p + 1]), device=rows.device
                    )
                    for e, sizes in enumerate(pieces)
                ]
            )
            for p in range(parts)
        ]
        mine = _SumGradOverTP.apply(rows, self.tp_mesh.get_group()).index_select(0, taken[me])
        out = self._exchange(mine, [sizes[me] for sizes in pieces])
        widest = max(len(t) for t in taken)
        padded = (
            torch.cat([out, out.new_zeros(widest - out.shape[0], *out.shape[1:])])
            if widest > out.shape[0]
            else out
        )
        gathered = DTensor.from_local(
            padded.contiguous(),
            self.tp_mesh,
            [Shard(0)],
            shape=torch.Size((parts * widest, *out.shape[1:])),
            stride=padded.contiguous().stride(),
        ).full_tensor()
        # Row r of the input is row (p * widest + its position among p's pieces) of the gathered tensor.
        where = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
        for p, t in enumerate(taken):
            where[t] = torch.arange(p * widest, p * widest + len(t), device=rows.device)
        return gathered.index_select(0, where)

    def _exchange(
        self, rows: torch.Tensor, per_expert: list[int], table: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Send rows (``per_expert`` of each expert) to their experts' ranks, run them, bring them back.

        ``table``: every rank's counts (`_count_table` of ``per_expert`` when None, as under TP, where
        each rank sends its own piece).
        """
        group, ep, local = self.ep_mesh.get_group(), self.ep_mesh.size(), self.num_local
        me = self.ep_mesh.get_local_rank()
        if table is None:
            table = self._count_table(per_expert, rows.device)  # [source][expert]
        send = [sum(per_expert[d * local : (d + 1) * local]) for d in range(ep)]
        from_source = [row[me * local : (me + 1) * local] for row in table]  # [source][local expert]
        recv = [sum(c) for c in from_source]
        received = _a2a(rows, recv, send, group)
        # Received: source-major, then expert; the experts want expert-major rows.
        blocks = [b.split(c) for b, c in zip(received.split(recv), from_source, strict=True)]
        expert_major = torch.cat([blocks[s][j] for j in range(local) for s in range(ep)])
        local_counts = [sum(from_source[s][j] for s in range(ep)) for j in range(local)]
        out = self.forward(expert_major, local_counts) if self.takes_counts else self.forward(expert_major)
        by_expert = [
            o.split([from_source[s][j] for s in range(ep)]) for j, o in enumerate(out.split(local_counts))
        ]
        back = torch.cat([by_expert[j][s] for s in range(ep) for j in range(local)])
        return _a2a(back, send, recv, group)


def install_dispatch(site: ExpertsSite, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
    """Replace ``site.module.forward`` by the token exchange around its own forward, in place.

    Preconditions: `shard_experts` ran on the site. ``tp_mesh``: the ranks holding the same batch (the
    ``tp`` axis, size 1 without TP). Collectives per call: see `GroupedRowsEP` and transformers'
    ``AllToAllEP``.
    """
    module = site.module
    original = module.forward
    exchange: Callable[..., torch.Tensor]
    if site.call is not ExpertsCall.ROUTED:
        exchange = GroupedRowsEP(
            site.num_experts // ep_mesh.size(),
            ep_mesh,
            original,
            tp_mesh,
            takes_counts=site.call is ExpertsCall.GROUPED_ROWS,
        )
    else:
        from transformers.distributed.expert_parallel import AllToAllEP  # `check_expert_parallel` checked

        # AllToAllEP reads the module's forward and its (now local) expert count at construction.
        exchange = AllToAllEP(module, ep_mesh, tp_mesh)

    def forward(*args: Any) -> torch.Tensor:
        with local_parameters(module):
            local_args = [a.to_local() if isinstance(a, DTensor) else a for a in args]
            out = exchange(*local_args)
        return out.to(local_args[0].dtype)

    module.forward = forward
