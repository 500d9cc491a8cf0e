"""Pipeline bubble of GPipe, 1F1B and Interleaved 1F1B on CPU ranks, against the schedules' theory.

What is measured, per schedule and per pipeline rank, over several training steps:

- **step**: the pipeline's wall time of one ``AutoPipeline.step``: from a common start (after a barrier)
  to the end of the last rank's step (a step is done when every rank is; the clock is the host's
  monotonic clock, the same in every rank's process);
- **compute**: the time the rank spends in its own stages' compute: the stages' ``forward_one_chunk``,
  ``backward_one_chunk`` and ``backward_weight_one_chunk`` and the loss;
- **idle** = step - compute: everything that is not this rank's compute. It splits into
  - *p2p wait*: blocked in the schedule's waits on its gloo sends and receives (``_wait_batch_p2p``):
    waiting for a peer's data (the bubble proper) plus the transfer itself;
  - *p2p post*: issuing the sends and receives (``_batch_p2p``);
  - *other*: the schedule's own Python between ops, and, on the rank that finishes first, the time
    until the last rank is done.

The theoretical idle time is the textbook bubble applied to the same compute time: ``(p - 1) / m``
times compute for GPipe and 1F1B with ``p`` ranks and ``m`` microbatches, ``(p - 1) / (v m)`` for
Interleaved 1F1B with ``v`` stages per rank (equal stages, free communication). The ratio
measured / theory is the figure; 1.0 is an ideal pipeline.

Communication is a real cost that the textbook leaves out, so it is also shown on its own: the one-way
time of one stage-to-stage message (the activations of one microbatch) measured by a gloo ping-pong in
the same job, and the idle that a replay of the schedule's op order predicts with the measured op
times and that message time (``model``), next to the replay without communication (``model, no
comm``), and the replay with each op's own time in each step (``own ops``): the replay with median
times shows the stages' imbalance, the one with each step's own times adds what the step-to-step
variation of op times costs (on a shared host, its jitter: an op late on one rank idles the other),
and the measured idle above that is the runtime's own overhead (transfers, waits, Python).

Use one rank per core (``--pp 2`` on a 2-core machine): oversubscribed cores count the time a rank
waits for a core as compute.

    uv run --all-packages python benchmarks/bench_pipeline_bubble.py [--pp 2] [--microbatches 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
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
# The same layers under a Llama-3-8B-like LM head: 2.4 layers of matmul work (6800 x 256 against a
# layer's 724,992 elements), the case `balance_stages` is for.
HEAVY_HEAD_MODEL = {**MODEL, "vocab_size": 6800}
BALANCE_STEPS = 8  # timed steps of each split: a 2-3% difference needs more than the schedules' 3-5
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def theoretical_idle_per_compute(p: int, m: int, v: int) -> float:
    """Idle time per unit of compute of an ideal pipeline: ``(p - 1) / (v m)`` (``v = 1``: GPipe, 1F1B)."""
    return (p - 1) / (v * m)


class _Recorder:
    """Timestamps of one rank's compute and P2P calls during a step (outermost calls only)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[Any, ...], float, float]] = []  # (kind, label, start, end)
        self._depth: dict[str, int] = defaultdict(int)

    def wrap(
        self, fn: Callable[..., Any], kind: str, label: Callable[..., tuple[Any, ...]]
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._depth[kind] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self._depth[kind] -= 1
                if self._depth[kind] == 0:
                    self.events.append((kind, label(*args, **kwargs), start, end))

        return wrapper

    def total(self, kind: str) -> float:
        return sum(end - start for k, _, start, end in self.events if k == kind)


def _instrument(pipe: Any, recorder: _Recorder) -> list[Callable[[], None]]:
    """Time the stages' compute, the loss and torch's P2P helpers; return the undo callbacks."""
    from torch.distributed.pipelining import schedules as torch_schedules

    undo: list[Callable[[], None]] = []
    for stage in pipe.info.stages:
        for name in COMPUTE:
            kind = {"forward_one_chunk": "F", "backward_one_chunk": "B"}.get(name, "W")

            def label(mb: int, *_: Any, _s: int = stage.stage_index, _k: str = kind, **__: Any) -> tuple:
                return (_s, _k, mb)

            setattr(stage, name, recorder.wrap(getattr(stage, name), "compute", label))
    schedule = pipe.schedule
    schedule._compute_loss = recorder.wrap(schedule._compute_loss, "compute", lambda *a, **k: ("loss",))
    undo.append(lambda: delattr(schedule, "_compute_loss"))
    for name, kind in (("_batch_p2p", "post"), ("_wait_batch_p2p", "wait")):
        original = getattr(torch_schedules, name)
        setattr(torch_schedules, name, recorder.wrap(original, kind, lambda *a, **k: ()))
        undo.append(functools.partial(setattr, torch_schedules, name, original))
    return undo


def _one_way_message_s(shape: tuple[int, ...], rounds: int = 20) -> float:
    """One-way time of one activation message between ranks 0 and 1 (gloo ping-pong, median)."""
    buf = torch.zeros(shape)
    rank = dist.get_rank()
    times = []
    for _ in range(rounds + 2):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[2:])


def measure(microbatches: int, seq_len: int, steps: int, warmup: int) -> dict[str, Any]:
    """On every rank: per schedule, the timestamps of its steps; plus the one-way message time."""
    from automodel_mesh import MeshContext, MeshKind, ParallelismSizes
    from automodel_pipelining import AutoPipeline, PipelineConfig

    torch.manual_seed(0)
    ctx = MeshContext.build(MeshKind.FSDP2, ParallelismSizes(pp_size=dist.get_world_size()))
    batch = make_batch(MODEL["vocab_size"], microbatches, seq_len, seed=1)
    out: dict[str, Any] = {"message_s": _one_way_message_s((1, seq_len, MODEL["hidden_size"]))}
    for schedule in SCHEDULES:
        config = PipelineConfig(pp_schedule=schedule, pp_batch_size=microbatches, pp_microbatch_size=1)
        pipe = AutoPipeline.from_config(config, ctx).build(
            build_tiny_model("llama", seed=0, **MODEL), loss_fn=causal_lm_loss
        )
        recorder = _Recorder()
        undo = _instrument(pipe, recorder)
        steps_out = []
        for step in range(warmup + steps):
            recorder.events.clear()
            start, end = _timed_step(pipe, batch)
            if step >= warmup:
                steps_out.append({"start": start, "end": end, "events": list(recorder.events)})
        for fn in undo:
            fn()
        out[schedule] = {
            "stage_ids": list(pipe.stage_ids),
            "steps": steps_out,
        }
    out["balance"] = _measure_balance(ctx, microbatches, seq_len, BALANCE_STEPS, warmup)
    return out


def _measure_balance(ctx: Any, microbatches: int, seq_len: int, steps: int, warmup: int) -> dict[str, Any]:
    """1F1B on the heavy-head model with the layers split evenly and by cost: steps and layers per rank."""
    from automodel_pipelining import AutoPipeline, PipelineConfig

    batch = make_batch(HEAVY_HEAD_MODEL["vocab_size"], microbatches, seq_len, seed=1)
    out: dict[str, Any] = {}
    # Alternate the two splits step by step so that a slow spell of the host weighs on both alike.
    pipes = {}
    for balance in (False, True):
        config = PipelineConfig(
            pp_schedule="1f1b", pp_batch_size=microbatches, pp_microbatch_size=1, balance_stages=balance
        )
        pipes[balance] = AutoPipeline.from_config(config, ctx).build(
            build_tiny_model("llama", seed=0, **HEAVY_HEAD_MODEL), loss_fn=causal_lm_loss
        )
        layers = {n.split(".")[2] for n, _ in pipes[balance].parts[0].named_parameters() if ".layers." in n}
        out[balance] = {"layers": len(layers), "steps": []}
    for step in range(warmup + steps):
        for balance, pipe in pipes.items():
            timed = _timed_step(pipe, batch)
            if step >= warmup:
                out[balance]["steps"].append(timed)
    return out


def _timed_step(pipe: Any, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """One training step of ``pipe`` from a barrier; its start and end on the host's clock."""
    dist.barrier()
    start = time.perf_counter()
    pipe.step(batch["input_ids"], target=batch["labels"], position_ids=batch["position_ids"])
    end = time.perf_counter()
    for part in pipe.parts:
        part.zero_grad(set_to_none=True)
    return start, end


def _replay(
    orders: list[list[tuple[int, str, int]]],
    durations: dict[tuple[int, ...], float],
    num_stages: int,
    message_s: float,
) -> list[float]:
    """Each rank's idle per step when it runs its ops in torch's order with these op times.

    ``durations`` gives an op's time by ``(stage, kind, microbatch)`` or, for every microbatch, by
    ``(stage, kind)``.

    An op starts when its rank is free and its input is there: a forward after the previous stage's
    forward of that microbatch, a backward after the next stage's backward (its input-gradient half
    for zero-bubble schedules); an input from another rank arrives ``message_s`` later.
    """
    rank_of = {stage: r for r, order in enumerate(orders) for stage, _, _ in order}
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    position = [0] * len(orders)
    while any(position[r] < len(o) for r, o in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                stage, kind, mb = order[position[r]]
                dep = (stage - 1, "F", mb) if kind == "F" else (stage + 1, "B", mb) if kind == "B" else None
                if dep is not None and not 0 <= dep[0] < num_stages:
                    dep = None
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (message_s if rank_of[dep[0]] != r else 0.0)
                start = max(free[r], ready)
                took = durations.get((stage, kind, mb), durations.get((stage, kind), 0.0))
                free[r] = start + took
                busy[r] += took
                done[(stage, kind, mb)] = free[r]
                position[r] += 1
                progressed = True
        assert progressed, (
            f"the op order cannot run: next {[o[i : i + 1] for o, i in zip(orders, position, strict=True)]}"
        )
    makespan = max(free)
    return [makespan - b for b in busy]


def summarize(pp: int, microbatches: int, seq_len: int, steps: int, warmup: int) -> dict[str, Any]:
    """Launch `measure` on ``pp`` ranks and analyse it.

    Returns:
        ``{"schedules": analyze(...), "balance": analyze_balance(...)}``: per schedule, theory, measured
        idle and its parts and the replays; and the heavy-head model's step split evenly and by cost.
        Times are per step (seconds), the mean over the timed steps; per-rank lists are in rank order.
    """
    per_rank = launch(measure, pp, microbatches, seq_len, steps, warmup, timeout_s=1200)
    return {"schedules": analyze(per_rank, microbatches), "balance": analyze_balance(per_rank)}


def analyze_balance(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The heavy-head model's 1F1B step, layers split evenly and by cost (`PipelineConfig.balance_stages`).

    A step's time is the pipeline's: from the earliest rank's start to the last rank's end.

    Returns:
        ``layers_even`` / ``layers_balanced``: decoder layers per rank; ``step_even_s`` /
        ``step_balanced_s``: median step time; ``ratio``: balanced / even.
    """
    out: dict[str, Any] = {}
    for balance, name in ((False, "even"), (True, "balanced")):
        ranks = [r["balance"][balance] for r in per_rank]
        out[f"layers_{name}"] = [r["layers"] for r in ranks]
        out[f"step_{name}_s"] = statistics.median(
            max(end for _, end in per_step) - min(start for start, _ in per_step)
            for per_step in zip(*(r["steps"] for r in ranks), strict=True)
        )
    out["ratio"] = out["step_balanced_s"] / out["step_even_s"]
    return out


def analyze(per_rank: list[dict[str, Any]], microbatches: int) -> list[dict[str, Any]]:
    """`summarize` from what `measure` returned on each rank."""
    pp = len(per_rank)
    steps = len(per_rank[0][SCHEDULES[0]]["steps"])
    message_s = per_rank[0]["message_s"]
    out = []
    for schedule in SCHEDULES:
        ranks = [r[schedule] for r in per_rank]
        v = len(ranks[0]["stage_ids"])
        num_stages = v * pp
        parts: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in range(pp)])
        op_times: dict[tuple[int, str], list[float]] = defaultdict(list)
        own_times: list[dict[tuple[int, ...], float]] = []  # per step: each op's own time
        for index in range(steps):
            per_step = [ranks[r]["steps"][index] for r in range(pp)]
            step_s = max(s["end"] for s in per_step) - min(s["start"] for s in per_step)
            for r, s in enumerate(per_step):
                totals = {
                    kind: sum(e - b for k, _, b, e in s["events"] if k == kind)
                    for kind in ("compute", "post", "wait")
                }
                parts["step"][r].append(step_s)
                parts["compute"][r].append(totals["compute"])
                parts["idle"][r].append(step_s - totals["compute"])
                parts["wait"][r].append(totals["wait"])
                parts["post"][r].append(totals["post"])
                parts["other"][r].append(step_s - totals["compute"] - totals["wait"] - totals["post"])
                # The previous definition: the idle fraction of the rank's own step (start to its own end).
                parts["own_fraction"][r].append(1.0 - totals["compute"] / (s["end"] - s["start"]))
            own: dict[tuple[int, ...], float] = {}
            for s in per_step:
                last_forward: tuple[int, ...] | None = None
                for k, label, b, e in s["events"]:
                    if k == "compute":
                        key = (num_stages - 1, "loss") if label == ("loss",) else label[:2]
                        op_times[key].append(e - b)
                        if label == ("loss",):  # the loss belongs to the last stage's forward before it
                            assert last_forward is not None, "a loss before any last-stage forward"
                            own[last_forward] += e - b
                        else:
                            own[label] = e - b
                            if label[:2] == (num_stages - 1, "F"):
                                last_forward = label
            own_times.append(own)
        mean = {key: [statistics.mean(x) for x in values] for key, values in parts.items()}
        durations = {key: statistics.median(values) for key, values in op_times.items() if key[1] != "loss"}
        last_f = (num_stages - 1, "F")
        durations[last_f] += statistics.median(op_times.get((num_stages - 1, "loss"), [0.0]))
        # The order each rank ran its compute in (the same every step): what torch's schedule does.
        orders = [
            [label for kind, label, _, _ in r["steps"][0]["events"] if kind == "compute" and len(label) == 3]
            for r in ranks
        ]
        ratio = theoretical_idle_per_compute(pp, microbatches, v)
        theory = [ratio * c for c in mean["compute"]]
        out.append(
            {
                "schedule": schedule,
                "v": v,
                "theory_per_compute": ratio,
                "theory_s": theory,
                "idle_s": mean["idle"],
                "compute_s": mean["compute"],
                "wait_s": mean["wait"],
                "post_s": mean["post"],
                "other_s": mean["other"],
                "step_s": statistics.mean(mean["step"]),
                "ratio": sum(mean["idle"]) / sum(theory),
                "own_fraction_ratio": statistics.mean(mean["own_fraction"])
                / ((pp - 1) / (v * microbatches + pp - 1)),
                "model_s": _replay(orders, durations, num_stages, message_s),
                "model_no_comm_s": _replay(orders, durations, num_stages, 0.0),
                # The same replay with each op's own time in each step, averaged over the steps: what
                # the step-to-step variation of op times adds to idle (a shared host's jitter).
                "model_own_s": [
                    statistics.mean(idle)
                    for idle in zip(
                        *(_replay(orders, own, num_stages, message_s) for own in own_times), strict=True
                    )
                ],
                "message_s": message_s,
                "op_s": {f"{s}{k}": t for (s, k), t in sorted(durations.items())},
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
    result = summarize(args.pp, args.microbatches, args.seq_len, args.steps, args.warmup)
    rows = result["schedules"]
    print(
        f"\nLlama h{MODEL['hidden_size']} x {MODEL['num_hidden_layers']} layers, seq {args.seq_len}, "
        f"p={args.pp} pipeline ranks, m={args.microbatches} microbatches of 1, {args.steps} timed steps; "
        f"one message {rows[0]['message_s'] * 1e3:.2f} ms one way. Times in ms per step, per rank."
    )

    def ms(values: list[float]) -> str:
        return "/".join(f"{v * 1e3:.0f}" for v in values)

    header = (
        f"{'schedule':<18}{'v':>2}{'ratio':>7}{'idle':>11}{'theory':>11}{'compute':>11}{'p2p wait':>11}"
        f"{'p2p post':>10}{'other':>9}{'model':>11}{'no comm':>11}{'own ops':>11}{'step':>7}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['schedule']:<18}{row['v']:>2}{row['ratio']:>7.2f}{ms(row['idle_s']):>11}"
            f"{ms(row['theory_s']):>11}{ms(row['compute_s']):>11}{ms(row['wait_s']):>11}"
            f"{ms(row['post_s']):>10}{ms(row['other_s']):>9}{ms(row['model_s']):>11}"
            f"{ms(row['model_no_comm_s']):>11}{ms(row['model_own_s']):>11}{row['step_s'] * 1e3:>7.0f}"
        )
    print(
        "previous definition (idle fraction of each rank's own step / (p - 1) / (v m + p - 1)): "
        + ", ".join(f"{row['schedule']} {row['own_fraction_ratio']:.2f}" for row in rows)
    )
    for row in rows:
        ops = ", ".join(f"{name} {t * 1e3:.1f}" for name, t in row["op_s"].items())
        print(f"  {row['schedule']} op times (ms, median): {ops}")
    balance = result["balance"]
    print(
        f"1F1B with a {HEAVY_HEAD_MODEL['vocab_size']}-token head (2.4 layers of work): layers per rank "
        f"{balance['layers_even']} -> {balance['layers_balanced']} with balance_stages, step "
        f"{balance['step_even_s'] * 1e3:.0f} -> {balance['step_balanced_s'] * 1e3:.0f} ms "
        f"({balance['ratio']:.2f}x)"
    )


if __name__ == "__main__":
    main()
