"""`PlanInput`: what the planner is given: a meta model, its config, the layout and the job's configs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from automodel_distributed.config import DistributedConfig
from automodel_mesh import MeshLayout

if TYPE_CHECKING:
    from automodel_moe.config import MoEParallelizerConfig
    from automodel_moe.memory import ExpertExchange
    from automodel_peft import PeftConfig
    from automodel_pipelining.config import PipelineConfig
    from automodel_quant.fp8 import FP8Config

__all__ = ["PlanInput"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class PlanInput:
    """One training job to plan: nothing here needs a process group or a device.

    Preconditions: ``model`` is on the meta device with the job's adapters applied (its parameters'
    ``requires_grad`` say what trains) and its frozen parts frozen; ``layout`` is validated
    (``MeshContext.resolve``).
    """

    model: nn.Module
    model_config: Any
    """The transformers config (real widths)."""
    layout: MeshLayout
    strategy: DistributedConfig
    dtype: torch.dtype
    """The parameters' and activations' dtype."""
    seq_len: int
    """Tokens per row (the whole sequence; each context-parallel rank holds ``seq_len / cp``)."""
    micro_batch_size: int
    """Rows per forward outside pipelining (the pipeline's ``pp_microbatch_size`` under it)."""
    accumulation: int = 1
    """Forward/backward passes per optimizer step outside pipelining."""
    pipeline: PipelineConfig | None = None
    """The pipeline config with its batch sizes filled in; None without pipeline parallelism."""
    pipeline_runs: int = 1
    """Under pipelining: the schedule's runs per optimizer step, each of ``pipeline.pp_batch_size`` rows
    and each with its bubble and gradient reduction (a loop of `AutoPipeline.step` calls before the
    optimizer step, as NeMo AutoModel's recipe runs its local batches); automodel's trainer runs one."""
    moe: MoEParallelizerConfig | None = None
    expert_exchange: ExpertExchange | None = None
    """How expert parallelism moves tokens, where the job runs another framework's exchange (DeepEP's
    one copy per destination rank: `automodel_moe.memory.ExpertExchange`); None: automodel's, one copy
    per routed expert."""
    peft: PeftConfig | None = None
    fp8: FP8Config | None = None
    base_weight_bits: int | None = None
    """4 or 8 for a quantized frozen base (QLoRA), else None."""
    attn_implementation: str | None = None
    attention_kernel: str | None = None
    """The attention kernel the time model prices (`automodel_planner.step_time.ATTENTION_KERNEL_SPEED`:
    ``fa2``, ``cudnn``, ``fa3``); None: ``attn_implementation``'s (``flash_attention_3``: FA3; SDPA and
    the rest: FA2)."""
    compile: bool = False
    """Whether the blocks are compiled (``torch.compile``): the time model fuses their elementwise ops."""
    compiled_loss: bool = False
    """Whether the loss is compiled (`MaskedCrossEntropy` ``compiled``; ``CompileConfig.compile_loss``):
    it saves the logits in their dtype, not an fp32 copy, and its elementwise ops are fused. Under
    tensor parallelism the vocabulary-parallel loss stays eager, as `MaskedCrossEntropy` keeps it."""
    attention_kv_heads: int | None = None
    """The key/value heads the attention kernel receives, where the model repeats them to the query
    heads before it (torchtitan's Llama); None: the config's ``num_key_value_heads`` (transformers'
    SDPA attention passes grouped heads to the kernel). Ring attention gathers what the kernel gets."""
    selective_save_ops: tuple[str, ...] | None = None
    """The ops (``namespace.op.overload``) whose outputs selective checkpointing saves, when the job runs
    another framework's policy (torchtitan's ``_save_list``); None: automodel's
    (`automodel_distributed.activation_checkpointing.selective_checkpoint_policy`). The time model reads
    whether it saves TP's all-gathers (`automodel_planner.facts.RankFacts.gather_runs`)."""
    model_memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """What the estimates compute from ``model`` alone (`model_fact`). Plans of one model, unchanged
    (not mutated) between them, may share one dict: ``automodel plan --suggest`` does for every layout
    it tries."""

    def __post_init__(self) -> None:
        if self.pipeline_runs < 1 or (self.pipeline is None and self.pipeline_runs != 1):
            raise ValueError(
                f"PlanInput.pipeline_runs={self.pipeline_runs}: the schedule's runs per step are at least 1, "
                "and more than 1 needs a pipeline (PlanInput.pipeline); without one, use accumulation"
            )

    @functools.cached_property
    def memo(self) -> dict[Any, Any]:
        """What the estimates compute from this plan alone, kept for its next estimate (it is frozen)."""
        return {}

    def model_fact(self, name: str, compute: Callable[[], T]) -> T:
        """``compute()``, a function of ``model`` alone, kept in `model_memo` under ``name``.

        An entry made for another model object (a plan copied with ``dataclasses.replace(model=...)``
        keeps the dict) is computed again.
        """
        entry = self.model_memo.get(name)
        if entry is None or entry[0] is not self.model:
            entry = (self.model, compute())
            self.model_memo[name] = entry
        value: T = entry[1]
        return value

    @property
    def element_size(self) -> int:
        """Bytes per parameter and activation value."""
        return self.dtype.itemsize

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the global batch: every data-parallel replica's rows times the sequence length."""
        rows = (
            self.pipeline.pp_batch_size * self.pipeline_runs
            if self.pipeline is not None
            else self.micro_batch_size * self.accumulation
        )
        return rows * self.layout.dp * self.seq_len

    def config_int(self, *names: str, default: int = 0) -> int:
        """The first of ``names`` the model config sets to a positive int, else ``default``.

        An attribute that varies per layer (transformers' heterogeneous configs, e.g. Gemma 4's
        ``head_dim``) counts at its largest layer's value.
        """
        for name in names:
            value = _config_value(self.model_config, name)
            if isinstance(value, int) and value > 0:
                return value
        return default


def _config_value(config: Any, name: str) -> Any:
    """``config.<name>`` (None when unset); for a per-layer attribute, the largest layer's int value."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: it varies per layer
        layers = getattr(config, "per_layer_config", None)
        values = [getattr(layers[i], name, None) for i in range(len(layers))] if layers is not None else []
        ints = [v for v in values if isinstance(v, int)]
        return max(ints) if ints else None
