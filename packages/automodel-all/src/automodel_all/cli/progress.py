"""Rank 0's progress bar: loss, tokens per second, MFU on GPUs, and memory (RSS on CPU, peak on CUDA)."""

from __future__ import annotations

import os
import resource
import sys

import torch

__all__ = ["Progress", "memory_gib", "warn"]


def warn(message: str) -> None:
    """Print a warning of the worker (stderr, flushed; the ``warnings`` module may be routed to logging)."""
    print(f"automodel train: warning: {message}", file=sys.stderr, flush=True)


def memory_gib(device: torch.device) -> float:
    """Current resident memory of this process on CPU, peak CUDA allocation on GPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:  # no procfs (macOS): peak RSS, which ru_maxrss gives in bytes there
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30


class Progress:
    """A tqdm bar on rank 0 (a no-op elsewhere); the postfix shows the latest step's figures."""

    def __init__(self, *, total: int, initial: int, enabled: bool, device: torch.device) -> None:
        self._device = device
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, *, loss: float, tokens_per_s: float, mfu: float | None = None) -> None:
        """Advance one step (``mfu`` shown when known: on a GPU of the planner's table)."""
        if self._bar is None:
            return
        memory = "rss" if self._device.type == "cpu" else "cuda max"
        utilization = f" mfu={mfu:.1%}" if mfu is not None else ""
        self._bar.set_postfix_str(
            f"loss={loss:.4f} tok/s={tokens_per_s:,.0f}{utilization} "
            f"{memory}={memory_gib(self._device):.2f}GiB",
            refresh=False,
        )
        self._bar.update(1)

    def write(self, line: str) -> None:
        """Print a line above the bar (rank 0)."""
        if self._bar is not None:
            self._bar.write(line)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
