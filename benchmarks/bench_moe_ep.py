"""Expert parallelism (ep 4) against replicated experts under FSDP2, on 4 ranks: step time and peak memory.

A Qwen3-30B-A3B-shaped layer stack: the real widths (hidden 2048, 32 query and 4 key-value heads of 128,
experts of width 768, top-k routing with normalised weights), fewer layers, a small vocabulary (the
stack is what is measured, not the embeddings), fp32. Qwen3-30B-A3B routes each token to 8 of 128
experts; by default this run keeps that share with 2 of 32 (``--experts 128 --top-k 8`` gives the real
count: the replicated baseline then gathers 2.4 GB of expert weights and as much of gradients per rank
and layer, more than 4 ranks of a 24 GiB machine hold). Both runs go through the public API
(`instantiate_infrastructure` + `apply_model_infrastructure` of a meta model, initialised, no
checkpoint), one launch each, in the same run:

- baseline: ``FSDP2Config()``, ep 1: every block, its experts included, is one FSDP2 unit sharded over
  the 4 ranks, gathered whole for its forward and backward;
- ours: the same with ``ParallelismSizes(ep_size=4)`` and ``moe_config=MoEParallelizerConfig()``: each
  rank holds 1/4 of the experts, tokens travel to them by all-to-all, the rest is FSDP2 over 4 ranks.

Each rank trains on its own batch (SGD). Printed: median step time (max over ranks), the peak resident
memory of a rank during the timed steps (``VmHWM``, reset through ``/proc/self/clear_refs`` after the
warm-up step, so the build is not in it; the process's whole memory: torch itself, the weights it holds,
what FSDP gathers; max over ranks), and the ratios ep / replicated.

    uv run --all-packages python benchmarks/bench_moe_ep.py [--steps 3] [--layers 2]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from _launch import launch
from bench_checkpoint_load import MiB, _reset_peak, _status

SHAPE = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "norm_topk_prob": True,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "use_cache": False,
    "tie_word_embeddings": False,
}
"""Qwen3-30B-A3B's widths (its config.json), a small vocabulary."""
RANKS, BATCH, SEQ = 4, 1, 256


def _model(ep: int, layers: int, experts: int, top_k: int) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from automodel_distributed import FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe import MoEParallelizerConfig

    config = FSDP2Config()
    mesh = MeshContext.build(config, ParallelismSizes(ep_size=ep))
    infra = instantiate_infrastructure(
        distributed_config=config,
        moe_config=MoEParallelizerConfig() if ep > 1 else None,
        mesh=mesh,
        device=torch.device("cpu"),
    )
    hf_config = Qwen3MoeConfig(
        **SHAPE, num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=top_k
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=torch.device("cpu"),
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        parallelize_fn=infra.parallelize_fn,
    )


def _step(model: Any, opt: Any, ids: torch.Tensor) -> None:
    logits = model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def run(ep: int, steps: int, layers: int, experts: int, top_k: int) -> dict[str, float]:
    """One rank: build, one warm-up step, then ``steps`` timed steps; peak memory of the timed steps."""
    model = _model(ep, layers, experts, top_k)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ + 1), generator=generator)
    _step(model, opt, ids)  # warm-up (first all-gathers, allocator growth)
    gc.collect()
    _reset_peak()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _step(model, opt, ids)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "peak_mib": _status("VmHWM") / MiB}


def measure(steps: int = 3, layers: int = 2, experts: int = 32, top_k: int = 2) -> dict[str, float]:
    """Step seconds and peak MiB (max over ranks) of replicated experts and of ep 4, one launch each."""
    out: dict[str, float] = {}
    for name, ep in (("replicated", 1), ("ep", RANKS)):
        results = launch(run, RANKS, ep, steps, layers, experts, top_k, timeout_s=1800)
        out[f"{name}_s"] = max(r["step_s"] for r in results)
        out[f"{name}_mib"] = max(r["peak_mib"] for r in results)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    r = measure(args.steps, args.layers, args.experts, args.top_k)
    tokens = f"{BATCH}x{SEQ} tokens/rank"
    print(f"Qwen3-30B-A3B widths, {args.layers} layers, {args.experts} experts (top {args.top_k}), {tokens}")
    for name, label in (("replicated", "replicated experts (FSDP2)"), ("ep", f"ep {RANKS} (EP + FSDP2)")):
        print(
            f"{label:28s} step {r[name + '_s']:.2f} s, peak {r[name + '_mib']:.0f} MiB/rank ({RANKS} ranks)"
        )
    step, peak = r["ep_s"] / r["replicated_s"], r["ep_mib"] / r["replicated_mib"]
    print(f"ratio ep / replicated: step time {step:.2f}x, peak memory {peak:.2f}x")


if __name__ == "__main__":
    main()
