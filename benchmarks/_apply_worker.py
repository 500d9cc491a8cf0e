"""One rank of the "same job" benchmark: build a Llama on meta, apply the infrastructure, take steps.

Launched by ``torchrun`` from `bench_vs_nemo.py`, once with ``--impl automodel`` (our workspace
environment) and once with ``--impl nemo`` (a scratch environment holding ``nemo-automodel`` from
PyPI). The script imports only torch, transformers and the implementation under test, so the same
file runs in both environments and both jobs are the same code up to the two calls being compared:
``instantiate_infrastructure`` + ``apply_model_infrastructure`` (FSDP2 over every rank, fp32
parameters and reduction, load the checkpoint straight into the shards).

One implementation per process (NeMo patches FSDP2 classes globally, so the two must not share one):
the apply time, the peak host memory growth over apply and over apply + the first step (``VmHWM``
after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` before), the median time of
the following SGD steps, and every loss. Each rank writes a JSON object to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

MiB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _apply_automodel(model: Any, path: str, device: Any, cpu_runtime: bool = True) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_cpu import CPURuntime
    from automodel_distributed.config import FSDP2Config
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext, ParallelismSizes

    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        host_runtime=CPURuntime() if cpu_runtime else None,
    )
    mesh = MeshContext.build(config, ParallelismSizes())
    wrapper, pipeline, parallelize_fn, qat = instantiate_infrastructure(
        distributed_config=config, mesh=mesh, device=device
    )
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=device,
        model_wrapper=wrapper,
        mesh=mesh,
        autopipeline=pipeline,
        parallelize_fn=parallelize_fn,
        qat_quantizer=qat,
        load_base_model=True,
        pretrained_model_name_or_path=path,
    )


def _apply_nemo(model: Any, path: str, device: Any) -> Any:
    import torch
    from nemo_automodel._transformers.infrastructure import (
        apply_model_infrastructure,
        instantiate_infrastructure,
    )
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    )
    mesh = MeshContext.build(config, ParallelismSizes())
    wrapper, pipeline, parallelize_fn, qat = instantiate_infrastructure(
        distributed_config=config, mesh=mesh, device=device
    )
    return apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=device,
        model_wrapper=wrapper,
        mesh=wrapper,
        autopipeline=pipeline,
        parallelize_fn=parallelize_fn,
        qat_quantizer=qat,
        load_base_model=True,
        pretrained_model_name_or_path=path,
    )


def _build(checkpoint: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), config.vocab_size


def _steps(model: Any, opt: Any, ids: Any, steps: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    losses, times = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    return losses, times


def _one(impl: str, checkpoint: str, seq: int, steps: int, cpu_runtime: bool) -> dict[str, Any]:
    """Fresh process, one implementation: apply time, peak memory of apply and of the first step, then
    the median time of ``steps`` more SGD steps and every loss."""
    import torch
    import torch.distributed as dist

    model, vocab = _build(checkpoint)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    dist.barrier()
    gc.collect()
    base = _reset_peak()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if impl == "automodel":
            model = _apply_automodel(model, checkpoint, torch.device("cpu"), cpu_runtime)
        else:
            model = _apply_nemo(model, checkpoint, torch.device("cpu"))
    dist.barrier()
    apply_s = time.perf_counter() - start
    apply_peak = (_status("VmHWM") - base) / MiB
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, _ = _steps(model, opt, ids, 1)
    peak = (_status("VmHWM") - base) / MiB
    more_losses, times = _steps(model, opt, ids, steps)
    return {
        "apply_s": apply_s,
        "apply_peak_mib": apply_peak,
        "peak_mib": peak,
        "step_s": statistics.median(times),
        "losses": losses + more_losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("automodel", "nemo"), required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5, help="timed SGD steps after the first")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--cpu-runtime",
        choices=("true", "false"),
        default="true",
        help="give the automodel job automodel_cpu.CPURuntime() (FSDP2Config.host_runtime)",
    )
    args = parser.parse_args()
    if args.impl != "automodel":
        # nemo-automodel 0.7.0 decorates a LoRA kernel with `triton.autotune(key=["S", ...])` at import
        # time, which recent triton rejects ("key contains names that are not kernel arguments: S").
        # Nothing here runs triton on CPU, so make `import triton` fail: nemo then takes its own
        # no-triton path.
        sys.modules["triton"] = None  # type: ignore[assignment]

    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.impl == "nemo":  # imports before any timing
        import nemo_automodel._transformers.infrastructure  # noqa: F401
    else:
        import automodel_infra.infrastructure  # noqa: F401
    result = _one(args.impl, args.checkpoint, args.seq, args.steps, args.cpu_runtime == "true")
    result["torch"], result["transformers"] = torch.__version__, transformers.__version__
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
