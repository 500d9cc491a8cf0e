"""Checkpoint saves at scale: asynchronous DCP saves and the export every rank writes, against baselines.

Two measurements, each against a baseline from the same run:

- ``async``: a Llama of 124.7M parameters (`bench_checkpoint_load.MODEL`, fp32) with AdamW state, FSDP2
  over 1 and over ``RANKS`` gloo ranks (1 rank leaves a core free for the background write, as a GPU
  node's host cores are while the GPUs compute; 4 ranks on 2 cores leave none). Per save, the time
  the training loop is held: a synchronous ``save_distributed_checkpoint`` (baseline),
  `AsyncCheckpointer.save`, and the bare copy of the rank's state to host memory that the asynchronous
  save cannot avoid (DCP's staging alone, just before it); then the step time while a save is being
  written against the step time with none in flight (steps interleaved).
- ``export``: real widths with random bf16 weights (`bench_scale.MODELS`: the Llama-3.2-1B shape under
  FSDP2, Qwen3-30B-A3B widths with 64 experts under EP x FSDP2), ``save_hf_checkpoint`` into files of
  `SHARD` with every rank writing against one writer (rank 0, the serial export), alternated and
  repeated, each into a new folder (in both, a tensor moves only onto the rank that writes it); the
  peak growth of each rank's resident memory during the export (over its shards, already resident), in
  units of the largest tensor.

On this CPU host, the ranks, the writer threads and the disk share 2 cores: the ratios say how the
mechanisms behave here, not what a GPU node gives (there staging is a device-to-host copy into pinned
memory and the writes overlap GPU compute).

    uv run --all-packages python benchmarks/bench_checkpoint_save.py [--only async export] [--repeats 3]
        [--async-ranks 1 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _launch import launch
from bench_checkpoint_load import MODEL, MiB, _Meter
from bench_scale import MODELS, _config, infrastructure, sharded_model

RANKS = 4
SHARD = "300MB"
"""File size of the exports: 8 files of a 2.4 GB model, as a 70B model makes 30 of 5 GB (with the default
5 GB, a 1B model is one file, which one rank writes however many ranks there are)."""
STEPS_BETWEEN = 4  # steps with no save in flight, between two measured saves


def _llama_fsdp2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_checkpoint import initialize_model_weights
    from automodel_distributed.config import FSDP2Config
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_testing import build_tiny_model

    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    )
    ctx = MeshContext.build(config, ParallelismSizes())
    assert ctx.device_mesh is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP2Manager(config, ctx.device_mesh).parallelize(
            build_tiny_model("llama", meta=True, **MODEL)
        )
    initialize_model_weights(model, "cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def async_saves(root: str, repeats: int) -> dict[str, Any]:
    """One rank: blocking time per save (sync, async, staging alone) and step times with/without a save."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from automodel_checkpoint import AsyncCheckpointer, save_distributed_checkpoint
    from automodel_checkpoint.dcp import checkpoint_state

    model, opt = _llama_fsdp2()
    ids = torch.randint(
        0, MODEL["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    _step(model, opt, ids)  # the optimizer state exists from here on
    out: dict[str, list[float]] = {"sync": [], "async": [], "staging": [], "idle_step": [], "busy_step": []}
    with AsyncCheckpointer() as checkpointer:
        for i in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            save_distributed_checkpoint(model, opt, f"{root}/sync_{i}", step=i, overwrite=True)
            out["sync"].append(time.perf_counter() - start)
            out["idle_step"] += [_step(model, opt, ids) for _ in range(STEPS_BETWEEN)]
            dist.barrier()
            start = time.perf_counter()  # in the memory state of the async save that follows
            FileSystemWriter(f"{root}/unused").stage(checkpoint_state(model, opt))
            out["staging"].append(time.perf_counter() - start)
            dist.barrier()
            checkpointer.save(model, opt, f"{root}/async_{i}", step=i, overwrite=True)
            out["async"].append(checkpointer.last_blocking_s)
            while checkpointer.in_flight:  # every rank steps until its own write is done
                out["busy_step"].append(_step(model, opt, ids))
            checkpointer.wait()
    return {**out, "bytes": sum(s.stat().st_size for s in Path(f"{root}/sync_0").rglob("*") if s.is_file())}


def _export_model(name: str) -> torch.nn.Module:
    from automodel_checkpoint import initialize_model_weights

    mesh, infra = infrastructure(name)
    model = sharded_model(_config(MODELS[name]), mesh, infra)
    initialize_model_weights(model, "cpu")
    return model


def _largest_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's largest full tensor."""
    return max(t.numel() * t.element_size() for t in model.state_dict().values())


def exports(name: str, root: str, repeats: int) -> dict[str, Any]:
    """One rank: export time and peak memory growth, every rank writing vs one writer, alternated."""
    from automodel_checkpoint import save_hf_checkpoint

    model = _export_model(name)
    out: dict[str, Any] = {"largest": _largest_bytes(model)}
    for _ in range(repeats):
        for label, writers in (("parallel", None), ("serial", 1)):
            folder = Path(root) / label
            if dist.get_rank() == 0:  # a new folder each time: removing the last one is not timed
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            meter = _Meter()
            start = time.perf_counter()
            save_hf_checkpoint(model, folder, max_shard_size=SHARD, writers=writers)
            out.setdefault(label, []).append(time.perf_counter() - start)
            out.setdefault(f"{label}_peak", []).append(meter.peak * MiB)
    out["bytes"] = sum(f.stat().st_size for f in (Path(root) / "parallel").glob("*.safetensors"))
    return out


def measure_async(ranks: int = RANKS, repeats: int = 3, folder: Path | None = None) -> dict[str, Any]:
    """`async_saves` on ``ranks`` ranks, summarized (`summarize_async`)."""
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-async-", dir=folder) as tmp:
        per_rank = launch(async_saves, ranks, tmp, repeats, timeout_s=3600)
    return {**summarize_async(per_rank), "ranks": ranks}


def summarize_async(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The slowest rank's median of each figure (the loop waits for the slowest rank)."""
    median = {k: max(statistics.median(r[k]) for r in per_rank) for k in ("sync", "async", "staging")}
    steps = {k: statistics.median([t for r in per_rank for t in r[k]]) for k in ("idle_step", "busy_step")}
    busy = sum(len(r["busy_step"]) for r in per_rank) / len(per_rank)
    return {
        **median,
        **steps,
        "busy_steps_per_save": busy / len(per_rank[0]["sync"]),
        "bytes": per_rank[0]["bytes"],
    }


def measure_exports(repeats: int = 2, folder: Path | None = None) -> dict[str, dict[str, Any]]:
    """Per model: the slowest rank's median export time per mode and the largest rank's peak growth."""
    results = {}
    for name in MODELS:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-export-", dir=folder) as tmp:
            per_rank = launch(exports, RANKS, name, tmp, repeats, timeout_s=3600)
        summary: dict[str, Any] = {"bytes": per_rank[0]["bytes"], "label": MODELS[name].label}
        for mode in ("parallel", "serial"):
            summary[mode] = statistics.median(max(r[mode][i] for r in per_rank) for i in range(repeats))
            summary[f"{mode}_peak"] = max(max(r[f"{mode}_peak"]) for r in per_rank)
        summary["largest"] = per_rank[0]["largest"]
        results[name] = summary
    return results


def _print_async(r: dict[str, Any]) -> None:
    print(
        f"asynchronous DCP saves, {r['ranks']} rank(s) on {os.cpu_count()} cores, "
        f"{r['bytes'] / MiB:.0f} MiB per checkpoint (model + AdamW)"
    )
    print(
        f"  blocking per save: sync {r['sync']:.2f} s, async {r['async']:.2f} s "
        f"(ratio {r['async'] / r['sync']:.2f})"
    )
    print(
        f"  async blocking / staging copy alone ({r['staging']:.2f} s): {r['async'] / r['staging']:.2f} "
        "(goal <= 1.2)"
    )
    print(
        f"  step with a save in flight {r['busy_step']:.3f} s vs none {r['idle_step']:.3f} s: ratio "
        f"{r['busy_step'] / r['idle_step']:.2f} (goal <= 1.10); {r['busy_steps_per_save']:.1f} steps per save"
    )


def _print_exports(results: dict[str, dict[str, Any]]) -> None:
    for r in results.values():
        print(f"HF export, {r['label']}, {r['bytes'] / MiB:.0f} MiB")
        print(
            f"  every rank writing {r['parallel']:.2f} s vs one writer {r['serial']:.2f} s: ratio "
            f"{r['parallel'] / r['serial']:.2f} (goal <= 0.35)"
        )
        print(
            f"  peak growth of a rank's memory over its shards: every rank writing "
            f"{r['parallel_peak'] / MiB:.0f} MiB ({r['parallel_peak'] / r['largest']:.2f} x the largest "
            f"tensor, {r['largest'] / MiB:.0f} MiB), one writer {r['serial_peak'] / MiB:.0f} MiB "
            f"({r['serial_peak'] / r['largest']:.2f} x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", nargs="+", choices=("async", "export"), default=("async", "export"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-ranks", type=int, nargs="+", default=(1, RANKS))
    args = parser.parse_args()
    for ranks in args.async_ranks if "async" in args.only else ():
        _print_async(measure_async(ranks, args.repeats))
    if "export" in args.only:
        _print_exports(measure_exports(args.repeats))


if __name__ == "__main__":
    main()
