"""Tokens/s and MFU of a Llama-3.1-8B-shaped model on one GPU: our FSDP2Manager vs hand-written fully_shard.

For a lent GPU machine with no registry access: it needs only torch, transformers, safetensors and
the workspace packages (carried in the working tree). Real Llama-3.1-8B widths (hidden 4096, MLP
14336, 32 heads / 8 key-value heads, vocab 128256), layers cut (``--layers``, default 8) so one H200
holds weights, gradients, AdamW state and activations. bf16 parameters. One process, a 1-rank gloo/nccl
process group (what ``torchrun --nproc-per-node 1`` gives).

Variants, each timed over ``--steps`` after ``--warmup`` steps, in the same process:

- ``hand-written``: ``fully_shard`` each block, then the root;
- ``FSDP2Manager``: `apply_model_infrastructure` with our `FSDP2Manager`;
- ``FSDP2Manager + compile``: the same with per-block ``torch.compile``;
- ``FSDP2Manager + FP8``: float8 linear layers (torchao tensorwise; emulated off-GPU).

MFU = 6 x non-embedding parameters x tokens/s + attention FLOPs, over the device's dense bf16 peak
(``--peak-tflops``, default 989 for an H200/H100 SXM). Then the load time of a real-size checkpoint
(the cut model saved as safetensors): `apply_model_infrastructure(load_base_model=True)` against
``AutoModelForCausalLM.from_pretrained`` onto the device.

    torchrun --nproc-per-node 1 benchmarks/gpu/bench_h200.py             # on the GPU machine
    python benchmarks/gpu/bench_h200.py --tiny --device cpu                # logic check on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LLAMA_31_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def model_config(widths: dict[str, Any], layers: int) -> Any:
    """The Llama config of the given widths with ``layers`` blocks."""
    from transformers import LlamaConfig

    return LlamaConfig(**widths, num_hidden_layers=layers, use_cache=False)


def flops_per_token(config: Any, seq: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters + causal attention (12 x L x h x seq / 2)."""
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    head = h * config.vocab_size
    return 6 * (layers * per_layer + head) + 6 * layers * h * seq


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hand_written(config: Any, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _ours(
    config: Any, device: torch.device, *, compile_blocks: bool, fp8: bool, checkpoint: str | None = None
) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from automodel_distributed import CompileConfig, FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes

    distributed = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    mesh = MeshContext.build(distributed, ParallelismSizes())
    infra = instantiate_infrastructure(distributed_config=distributed, mesh=mesh, device=device)
    fp8_config = None
    if fp8:
        from automodel_quant.fp8 import FP8Config

        fp8_config = FP8Config(enabled=True, emulate=device.type != "cuda")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=device,
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        fp8_config=fp8_config,
        autopipeline=infra.autopipeline,
        parallelize_fn=infra.parallelize_fn,
        qat_quantizer=infra.qat_quantizer,
        compile_config=CompileConfig(enabled=True) if compile_blocks else None,
        load_base_model=checkpoint is not None,
        pretrained_model_name_or_path=checkpoint or "",
    )


def time_training(
    model: torch.nn.Module,
    config: Any,
    device: torch.device,
    *,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
) -> dict[str, float]:
    """Median-free simple timing: total wall time of ``steps`` steps after ``warmup``; tokens/s, loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator).to(device)
    loss = torch.zeros(())
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach()
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = batch * seq * steps / elapsed
    result = {"tokens_per_s": tokens_per_s, "step_s": elapsed / steps, "loss": float(loss)}
    if device.type == "cuda":
        result["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def time_load(config: Any, device: torch.device, folder: Path) -> dict[str, float]:
    """Seconds to load the saved checkpoint: ours (into the shards) against ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    _sync(device)
    start = time.perf_counter()
    ours = _ours(config, device, compile_blocks=False, fp8=False, checkpoint=str(folder))
    _sync(device)
    ours_s = time.perf_counter() - start
    del ours
    _free(device)
    start = time.perf_counter()
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device)
    _sync(device)
    theirs_s = time.perf_counter() - start
    del theirs
    _free(device)
    return {"ours_s": ours_s, "from_pretrained_s": theirs_s, "ratio": ours_s / theirs_s}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant and the load comparison; returns the results (rank 0 prints them)."""
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    config = model_config(TINY if args.tiny else LLAMA_31_8B, args.layers)
    per_token = flops_per_token(config, args.seq)
    results: dict[str, Any] = {
        "device": str(device),
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
    }
    variants = {
        "hand-written fully_shard": lambda: _hand_written(config, device),
        "FSDP2Manager": lambda: _ours(config, device, compile_blocks=False, fp8=False),
        "FSDP2Manager + compile": lambda: _ours(config, device, compile_blocks=True, fp8=False),
        "FSDP2Manager + FP8": lambda: _ours(config, device, compile_blocks=False, fp8=True),
    }
    for name, build in variants.items():
        if name in args.skip:
            continue
        try:
            model = build()
            row = time_training(
                model, config, device, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup
            )
        except Exception as exc:  # a variant the machine cannot run is reported, the others still run
            row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        else:
            row["mfu"] = row["tokens_per_s"] * per_token / (args.peak_tflops * 1e12)
            del model
        _free(device)
        results[name] = row
    if "load" not in args.skip:
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory(prefix="bench-h200-") as tmp:
            with torch.device(device):
                saved = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            if dist.get_rank() == 0:
                saved.save_pretrained(tmp)
            del saved
            _free(device)
            dist.barrier()
            results["load"] = time_load(config, device, Path(tmp))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="blocks of the 32 of Llama-3.1-8B to keep")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    parser.add_argument("--tiny", action="store_true", help="tiny widths: a logic check on CPU")
    parser.add_argument("--skip", nargs="*", default=[], help="variant names (or 'load') to skip")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run and print one line per variant: tokens/s, MFU, step time; then the load times."""
    args = parse_args(argv)
    results = run(args)
    if dist.get_rank() == 0:
        shape = f"{args.layers} layers, bf16, batch {args.batch} x {args.seq}, {results['device']}"
        print(f"{'tiny (logic check)' if args.tiny else 'Llama-3.1-8B'} widths, {shape}")
        print("| variant | tokens/s | MFU | step (s) | max allocated (GiB) |")
        print("|---|---|---|---|---|")
        for name, row in results.items():
            if not isinstance(row, dict) or name == "load":
                continue
            if "error" in row:
                print(f"| {name} | failed: {row['error']} | | | |")
                continue
            mem = row.get("max_allocated_gib")
            print(
                f"| {name} | {row['tokens_per_s']:.0f} | {row['mfu']:.3f} | {row['step_s']:.3f} | "
                f"{'' if mem is None else f'{mem:.1f}'} |"
            )
        if "load" in results:
            load = results["load"]
            print(
                f"load of the {args.layers}-layer checkpoint: ours {load['ours_s']:.2f} s, from_pretrained "
                f"{load['from_pretrained_s']:.2f} s, ratio {load['ratio']:.2f}"
            )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
