"""The worker process of ``automodel train`` (started by the elastic launcher, one per rank).

Receives the job as JSON in the ``AUTOMODEL_JOB`` environment variable, then: stop-signal handlers
(SIGTERM, SIGUSR1) -> process group (gloo on CPU, nccl on CUDA) -> the rows the launcher prepared ->
mesh (`MeshContext.build`) -> `instantiate_infrastructure` -> the model on meta ->
`apply_model_infrastructure` -> AdamW -> resume from the newest verified checkpoint (with ``--resume``,
and always when the launcher restarted the workers after a failure) -> the training loop
(`automodel_all.cli.loop`) -> the Hugging Face export, a sample and the loss curve (rank 0).

A stop signal ends the loop after the step in progress with a checkpoint; the worker then exits 0
without exporting (the next launch with ``--resume`` continues exactly).
"""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_all.cli.config import JobConfig, build_job, resolve_job
from automodel_all.cli.data import load_data
from automodel_all.cli.export import export_hf, generate_sample
from automodel_all.cli.guards import StopRequest
from automodel_all.cli.loop import LoopResult, data_identity, train_loop
from automodel_all.cli.metrics import MetricsWriter, plot_losses, truncate_logs
from automodel_all.cli.model import (
    build_meta_model,
    is_image_text_model,
    load_model_config,
    load_processor,
    text_tokenizer,
)
from automodel_all.cli.resume import ResumePoint, resume_from_checkpoint
from automodel_all.cli.run_state import TrainingRun
from automodel_all.cli.steps import TokenLoss
from automodel_all.cli.utilization import Utilization
from automodel_all.cli.yaml_source import RawJob
from automodel_distributed.strategy import as_strategy

__all__ = ["JOB_ENV", "main"]

JOB_ENV = "AUTOMODEL_JOB"
"""Environment variable carrying the job (JSON of its sections) from the launcher to the workers."""


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:  # numpy is optional here
        pass


def restart_count() -> int:
    """How often the elastic launcher restarted this worker group (``TORCHELASTIC_RESTART_COUNT``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _init_process_group(job: JobConfig) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(minutes=job.launch.timeout_minutes)
    if dist.is_initialized():  # a caller running several jobs in one process group (benchmarks)
        return torch.device("cuda", local_rank) if job.device_type == "cuda" else torch.device("cpu")
    options: dict[str, Any] = {"timeout": timeout}
    restarts = restart_count()
    if restarts:
        # torchrun restarts the workers against the same store server, which still holds the keys the
        # previous generation wrote (each process group's peer addresses): a new group of the same name
        # would read them and wait on dead peers. One key prefix per restart keeps generations apart.
        from torch.distributed.distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous

        store, rank, world = next(rendezvous("env://", timeout=timeout))
        options.update(store=PrefixStore(f"automodel/restart_{restarts}", store), rank=rank, world_size=world)
    if job.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, **options)
        return device
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", **options)
    return torch.device("cpu")


def _parts(model: Any) -> list[nn.Module]:
    return list(model.parts) if not isinstance(model, nn.Module) else [model]


def _check_adapters_exportable(parts: list[nn.Module]) -> None:
    """Refuse, before training, LoRA targets that the PEFT-format export could not hold (collective)."""
    from automodel_checkpoint.ranks import agree_on_failure
    from automodel_peft import peft_reload_problem

    problem = next((found for part in parts if (found := peft_reload_problem(part))), None)
    agree_on_failure(ValueError(f"peft: {problem}") if problem else None, "checking the LoRA targets")


def _setup(job: JobConfig) -> TrainingRun:
    """Process group, mesh, infrastructure, data, the model and its optimizer (collective)."""
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext

    device = _init_process_group(job)
    tokenizer = load_processor(job.data.tokenizer or job.model.name_or_path or "")
    model_config = load_model_config(job, text_tokenizer(tokenizer).eos_token_id)
    resolved = resolve_job(job, dist.get_world_size(), model_config)  # fills in a default micro-batch
    _seed(job.train.seed)
    rows, eval_rows = load_data(job.train.output_dir, streaming=job.data.streaming)
    mesh = MeshContext.build(
        job.distributed,
        job.parallelism,
        world_size=resolved.world_size,
        timeout_minutes=job.launch.timeout_minutes,
    )
    infra = instantiate_infrastructure(
        distributed_config=job.distributed,
        pipeline_config=resolved.pipeline,
        qat_config=job.qat,
        moe_config=job.moe,
        device=device,
        mesh=mesh,
    )
    compiled = job.compile is not None and job.compile.enabled and job.compile.compile_loss
    loss_fn = TokenLoss(1.0, compiled=compiled)  # the loop sets each step's denominator (tokens / dp_cp)
    path = job.model.name_or_path or ""
    model = apply_model_infrastructure(
        build_meta_model(job, model_config),
        is_meta_device=True,
        device=device,
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        peft_config=job.peft,
        fp8_config=job.fp8,
        qat_quantizer=infra.qat_quantizer,
        loss_fn=loss_fn,
        autopipeline=infra.autopipeline,
        parallelize_fn=infra.parallelize_fn,
        compile_config=job.compile,
        load_base_model=bool(path) and job.model.load_weights,
        pretrained_model_name_or_path=path,
        freeze_config=job.freeze_config,
    )
    parts = _parts(model)
    if job.peft is not None:
        _check_adapters_exportable(parts)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=job.train.lr, betas=(0.9, 0.95), weight_decay=job.train.weight_decay
    )
    strategy = as_strategy(infra.model_wrapper, mesh)
    utilization = (
        Utilization.of(job, resolved, model_config, device)
        if dist.get_rank() == 0
        else Utilization(None, None)
    )
    return TrainingRun(
        job=job,
        resolved=resolved,
        device=device,
        mesh=mesh,
        tokenizer=tokenizer,
        model_config=model_config,
        rows=rows,
        eval_rows=eval_rows,
        model=model,
        parts=parts,
        optimizer=optimizer,
        loss_fn=loss_fn,
        strategy=strategy,
        utilization=utilization,
    )


def _resume(run: TrainingRun) -> ResumePoint:
    """Where to start: the newest verified checkpoint when resuming, else step 0 (collective).

    Resumes when ``train.resume`` is set and always after a restart by the launcher (a failed worker
    group restarted with ``launch.max_restarts``). Rank 0 also trims the logs to the steps before it.
    """
    rank = dist.get_rank()
    restarts = restart_count()
    start = ResumePoint(0, 0, None)
    if run.job.train.resume or restarts:
        start = resume_from_checkpoint(
            run.state_module,
            run.optimizer,
            run.out,
            fallback=run.job.train.resume_fallback,
            data=data_identity(run),
            device=run.device,
            parts=run.parts if len(run.parts) > 1 or run.pipeline is not None else None,
        )
        if rank == 0:
            why = f" (restart {restarts} by the launcher)" if restarts else ""
            if start.path is None:
                root = run.out / "checkpoints"
                print(f"resume{why}: no complete checkpoint under {root}; starting from step 0")
            else:
                print(f"resumed from {start.path} (step {start.step}){why}", flush=True)
    if rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
        truncate_logs(run.out, start.step)
    return start


def _finish(run: TrainingRun) -> Path:
    """Export the Hugging Face model (collective) and, on rank 0, print where and a sample.

    Returns:
        The exported model's folder.
    """
    hf_dir = export_hf(
        run.parts, run.out / "hf", tokenizer=run.tokenizer, with_adapters=run.job.peft is not None
    )
    train_cfg = run.job.train
    if dist.get_rank() == 0:
        multimodal = is_image_text_model(run.model_config)
        auto = "AutoModelForImageTextToText" if multimodal else "AutoModelForCausalLM"
        print(f"saved the trained model to {hf_dir.resolve()} (load it with {auto}.from_pretrained)")
        if train_cfg.sample_tokens and multimodal:
            warnings.warn(
                "train.sample_tokens is ignored for a vision-language model (the sample is a text prompt); "
                "set it to 0 to silence this",
                stacklevel=2,
            )
        elif train_cfg.sample_tokens:
            chat = run.job.data.format == "messages"
            text = generate_sample(
                hf_dir, train_cfg.sample_prompt, train_cfg.sample_tokens, train_cfg.seed, chat=chat
            )
            print(f"sample: {text!r}", flush=True)
        if train_cfg.plot is not False:
            png = plot_losses(run.out, required=train_cfg.plot is True)
            if png is not None:
                print(f"loss curve: {png.resolve()}", flush=True)
    return hf_dir


def _report_preemption(run: TrainingRun, result: LoopResult) -> None:
    if dist.get_rank() == 0:
        print(
            f"stopped by {result.signal_name} after step {result.step}: saved a checkpoint under "
            f"{run.out / 'checkpoints'}; run the same command with --resume to continue",
            flush=True,
        )


def train(job: JobConfig, stop: StopRequest | None = None) -> None:
    """Run the job on this rank. Every rank of the world calls it, with the same job."""
    stop = stop or StopRequest()
    # Rank 0 opens the metric sinks before the process group exists: one that cannot open (a tracker
    # that refuses) stops this worker, and the launcher stops the rest, before anyone waits on it.
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    metrics = MetricsWriter(job.report, Path(job.train.output_dir), job.raw.to_plain(), enabled=rank == 0)
    final_model = None
    try:
        run = _setup(job)
        result = train_loop(run, _resume(run), stop, metrics)
        if result.outcome == "preempted":
            _report_preemption(run, result)
        else:
            final_model = str(_finish(run).resolve())
    finally:
        metrics.close(final_model)
    dist.destroy_process_group()


def _quiet() -> None:
    """Keep the workers' output to the progress bar and the results."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in ("torch.distributed", "torch.utils._pytree", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")


def main() -> None:
    """Entry point of a worker: ``python -m automodel_all.cli.train`` with ``AUTOMODEL_JOB`` set."""
    _quiet()
    text = os.environ.get(JOB_ENV)
    if not text:
        raise SystemExit(f"{JOB_ENV} is not set: workers are started by `automodel train`")
    stop = StopRequest().install()  # before anything slow, so an early signal is not lost
    train(build_job(RawJob(sections=json.loads(text))), stop)


if __name__ == "__main__":
    main()
