"""Step time of FSDP2Manager.parallelize against hand-written fully_shard / parallelize_module.

Both versions of the same Llama (hidden 256, 4 layers, vocab 4096, batch 2 x 128 per rank) are built
in the same processes, on the same mesh, and timed in alternating rounds, so machine noise hits both
alike. The baseline is the hand-written version under glibc's malloc with its defaults (what a user
writing ``fully_shard`` under plain torchrun gets), measured in a job next to ours with
no host runtime (FSDP2Config's default). Every setting of `_launch.HOST_SETTINGS` runs in two jobs of
its own (see `measure`): under glibc, the CPU runtime changes process-wide allocator settings, so only
ours runs there; under mimalloc (the ``automodel`` launcher's default on CPU, where
the glibc tuning does nothing) the hand-written version runs alongside again, which gives the
manager's own cost on that allocator too. Prints the ratio manager / hand-written for each layout and
setting (goal: at most 1.03).

    uv run --all-packages python benchmarks/bench_fsdp2_manager.py [--steps 2] [--rounds 24]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _launch import HOST_SETTINGS, HostSetting, launch
from automodel_mesh import MeshContext, ParallelismSizes
from automodel_testing import build_tiny_model, make_batch

MODEL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 256,
}

STEPS, ROUNDS = 2, 24
"""Steps per round and rounds per version and setting (split over its two jobs): short alternating
rounds, so that the load of a shared 2-core host drifts under both versions alike (10-step rounds
measured the same code anywhere from 0.98 to 1.05 of hand-written; 2-step rounds, 45 of them, 1.015
and 1.022)."""


def _hand_written(model: torch.nn.Module, ctx: MeshContext, tp: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp:
        plan = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(),
            # The vocab-parallel head of the built-in Llama plan; the loss runs under loss_parallel.
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        parallelize_module(model, ctx.submesh("tp"), plan)
    if ctx.dp_shard_cp_size > 1:
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        mesh = ctx.submesh("dp_shard_cp")
        layers = model.model.layers  # type: ignore[union-attr]
        for i, layer in enumerate(layers):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def _loss_context(logits: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


def _time_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], steps: int
) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        with _loss_context(logits):  # one context around loss and backward: loss_parallel does not nest
            vocab = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), batch["labels"][:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench(layout: str, steps: int, rounds: int, cpu_runtime: bool, hand_written: bool) -> dict[str, Any]:
    """Per round, the median step of ours and (when ``hand_written``) the hand-written version.

    Rounds alternate between the two (``steps`` steps each), so a drift of the machine's load hits both
    alike: many short rounds make the comparison robust on a shared host.

    ``hand_written`` must be False when the CPU runtime tunes glibc (``cpu_runtime`` under glibc): its
    process-wide settings would change what the hand-written version gets.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_cpu import CPURuntime
    from automodel_distributed import FSDP2Config, FSDP2Manager

    sizes = ParallelismSizes(tp_size=2) if layout == "tp2" else ParallelismSizes()
    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        host_runtime=CPURuntime() if cpu_runtime else None,
    )
    ctx = MeshContext.build(config, sizes)
    models = {"ours": FSDP2Manager(config, ctx.device_mesh).parallelize(build_tiny_model("llama", **MODEL))}
    if hand_written:
        models["theirs"] = _hand_written(build_tiny_model("llama", **MODEL), ctx, tp=layout == "tp2")
    batch = make_batch(MODEL["vocab_size"], 2, 128, seed=dist.get_rank() if layout != "tp2" else 0)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    for name in models:  # warm-up
        _time_steps(models[name], opts[name], batch, 3)
    samples: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for name in order:
            samples[name].append(_time_steps(models[name], opts[name], batch, steps))
    return samples


def _median_over_rounds(per_rank: list[dict[str, list[float]]], name: str) -> float:
    """The median over rounds of each round's slowest rank (a step ends when its last rank ends)."""
    rounds = zip(*(rank[name] for rank in per_rank), strict=True)
    return statistics.median(max(round_) for round_ in rounds)


def measure(
    steps: int = STEPS, rounds: int = ROUNDS, settings: tuple[HostSetting, ...] = HOST_SETTINGS
) -> dict[str, dict[str, Any]]:
    """Step seconds per layout: per job, the median over rounds of the slower rank's median step in the
    round; per setting, the mean over its two jobs.

    Every setting runs in two jobs of ``rounds // 2`` rounds each, in the order of the settings and then
    in reverse (the baseline job first and last), so a drift in the machine's load over the run hits all
    settings alike. ``theirs``: hand-written under glibc with its defaults; ``ours[label]``: ours under
    each setting; ``theirs_same_job[label]``: the hand-written version in that setting's jobs, where it
    ran. ``ours_runs[label]`` and ``theirs_runs``: the per-job figures behind the means, in job order.
    """
    glibc_plain = next((s for s in settings if s.host_allocator == "glibc" and not s.cpu_runtime), None)
    if glibc_plain is None:
        raise ValueError("settings must hold glibc without the CPU runtime (the baseline's jobs)")
    order = [glibc_plain, *(s for s in settings if s is not glibc_plain)]
    order += order[::-1]
    out: dict[str, dict[str, Any]] = {}
    for layout in ("fsdp2", "tp2"):
        figures: dict[str, dict[str, list[float]]] = {"ours": {}, "theirs_same_job": {}}
        for setting in order:
            # Under glibc, the CPU runtime changes process-wide allocator settings, which would
            # change what the hand-written version gets: ours runs alone there.
            alongside = not (setting.host_allocator == "glibc" and setting.cpu_runtime)
            per_rank = launch(
                _bench, 2, layout, steps, max(rounds // 2, 1), setting.cpu_runtime, alongside,
                timeout_s=1200, env=setting.env(),
            )  # fmt: skip
            figures["ours"].setdefault(setting.label, []).append(_median_over_rounds(per_rank, "ours"))
            if alongside:
                theirs = _median_over_rounds(per_rank, "theirs")
                figures["theirs_same_job"].setdefault(setting.label, []).append(theirs)
        row: dict[str, Any] = {
            kind: {label: statistics.mean(v) for label, v in by_label.items()}
            for kind, by_label in figures.items()
        }
        row["theirs"] = row["theirs_same_job"][glibc_plain.label]
        row["ours_runs"] = figures["ours"]
        row["theirs_runs"] = figures["theirs_same_job"][glibc_plain.label]
        out[layout] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    print("layout   manager/hand-written (glibc defaults)  [vs hand-written in the same job]  setting")
    for layout, r in measure(args.steps, args.rounds).items():
        theirs = r["theirs"]
        for label, ours in r["ours"].items():
            same = r["theirs_same_job"].get(label)
            extra = f"[{ours / same:.3f}]" if same else ""
            print(
                f"{layout:<8} {ours / theirs:>8.3f} ({ours * 1e3:.0f} ms vs {theirs * 1e3:.0f} ms)  "
                f"{extra:>8}  {label}"
            )


if __name__ == "__main__":
    main()
