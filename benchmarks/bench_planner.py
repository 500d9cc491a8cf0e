"""The planner's estimated peak per rank (`automodel plan`) against the measured peak, layout by layout.

Each layout is an `automodel train` job on 4 CPU ranks (gloo). The estimate is `plan_report`'s total
for that job; the measurement runs the job's own setup (`automodel_all.cli.train._setup`: mesh,
`apply_model_infrastructure`, loading the initial weights into the shards, AdamW) and one steady-state
training step (AdamW's states are created first by a step on zero gradients, so they exist during the
measured forward and backward, as in every step after the first; then `run_step` and the optimizer
step), each layout in its own launch of fresh ranks under the launcher's CPU defaults (mimalloc
preloaded, the CPU runtime on: `_launch.HOST_SETTINGS[0]`), and takes each rank's peak growth of
resident memory: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS``
before the setup (imports, the process group and a warm-up of the same job on a tiny model are done).
Printed per layout: estimate, measured (largest rank), their ratio, and the largest rank's growth by
phase (setup, AdamW states, each micro-batch's forward and backward, the step) with the bytes the
buffer pool keeps.

The dense model is the embedded default Llama widened to ``MODEL`` (112 M parameters, fp32); the EP
layout uses a Qwen3-MoE of the same width with 8 experts.

    uv run --all-packages python benchmarks/bench_planner.py [--only LAYOUT ...] [--json rows.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

from bench_checkpoint_load import MiB, _status
from bench_checkpoint_load import _reset_peak as _reset_rss

MODEL: dict[str, int] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 10,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
SEQ, GLOBAL_BATCH = 256, 8
RANKS = 4
MODEL_LABEL = "Llama 112M fp32"

LAYOUTS: dict[str, list[str]] = {
    "FSDP2 dp_shard=4": [],
    "HSDP 2x2": ["--dp-replicate", "2"],
    "TP=2 + SP": ["--tp", "2", "--sequence-parallel"],
    "TP=2 (no SP)": ["--tp", "2"],
    "PP=2 1F1B": ["--pp", "2", "--pp-schedule", "1f1b"],
    "CP=2": ["--cp", "2"],
    "LoRA r=16": ["--lora", "--lora-rank", "16"],
    "AC full": ["--activation-checkpointing"],
    "AC selective": ["--set", "distributed.activation_checkpointing=selective"],
    "EP=4 (MoE)": ["--ep", "4", "__moe__"],
}


def _argv(name: str, output: Path, moe_dir: Path) -> list[str]:
    extra = list(LAYOUTS[name])
    base = [
        "--seq-len", str(SEQ), "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "1",
        "--steps", "1", "--output-dir", str(output), "--device", "cpu", "--nproc-per-node", str(RANKS),
    ]  # fmt: skip
    if "__moe__" in extra:
        extra.remove("__moe__")
        base += ["--model", str(moe_dir), "--tokenizer", str(output / "tokenizer")]
        base += ["--set", "model.load_weights=false"]
    else:
        base += ["--set", "model.config_overrides=" + json.dumps(MODEL)]
    return base + extra


def _write_moe(folder: Path) -> None:
    from transformers import Qwen3MoeConfig

    from automodel_all.cli.default_job import DEFAULT_VOCAB_SIZE

    Qwen3MoeConfig(
        **{k: v for k, v in MODEL.items() if k != "intermediate_size"},
        intermediate_size=2048, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
        vocab_size=DEFAULT_VOCAB_SIZE, max_position_embeddings=SEQ, use_cache=False,
    ).save_pretrained(folder)  # fmt: skip


def _jobs(tmp: Path) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Each layout's plain job (as workers receive it) and the planner's estimate (MiB)."""
    from automodel_all.cli.launch import prepare_job
    from automodel_all.cli.main import build_parser, job_from_args
    from automodel_all.cli.plan import plan_report

    moe = tmp / "moe"
    _write_moe(moe)
    jobs, estimates = {}, {}
    for name in LAYOUTS:
        args = build_parser().parse_args(["train", *_argv(name, tmp / "out", moe)])
        _resolved, plain = prepare_job(job_from_args(args))
        jobs[name] = plain
        args = build_parser().parse_args(["plan", *_argv(name, tmp / "out", moe)])
        estimates[name] = plan_report(job_from_args(args), world_size=RANKS)["estimate"].total / MiB
    return jobs, estimates


def _tiny(plain: dict[str, Any], moe: bool) -> dict[str, Any]:
    """The same job on a model a few MiB in size, initialised randomly: it imports what the job uses."""
    import copy

    tiny = copy.deepcopy(plain)
    model = tiny.setdefault("model", {})
    overrides = dict(model.get("config_overrides") or {})
    overrides.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    if moe:
        overrides["moe_intermediate_size"] = 32
    model["config_overrides"] = overrides
    model["load_weights"] = False
    return tiny


class _PhaseMeter:
    """Peak growth (MiB) since ``base`` at named points (and per micro-batch, by forward hooks)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.phases: dict[str, float] = {}
        self.calls = 0

    def mark(self, name: str) -> None:
        self.phases[name] = (_status("VmHWM") - self.base) / MiB

    def before_forward(self, _module: Any, _args: Any) -> None:
        if self.calls:  # a forward starting means the previous micro-batch's backward ended
            self.mark(f"backward {self.calls}")

    def after_forward(self, _module: Any, _args: Any, _out: Any) -> None:
        self.calls += 1
        self.mark(f"forward {self.calls}")


def _pool_bytes(parts: list[Any]) -> int:
    """Bytes the FSDP2 units' `HostBufferPool` objects keep (0 without one)."""
    from automodel_cpu.fsdp_buffer_pool import host_buffer_pools

    pools = {id(pool): pool for part in parts for pool in host_buffer_pools(part)}
    return sum(pool.nbytes for pool in pools.values())


def measure_layout(plain: dict[str, Any], warm: dict[str, Any]) -> dict[str, float]:
    """On each rank: one layout's setup and one steady-state training step; peak growth by phase (MiB).

    Phases (each the peak since the start, so they only grow): ``setup`` (mesh, infrastructure, the
    weights loaded into the shards, AdamW created), ``states`` (AdamW's states made by a step on zero
    gradients, so the measured step is like every later one: the states exist during its forward and
    backward), ``forward k`` / ``backward k`` per micro-batch outside pipelining (the model's forward
    hooks), ``backward`` (the step's forward and backward), ``step`` (AdamW). ``pool`` is what the FSDP2
    buffer pool keeps after the step. The same job on a tiny model runs first, unmeasured: it imports
    what the real job uses (FSDP, DTensor, pipelining) and leaves a few MiB in the allocator.
    """
    import torch
    import torch.distributed as dist

    from automodel_all.cli import train
    from automodel_all.cli.config import build_job
    from automodel_all.cli.steps import ContextParallelism, run_step
    from automodel_all.cli.yaml_source import RawJob

    train._quiet()
    meter = _PhaseMeter(0)
    for measured, plain_job in ((False, warm), (True, plain)):
        job = build_job(RawJob(sections=plain_job))
        if dist.is_initialized():  # the first setup starts the process group
            dist.barrier()
        gc.collect()
        meter = _PhaseMeter(_reset_rss())
        run = train._setup(job)
        meter.mark("setup")
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        for param in params:
            param.grad = torch.zeros_like(param)
        run.optimizer.step()  # creates the states (zero gradients: AdamW's decay moves the weights a hair)
        run.optimizer.zero_grad(set_to_none=True)
        meter.mark("states")
        handles = []
        if run.pipeline is None and measured:
            handles = [
                run.model.register_forward_pre_hook(meter.before_forward),
                run.model.register_forward_hook(meter.after_forward),
            ]
        rows = torch.arange(run.resolved.rows_per_dp_rank)
        run_step(
            run.model if run.pipeline is None else None,
            run.rows.batch(rows, run.device),
            loss_fn=run.loss_fn,
            micro_batch_size=job.train.micro_batch_size,
            strategy=run.strategy,
            pipeline=run.pipeline,
            context_parallel=ContextParallelism(
                run.mesh, run.job.host_runtime, job.parallelism.cp_ulysses_degree
            )
            if run.resolved.layout.cp > 1
            else None,
        )
        meter.mark("backward")
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        meter.mark("step")
        meter.phases["pool"] = _pool_bytes(run.parts) / MiB
        for handle in handles:
            handle.remove()
        del run
        dist.barrier()
    return meter.phases


def measure(layouts: list[str] | None = None) -> list[dict[str, Any]]:
    """Each layout in its own launch of fresh ranks under the launcher's defaults (mimalloc, the pool).

    A fresh job per layout, as a user runs it: mimalloc keeps freed memory for reuse (never returned
    before the rank exits), so a second layout in the same ranks would reuse the first one's memory
    and show less growth. Returns per layout: the estimate, the measured peak of the largest rank
    (MiB), their ratio and the largest rank's growth by phase.
    """
    from _launch import HOST_SETTINGS, launch

    setting = HOST_SETTINGS[0]  # what `automodel train` does by default on CPU
    assert setting.host_allocator == "mimalloc" and setting.cpu_runtime, setting
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        jobs, estimates = _jobs(Path(tmp))
        for name in layouts or list(LAYOUTS):
            plain = jobs[name]
            warm = _tiny(plain, "__moe__" in LAYOUTS[name])
            env = setting.env()
            per_rank = launch(
                measure_layout, RANKS, plain, warm, init_process_group=False, timeout_s=1800, env=env
            )
            worst = max(per_rank, key=lambda phases: phases["step"])
            rows.append(
                {"layout": name, "estimate_mib": estimates[name], "measured_mib": worst["step"],
                 "ratio": estimates[name] / worst["step"], "phases_mib": worst,
                 "allocator": setting.label}
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(LAYOUTS), help="layouts to measure")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    rows = measure(args.only)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"planner estimate vs measured peak per rank, {RANKS} CPU ranks, seq {SEQ}, model {MODEL}")
    print("| layout | estimate (MiB) | measured (MiB) | estimate / measured |")
    print("|---|---|---|---|")
    for row in rows:
        estimate, measured = row["estimate_mib"], row["measured_mib"]
        print(f"| {row['layout']} | {estimate:.0f} | {measured:.0f} | {row['ratio']:.2f} |")
    print(f"\nmeasured under {rows[0]['allocator']}; growth of the largest rank by phase (MiB):")
    for row in rows:
        phases = ", ".join(f"{k} {v:.0f}" for k, v in row["phases_mib"].items())
        print(f"  {row['layout']}: {phases}")


if __name__ == "__main__":
    main()
