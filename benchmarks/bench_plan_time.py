"""How long ``automodel plan`` takes to answer for a 405B model on 1,024 GPUs, against transformers alone.

The issue asks the planner to answer in under 5 s for a 405B model on 1,024 GPUs. Measured as a user
meets it: the wall time of a fresh ``automodel plan`` process (the console script), from start to exit,
for Llama 3.1 405B's widths (a ``config.json`` only: the planner reads no weights) on ``1024xH100`` with
torchtitan's 405B layout (TP 8 with sequence parallelism, PP 8, full activation checkpointing, local
batch 8 of 8,192-token rows in micro-batches of 1). The baseline, in the same rounds, is the least any
planner of a transformers model pays: a fresh process that imports transformers and builds the same
model on the meta device (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` and
transformers' ``no_init_weights``: initialising meta tensors is a no-op a planner need not run), then
exits the same way (``os._exit``: neither process waits for the interpreter's teardown). Beside them,
the same job's ``--suggest``, which ranks every valid layout of the 1,024 GPUs. Rounds of the three,
interleaved, after a warm-up round that fills the bytecode caches; the median of each is kept, and
the CPU time (user + system) beside it.

    uv run --all-packages python benchmarks/bench_plan_time.py [--repeats 5] [--no-suggest]

Where the packages are on ``PYTHONPATH`` without their console scripts (``tools/gpu_check.sh`` on a lent
GPU machine, whose host is the kind users plan from), the plan runs as ``python -m automodel_all.cli``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Llama 3.1 405B (Meta's published config): what the plan reads from the model folder.
LLAMA_405B: dict[str, Any] = {
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
CLUSTER = "1024xH100"
LAYOUT = ("--tp", "8", "--pp", "8", "--sequence-parallel")
JOB = ("--activation-checkpointing", "--seq-len", "8192", "--micro-batch-size", "1")
# torchtitan's 405B job: local batch 8 on each of the 16 data-parallel ranks of TP 8 x PP 8.
BATCH = ("--global-batch-size", "128")
LABEL = "Llama 3.1 405B on 1,024 H100s"

_META_BUILD = (
    "import os, sys, torch\n"
    "from transformers import AutoConfig, AutoModelForCausalLM\n"
    "from transformers.initialization import no_init_weights\n"
    "with torch.device('meta'), no_init_weights():\n"
    "    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))\n"
    "sys.stdout.flush()\n"
    "os._exit(0)\n"
)


def write_model(folder: Path) -> Path:
    """Write the 405B ``config.json`` into ``folder`` (transformers' own ``save_pretrained``)."""
    from transformers import LlamaConfig

    LlamaConfig(**LLAMA_405B).save_pretrained(folder)
    return folder


def _run(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of ``command`` in a fresh process; raises when it fails.

    The process may write bytecode whatever the caller's ``PYTHONDONTWRITEBYTECODE`` says, so that the
    warm-up round fills the caches as a user's first run does (set in a sandbox, it left every timed
    round compiling the workspace's own modules from source).
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{command[0]} exited {proc.returncode}: {tail}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


def commands(model: Path, suggest: bool = True) -> dict[str, list[str]]:
    """The timed commands: ``ours`` (``automodel plan``), ``suggest`` (the same job's ``--suggest``,
    every layout of the cluster's GPUs; left out without ``suggest``) and ``baseline`` (the meta build)."""
    script = Path(sys.executable).parent / "automodel"
    automodel = [str(script)] if script.is_file() else [sys.executable, "-m", "automodel_all.cli"]
    plan = [*automodel, "plan", "--model", str(model), "--cluster", CLUSTER]
    timed = {"ours": [*plan, *JOB, *BATCH, *LAYOUT]}
    if suggest:
        # From the job without a layout (FSDP over all 1,024 GPUs): one row per GPU at least.
        timed["suggest"] = [*plan, *JOB, "--global-batch-size", "1024", "--sequence-parallel", "--suggest"]
    return {**timed, "baseline": [sys.executable, "-c", _META_BUILD, str(model)]}


def measure(repeats: int = 5, suggest: bool = True) -> dict[str, dict[str, Any]]:
    """Median wall and CPU seconds of each command over ``repeats`` interleaved rounds (after a warm-up).

    Returns ``{"ours": {...}, "suggest": {...}, "baseline": {...}}`` (no ``suggest`` without it), each
    with ``wall_s``, ``cpu_s`` (medians) and ``walls`` (every round's wall time).
    """
    with tempfile.TemporaryDirectory() as tmp:
        timed = commands(write_model(Path(tmp)), suggest)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in timed}
        for round_index in range(repeats + 1):
            for name, command in timed.items():
                figures = _run(command)
                if round_index:
                    runs[name].append(figures)
    return {
        name: {
            "wall_s": statistics.median(wall for wall, _ in figures),
            "cpu_s": statistics.median(cpu for _, cpu in figures),
            "walls": [wall for wall, _ in figures],
        }
        for name, figures in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-suggest", action="store_true", help="time the plan and the baseline only")
    args = parser.parse_args()
    result = measure(args.repeats, suggest=not args.no_suggest)
    host = platform.processor() or platform.machine()
    print(f"host: {host}, {os.cpu_count()} cores; Python {platform.python_version()}")
    for name, figures in result.items():
        walls = ", ".join(f"{w:.2f}" for w in figures["walls"])
        print(f"{name:9s} wall {figures['wall_s']:.2f} s (rounds: {walls}), CPU {figures['cpu_s']:.2f} s")
    for name in [n for n in ("ours", "suggest") if n in result]:
        print(f"{LABEL}: {name} / meta build = {result[name]['wall_s'] / result['baseline']['wall_s']:.2f}")


if __name__ == "__main__":
    main()
