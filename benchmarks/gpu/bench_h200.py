"""Tokens/s, MFU and peak memory of a Llama-3.1-8B-shaped model on one GPU, against plain transformers.

For a lent GPU machine with no registry access (``tools/gpu_check.sh`` runs it): it needs only torch,
transformers, safetensors, peft and the workspace packages (carried in the working tree). Real
Llama-3.1-8B widths (hidden 4096, MLP 14336, 32 heads / 8 key-value heads, vocab 128256), layers cut
(``--layers``, default 8) so one H200 holds fp32 master weights, gradients, AdamW state and activations.
One process, a 1-rank gloo/nccl process group (what ``torchrun --nproc-per-node 1`` gives).

Variants, each timed over ``--steps`` after ``--warmup`` steps, in the same process, all with fp32
master weights and bf16 compute and the same activation checkpointing (``--ac``):

- ``transformers + autocast``: the plain model under ``torch.autocast(bf16)`` (checkpointing through
  transformers' ``gradient_checkpointing_enable``, full only), the baseline;
- ``hand-written fully_shard``: ``fully_shard`` each block, then the root, bf16 mixed precision;
- ``FSDP2Manager``: `apply_model_infrastructure` with our `FSDP2Manager` (default bf16 policy);
- ``FSDP2Manager + compile``, ``FSDP2Manager + compile + FP8`` (torchao tensorwise float8): CUDA only;
- ``FSDP2Manager + LoRA``: rank-16 adapters on every linear of the blocks at ``--lora-seq`` (4096, NeMo
  AutoModel's single-GPU LoRA anchor), the base frozen in bf16.

Off CUDA the CUDA-only variants print one "skipped: needs CUDA" line each (``--device cpu`` is the
rehearsal). MFU = model FLOPs per token x tokens/s over the device's dense bf16 peak (``--peak-tflops``,
default 989 for an H200/H100 SXM), FLOPs counted as torchtitan counts them (6 x parameters without the
embedding + 12 x layers x hidden x seq for attention, recompute excluded; LoRA: the frozen base's
forward and input-gradient work, 4 x its parameters). Then the load time of a real-size checkpoint:
`apply_model_infrastructure(load_base_model=True)` against ``AutoModelForCausalLM.from_pretrained``.
Then the loss alone (CUDA only): `MaskedCrossEntropy` eager against ``compiled=True`` on the logits of
``batch x seq`` tokens at the 128k vocabulary, forward and backward: time and peak memory over the
logits' own size.
Printed beside: NeMo AutoModel's Llama 3 8B LoRA on one H100 (seq 4096, global batch 32): 12,473
tokens/s, 402 TFLOP/s; torchtitan's Llama 3.1 8B FSDP on 8 H100s (local batch 2, seq 8192, selective
AC): 5,762 tokens/s/GPU, 6,667 compiled, 8,532 compiled with float8.

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
from collections.abc import Callable
from dataclasses import dataclass
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
ANCHORS = (
    "anchors: NeMo AutoModel Llama 3 8B LoRA, 1 H100, seq 4096, global batch 32: 12,473 tokens/s, "
    "402 TFLOP/s; torchtitan Llama 3.1 8B FSDP, 8 H100, local batch 2, seq 8192, selective AC: "
    "5,762 tokens/s/GPU, 6,667 compiled, 8,532 compiled + float8"
)
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


def flops_per_token(config: Any, seq: int, *, lora: bool = False) -> float:
    """Training FLOPs per token, as torchtitan counts them (recompute excluded).

    Full training: 6 x parameters without the embedding + 12 x layers x hidden x seq (causal attention's
    two matmuls, forward and backward). LoRA: the frozen base needs no weight gradients, so 4 x its
    parameters (forward, and the input gradients), attention as before; the adapters are negligible.
    """
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    head = h * config.vocab_size
    return (4 if lora else 6) * (layers * per_layer + head) + 12 * layers * h * seq


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hand_written(config: Any, device: torch.device, ac: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _checkpoint_blocks(model, ac)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _checkpoint_blocks(model: torch.nn.Module, ac: str) -> None:
    """The hand-written baseline's checkpointing: our applier, the mode ``--ac`` names."""
    if ac != "none":
        from automodel_distributed.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, mode=ac)  # type: ignore[arg-type]


def _transformers(config: Any, device: torch.device, ac: str) -> torch.nn.Module:
    """Plain transformers, fp32 weights; the step runs under bf16 autocast (`time_training`)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif ac == "selective":
        _checkpoint_blocks(model, ac)  # transformers has no selective mode: the same applier as ours
    model.train()
    return model


def _ours(
    config: Any,
    device: torch.device,
    *,
    ac: str = "none",
    compile_blocks: bool = False,
    fp8: bool = False,
    lora: bool = False,
    checkpoint: str | None = None,
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from automodel_distributed import CompileConfig, FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes

    # The default policy: bf16 compute and outputs over the parameters' dtype, fp32 gradient reduction.
    distributed = FSDP2Config(activation_checkpointing=False if ac == "none" else ac)
    mesh = MeshContext.build(distributed, ParallelismSizes())
    infra = instantiate_infrastructure(distributed_config=distributed, mesh=mesh, device=device)
    fp8_config = None
    if fp8:
        from automodel_quant.fp8 import FP8Config

        fp8_config = FP8Config(enabled=True, emulate=device.type != "cuda")
    peft_config = None
    if lora:
        from automodel_peft import PeftConfig

        peft_config = PeftConfig(match_all_linear=True, dim=16, alpha=32)  # every linear but the head
    with torch.device("meta"):  # LoRA trains adapters over a frozen bf16 base; full training fp32 masters
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if lora else torch.float32)
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=device,
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        peft_config=peft_config,
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
    autocast: bool = False,
) -> dict[str, float]:
    """Total wall time of ``steps`` steps after ``warmup``; tokens/s, loss, peak memory on CUDA.

    ``autocast``: run the forward under bf16 autocast (the plain-transformers baseline's precision).
    """
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator).to(device)
    loss = torch.zeros(())
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
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
    ours = _ours(config, device, checkpoint=str(folder))
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


def time_loss(device: torch.device, tokens: int, vocab: int, steps: int) -> dict[str, Any]:
    """`MaskedCrossEntropy` eager and compiled on ``tokens x vocab`` bf16 logits: seconds per forward and
    backward, and the peak allocated over the logits' own bytes (CUDA)."""
    from automodel_distributed.loss import MaskedCrossEntropy

    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    out: dict[str, Any] = {"tokens": tokens, "vocab": vocab}
    for name, compiled in (("eager", False), ("compiled", True)):
        loss_fn = MaskedCrossEntropy(compiled=compiled)
        for step in range(steps + 2):  # two warm-up runs (the compile)
            if step == 2:
                _sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                start = time.perf_counter()
            x = logits.detach().requires_grad_(True)
            loss_fn(x, labels).backward()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        out[name] = {
            "step_s": (time.perf_counter() - start) / steps,
            "peak_over_logits": peak / (logits.numel() * logits.element_size()),
        }
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(frozen=True)
class Variant:
    """One timed configuration: how to build the model and how its step runs."""

    name: str
    build: Callable[[], torch.nn.Module]
    cuda_only: bool = False
    autocast: bool = False
    lora: bool = False


def _variants(config: Any, device: torch.device, args: argparse.Namespace) -> list[Variant]:
    ac = args.ac
    return [
        Variant("transformers + autocast", lambda: _transformers(config, device, ac), autocast=True),
        Variant("hand-written fully_shard", lambda: _hand_written(config, device, ac)),
        Variant("FSDP2Manager", lambda: _ours(config, device, ac=ac)),
        # Inductor on a CPU takes minutes for nothing the rehearsal checks: the compiled variants need CUDA.
        Variant(
            "FSDP2Manager + compile",
            lambda: _ours(config, device, ac=ac, compile_blocks=True),
            cuda_only=True,
        ),
        Variant(
            "FSDP2Manager + compile + FP8",
            lambda: _ours(config, device, ac=ac, compile_blocks=True, fp8=True),
            cuda_only=True,
        ),
        Variant("FSDP2Manager + LoRA", lambda: _ours(config, device, ac=ac, lora=True), lora=True),
    ]


def _time_variant(
    variant: Variant, config: Any, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """Build and time one variant; a variant the machine cannot run is reported, the others still run."""
    seq = args.lora_seq if variant.lora else args.seq
    try:
        model = variant.build()
        row: dict[str, Any] = time_training(
            model,
            config,
            device,
            batch=args.batch,
            seq=seq,
            steps=args.steps,
            warmup=args.warmup,
            autocast=variant.autocast,
        )
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    del model
    row["seq"] = seq
    row["tflops_per_s"] = row["tokens_per_s"] * flops_per_token(config, seq, lora=variant.lora) / 1e12
    row["mfu"] = row["tflops_per_s"] / args.peak_tflops
    return row


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
    results: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "ac": args.ac,
    }
    for variant in _variants(config, device, args):
        if variant.name in args.skip:
            continue
        if variant.cuda_only and device.type != "cuda":
            print(f"{variant.name}: skipped: needs CUDA", flush=True)
            results[variant.name] = {"skipped": "needs CUDA"}
            continue
        results[variant.name] = _time_variant(variant, config, device, args)
        _free(device)
    if "loss" not in args.skip:
        if device.type == "cuda":
            results["loss"] = time_loss(device, args.batch * args.seq, config.vocab_size, args.steps)
            _free(device)
        else:
            print("loss: skipped: needs CUDA", flush=True)
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
    if device.type == "cuda":
        results["outside_allocator_bytes"] = outside_allocator_bytes(device)
    return results


def outside_allocator_bytes(device: torch.device) -> int:
    """What the process holds on ``device`` beyond torch's caching allocator: its CUDA context with the
    kernels every variant loaded, and NCCL's one-rank communicator. Compared with
    ``automodel_planner.runtime_memory.CUDA_CONTEXT_BYTES``, the planner's figure for the context."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="blocks of the 32 of Llama-3.1-8B to keep")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--lora-seq", type=int, default=4096, help="sequence length of the LoRA variant")
    parser.add_argument("--ac", choices=["none", "full", "selective"], default="selective")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    parser.add_argument("--tiny", action="store_true", help="tiny widths: a logic check on CPU")
    parser.add_argument("--skip", nargs="*", default=[], help="variant names (or 'load', 'loss') to skip")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run and print one line per variant: tokens/s, MFU, step time; then the load times."""
    args = parse_args(argv)
    results = run(args)
    if dist.get_rank() == 0:
        shape = (
            f"{args.layers} layers, batch {args.batch} x {args.seq}, AC {args.ac}, {results['device_name']}"
        )
        print(f"{'tiny (logic check)' if args.tiny else 'Llama-3.1-8B'} widths, {shape}")
        print("| variant | tokens/s | TFLOP/s | MFU | step (s) | max allocated (GiB) |")
        print("|---|---|---|---|---|---|")
        for name, row in results.items():
            if not isinstance(row, dict) or name in ("load", "loss"):
                continue
            if "error" in row or "skipped" in row:
                print(f"| {name} | {row.get('error') or 'skipped: ' + row['skipped']} | | | | |")
                continue
            mem = row.get("max_allocated_gib")
            print(
                f"| {name} | {row['tokens_per_s']:.0f} | {row['tflops_per_s']:.1f} | {row['mfu']:.3f} | "
                f"{row['step_s']:.3f} | {'' if mem is None else f'{mem:.1f}'} |"
            )
        print(ANCHORS)
        if "load" in results:
            load = results["load"]
            print(
                f"load of the {args.layers}-layer checkpoint: ours {load['ours_s']:.2f} s, from_pretrained "
                f"{load['from_pretrained_s']:.2f} s, ratio {load['ratio']:.2f}"
            )
        if "loss" in results:
            loss = results["loss"]
            eager, compiled = loss["eager"], loss["compiled"]
            print(
                f"loss on {loss['tokens']} x {loss['vocab']} bf16 logits, forward + backward: eager "
                f"{eager['step_s'] * 1e3:.1f} ms, peak {eager['peak_over_logits']:.2f}x the logits; "
                f"compiled {compiled['step_s'] * 1e3:.1f} ms ({compiled['step_s'] / eager['step_s']:.2f}x), "
                f"peak {compiled['peak_over_logits']:.2f}x"
            )
        if "outside_allocator_bytes" in results:
            from automodel_planner.runtime_memory import CUDA_CONTEXT_BYTES

            outside = results["outside_allocator_bytes"]
            print(
                f"outside torch's allocator: {outside / 1e6:.0f} MB (the planner's CUDA context: "
                f"{CUDA_CONTEXT_BYTES / 1e6:.0f} MB, ratio {outside / CUDA_CONTEXT_BYTES:.2f})"
            )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
