"""The sizes the CPU runtime's buffer pool works with (light: the runtime's defaults read them)."""

from __future__ import annotations

__all__ = ["GLOO_CHUNK_BYTES", "POOL_MAX_BYTES", "RELEASE_ABOVE_BYTES"]

POOL_MAX_BYTES = 64 << 20
"""Largest buffer `HostBufferPool` keeps; larger ones go back to the allocator when freed.

What a kept buffer saves is a fresh mapping's page faults, in proportion to its size, once per step;
what it costs is its bytes for the whole run, also while idle. For a unit of a few tens of MiB (the
blocks of models up to about 1B parameters) the faults are a measurable share of a CPU step. A unit
of hundreds of MiB (a 128k-vocabulary embedding: 0.5 GiB gathered in bf16, 1 GiB reduced in fp32)
takes seconds of compute per step, against which its faults are noise, while keeping its all-gather
buffer through the backward and its reduce-scatter buffer through the next forward added 0.5 to 0.7
GiB to each rank's peak on the Llama-3.2-1B shape (2 of its layers) over 4 ranks, under mimalloc and
under glibc's tuned thresholds (`benchmarks/bench_scale.py`).
"""

RELEASE_ABOVE_BYTES = 256 << 20
"""A `HostBufferPool` request above this first returns the memory the allocator holds free to the OS.

Such a buffer is a fresh mapping (above `POOL_MAX_BYTES`, and above the block size mimalloc's arenas
serve under the launcher's options), which memory held free cannot serve, so at the collective of a
large unit the two add up: on the Llama-3.2-1B shape over 4 ranks the peak per rank is the tied
embedding's 1 GiB fp32 reduce-scatter at the end of the backward, taken while the activations freed
during that backward are still held. Returning it before every buffer above 64 MiB took that peak
from 3295 to 2925 MiB in one experiment (`benchmarks/bench_scale.py`, SGD, mimalloc with a purge
delay); with this bound the published run measured 3068 MiB. What it costs is faulting that
memory in again where the next step reuses it: bounded by what is held free, and paid only by jobs
with a unit this large, whose steps take seconds per unit. Units of smaller models (tens of MiB, up
to a 100 MiB embedding) never trigger it, so their steps keep the memory they reuse.
"""


GLOO_CHUNK_BYTES = 32 << 20
"""Largest collective buffer handed to gloo in one call by `PooledAllGather` / `PooledReduceScatter`.

gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` allocate a temporary as large as the
whole output (all-gather) or input (reduce-scatter): measured on 2 and 4 CPU ranks, a 256 MiB
all-gather grows a rank's peak by 514 MiB and a 256 MiB reduce-scatter by 320-384 MiB. A tied 128k
vocabulary's embedding (Llama-3.2-1B) is a 0.5 GiB all-gather and, reduced in fp32, a 1 GiB
reduce-scatter. Above this size the collective runs as a sequence of pieces of at most this many
bytes, so the temporaries stay this small; each piece costs one more gloo call (about 0.2 ms), against
seconds for the whole collective at that size.
"""
