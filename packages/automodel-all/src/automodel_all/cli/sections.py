"""The command's own YAML sections: ``model:``, ``data:``, ``train:``, ``report:`` and ``launch:``.

Every other section maps onto a component's own config dataclass (see `automodel_all.cli.config`).
These five describe what only the command needs: which model and data, the training loop, where its
metrics go, and how worker processes are started. Each is a ``kw_only`` dataclass whose fields are
the YAML keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["SINKS", "DataSection", "LaunchSection", "ModelSection", "ReportSection", "TrainSection"]


def _positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        low = 0 if allow_zero else 1
        if value < low:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= {low}, got {value}")


@dataclass(kw_only=True)
class ModelSection:
    """Which model to train (YAML section ``model:``)."""

    name_or_path: str | None = None
    """A Hugging Face model folder, or a hub id already in the local cache. ``None``: the embedded default
    (a small Llama-style model built from a ``LlamaConfig``, randomly initialised)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the model (QAT needs ``bfloat16``)."""
    attn_implementation: str | None = None
    """transformers attention implementation. ``None``: transformers' default for the family (``sdpa``
    where the family supports it, else its ``eager`` attention), as ``from_config`` chooses; context
    parallelism needs ``sdpa``."""
    load_weights: bool = True
    """With ``name_or_path``: load its weights (``False``: same architecture, random initialisation)."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields set on the model's config before it is built, e.g. ``{num_hidden_layers: 2}``."""

    def __post_init__(self) -> None:
        if self.name_or_path is not None and not self.name_or_path:
            raise ValueError(
                "ModelSection.name_or_path is empty; give a folder or a cached hub id, or drop it"
            )


@dataclass(kw_only=True)
class DataSection:
    """Training (and evaluation) data (YAML section ``data:``)."""

    path: str | None = None
    """Where the records come from: a ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` / ``.arrow`` /
    ``.txt`` / ``.md`` file, a folder of them (read recursively; splits inferred from file names), a
    ``save_to_disk`` folder, ``builtin:chat`` (the embedded chat dataset) or ``builtin:image_chat``
    (the embedded conversations about pictures, for vision-language models). ``None`` (or
    ``builtin:text``): a corpus made from text that ships with Python (``pydoc_data``)."""
    format: Literal["auto", "text", "prompt_completion", "messages", "image_messages"] = "auto"
    """What a record is. ``auto``: ``messages`` if the records have ``messages_key`` (``image_messages``
    when the first conversation holds an image part), else ``prompt_completion`` if they have
    ``prompt_key`` and ``completion_key``, else ``text``. ``image_messages``: conversations with images
    in the transformers chat format, rendered by the model's processor (`automodel_all.cli.image_data`);
    relative image paths are resolved against the data's folder."""
    text_key: str = "text"
    """Field holding the text of a ``text`` record."""
    prompt_key: str = "prompt"
    """Field holding the prompt of a ``prompt_completion`` record (no loss on it)."""
    completion_key: str = "completion"
    """Field holding the completion of a ``prompt_completion`` record (the loss is on it)."""
    messages_key: str = "messages"
    """Field holding a conversation (a list of ``{role, content}``), rendered with the tokenizer's chat
    template; the loss is on the assistant's tokens only."""
    split: str = "train"
    """Split of ``path`` to train on."""
    eval_path: str | None = None
    """Evaluation records (same kinds of source as ``path``); ``None``: ``eval_split`` of ``path``, or
    no evaluation."""
    eval_split: str | None = None
    """Split to evaluate on (of ``eval_path`` if given, else of ``path``), e.g. ``validation``."""
    seq_len: int = 128
    """Tokens per training row."""
    packing: Literal["concat", "packed", "padded"] | None = None
    """How records become rows. ``concat``: joined (EOS between them) and cut into rows, attention across
    records (pre-training style); ``packed``: whole records packed into rows, each with its own
    positions, attention never crossing records; ``padded``: one record per row, padded. ``None``:
    ``concat`` for text, ``packed`` for prompt/completion and conversations (under context parallelism
    too, where attention is masked per record over the gathered keys)."""
    tokenizer: str | None = None
    """Tokenizer folder or cached hub id; ``None``: the model's own (or, for the embedded default, a BPE
    tokenizer trained on the corpus, with a chat template)."""
    streaming: bool = False
    """Stream the training records instead of preparing every row up front: for data larger than memory
    (`automodel_all.cli.streaming`). Each row of a global batch is a stream of its own records,
    tokenized and packed on the fly (``packed``: next-fit in record order rather than best-fit over all
    records), read in the source's order rather than shuffled per epoch; the position of every stream
    is saved in each checkpoint, so ``--resume`` continues exactly, on any world size with the same
    ``train.global_batch_size``. Off by default: prepared rows are packed tighter and shuffled.
    Evaluation data is still read whole; records with images are not streamed."""

    def __post_init__(self) -> None:
        _positive(self, "seq_len")
        for name in ("text_key", "prompt_key", "completion_key", "messages_key", "split"):
            if not getattr(self, name):
                raise ValueError(f"DataSection.{name} must not be empty")
        if self.eval_split is not None and not self.eval_split:
            raise ValueError("DataSection.eval_split must not be empty (null: no evaluation split)")


@dataclass(kw_only=True)
class TrainSection:
    """The training loop (YAML section ``train:``)."""

    steps: int = 300
    """Optimizer steps in total (a resumed run continues up to this number)."""
    global_batch_size: int = 16
    """Rows per optimizer step over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Rows per forward pass on one rank (the pipeline microbatch under pipeline parallelism). Gradient
    accumulation steps = global_batch_size / (micro_batch_size x data-parallel size). When not given:
    the largest divisor of the rows per data-parallel rank up to 8 (under pipelining, one that still
    gives every stage a microbatch)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at ``lr * min_lr_ratio``."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; ``None`` disables clipping."""
    seed: int = 1234
    """Seed of every random number generator (same on every rank)."""
    checkpoint_every: int = 100
    """Save a distributed checkpoint (DCP) every this many steps, and at the end; 0: only at the end."""
    keep_checkpoints: int = 2
    """Distributed checkpoints kept (older ones are deleted); 0 keeps all."""
    hf_checkpoints: Literal["none", "also", "only"] = "none"
    """Each checkpoint's weights also (``also``) or only (``only``: the DCP files then hold the
    optimizer's state) as a Hugging Face folder ``step_XXXXXXXX/hf/``, which ``from_pretrained`` reads
    without automodel; ``--resume`` continues from either. Written by every rank, before the training
    goes on (a consolidated export gathers every tensor); one completion marker covers both parts."""
    async_checkpoint: bool = True
    """Write the periodic checkpoints in the background: the step that saves waits only while this
    rank's shards of model and optimizer state are copied to host memory (pinned on GPUs), and training
    goes on while the files are written. Costs host memory for that copy (about 16 bytes per parameter
    / the ranks sharding it, with AdamW) and a ``gloo`` process group. At most one save is in flight;
    the final and the preemption checkpoints are waited for. ``false``: every save blocks."""
    output_dir: str = "automodel_output"
    """Where checkpoints, the final Hugging Face model, the prepared data and the logs go."""
    resume: bool = False
    """Continue from the latest complete distributed checkpoint under ``output_dir/checkpoints`` (its
    files are verified against the checksums in its completion marker first). Workers that the launcher
    restarts after a failure (``launch.max_restarts``) resume on their own."""
    resume_fallback: bool = False
    """When the newest checkpoint fails verification, resume from the newest one that passes (with a
    warning) instead of stopping with the error."""
    eval_every: int = 0
    """Evaluate every this many steps (and at the end) when there is evaluation data; 0: at the end only."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """A NaN or Inf loss or gradient norm: ``error`` stops the job naming the step and the rank(s);
    ``skip`` drops that step's update (no optimizer step) and counts it in the log."""
    plot: bool | None = None
    """Draw ``output_dir/loss_curve.png`` at the end from the JSON lines (needs ``jsonl`` in
    ``report.to`` and the ``automodel-all[plot]`` extra, matplotlib). ``None``: when both are there;
    ``true``: a warning says so when matplotlib is not."""
    sample_prompt: str = "The "
    """Prompt of the sample generated from the saved model at the end."""
    sample_tokens: int = 40
    """Tokens generated for the sample; 0 skips it."""

    def __post_init__(self) -> None:
        _positive(self, "steps", "global_batch_size", "micro_batch_size")
        _positive(
            self,
            "warmup_steps",
            "checkpoint_every",
            "keep_checkpoints",
            "sample_tokens",
            "eval_every",
            allow_zero=True,
        )
        if not 0 < self.lr < math.inf:
            raise ValueError(f"TrainSection.lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainSection.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"TrainSection.max_grad_norm must be > 0 or null, got {self.max_grad_norm}")


SINKS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""The metric sinks ``report.to`` may name (`automodel_all.cli.sinks`)."""


@dataclass(kw_only=True)
class ReportSection:
    """Where the metrics go (YAML section ``report:``; rank 0 writes every sink)."""

    to: list[str] = field(default_factory=lambda: ["jsonl"])
    """The sinks, any of ``jsonl`` (``train_log.jsonl``, ``eval_log.jsonl``, ``run.json``),
    ``tensorboard`` (``output_dir/tensorboard``), ``wandb`` and ``mlflow``; each but ``jsonl`` needs the
    extra of automodel-all of the same name. ``--report-to jsonl,wandb``; ``[]``: none."""
    project: str = "automodel"
    """The W&B project and the MLflow experiment."""
    run_name: str | None = None
    """The W&B and MLflow run name. ``None``: the output folder's name."""
    wandb_mode: Literal["online", "offline"] = "online"
    """``online`` streams to the W&B server (after ``wandb login``); ``offline`` writes the run under
    ``output_dir/wandb`` only, for ``wandb sync`` later."""
    mlflow_tracking_uri: str | None = None
    """The MLflow tracking server or store, e.g. ``http://mlflow:5000``. ``None``: a SQLite store in
    the output folder, ``output_dir/mlflow.db`` (view it with ``mlflow ui --backend-store-uri
    sqlite:///...``)."""

    def __post_init__(self) -> None:
        for sink in self.to:
            if sink not in SINKS:
                raise ValueError(f"ReportSection.to: unknown sink {sink!r}; choose from {', '.join(SINKS)}")
        if len(set(self.to)) != len(self.to):
            raise ValueError(f"ReportSection.to names a sink twice: {self.to}")
        if not self.project:
            raise ValueError("ReportSection.project must not be empty")


@dataclass(kw_only=True)
class LaunchSection:
    """How worker processes are started (YAML section ``launch:``; the flags of ``torchrun``)."""

    nproc_per_node: int | None = None
    """Workers on this node. ``None``: the GPU count on CUDA, 2 on CPU."""
    nnodes: int = 1
    """Number of nodes."""
    node_rank: int = 0
    """This node's rank (static rendezvous with ``master_addr``)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous (c10d) on one of the nodes; multi-node runs need it or
    ``master_addr``."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend (``c10d`` or ``static``)."""
    rdzv_id: str = "automodel"
    """Job id shared by all nodes of one run."""
    master_addr: str | None = None
    """Address of node 0 for a static rendezvous (used with ``node_rank``)."""
    master_port: int | None = None
    """Port on ``master_addr``; ``None``: 29500, or a free port for a single-node run."""
    max_restarts: int = 0
    """Times the elastic agent restarts failed workers."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA (nccl) when GPUs are visible, else CPU (gloo)."""
    timeout_minutes: float = 10.0
    """Timeout of collectives (a stuck rank fails the job instead of hanging)."""
    shutdown_timeout: int = 60
    """Seconds the workers get after SIGTERM or SIGUSR1 (preemption) to finish their step, save a
    checkpoint and exit, before the launcher kills them."""
    host_allocator: Literal["auto", "glibc", "mimalloc"] = "auto"
    """The workers' ``malloc``. ``mimalloc`` is preloaded into them from the ``cmeel-mimalloc`` wheel
    (Linux; see `automodel_cpu.mimalloc_preload`), ``glibc`` leaves the system's. ``auto``: mimalloc
    for CPU jobs, where FSDP2's buffers are host memory and glibc either fragments (peak memory) or
    page-faults (step time), glibc otherwise. Cost of mimalloc: memory a worker frees is reused but
    not returned to the OS before it exits. Figures of both: docs/benchmarks.md."""

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None:
            _positive(self, "nproc_per_node")
        _positive(self, "nnodes")
        _positive(self, "node_rank", "max_restarts", "shutdown_timeout", allow_zero=True)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"LaunchSection.node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if not self.timeout_minutes > 0:
            raise ValueError(f"LaunchSection.timeout_minutes must be > 0, got {self.timeout_minutes}")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"LaunchSection.rdzv_endpoint={self.rdzv_endpoint!r} must be HOST:PORT (a port of node 0 "
                    "the other nodes reach, e.g. node0:29400)"
                )
