"""Peak memory per rank at real widths: load + one training step on 4 ranks against transformers alone.

Two checkpoints with real widths and random bf16 weights are written once with ``save_pretrained``:

- ``llama-1b``: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 / 8 heads, vocab 128256, tied
  embeddings; 1.24 B parameters, 2.3 GiB);
- ``qwen3-moe``: Qwen3-30B-A3B's widths (hidden 2048, experts of width 768, top 8, vocab 151936) with
  2 layers of 64 experts (1.26 B parameters, 2.4 GiB).

Then, in the same run, for each model and optimizer (SGD; AdamW, whose states the baseline holds in
full):

- baseline: one process, ``AutoModelForCausalLM.from_pretrained`` and one step on the global batch
  (``RANKS`` rows of ``SEQ`` tokens);
- ours: ``RANKS`` gloo ranks, a meta model from the config, `instantiate_infrastructure` +
  `apply_model_infrastructure(load_base_model=True)` with the default `FSDP2Config` (bf16 parameters,
  fp32 reduction; ``ep_size=RANKS`` for the MoE), and one step on the rank's own row of the same
  global batch. Together the ranks take exactly the baseline's step (data parallelism: the mean of the
  ranks' losses is the baseline's loss, printed for both).

Memory is a process's peak growth over load + step (``VmHWM`` after a reset through
``/proc/self/clear_refs``, minus ``VmRSS`` before; imports done first), the largest rank's, with its
growth after each phase (load, forward, backward, step). Ours runs under each host setting asked for
(`_launch.HOST_SETTINGS`); the baseline under glibc's defaults, as a plain script would.

    uv run --all-packages python benchmarks/bench_scale.py [--only llama-1b] [--optimizer sgd adamw]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _launch import HOST_SETTINGS, HostSetting, launch
from bench_checkpoint_load import MiB, _Meter

RANKS, SEQ = 4, 256


@dataclass(frozen=True)
class ScaleModel:
    """A real-width model: its transformers config class and fields, and how ours shards it."""

    label: str
    config_class: str
    fields: dict[str, Any]
    ep_size: int = 1


MODELS: dict[str, ScaleModel] = {
    "llama-1b": ScaleModel(
        label="Llama-3.2-1B shape (1.24B, tied), FSDP2 x 4",
        config_class="LlamaConfig",
        fields={
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "max_position_embeddings": 8192,
        },
    ),
    "qwen3-moe": ScaleModel(
        label="Qwen3-30B-A3B widths, 2 layers, 64 experts (1.26B), EP 4 + FSDP2",
        config_class="Qwen3MoeConfig",
        fields={
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 2,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "max_position_embeddings": 8192,
        },
        ep_size=RANKS,
    ),
}


def _config(model: ScaleModel) -> Any:
    import transformers

    config = getattr(transformers, model.config_class)(**model.fields, use_cache=False)
    config.dtype = torch.bfloat16  # written into config.json: what from_pretrained and the meta model use
    return config


def write_checkpoint(name: str, folder: Path) -> tuple[Path, float]:
    """Random bf16 weights of ``MODELS[name]`` saved with ``save_pretrained``; path and size in MiB."""
    from transformers import AutoModelForCausalLM

    path = folder / name
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(_config(MODELS[name]), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    gc.collect()
    return path, sum(f.stat().st_size for f in path.glob("*.safetensors")) / MiB


def _batch(vocab: int) -> torch.Tensor:
    """The global batch: ``RANKS`` rows of ``SEQ + 1`` token ids (inputs and shifted labels)."""
    return torch.randint(0, vocab, (RANKS, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=False: one parameter at a time, as large models are stepped where memory is tight; the
    # same choice for both sides.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-4, foreach=False)
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def _train_step(model: torch.nn.Module, ids: torch.Tensor, kind: str, meter: _Meter) -> float:
    opt = _optimizer(kind, model)
    out = model(input_ids=ids[:, :-1], labels=ids[:, :-1].clone())
    meter.mark("forward")
    out.loss.backward()
    meter.mark("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    meter.mark("step")
    return float(out.loss.detach())


def baseline(path: str, kind: str) -> dict[str, Any]:
    """Plain transformers in one process: ``from_pretrained``, one step on the whole global batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = _batch(AutoConfig.from_pretrained(path).vocab_size)
    meter = _Meter()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path)
    load_s = time.perf_counter() - start
    meter.mark("load")
    start = time.perf_counter()
    loss = _train_step(model, ids, kind, meter)
    return {
        "peak": meter.peak,
        "phases": meter.phases,
        "load_s": load_s,
        "step_s": time.perf_counter() - start,
        "loss": loss,
    }


def infrastructure(name: str, cpu_runtime: bool = False) -> tuple[Any, Any]:
    """The mesh and infrastructure of ``MODELS[name]`` with the default `FSDP2Config` (collective)."""
    from automodel_cpu import CPURuntime
    from automodel_distributed import FSDP2Config
    from automodel_infra import instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe import MoEParallelizerConfig

    spec = MODELS[name]
    config = FSDP2Config(host_runtime=CPURuntime() if cpu_runtime else None)
    mesh = MeshContext.build(config, ParallelismSizes(ep_size=spec.ep_size))
    infra = instantiate_infrastructure(
        distributed_config=config,
        moe_config=MoEParallelizerConfig() if spec.ep_size > 1 else None,
        mesh=mesh,
        device=torch.device("cpu"),
    )
    return mesh, infra


def sharded_model(hf_config: Any, mesh: Any, infra: Any, path: str | None = None) -> torch.nn.Module:
    """A bf16 meta model of ``hf_config`` through `apply_model_infrastructure` (collective).

    Loaded from ``path`` when given; else its weights are left for `initialize_model_weights`.
    """
    from transformers import AutoModelForCausalLM

    from automodel_infra import apply_model_infrastructure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        return apply_model_infrastructure(
            model,
            is_meta_device=True,
            device=torch.device("cpu"),
            model_wrapper=infra.model_wrapper,
            mesh=mesh,
            parallelize_fn=infra.parallelize_fn,
            load_base_model=path is not None,
            pretrained_model_name_or_path=path or "",
        )


def ours(name: str, path: str, kind: str, cpu_runtime: bool) -> dict[str, Any]:
    """One rank: meta model, the public API with ``load_base_model=True``, one step on this rank's row."""
    from transformers import AutoConfig

    mesh, infra = infrastructure(name, cpu_runtime)
    hf_config = AutoConfig.from_pretrained(path)
    rank = dist.get_rank()
    ids = _batch(hf_config.vocab_size)[rank : rank + 1]
    dist.barrier()
    meter = _Meter()
    start = time.perf_counter()
    model = sharded_model(hf_config, mesh, infra, path)
    dist.barrier()
    load_s = time.perf_counter() - start
    meter.mark("load")
    start = time.perf_counter()
    loss = _train_step(model, ids, kind, meter)
    step_s = time.perf_counter() - start
    return {"peak": meter.peak, "phases": meter.phases, "load_s": load_s, "step_s": step_s, "loss": loss}


@dataclass
class ScaleResult:
    """One model and optimizer: the baseline and ours per host setting (label -> per-rank results)."""

    model: str
    optimizer: str
    checkpoint_mib: float
    baseline: dict[str, Any]
    ours: dict[str, list[dict[str, Any]]]


def measure(
    names: Sequence[str] = tuple(MODELS),
    optimizers: Sequence[str] = ("sgd", "adamw"),
    settings: Sequence[HostSetting] = HOST_SETTINGS[:2],
    folder: Path | None = None,
) -> list[ScaleResult]:
    """Write each checkpoint, then run the baseline and ours (each setting) per optimizer.

    AdamW runs on the dense model only (``llama-1b``), the case the issue names; SGD on every model.
    """
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=folder) as tmp:
        for name in names:
            path, size = write_checkpoint(name, Path(tmp))
            for kind in optimizers:
                if kind == "adamw" and MODELS[name].ep_size > 1:
                    continue
                (base,) = launch(baseline, 1, str(path), kind, init_process_group=False, timeout_s=3600)
                per_setting = {
                    s.label: launch(
                        ours, RANKS, name, str(path), kind, s.cpu_runtime, timeout_s=3600, env=s.env()
                    )
                    for s in settings
                }
                results.append(ScaleResult(name, kind, size, base, per_setting))
    return results


def phases_text(phases: dict[str, float]) -> str:
    """``load 616, forward 2220, ...``: a process's peak growth (MiB) after each phase."""
    return ", ".join(f"{k} {v:.0f}" for k, v in phases.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--optimizer", nargs="+", choices=("sgd", "adamw"), default=["sgd", "adamw"])
    parser.add_argument("--settings", type=int, default=2, help="how many of HOST_SETTINGS to run (1-3)")
    args = parser.parse_args()
    for r in measure(args.only, args.optimizer, HOST_SETTINGS[: args.settings]):
        base = r.baseline
        print(
            f"{MODELS[r.model].label}, {r.optimizer}, checkpoint {r.checkpoint_mib:.0f} MiB, "
            f"{RANKS} x {SEQ} tokens"
        )
        print(
            f"  transformers, 1 process: peak {base['peak']:.0f} MiB ({phases_text(base['phases'])}), "
            f"load {base['load_s']:.1f} s, step {base['step_s']:.1f} s, loss {base['loss']:.4f}"
        )
        for label, per_rank in r.ours.items():
            worst = max(per_rank, key=lambda x: x["peak"])
            mean_loss = sum(x["loss"] for x in per_rank) / len(per_rank)
            print(
                f"  ours [{label}]: peak {worst['peak']:.0f} MiB ({worst['peak'] / base['peak']:.2f}; "
                f"{phases_text(worst['phases'])}), load {max(x['load_s'] for x in per_rank):.1f} s, "
                f"step {max(x['step_s'] for x in per_rank):.1f} s, mean loss {mean_loss:.4f}"
            )


if __name__ == "__main__":
    main()
