"""Long rows on 4 CPU ranks: peak memory per rank and step time, CP 4 against no CP, ring against all-to-all,
packed against unpacked rows, with the planner's estimate beside each.

Each case is an `automodel train` job (4 gloo ranks, one launch each, the launcher's CPU defaults:
mimalloc and the CPU runtime), measured as `bench_planner` measures a layout: the job's own setup
(`automodel_all.cli.train._setup`), AdamW's states, then two training steps through `run_step` and
AdamW; the peak is the largest rank's ``VmHWM`` growth over its resident memory before the setup, the
step time the second step's (max over ranks). The estimate is `automodel plan`'s total for the same job.

Cases, at 8k and 32k tokens per row (``--only-len`` picks one):

- ``no CP``: data parallelism over the 4 ranks, one whole row per rank;
- ``CP 4 ring`` / ``CP 4 all-to-all``: one row over the 4 ranks, documents concatenated (positions run
  on through the row: ``data.packing: concat``), ring attention or all-to-all attention;
- ``CP 4 packed``: one row of packed documents (positions restart per document: ``packed``), which
  context parallelism runs as all-to-all attention per document (no mask over the row);
- ``CP 4 packed, gathered keys``: the same packed row with a model whose 6 query heads the cp size
  does not divide, so every layer gathers all keys and values and masks them per document (the only
  method for packed rows before all-to-all attention, kept for such models): a ``[T/4, T]`` boolean
  mask per rank. Its ``ring`` row beside it is the same 6-head model unpacked.

The model: the embedded default Llama at ``MODEL`` widths (fp32), small enough that a 32k-token step
runs in a minute on 2 cores: the figures are about how memory and time grow with the row, not about
the model.

    uv run --all-packages python benchmarks/bench_long_context.py [--only-len 8192]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_checkpoint_load import MiB, _status
from bench_checkpoint_load import _reset_peak as _reset_rss

MODEL: dict[str, int] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
}
SIX_HEADS = {**MODEL, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}
RANKS = 4
LENGTHS = (8192, 32768)

CASES: dict[str, tuple[list[str], dict[str, int]]] = {
    "no CP": (["--global-batch-size", "4", "--packing", "concat"], MODEL),
    "CP 4 ring": (["--cp", "4", "--packing", "concat"], MODEL),
    "CP 4 all-to-all": (["--cp", "4", "--cp-ulysses-degree", "4", "--packing", "concat"], MODEL),
    "CP 4 packed": (["--cp", "4", "--packing", "packed"], MODEL),
    "CP 4 ring, 6 heads": (["--cp", "4", "--packing", "concat"], SIX_HEADS),
    "CP 4 packed, gathered keys (6 heads)": (["--cp", "4", "--packing", "packed"], SIX_HEADS),
}


def _argv(case: str, seq: int, output: Path) -> list[str]:
    extra, model = CASES[case]
    base = [
        "--seq-len", str(seq), "--global-batch-size", "1", "--micro-batch-size", "1", "--steps", "2",
        "--output-dir", str(output), "--device", "cpu", "--nproc-per-node", str(RANKS),
        "--set", "model.config_overrides=" + json.dumps({**model, "max_position_embeddings": seq}),
    ]  # fmt: skip
    return base + extra


def _job(case: str, seq: int, tmp: Path) -> tuple[dict[str, Any], float]:
    """The case's plain job (as workers receive it) and the planner's estimate (MiB)."""
    from automodel_all.cli.launch import prepare_job
    from automodel_all.cli.main import build_parser, job_from_args
    from automodel_all.cli.plan import plan_report

    out = tmp / f"{case}-{seq}".replace(" ", "_").replace(",", "")
    _resolved, plain = prepare_job(
        job_from_args(build_parser().parse_args(["train", *_argv(case, seq, out)]))
    )
    args = build_parser().parse_args(["plan", *_argv(case, seq, out)])
    return plain, plan_report(job_from_args(args), world_size=RANKS)["estimate"].total / MiB


def _tiny(plain: dict[str, Any]) -> dict[str, Any]:
    """The same job on 256-token rows: it imports and warms up what the real one uses."""
    import copy

    tiny = copy.deepcopy(plain)
    tiny["data"]["seq_len"] = 256
    tiny["model"]["load_weights"] = False
    return tiny


def measure_case(plain: dict[str, Any], warm: dict[str, Any]) -> dict[str, float]:
    """On each rank: setup, AdamW's states, two steps; peak growth (MiB) and the second step's seconds."""
    import torch
    import torch.distributed as dist

    from automodel_all.cli import train
    from automodel_all.cli.config import build_job
    from automodel_all.cli.steps import ContextParallelism, run_step
    from automodel_all.cli.yaml_source import RawJob

    train._quiet()
    result: dict[str, float] = {}
    for measured, plain_job in ((False, warm), (True, plain)):
        job = build_job(RawJob(sections=plain_job))
        if dist.is_initialized():
            dist.barrier()
        gc.collect()
        base = _reset_rss()
        run = train._setup(job)
        cp = run.resolved.layout.cp
        context = ContextParallelism(run.mesh, job.host_runtime, job.parallelism.cp_ulysses_degree)
        seconds = 0.0
        for _ in range(2):
            dist.barrier()
            start = time.perf_counter()
            run_step(
                run.model,
                run.rows.batch(torch.arange(run.resolved.rows_per_dp_rank), run.device),
                loss_fn=run.loss_fn,
                micro_batch_size=1,
                strategy=run.strategy,
                context_parallel=context if cp > 1 else None,
            )
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - start
        if measured:
            result = {"peak_mib": (_status("VmHWM") - base) / MiB, "step_s": seconds}
        del run
        dist.barrier()
    return result


def measure(lengths: tuple[int, ...] = LENGTHS) -> list[dict[str, Any]]:
    """Every case at every length, each in its own launch; the largest rank's figures."""
    from _launch import HOST_SETTINGS, launch

    setting = HOST_SETTINGS[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        for seq in lengths:
            for case in CASES:
                plain, estimate = _job(case, seq, Path(tmp))
                per_rank = launch(
                    measure_case, RANKS, plain, _tiny(plain), init_process_group=False, timeout_s=3000,
                    env=setting.env(),
                )  # fmt: skip
                rows.append(
                    {"case": case, "seq": seq, "estimate_mib": estimate,
                     "peak_mib": max(r["peak_mib"] for r in per_rank),
                     "step_s": max(r["step_s"] for r in per_rank)}
                )  # fmt: skip
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The comparisons the issue asks for, at each length: ``<what> <seq>`` -> ours / baseline."""
    by = {(r["case"], r["seq"]): r for r in rows}
    pairs = {
        "CP 4 ring / no CP, peak": ("CP 4 ring", "no CP", "peak_mib"),
        "all-to-all / ring, peak": ("CP 4 all-to-all", "CP 4 ring", "peak_mib"),
        "all-to-all / ring, step": ("CP 4 all-to-all", "CP 4 ring", "step_s"),
        "packed / unpacked (all-to-all), peak": ("CP 4 packed", "CP 4 all-to-all", "peak_mib"),
        "packed / unpacked (ring), peak": ("CP 4 packed", "CP 4 ring", "peak_mib"),
        "packed gathered keys / ring (6 heads), peak": (
            "CP 4 packed, gathered keys (6 heads)", "CP 4 ring, 6 heads", "peak_mib"
        ),
    }  # fmt: skip
    out = {}
    for seq in sorted({r["seq"] for r in rows}):
        for name, (ours, base, key) in pairs.items():
            if (ours, seq) in by and (base, seq) in by:
                out[f"{name} {seq}"] = by[(ours, seq)][key] / by[(base, seq)][key]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only-len", type=int, choices=LENGTHS, help="one row length")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    rows = measure((args.only_len,) if args.only_len else LENGTHS)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"long rows on {RANKS} CPU ranks (gloo), model {MODEL}")
    print("| case | tokens per row | peak per rank (MiB) | planner (MiB) | step (s) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        figures = f"{r['peak_mib']:.0f} | {r['estimate_mib']:.0f} | {r['step_s']:.2f}"
        print(f"| {r['case']} | {r['seq']} | {figures} |")
    for name, value in ratios(rows).items():
        print(f"{name}: {value:.2f}x")


if __name__ == "__main__":
    main()
