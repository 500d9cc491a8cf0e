"""Prepare and validate a job, then start its workers through PyTorch's elastic launcher.

Everything that can be wrong with a job is checked here, in the launching process, before any worker
starts: the sections, the mesh layout for the world size, the batch sizes, the model's shape and the
data path. Workers are started with ``torch.distributed.run`` (what ``torchrun`` runs), called in
process with the same flags, so multi-node runs, Slurm and elastic restarts work as with torchrun.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from automodel_all.cli.config import JobConfig, ResolvedJob, build_job, resolve_job
from automodel_all.cli.default_job import builtin_corpus, train_tokenizer
from automodel_all.cli.model import load_model_config, model_dtype
from automodel_all.cli.train import JOB_ENV
from automodel_all.cli.yaml_source import ConfigError, RawJob

__all__ = ["launch", "nproc_per_node", "prepare_job", "torchrun_args"]


def nproc_per_node(job: JobConfig) -> int:
    """Workers on this node: ``launch.nproc_per_node``, else every visible GPU, else 2 on CPU."""
    if job.launch.nproc_per_node is not None:
        return job.launch.nproc_per_node
    return torch.cuda.device_count() if job.device_type == "cuda" else 2


def _ensure_tokenizer(raw: RawJob, job: JobConfig) -> None:
    """The embedded default trains its tokenizer once, under the output folder."""
    if job.data.tokenizer is not None or job.model.name_or_path is not None:
        return
    folder = Path(job.train.output_dir).resolve() / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        documents = builtin_corpus()
        staging = folder.with_name(f".tokenizer.{os.getpid()}")
        train_tokenizer(documents, staging)
        # Another node sharing the folder may have published the same tokenizer first.
        with contextlib.suppress(OSError):
            staging.rename(folder)
    raw.set("data", "tokenizer", str(folder), "the embedded default")


def _ensure_initial_weights(raw: RawJob, job: JobConfig) -> None:
    """Give the embedded default model initial weights that do not depend on the world size.

    Initialising a sharded meta model draws each rank's shard from that rank's generator, so the
    starting point would change with the layout. The default model is small: it is initialised once
    here, in one process (seeded with ``train.seed``), saved under the output folder, and every worker
    loads its shards from it, so runs on 1, 2 or 8 ranks start from the same weights.
    """
    if job.model.name_or_path is not None:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(job.data.tokenizer)
    config = load_model_config(job, tokenizer.eos_token_id)
    identity = json.dumps([config.to_dict(), job.model.dtype, job.train.seed], sort_keys=True, default=str)
    digest = hashlib.sha1(identity.encode()).hexdigest()[:12]
    folder = Path(job.train.output_dir) / "init" / digest
    if not (folder / "config.json").is_file():
        torch.manual_seed(job.train.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=model_dtype(job))
        staging = folder.with_name(f".{digest}.{os.getpid()}")
        model.save_pretrained(str(staging))
        with contextlib.suppress(OSError):  # another node published the same weights first
            staging.rename(folder)
    raw.set("model", "name_or_path", str(folder), "the embedded default")


def prepare_job(raw: RawJob, *, world_size: int | None = None) -> tuple[ResolvedJob, dict[str, Any]]:
    """Build and validate the job; return it resolved for its world size and the plain sections.

    Side effects: resolves ``launch.device`` (``auto``) and the output folder to absolute values in
    ``raw``, and trains the default tokenizer when the embedded default needs it.

    Raises:
        ConfigError: Any problem, naming the setting and where it came from.
    """
    job = build_job(raw)
    raw.set("launch", "device", job.device_type, raw.where("launch", "device"))
    raw.set(
        "train", "output_dir", str(Path(job.train.output_dir).resolve()), raw.where("train", "output_dir")
    )
    job = build_job(raw)
    if job.device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{raw.where('launch', 'device')}: launch.device=cuda but no CUDA device is visible"
        )
    nproc = nproc_per_node(job)
    if job.device_type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"{raw.where('launch', 'nproc_per_node')}: nproc_per_node={nproc} but only "
            f"{torch.cuda.device_count()} GPU(s) are visible"
        )
    if job.data.path is not None and not Path(job.data.path).exists():
        raise ConfigError(f"{raw.where('data', 'path')}: data.path {job.data.path} does not exist")
    _ensure_tokenizer(raw, job)
    job = build_job(raw)
    _ensure_initial_weights(raw, job)
    job = build_job(raw)
    model_config = load_model_config(job)
    world = world_size if world_size is not None else job.launch.nnodes * nproc
    resolved = resolve_job(job, world, model_config)
    # Workers get the resolved micro-batch explicitly (resolve_job may have chosen it).
    raw.set(
        "train",
        "micro_batch_size",
        resolved.job.train.micro_batch_size,
        raw.where("train", "micro_batch_size"),
    )
    return resolved, raw.to_plain()


def torchrun_args(job: JobConfig) -> list[str]:
    """The ``torchrun`` flags for this job (the worker module last)."""
    launch = job.launch
    args = ["--nnodes", str(launch.nnodes), "--nproc-per-node", str(nproc_per_node(job))]
    args += ["--max-restarts", str(launch.max_restarts)]
    if launch.rdzv_endpoint:
        args += ["--rdzv-backend", launch.rdzv_backend, "--rdzv-endpoint", launch.rdzv_endpoint]
        args += ["--rdzv-id", launch.rdzv_id, "--node-rank", str(launch.node_rank)]
    elif launch.master_addr:
        args += ["--node-rank", str(launch.node_rank), "--master-addr", launch.master_addr]
        args += ["--master-port", str(launch.master_port or 29500)]
    elif launch.nnodes == 1:
        if launch.master_port is not None:
            args += ["--master-port", str(launch.master_port)]
        else:
            args += ["--standalone"]  # a free port, so concurrent single-node jobs do not collide
    else:
        raise ConfigError(
            f"{job.raw.where('launch')}: launch.nnodes={launch.nnodes} needs --rdzv-endpoint HOST:PORT "
            "(or --master-addr with --node-rank) so the nodes can find each other"
        )
    return [*args, "--module", "automodel_all.cli.train"]


def launch(resolved: ResolvedJob, plain: dict[str, Any]) -> int:
    """Start the workers and wait for them; return the exit status (0 when every worker succeeded)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    job = resolved.job
    os.environ[JOB_ENV] = json.dumps(plain)
    if job.device_type == "cpu":
        # One thread per worker: several workers share the cores (torchrun would also warn about it).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = get_args_parser().parse_args(torchrun_args(job))
    try:
        run(args)
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures.values(), key=lambda f: f.timestamp) if failures else None
        where = f" (first: rank {first.local_rank}, exit code {first.exitcode})" if first is not None else ""
        print(
            f"automodel train: {len(failures)} worker(s) failed{where}; see their output above",
            file=sys.stderr,
        )
        return 1
    return 0
