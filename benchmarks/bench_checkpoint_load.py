"""Peak memory and time of loading a checkpoint into an FSDP2 meta model, against plain transformers.

A Llama of 124.7M parameters (hidden 768, 12 layers, 12 heads / 4 key-value heads, vocab 32000,
untied, fp32: a 476 MiB safetensors file) is generated once into a temporary folder. Then, in the same
run:

- baseline: one fresh process does ``AutoModelForCausalLM.from_pretrained`` and one SGD step on a
  1 x 32 batch;
- ours: 4 CPU ranks build the model on meta, shard it with ``FSDP2Manager.parallelize``, load it with
  ``load_hf_checkpoint`` (each rank reads only its slices) and take the same step on their own batch.

Memory is each process's peak growth over load + step: ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, minus ``VmRSS`` before (imports and allocator warm-up are done before the
reset). Printed per rank, as a ratio to the baseline, with the load time against ``from_pretrained``.

    uv run --all-packages python benchmarks/bench_checkpoint_load.py [--ranks 4] [--phases]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _launch import HOST_SETTINGS, HostSetting, launch
from automodel_testing import make_batch, save_tiny_checkpoint

MODEL: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
BATCH, SEQ = 1, 32
MiB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; return the RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


class _Meter:
    def __init__(self) -> None:
        gc.collect()
        self.base = _reset_peak()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.phases[phase] = (_status("VmHWM") - self.base) / MiB

    @property
    def peak(self) -> float:
        return (_status("VmHWM") - self.base) / MiB


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], meter: _Meter) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"])
    meter.mark("forward")
    out.loss.backward()
    meter.mark("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    meter.mark("step")
    return float(out.loss.item())


def _time_steps(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def baseline(path: str) -> dict[str, Any]:
    """Plain transformers in one process: from_pretrained, then one SGD step."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    del LlamaForCausalLM  # imported only so the model class is loaded before measuring, as in `ours`
    batch = make_batch(MODEL["vocab_size"], BATCH, SEQ, seed=0)
    torch.set_num_threads(1)
    meter = _Meter()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path)
    load_s = time.perf_counter() - start
    meter.mark("load")
    loss = _step(model, batch, meter)
    return {"peak": meter.peak, "load_s": load_s, "loss": loss, "phases": meter.phases}


def ours(path: str, cpu_runtime: bool, steps: int) -> dict[str, Any]:
    """FSDP2 over all ranks: meta model -> parallelize -> load_hf_checkpoint -> one SGD step.

    ``cpu_runtime``: give `FSDP2Config` ``automodel_cpu.CPURuntime()`` (what ``automodel train`` does on
    CPU; without it FSDP2 is plain torch and glibc's allocator is left alone).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_checkpoint import load_hf_checkpoint
    from automodel_cpu import CPURuntime
    from automodel_distributed.config import FSDP2Config
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_testing import build_tiny_model

    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        host_runtime=CPURuntime() if cpu_runtime else None,
    )
    ctx = MeshContext.build(config, ParallelismSizes())
    assert ctx.device_mesh is not None
    manager = FSDP2Manager(config, ctx.device_mesh)
    build_tiny_model("llama", meta=True)  # import the model classes before measuring
    batch = make_batch(MODEL["vocab_size"], BATCH, SEQ, seed=dist.get_rank())
    dist.barrier()
    meter = _Meter()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = manager.parallelize(build_tiny_model("llama", meta=True, **MODEL))
    report = load_hf_checkpoint(model, path)
    dist.barrier()
    load_s = time.perf_counter() - start
    meter.mark("load")
    loss = _step(model, batch, meter)
    peak = meter.peak
    step_s = _time_steps(model, batch, steps) if steps else 0.0
    return {
        "peak": peak,
        "step_s": step_s,
        "load_s": load_s,
        "loss": loss,
        "phases": meter.phases,
        "bytes_read": report.bytes_read,
    }


def _report(title: str, per_rank: list[dict[str, Any]], base: dict[str, Any], phases: bool) -> None:
    print(title)
    print("rank  peak MiB  ratio  load s  read MiB  step s  loss")
    for rank, r in enumerate(per_rank):
        print(
            f"{rank:>4}  {r['peak']:>8.0f}  {r['peak'] / base['peak']:>5.2f}  {r['load_s']:>6.2f}  "
            f"{r['bytes_read'] / MiB:>8.0f}  {r['step_s']:>6.2f}  {r['loss']:.4f}"
        )
    worst = max(r["peak"] for r in per_rank)
    load = max(r["load_s"] for r in per_rank)
    print(
        f"  max over ranks: peak ratio {worst / base['peak']:.2f} (goal <= 0.5), "
        f"load time ratio {load / base['load_s']:.2f} (goal <= 1.0)"
    )
    if phases:
        for rank, r in enumerate(per_rank):
            print(f"  rank {rank} peak after: " + ", ".join(f"{k} {v:.0f}" for k, v in r["phases"].items()))


def write_checkpoint(folder: Path) -> tuple[Path, float]:
    """Generate the 124.7M-parameter Llama checkpoint into ``folder``; return its path and size in MiB."""
    path = folder / "llama-125m"
    save_tiny_checkpoint("llama", path, seed=0, **MODEL)
    return path, sum(f.stat().st_size for f in path.glob("*.safetensors")) / MiB


def measure_baseline(path: Path) -> dict[str, Any]:
    """Plain transformers in one fresh process (no process group)."""
    (base,) = launch(baseline, 1, str(path), init_process_group=False, timeout_s=1200)
    return dict(base)


def measure_ours(
    path: Path, ranks: int, setting: HostSetting = HOST_SETTINGS[0], steps: int = 0
) -> list[dict[str, Any]]:
    """FSDP2 over ``ranks`` processes under ``setting``; one result per rank."""
    return launch(ours, ranks, str(path), setting.cpu_runtime, steps, timeout_s=1200, env=setting.env())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--phases", action="store_true", help="also print peak growth after each phase")
    parser.add_argument("--steps", type=int, default=0, help="also time this many more steps (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        start = time.perf_counter()
        path, size = write_checkpoint(Path(tmp))
        print(f"checkpoint: {size:.0f} MiB fp32 safetensors, written in {time.perf_counter() - start:.1f} s")
        base = measure_baseline(path)
        print(
            f"transformers from_pretrained + step, 1 process: peak growth {base['peak']:.0f} MiB, "
            f"load {base['load_s']:.2f} s, loss {base['loss']:.4f}"
        )
        if args.phases:
            print("  peak after: " + ", ".join(f"{k} {v:.0f}" for k, v in base["phases"].items()))
        for setting in HOST_SETTINGS:
            per_rank = measure_ours(path, args.ranks, setting, args.steps)
            _report(
                f"FSDP2 x {args.ranks} ranks, load_hf_checkpoint + step ({setting.label}):",
                per_rank,
                base,
                args.phases,
            )


if __name__ == "__main__":
    main()
