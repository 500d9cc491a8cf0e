"""The worker process of ``automodel train`` (started by the elastic launcher, one per rank).

Receives the job as JSON in the ``AUTOMODEL_JOB`` environment variable, then: process group (gloo on
CPU, nccl on CUDA) -> mesh (`MeshContext.build`) -> `instantiate_infrastructure` -> the model on meta
-> `apply_model_infrastructure` -> AdamW -> optional resume from the latest distributed checkpoint ->
the training loop -> periodic distributed checkpoints -> the Hugging Face export and a sample (rank 0).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_all.cli.config import JobConfig, ResolvedJob, build_job, resolve_job
from automodel_all.cli.data import RowSampler, pack_rows, read_documents
from automodel_all.cli.default_job import builtin_corpus
from automodel_all.cli.export import export_hf, generate_sample, prune_checkpoints
from automodel_all.cli.model import build_meta_model, load_model_config, model_dtype
from automodel_all.cli.progress import Progress
from automodel_all.cli.steps import TokenLoss, clip_gradients, lr_at, run_step
from automodel_all.cli.yaml_source import RawJob
from automodel_distributed.strategy import StrategyManager, as_strategy

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


def _init_process_group(job: JobConfig) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(minutes=job.launch.timeout_minutes)
    if job.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def _load_rows(job: JobConfig, tokenizer: Any) -> torch.Tensor:
    documents = read_documents(job.data.path, job.data.text_key) if job.data.path else builtin_corpus()
    return pack_rows(documents, tokenizer, job.data.seq_len)


def _dp_coordinates(resolved: ResolvedJob, mesh: Any) -> tuple[int, int]:
    """This rank's data-parallel index and the data-parallel size."""
    if mesh.device_mesh is None:  # DDP: every rank is a data-parallel rank
        return dist.get_rank(), dist.get_world_size()
    group = mesh.get_group("dp")
    return dist.get_rank(group), resolved.dp_size


def _parts(model: Any) -> list[nn.Module]:
    return list(model.parts) if not isinstance(model, nn.Module) else [model]


def _log(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _truncate_log(path: Path, last_step: int) -> None:
    """Keep the log lines of steps up to ``last_step`` (a resumed run rewrites what follows)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


@dataclass
class _Run:
    """Everything the loop needs, built once by `_setup` on every rank."""

    job: JobConfig
    resolved: ResolvedJob
    device: torch.device
    mesh: Any
    tokenizer: Any
    model_config: Any
    rows: torch.Tensor
    model: Any
    """`apply_model_infrastructure`'s result: a module, or the `AutoPipeline`."""
    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    loss_fn: TokenLoss
    strategy: StrategyManager
    """The strategy manager: autocast and gradient sync of every step go through it."""
    expert_load: Any
    """An `automodel_moe.ExpertLoad` on every rank for a mixture-of-experts model, else None."""

    @property
    def pipeline(self) -> Any:
        """The `AutoPipeline` under pipeline parallelism, else None."""
        return self.model if not isinstance(self.model, nn.Module) else None

    @property
    def state_module(self) -> nn.Module:
        """What distributed checkpoints save: the model, or this rank's pipeline stages."""
        return self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)

    @property
    def out(self) -> Path:
        """The output folder."""
        return Path(self.job.train.output_dir)


def _setup(job: JobConfig) -> _Run:
    """Process group, mesh, infrastructure, data, the model and its optimizer (collective)."""
    from transformers import AutoTokenizer

    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext
    from automodel_moe import ExpertLoad, find_experts

    device = _init_process_group(job)
    tokenizer = AutoTokenizer.from_pretrained(job.data.tokenizer or job.model.name_or_path)
    model_config = load_model_config(job, tokenizer.eos_token_id)
    resolved = resolve_job(job, dist.get_world_size(), model_config)  # fills in a default micro-batch
    _seed(job.train.seed)
    rows = _load_rows(job, tokenizer)
    if int(rows.max()) >= model_config.vocab_size:
        raise ValueError(
            f"the tokenizer produces id {int(rows.max())} but the model's vocabulary has "
            f"{model_config.vocab_size} entries; use the model's own tokenizer (data.tokenizer)"
        )
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
    layout = resolved.layout
    loss_fn = TokenLoss(job.train.global_batch_size * job.data.seq_len / layout.dp_cp)
    path = job.model.name_or_path or ""
    meta_model = build_meta_model(job, model_config)
    # The expert count of the whole model (same on every rank, so every rank joins the load's collective,
    # also one whose pipeline stages hold no MoE layer).
    expert_counts = {site.num_experts for site in find_experts(meta_model)}
    model = apply_model_infrastructure(
        meta_model,
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
    )
    parts = _parts(model)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=job.train.lr, betas=(0.9, 0.95), weight_decay=job.train.weight_decay
    )
    strategy = as_strategy(infra.model_wrapper, mesh)
    expert_load = (
        ExpertLoad.attach(parts, ep_size=mesh.ep_size, num_experts=min(expert_counts))
        if expert_counts
        else None
    )
    return _Run(
        job,
        resolved,
        device,
        mesh,
        tokenizer,
        model_config,
        rows,
        model,
        parts,
        optimizer,
        loss_fn,
        strategy,
        expert_load,
    )


def _resume(run: _Run) -> int:
    """Load the newest complete distributed checkpoint when ``train.resume``; return the step to start at.

    Rank 0 also trims ``train_log.jsonl`` to the steps before it (collective when a checkpoint loads).
    """
    from automodel_distributed.checkpoint import latest_checkpoint, load_distributed_checkpoint

    rank = dist.get_rank()
    root = run.out / "checkpoints"
    start = 0
    if run.job.train.resume:
        latest = latest_checkpoint(root, kind="dcp")
        if latest is None:
            if rank == 0:
                print(f"--resume: no complete checkpoint under {root}; starting from step 0", flush=True)
        else:
            start = load_distributed_checkpoint(run.state_module, run.optimizer, latest).step or 0
            if rank == 0:
                print(f"resumed from {latest} (step {start})", flush=True)
    if rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
        log = run.out / "train_log.jsonl"
        if start == 0:
            log.unlink(missing_ok=True)
        _truncate_log(log, start)
    return start


def _loop(run: _Run, start: int) -> None:
    """Train from step ``start`` to ``train.steps``, logging and checkpointing (collective)."""
    from automodel_distributed.checkpoint import save_distributed_checkpoint

    job, layout, train_cfg = run.job, run.resolved.layout, run.job.train
    rank = dist.get_rank()
    sampler = RowSampler(run.rows.shape[0], train_cfg.global_batch_size, train_cfg.seed)
    dp_rank, dp_size = _dp_coordinates(run.resolved, run.mesh)
    pp_group = run.mesh.get_group("pp") if layout.pp > 1 else None
    tokens_per_step = train_cfg.global_batch_size * job.data.seq_len
    loss_scale = tokens_per_step * layout.tp  # tp ranks compute the same loss
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    precompute_fp8 = (
        job.fp8 is not None and job.fp8.enabled and job.fp8.precompute_float8_dynamic_scale_for_fsdp
    )
    progress = Progress(total=train_cfg.steps, initial=start, enabled=rank == 0, device=run.device)
    for step in range(start, train_cfg.steps):
        began = time.perf_counter()
        lr = lr_at(
            step,
            lr=train_cfg.lr,
            warmup_steps=train_cfg.warmup_steps,
            total_steps=train_cfg.steps,
            min_lr_ratio=train_cfg.min_lr_ratio,
        )
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        local = run_step(
            run.model if run.pipeline is None else None,
            run.rows[sampler.indices(step, dp_rank, dp_size)].to(run.device),
            loss_fn=run.loss_fn,
            micro_batch_size=train_cfg.micro_batch_size,
            strategy=run.strategy,
            pipeline=run.pipeline,
            cp_mesh=run.mesh if layout.cp > 1 else None,
        )
        grad_norm = float("nan")
        if train_cfg.max_grad_norm:
            grad_norm = clip_gradients(params, train_cfg.max_grad_norm, pp_group)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if precompute_fp8:
            from automodel_quant.fp8 import precompute_fp8_scales_for_fsdp

            for part in run.parts:
                precompute_fp8_scales_for_fsdp(part)
        dist.all_reduce(local)
        loss = float(local) / loss_scale
        # Collective on every rank: the step's tokens per expert, over the ranks.
        balance = run.expert_load.summary() if run.expert_load is not None else None
        elapsed = time.perf_counter() - began
        done = step + 1
        extra = f"moe_imbalance={balance['imbalance']:.2f}" if balance is not None else ""
        progress.update(loss=loss, tokens_per_s=tokens_per_step / elapsed, extra=extra)
        if rank == 0:
            record: dict[str, Any] = {
                "step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm, "seconds": elapsed
            }  # fmt: skip
            if balance is not None:
                record["expert_load"] = balance
            _log(run.out / "train_log.jsonl", record)
        if done == train_cfg.steps or (train_cfg.checkpoint_every and done % train_cfg.checkpoint_every == 0):
            root = run.out / "checkpoints"
            save_distributed_checkpoint(
                run.state_module, run.optimizer, root / f"step_{done:08d}", step=done, overwrite=True
            )
            if rank == 0:
                prune_checkpoints(root, train_cfg.keep_checkpoints)
            dist.barrier()
    progress.close()


def _finish(run: _Run) -> None:
    """Export the Hugging Face model (collective) and, on rank 0, print where and a sample."""
    from automodel_distributed.checkpoint import latest_checkpoint

    hf_dir = export_hf(
        run.model if run.pipeline is None else None,
        run.out / "hf",
        tokenizer=run.tokenizer,
        with_adapters=run.job.peft is not None and run.pipeline is None,
        final_dcp=latest_checkpoint(run.out / "checkpoints", kind="dcp"),
        model_config=run.model_config,
        dtype=model_dtype(run.job),
    )
    train_cfg = run.job.train
    if dist.get_rank() == 0:
        print(
            f"saved the trained model to {hf_dir.resolve()} "
            "(load it with AutoModelForCausalLM.from_pretrained)"
        )
        if train_cfg.sample_tokens:
            text = generate_sample(hf_dir, train_cfg.sample_prompt, train_cfg.sample_tokens, train_cfg.seed)
            print(f"sample: {text!r}", flush=True)


def train(job: JobConfig) -> None:
    """Run the job on this rank. Every rank of the world calls it, with the same job."""
    run = _setup(job)
    _loop(run, _resume(run))
    _finish(run)
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
    train(build_job(RawJob(sections=json.loads(text))))


if __name__ == "__main__":
    main()
