"""Step time of expert parallelism (ep 2) against replicated experts (plain FSDP2), on the same 2 ranks.

A Qwen3-MoE (hidden 256, 4 layers, 16 experts of width 256, top-2, vocab 1024, fp32) trains for a few
AdamW steps on a 2 x 128 token batch per rank, in the same run:

- baseline: every rank holds all experts; ``automodel_distributed.fsdp2.apply_fsdp2`` shards each block
  (experts included) over the 2 ranks;
- ours: ``automodel_moe.parallelizer.parallelize_model`` with ep 2 (each rank holds 8 experts; tokens
  travel by ``all_to_all_single``), the rest FSDP2 over the same 2 ranks.

Printed: median step time of each and their ratio, and the share of the EP step spent in dispatch and
combine: wall time inside the token all-to-alls and the count exchange, forward (timed around each call)
and backward (timed between marker autograd nodes placed on both sides of each all-to-all), over one step.

    uv run --all-packages python benchmarks/bench_moe_ep.py [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from _launch import launch
from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "num_experts": 16,
    "moe_intermediate_size": 256,
}
BATCH, SEQ = 2, 128


class _A2ATimer:
    """Times every all-to-all of `automodel_moe.experts` (forward, and backward through marker nodes)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def installed(self) -> Any:
        import contextlib

        import automodel_moe.experts as experts

        timer = self

        class _After(torch.autograd.Function):  # backward runs just before the a2a's backward
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                timer._bwd_start = time.perf_counter()
                return grad

        class _Before(torch.autograd.Function):  # backward runs just after the a2a's backward
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                timer.seconds += time.perf_counter() - timer._bwd_start
                return grad

        original_a2a, original_counts = experts._a2a, experts.dist.all_to_all_single

        def timed_a2a(x: torch.Tensor, *args: Any) -> torch.Tensor:
            start = time.perf_counter()
            out = original_a2a(_Before.apply(x), *args)
            self.seconds += time.perf_counter() - start
            return _After.apply(out)

        def timed_counts(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original_counts(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        @contextlib.contextmanager
        def patch() -> Any:
            experts._a2a = timed_a2a
            experts.dist.all_to_all_single = timed_counts
            try:
                yield
            finally:
                experts._a2a, experts.dist.all_to_all_single = original_a2a, original_counts

        return patch()


def _step(model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> None:
    loss = causal_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
    loss.backward()
    opt.step()
    opt.zero_grad()


def _run(mode: str, steps: int) -> dict[str, float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed import FSDP2Config
    from automodel_distributed.fsdp2 import apply_fsdp2
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe.parallelizer import parallelize_model

    model = build_tiny_model("qwen3_moe", seed=0, **MODEL)
    if mode == "ep":
        ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(ep_size=2))
        parallelize_model(model, ctx.device_mesh, ctx.moe_mesh, **ctx.parallelize_axis_kwargs())
    else:
        ctx = MeshContext.build(FSDP2Config(), ParallelismSizes())
        apply_fsdp2(
            model, ctx.submesh("dp_shard_cp"), mp_policy=MixedPrecisionPolicy(), reshard_after_forward=False
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(MODEL["vocab_size"], BATCH, SEQ, seed=1 + dist.get_rank())
    _step(model, opt, batch)  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _step(model, opt, batch)
        times.append(time.perf_counter() - start)
    result = {"step_s": statistics.median(times)}
    if mode == "ep":
        timer = _A2ATimer()
        with timer.installed():
            dist.barrier()
            start = time.perf_counter()
            _step(model, opt, batch)
            total = time.perf_counter() - start
        result["a2a_share"] = timer.seconds / total
    return result


def _both(steps: int) -> dict[str, dict[str, float]]:
    out = {"replicated": _run("replicated", steps)}
    dist.barrier()
    out["ep"] = _run("ep", steps)
    return out


def measure(steps: int = 6) -> dict[str, float]:
    """Step seconds of replicated experts and of ep 2 (max over ranks), and the all-to-all share."""
    results = launch(_both, 2, steps, timeout_s=900)
    return {
        "replicated_s": max(r["replicated"]["step_s"] for r in results),
        "ep_s": max(r["ep"]["step_s"] for r in results),
        "a2a_share": max(r["ep"]["a2a_share"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    r = measure(args.steps)
    base, ep, share = r["replicated_s"], r["ep_s"], r["a2a_share"]
    print(f"replicated experts (FSDP2, 2 ranks): step {base * 1e3:.1f} ms")
    print(f"ep 2 (EP + FSDP2, 2 ranks):          step {ep * 1e3:.1f} ms")
    print(f"ratio ep / replicated step time: {ep / base:.2f}x")
    print(f"dispatch + combine share of the ep step: {share:.1%} (max over ranks)")


if __name__ == "__main__":
    main()
