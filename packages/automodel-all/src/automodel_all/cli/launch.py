"""Prepare and validate a job, then start its workers through PyTorch's elastic launcher.

Everything that can be wrong with a job is checked here, in the launching process, before any worker
starts: the sections, the mesh layout for the world size, the batch sizes, the model's shape and the
data, which is read, tokenized and laid out in rows here, once (`prepare_data`), or, streamed, checked by
its first records (`prepare_stream`). Workers are started
with ``torch.distributed.run`` (what ``torchrun`` runs), called in process with the same flags, so
multi-node runs, Slurm and elastic restarts work as with torchrun.

Signals: SIGTERM and SIGUSR1 (preemption) are forwarded to the workers, which finish their step, save
a checkpoint and exit; the launcher waits ``launch.shutdown_timeout`` seconds for them, then exits 0
if they saved that checkpoint (1 otherwise).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from automodel_all.cli.config import JobConfig, ResolvedJob, build_job, resolve_job, warn_inert_settings
from automodel_all.cli.data import prepare_data, prepare_stream
from automodel_all.cli.default_job import builtin_corpus, train_tokenizer
from automodel_all.cli.model import (
    adapt_experts_too,
    build_meta_model,
    load_model_config,
    load_processor,
    model_dtype,
    text_tokenizer,
)
from automodel_all.cli.train import JOB_ENV
from automodel_all.cli.yaml_source import ConfigError, RawJob
from automodel_cpu.mimalloc_preload import resolve_host_allocator, worker_environment

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
    # A folder from before the chat template existed is trained again (same vocabulary, now with it).
    if not (folder / "tokenizer.json").is_file() or not (folder / "chat_template.jinja").is_file():
        documents = builtin_corpus()
        staging = folder.with_name(f".tokenizer.{os.getpid()}")
        train_tokenizer(documents, staging)
        # Another node sharing the folder may have published the same tokenizer first.
        with contextlib.suppress(OSError):
            if folder.exists() and not (folder / "chat_template.jinja").is_file():
                shutil.rmtree(folder)
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
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = text_tokenizer(_load_tokenizer(raw, job))
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

    Side effects: resolves ``launch.device`` and ``launch.host_allocator`` (``auto``) and the output
    folder to absolute values in ``raw``, and trains the default tokenizer when the embedded default needs it.

    Raises:
        ConfigError: Any problem, naming the setting and where it came from.
    """
    job = build_job(raw)
    warn_inert_settings(job)
    raw.set("launch", "device", job.device_type, raw.where("launch", "device"))
    raw.set(
        "train", "output_dir", str(Path(job.train.output_dir).resolve()), raw.where("train", "output_dir")
    )
    try:
        allocator = resolve_host_allocator(job.launch.host_allocator, job.device_type)
    except ValueError as exc:
        raise ConfigError(f"{raw.where('launch', 'host_allocator')}: {exc}") from None
    raw.set("launch", "host_allocator", allocator, raw.where("launch", "host_allocator"))
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
    from automodel_all.cli.folders import check_job_folders
    from automodel_all.cli.sources import check_source

    check_job_folders(job)
    job = _resolve_hub_datasets(raw, job)
    for key in ("path", "eval_path"):
        try:
            check_source(getattr(job.data, key))
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"{raw.where('data', key)}: data.{key}: {exc}") from None
    from automodel_all.cli.sinks import require_sinks

    try:
        require_sinks(job.report)
    except ImportError as exc:
        raise ConfigError(f"{raw.where('report', 'to')}: {exc}") from None
    _ensure_tokenizer(raw, job)
    job = build_job(raw)
    _ensure_initial_weights(raw, job)
    job = build_job(raw)
    model_config = load_model_config(job)
    _check_attention_kernel(raw, job, model_config)
    job = adapt_experts_too(raw, job, model_config)
    _prepare_data(raw, job, model_config)
    job = build_job(raw)
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


def _check_attention_kernel(raw: RawJob, job: JobConfig, model_config: Any) -> None:
    """Refuse, before any worker starts, an attention kernel transformers cannot load here.

    A GPU-only kernel (flash-attn's, a hub kernel) is checked by transformers when it builds the
    model: built here once on the meta device, as each worker will.

    Raises:
        ConfigError: The kernel's package is missing or the model does not support it (its reason).
    """
    from automodel_planner.sdpa_choice import runs_on_gpu_only

    if runs_on_gpu_only(job.model.attn_implementation):
        build_meta_model(job, model_config, where=raw.where("model", "attn_implementation"))


def _resolve_hub_datasets(raw: RawJob, job: JobConfig) -> JobConfig:
    """Replace a dataset hub id in ``data.path`` / ``data.eval_path`` by its snapshot in the HF cache.

    Raises:
        ConfigError: The id is not in the cache (naming the option and how to fetch it).
    """
    from automodel_all.cli.sources import hub_dataset_snapshot, is_hub_id

    for key in ("path", "eval_path"):
        name = getattr(job.data, key)
        if name is None or not is_hub_id(name):
            continue
        where = raw.where("data", key)
        try:
            raw.set("data", key, str(hub_dataset_snapshot(name)), where)
        except FileNotFoundError as exc:
            raise ConfigError(f"{where}: data.{key}: {exc}") from None
    return build_job(raw)


def _load_tokenizer(raw: RawJob, job: JobConfig) -> Any:
    """The job's tokenizer (or processor): ``data.tokenizer``, else the model's own.

    Raises:
        ConfigError: It cannot be loaded (not in the cache, files unreadable), naming the option.
    """
    source = job.data.tokenizer or job.model.name_or_path or ""
    try:
        return load_processor(source)
    except (OSError, ValueError) as exc:  # not cached, or files transformers cannot read
        where = raw.where("data", "tokenizer") if job.data.tokenizer else raw.where("model", "name_or_path")
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where}: cannot load a tokenizer from {source!r}: {first}") from None


def _prepare_data(raw: RawJob, job: JobConfig, model_config: Any) -> None:
    """Read, tokenize and lay out the data once, here; the workers load the rows (`prepare_data`).

    Records the resolved ``data.format`` and ``data.packing`` in ``raw`` for the workers (and for the
    checks of `resolve_job`).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = _load_tokenizer(raw, job)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            prepared = (
                prepare_stream(job.data, tokenizer, job.train.output_dir, job.train.global_batch_size)
                if job.data.streaming
                else prepare_data(job.data, tokenizer, job.train.output_dir)
            )
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"{raw.where('data', 'path')}: {exc}") from None
    for warning in caught:
        if issubclass(warning.category, UserWarning) and str(warning.message).startswith("data "):
            print(f"automodel train: warning: {warning.message}", file=sys.stderr)
    largest = prepared.largest_id
    vocab = model_config.get_text_config().vocab_size
    if largest >= vocab:
        raise ConfigError(
            f"{raw.where('data', 'tokenizer')}: the tokenizer produces id {largest} but the model's "
            f"vocabulary has {vocab} entries; use the model's own tokenizer "
            "(data.tokenizer)"
        )
    raw.set("data", "format", prepared.format, raw.where("data", "format"))
    raw.set("data", "packing", prepared.packing, raw.where("data", "packing"))


def torchrun_args(job: JobConfig) -> list[str]:
    """The ``torchrun`` flags for this job (the worker module last)."""
    launch = job.launch
    args = ["--nnodes", str(launch.nnodes), "--nproc-per-node", str(nproc_per_node(job))]
    args += ["--max-restarts", str(launch.max_restarts)]
    # Forward the preemption signals to the workers too (torchrun's default list lacks SIGUSR1), and give
    # them time to checkpoint before it kills them.
    args += ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    args += ["--shutdown-timeout", str(launch.shutdown_timeout)]
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


def _preempted_checkpoint(job: JobConfig, since: float) -> Path | None:
    """The checkpoint the workers saved after a stop signal that arrived at ``since``, if any."""
    from automodel_checkpoint import latest_checkpoint, read_marker

    latest = latest_checkpoint(Path(job.train.output_dir) / "checkpoints", kind="dcp")
    if latest is None:
        return None
    marker = read_marker(latest)
    fresh = float(marker.get("time") or 0.0) >= since
    return latest if fresh and (marker.get("extra_state") or {}).get("reason") == "preempted" else None


def launch(resolved: ResolvedJob, plain: dict[str, Any]) -> int:
    """Start the workers and wait for them; return the exit status.

    0 when every worker succeeded, or when a stop signal (SIGTERM, SIGUSR1) made them save a checkpoint
    and exit in time; 1 when a worker failed. The workers' variables (the job, the host allocator's
    ``LD_PRELOAD``) are in ``os.environ`` only while they run: the caller's environment is restored
    afterwards, so a later process this one starts does not inherit them.
    """
    saved = dict(os.environ)
    try:
        return _launch(resolved, plain)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _launch(resolved: ResolvedJob, plain: dict[str, Any]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    job = resolved.job
    os.environ[JOB_ENV] = json.dumps(plain)
    if job.device_type == "cpu":
        # One thread per worker: several workers share the cores (torchrun would also warn about it).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Only this process's children see it: the workers start on the malloc prepare_job resolved.
    os.environ.update(worker_environment(job.launch.host_allocator))
    args = get_args_parser().parse_args(torchrun_args(job))
    started = time.time()
    try:
        run(args)
    except SignalException as exc:
        saved = _preempted_checkpoint(job, started)
        if saved is not None:
            print(
                f"automodel train: stopped by {exc.sigval.name}; the workers saved {saved}", file=sys.stderr
            )
            return 0
        print(
            f"automodel train: stopped by {exc.sigval.name} before the workers saved a checkpoint "
            f"(launch.shutdown_timeout={job.launch.shutdown_timeout} s)",
            file=sys.stderr,
        )
        return 1
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
