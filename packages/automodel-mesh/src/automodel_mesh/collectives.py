"""`Collective`: one kind of collective a layout issues per optimizer step, as the planner's terms state it.

Each package that issues collectives states them through its planner term (``collectives(facts)``): the
axis whose groups carry it (`MeshLayout.group` says how its ranks lie on the nodes), the bytes one
rank sends per call with the ring algorithm's factor applied, the calls per optimizer step, the NCCL
operations each call is made of (each pays a latency) and what it hides behind (`Overlap`). A term's
traffic is the sum of its collectives (`traffic_of`); the planner's time model applies the overlap rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import NamedTuple, Protocol

__all__ = ["Collective", "NodeFanout", "Overlap", "traffic_of"]


class NodeFanout(Protocol):
    """How an all-to-all that crosses the network once per destination node spreads its data.

    Such a dispatch (DeepEP's) sends each unit once to every node holding one of its destinations and
    forwards it to those ranks over NVLink there, instead of once per destination rank.
    """

    def network_share(self, ranks_per_node: int) -> float:
        """The copies crossing the network per copy sent to another rank.

        For a group laid ``ranks_per_node`` consecutive ranks to a node.
        """
        ...


class Overlap(StrEnum):
    """What a collective can run beside, on its own stream, in torch's implementation."""

    FORWARD = "forward"
    """Prefetched while the previous unit computes its forward (FSDP2's all-gathers)."""
    BACKWARD = "backward"
    """Issued as backward produces gradients and hidden behind the backward still to run (FSDP2's
    reduce-scatter and HSDP's all-reduce per unit, DDP's buckets); the last unit's is exposed."""
    RING_STEP_FORWARD = "ring step, forward"
    """Hidden behind one step of ring attention in forward (a ``1 / cp`` of its block's attention), call
    by call: torch's ring attention gathers K/V as its first (local) step starts and waits for them
    when it ends."""
    RING_STEP_BACKWARD = "ring step, backward"
    """The same in backward: each step's K/V gradients travel to the next rank while the next step
    computes (and the K/V, gathered again, during the first step)."""
    AFTER_LAST_BACKWARD = "after the stage's last backward"
    """Issued once a pipeline stage has run its last backward, and waited for at once: torch's pipeline
    stages keep FSDP's gradients unsharded over the micro-batches and reduce them only then (the
    schedule's ``REDUCE_GRAD`` and, right after it, ``WAIT_REDUCE_GRAD``; ``post_backward`` and
    ``_root_post_backward_final_callback`` in ``backward_maybe_with_nosync`` in earlier releases). No
    compute of the rank runs beside it; only the schedule's drain, while the ranks before it finish
    their backward, leaves idle time it can fill."""
    EXPOSED = "exposed"
    """On the critical path: the next op needs its result (TP's all-reduces or all-gather/reduce-
    scatter pairs, EP's dispatch and combine, a pipeline stage's send/receive)."""


class Collective(NamedTuple):
    """One collective of a layout: ``calls`` per optimizer step of ``bytes_per_call`` each over ``axis``."""

    name: str
    axis: str
    """The mesh axis whose groups carry it (``"world"`` for DDP's single group)."""
    bytes_per_call: float
    """Bytes one rank sends per call (ring factors applied)."""
    calls: float
    """Calls per optimizer step on the rank."""
    overlap: Overlap
    pattern: str = "ring"
    """How the bytes move: ``ring`` (all-gather, reduce-scatter, all-reduce: every byte passes every
    rank), ``all_to_all`` (each rank sends to each other one directly) or ``p2p`` (to a neighbour)."""
    node_fanout: NodeFanout | None = None
    """An ``all_to_all`` that crosses the network once per destination node and forwards inside it: its
    NVLink carries every copy (``bytes_per_call``), the network `NodeFanout.network_share` of them.
    None: each copy travels straight to its rank, evenly over the group's ranks."""
    operations: float = 1.0
    """NCCL operations one call is made of (``bytes_per_call`` is their sum), each paying NCCL's
    latency: an FSDP unit's all-gather, a DDP bucket's all-reduce."""
    all_reduce: bool = False
    """Each operation is an all-reduce (NCCL runs twice a gather's ring steps, or a tree across nodes)."""

    @property
    def total(self) -> float:
        """Bytes per step."""
        return self.bytes_per_call * self.calls


def traffic_of(collectives: Iterable[Collective]) -> dict[str, int]:
    """Bytes per step by collective name (entries of one name summed)."""
    totals: dict[str, float] = {}
    for collective in collectives:
        totals[collective.name] = totals.get(collective.name, 0.0) + collective.total
    return {name: int(total) for name, total in totals.items()}
