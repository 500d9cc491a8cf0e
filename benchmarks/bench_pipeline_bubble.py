"""Pipeline bubble of GPipe, 1F1B and Interleaved 1F1B on CPU ranks, against the schedules' theory.

For each schedule, every pipeline rank measures, over several training steps, the time its stages spend
computing (the stage's ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``,
and the loss) and the step's wall time. The idle fraction ``1 - compute / step`` is the measured bubble
(it also holds the P2P latency and Python overhead). The theoretical bubble of a pipeline of ``p``
ranks running ``m`` microbatches is ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, and
``(p - 1) / (v * m + p - 1)`` for Interleaved 1F1B with ``v`` stages per rank. The table prints both
and their ratio, plus each schedule's step time against GPipe's measured in the same run.

Use one rank per core (the default ``--pp 2`` on a 2-core machine): oversubscribed cores count the time a
rank waits for a core as compute.

    uv run --all-packages python benchmarks/bench_pipeline_bubble.py [--pp 2] [--microbatches 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from _launch import launch
from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

MODEL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 512,  # a small LM head keeps the last stage close to the others
    "max_position_embeddings": 256,
}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))


def theoretical_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The idle fraction of an ideal pipeline with equal stage times and free communication."""
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def _timed(fn: Callable[..., Any], busy: list[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    return wrapper


def measure(microbatches: int, seq_len: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """On every rank: per schedule, the mean idle fraction of this rank and the mean step time."""
    from automodel_mesh import MeshContext, MeshKind, ParallelismSizes
    from automodel_pipelining import AutoPipeline, PipelineConfig

    torch.manual_seed(0)
    ctx = MeshContext.build(MeshKind.FSDP2, ParallelismSizes(pp_size=dist.get_world_size()))
    batch = make_batch(MODEL["vocab_size"], microbatches, seq_len, seed=1)
    rows = []
    for schedule, _v in SCHEDULES:
        config = PipelineConfig(pp_schedule=schedule, pp_batch_size=microbatches, pp_microbatch_size=1)
        pipe = AutoPipeline.from_config(config, ctx).build(
            build_tiny_model("llama", seed=0, **MODEL), loss_fn=causal_lm_loss
        )
        busy = [0.0]
        for stage in pipe.info.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, _timed(getattr(stage, name), busy))
        # The loss on the last stage is compute too (the schedule runs it between chunks).
        pipe.schedule._compute_loss = _timed(pipe.schedule._compute_loss, busy)
        idle, step_times = [], []
        for step in range(warmup + steps):
            dist.barrier()
            busy[0] = 0.0
            start = time.perf_counter()
            pipe.step(batch["input_ids"], target=batch["labels"], position_ids=batch["position_ids"])
            elapsed = time.perf_counter() - start
            for part in pipe.parts:
                part.zero_grad(set_to_none=True)
            if step >= warmup:
                idle.append(1.0 - busy[0] / elapsed)
                step_times.append(elapsed)
        rows.append(
            {
                "schedule": schedule,
                "stages_per_rank": len(pipe.stage_ids),
                "idle": statistics.mean(idle),
                "step_s": statistics.median(step_times),
            }
        )
    return rows


def summarize(pp: int, microbatches: int, seq_len: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Launch `measure` on ``pp`` ranks; per schedule: theory, measured bubble, idle per rank, step time."""
    per_rank = launch(measure, pp, microbatches, seq_len, steps, warmup, timeout_s=1200)
    out = []
    for index, (schedule, _v) in enumerate(SCHEDULES):
        rows = [ranks[index] for ranks in per_rank]
        v = rows[0]["stages_per_rank"]
        out.append(
            {
                "schedule": schedule,
                "v": v,
                "theory": theoretical_bubble(schedule, pp, microbatches, v),
                "measured": statistics.mean(r["idle"] for r in rows),
                "idle": [r["idle"] for r in rows],
                "step_s": max(r["step_s"] for r in rows),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (one per core is best)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rows = summarize(args.pp, args.microbatches, args.seq_len, args.steps, args.warmup)
    print(
        f"\nLlama h{MODEL['hidden_size']} x {MODEL['num_hidden_layers']} layers, seq {args.seq_len}, "
        f"p={args.pp} pipeline ranks, m={args.microbatches} microbatches of 1, {args.steps} timed steps"
    )
    header = (
        f"{'schedule':<18}{'v':>3}{'theory':>9}{'measured':>10}{'ratio':>8}"
        f"{'per-rank idle':>22}{'step s':>9}{'vs gpipe':>10}"
    )
    print(header)
    gpipe_step = rows[0]["step_s"]
    for row in rows:
        ranks = " ".join(f"{idle:.3f}" for idle in row["idle"])
        print(
            f"{row['schedule']:<18}{row['v']:>3}{row['theory']:>9.3f}{row['measured']:>10.3f}"
            f"{row['measured'] / row['theory']:>8.2f}{ranks:>22}{row['step_s']:>9.3f}"
            f"{row['step_s'] / gpipe_step:>10.2f}"
        )


if __name__ == "__main__":
    main()
