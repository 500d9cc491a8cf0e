"""The command's own YAML sections: ``model:``, ``data:``, ``train:`` and ``launch:``.

Every other section maps onto a component's own config dataclass (see `automodel_all.cli.config`).
These four describe what only the command needs: which model and data, the training loop, and how
worker processes are started. Each is a ``kw_only`` dataclass whose fields are the YAML keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DataSection", "LaunchSection", "ModelSection", "TrainSection"]


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
    attn_implementation: str = "sdpa"
    """transformers attention implementation (context and sequence parallelism need ``sdpa``)."""
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
    """Training text (YAML section ``data:``)."""

    path: str | None = None
    """A ``.txt`` / ``.jsonl`` file or a folder of them (read recursively, in sorted order). ``None``: a
    corpus made from text that ships with Python (the documentation topics of ``pydoc_data``)."""
    text_key: str = "text"
    """Field holding the text in each JSONL record."""
    seq_len: int = 128
    """Tokens per training row; documents are concatenated (EOS between them) and cut into rows."""
    tokenizer: str | None = None
    """Tokenizer folder or cached hub id; ``None``: the model's own (or, for the embedded default, a BPE
    tokenizer trained on the corpus)."""

    def __post_init__(self) -> None:
        _positive(self, "seq_len")


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
    output_dir: str = "automodel_output"
    """Where checkpoints, the final Hugging Face model and ``train_log.jsonl`` go."""
    resume: bool = False
    """Continue from the latest complete distributed checkpoint under ``output_dir/checkpoints``."""
    sample_prompt: str = "The "
    """Prompt of the sample generated from the saved model at the end."""
    sample_tokens: int = 40
    """Tokens generated for the sample; 0 skips it."""

    def __post_init__(self) -> None:
        _positive(self, "steps", "global_batch_size", "micro_batch_size")
        _positive(
            self, "warmup_steps", "checkpoint_every", "keep_checkpoints", "sample_tokens", allow_zero=True
        )
        if not self.lr > 0:
            raise ValueError(f"TrainSection.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainSection.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"TrainSection.max_grad_norm must be > 0 or null, got {self.max_grad_norm}")


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

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None:
            _positive(self, "nproc_per_node")
        _positive(self, "nnodes")
        _positive(self, "node_rank", "max_restarts", allow_zero=True)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"LaunchSection.node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if not self.timeout_minutes > 0:
            raise ValueError(f"LaunchSection.timeout_minutes must be > 0, got {self.timeout_minutes}")
