"""Check that ``import <package>`` is lean: no CUDA initialisation, no heavy modules, little time.

For every published package of `dependency_graph.ALLOWED_GRAPH`, in fresh interpreters of the
current environment (run it in an environment where every package and every optional dependency is
installed, so that an eager import has something to import):

1. One process imports torch, wraps ``torch.cuda._lazy_init`` (the function every CUDA-initialising
   call goes through), imports the package, and fails if CUDA was initialised or asked to be, or if
   any module of `dependency_graph.HEAVY_MODULES` (torchao, peft, bitsandbytes, megatron_fsdp,
   ``transformers.models.*``) is in ``sys.modules``. The wrapper makes the check meaningful on
   machines without GPUs too.
2. Import time: up to ``--repeats`` fresh processes per package (default 5), each of which times
   ``import torch`` and then ``import <package>`` in the same interpreter; the probes of step 1 are
   the warm-up that fills the bytecode caches. A run's ratio is ``(torch + package) / torch``, the
   time ``import <package>`` takes in a fresh interpreter over the time of ``import torch`` alone.
   Both parts are timed in one process, back to back, so the load of the machine moves them together
   (two separate processes' ``import torch`` differ by 20% on a busy 2-core host, the whole budget).
   A package fails when its best ratio exceeds ``--budget`` (default 1.2). Since the verdict rests on
   the best run, a package stops being timed at its first run within the budget: repeats are spent
   only where load may have hidden a lean import (one run each on a quiet machine, about 3 s a
   package). The table is printed either way, with the largest top-level modules a slow package added.

Usage: ``python tools/check_lean_import.py [--repeats N] [--budget R] [package ...]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dependency_graph import ALLOWED_GRAPH, HEAVY_MODULES, import_name

_PROBE = r"""
import json, sys, traceback
import torch
import torch.cuda
calls = []
_original = torch.cuda._lazy_init
def _recording_lazy_init(*args, **kwargs):
    calls.append("".join(traceback.format_stack(limit=12)[:-1]))
    return _original(*args, **kwargs)
torch.cuda._lazy_init = _recording_lazy_init
before = set(sys.modules)
import importlib
try:
    importlib.import_module(sys.argv[1])
    error = None
except BaseException:
    error = traceback.format_exc()
heavy = tuple(sys.argv[2:])
print(json.dumps({
    "error": error,
    "cuda_initialized": torch.cuda.is_initialized(),
    "lazy_init_calls": calls,
    "heavy": sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy)),
    "new_top_level": sorted({m.split(".")[0] for m in set(sys.modules) - before}),
}))
"""

_TIMER = r"""
import sys, time
start = time.perf_counter()
import torch
middle = time.perf_counter()
__import__(sys.argv[1])
print(middle - start, time.perf_counter() - middle)
"""


def _python(code: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"`import {args[0]}` failed in a fresh interpreter:\n{result.stderr.strip()}")
    return result.stdout.strip().splitlines()[-1]


def probe(module: str) -> list[str]:
    """Import ``module`` after torch in a fresh process; return the lean-import violations."""
    report = json.loads(_python(_PROBE, module, *HEAVY_MODULES))
    problems = []
    if report["error"]:
        problems.append(f"`import {module}` raised:\n{report['error']}")
    if report["cuda_initialized"] or report["lazy_init_calls"]:
        where = report["lazy_init_calls"][0] if report["lazy_init_calls"] else "(no stack recorded)\n"
        problems.append(f"`import {module}` initialises CUDA; first call from:\n{where}")
    if report["heavy"]:
        problems.append(f"`import {module}` imports heavy modules: {', '.join(report['heavy'][:12])}")
    return problems


def time_imports(modules: list[str], repeats: int, budget: float) -> dict[str, list[tuple[float, float]]]:
    """Time ``import torch`` and then ``import <m>`` in one fresh process, up to ``repeats`` times per module.

    Returns, per module, ``(torch seconds, module seconds beyond torch)`` of each run; the rounds are
    interleaved over the modules, and a module leaves the rounds after its first run within ``budget``
    (the verdict is its best run). Precondition: every module was imported once already (`probe`, the
    warm-up that fills the bytecode caches).
    """
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in modules}
    pending = list(modules)
    for _ in range(repeats):
        for module in pending:
            torch_s, module_s = (float(x) for x in _python(_TIMER, module).split())
            samples[module].append((torch_s, module_s))
        pending = [m for m in pending if min((t + m_s) / t for t, m_s in samples[m]) > budget]
    return samples


def main(argv: list[str] | None = None) -> int:
    """Run both checks and print a table; return 1 on any violation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", help="import names (default: every published package)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=1.2, help="allowed (torch + package) / torch")
    args = parser.parse_args(argv)
    modules = args.packages or [import_name(d) for d, node in ALLOWED_GRAPH.items() if node.published]

    failures: list[str] = []
    for module in modules:
        failures.extend(probe(module))

    samples = time_imports(modules, args.repeats, args.budget)
    print(f"\nimport time, best of up to {args.repeats} fresh processes (budget {args.budget:.2f}x torch):")
    print(f"  {'module':<24}{'torch s':>10}{'+ module s':>12}{'ratio':>8}  verdict")
    for module in modules:
        # The run with the smallest ratio: the import's own cost, least disturbed by other load.
        torch_s, module_s = min(samples[module], key=lambda run: run[1] / run[0])
        ratio = (torch_s + module_s) / torch_s
        verdict = "ok" if ratio <= args.budget else "TOO SLOW"
        print(f"  {module:<24}{torch_s:>10.3f}{module_s:>12.3f}{ratio:>8.2f}  {verdict}")
        if ratio > args.budget:
            extra = json.loads(_python(_PROBE, module, *HEAVY_MODULES))["new_top_level"]
            failures.append(
                f"`import {module}` takes {ratio:.2f}x `import torch` (budget {args.budget:.2f}x); top-level "
                f"modules it adds beyond torch: {', '.join(extra[:20]) or '(none)'}"
            )

    if failures:
        print(f"\n{len(failures)} lean-import violation(s):")
        for failure in failures:
            print(f"  - {failure}")
        return 1
    print(f"\nlean import OK: {len(modules)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
