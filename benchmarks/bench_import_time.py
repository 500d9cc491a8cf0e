"""Import cost of each published package against ``import torch``, in fresh interpreters.

Measured as the importing process's CPU time (user + system, ``time.process_time``) around
``__import__(name)``, not wall time: on a shared machine, wall time mostly measures how long the
process waited for a core (a busy 2-core host swings it by 2x), while CPU time is the work the import
does. Rounds of fresh processes, each importing torch and then each package, after one warm-up round
that fills the bytecode caches; the smallest figure of each is kept. The `lean_import` session checks
the wall-time budget (1.2x torch) on its own.

    uv run --all-packages python benchmarks/bench_import_time.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from dependency_graph import ALLOWED_GRAPH, import_name

TIMER = "import sys, time; t = time.process_time(); __import__(sys.argv[1]); print(time.process_time() - t)"


def import_cpu_seconds(python: str, module: str, prelude: str = "") -> float:
    """CPU seconds of ``import module`` in a fresh ``python`` process (``prelude`` runs first, untimed)."""
    proc = subprocess.run(
        [python, "-c", prelude + TIMER, module], capture_output=True, text=True, check=False, timeout=600
    )
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-2:])
        raise RuntimeError(f"`import {module}` failed: {tail}")
    return float(proc.stdout.strip().splitlines()[-1])


def best_of(python: str, modules: dict[str, tuple[str, str]], repeats: int) -> dict[str, float]:
    """Smallest CPU seconds per key over ``repeats`` interleaved rounds (after a warm-up round).

    ``modules`` maps a key to ``(module, prelude)``.
    """
    best: dict[str, float] = {}
    for round_index in range(repeats + 1):
        for key, (module, prelude) in modules.items():
            seconds = import_cpu_seconds(python, module, prelude)
            if round_index:
                best[key] = min(best.get(key, seconds), seconds)
    return best


def measure(repeats: int = 3) -> dict[str, float]:
    """Smallest import CPU seconds of torch and of every published package, in this environment."""
    names = [import_name(d) for d, node in ALLOWED_GRAPH.items() if node.published]
    return best_of(sys.executable, {m: (m, "") for m in ["torch", *names]}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    best = measure(args.repeats)
    torch_s = best.pop("torch")
    print(f"import torch: {torch_s:.3f} CPU s (smallest of {args.repeats})")
    for module, seconds in best.items():
        print(f"import {module:<24} {seconds:.3f} CPU s  {seconds / torch_s:.2f}x torch")


if __name__ == "__main__":
    main()
