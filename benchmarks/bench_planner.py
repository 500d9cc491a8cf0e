"""The planner's estimated peak per rank (`automodel plan`) against the measured peak, layout by layout.

Each layout is an `automodel train` job on 4 CPU ranks (gloo). The estimate is `plan_report`'s total
for that job; the measurement runs the job's own setup (`automodel_all.cli.train._setup`: mesh,
`apply_model_infrastructure`, loading the initial weights into the shards, AdamW) and one training step
(`run_step`, the optimizer step) in ONE launch of 4 ranks for all layouts, and takes each rank's peak
host-memory growth: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS``
before the layout (imports and the process group are already up; freed memory is handed back to the
OS with ``malloc_trim`` between layouts). Printed per layout: estimate, measured (largest rank) and
their ratio.

The dense model is the embedded default Llama widened to ``MODEL`` (53 M parameters, fp32); the EP
layout uses a Qwen3-MoE of the same width with 8 experts. That is below the issue's 100M-1B: the
shared 2-core machine runs all layouts in a few minutes only at this size.

    uv run --all-packages python benchmarks/bench_planner.py
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

from bench_checkpoint_load import MiB, _status
from bench_checkpoint_load import _reset_peak as _reset_rss

MODEL: dict[str, int] = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}
SEQ, GLOBAL_BATCH = 256, 8
RANKS = 4

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


def _reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed pages back, so the next layout's growth shows
    return _reset_rss()


def measure_layouts(jobs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """On each rank: every layout's setup + one step; return its peak growth per layout (MiB)."""
    import torch.distributed as dist

    from automodel_all.cli import train
    from automodel_all.cli.config import build_job
    from automodel_all.cli.steps import run_step
    from automodel_all.cli.yaml_source import RawJob

    train._quiet()
    peaks: dict[str, float] = {}
    first = next(iter(jobs))
    # The first setup imports torch's FSDP, DTensor and pipelining modules: run it once unmeasured.
    for name, plain in [("warm-up", jobs[first]), *jobs.items()]:
        job = build_job(RawJob(sections=plain))
        if dist.is_initialized():  # the first setup starts the process group
            dist.barrier()
        base = _reset_peak()
        run = train._setup(job)
        import torch

        rows = torch.arange(run.resolved.rows_per_dp_rank)
        run_step(
            run.model if run.pipeline is None else None,
            run.rows.batch(rows, run.device),
            loss_fn=run.loss_fn,
            micro_batch_size=job.train.micro_batch_size,
            strategy=run.strategy,
            pipeline=run.pipeline,
            cp_mesh=run.mesh if run.resolved.layout.cp > 1 else None,
        )
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        peaks[name] = (_status("VmHWM") - base) / MiB
        del run
        dist.barrier()
    peaks.pop("warm-up")
    return peaks


def measure() -> list[dict[str, Any]]:
    """Every layout: the estimate and the measured peak of the largest rank (MiB), with their ratio."""
    from _launch import launch

    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        jobs, estimates = _jobs(Path(tmp))
        per_rank = launch(measure_layouts, RANKS, jobs, init_process_group=False, timeout_s=1800)
    rows = []
    for name in LAYOUTS:
        measured = max(rank[name] for rank in per_rank)
        rows.append(
            {"layout": name, "estimate_mib": estimates[name], "measured_mib": measured,
             "ratio": estimates[name] / measured}
        )  # fmt: skip
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = measure()
    print(f"planner estimate vs measured peak per rank, {RANKS} CPU ranks, seq {SEQ}, model {MODEL}")
    print("| layout | estimate (MiB) | measured (MiB) | estimate / measured |")
    print("|---|---|---|---|")
    for row in rows:
        estimate, measured = row["estimate_mib"], row["measured_mib"]
        print(f"| {row['layout']} | {estimate:.0f} | {measured:.0f} | {row['ratio']:.2f} |")


if __name__ == "__main__":
    main()
