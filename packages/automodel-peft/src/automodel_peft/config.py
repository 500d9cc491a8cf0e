"""`PeftConfig`: LoRA / DoRA settings with the reference system's field names and defaults."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from automodel_mesh.config_dict import ConfigDict
from automodel_peft.patterns import pattern_regex, patterns_to_regex

if TYPE_CHECKING:
    import peft

__all__ = ["DEFAULT_TARGET_MODULES", "DROPOUT_POSITIONS", "LORA_A_INITS", "PeftConfig"]

logger = logging.getLogger(__name__)

DROPOUT_POSITIONS: tuple[str, ...] = ("pre", "post")
LORA_A_INITS: tuple[str, ...] = ("xavier", "kaiming")
#: What an empty `PeftConfig` targets (every ``*_proj`` linear), with a warning.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("*_proj",)


def _parse_dtype(value: object) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"PeftConfig.lora_dtype={value!r} is not a torch dtype; use e.g. 'bfloat16'")
    else:
        raise ValueError(f"PeftConfig.lora_dtype must be None, a torch.dtype or its name, got {value!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"PeftConfig.lora_dtype={dtype} must be a floating-point dtype")
    return dtype


def _as_list(value: object, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, str | list | tuple):
        raise ValueError(f"PeftConfig.{name} must be a list of module names or patterns, got {value!r}")
    items = [value] if isinstance(value, str) else list(value)
    bad = [item for item in items if not isinstance(item, str) or not item]
    if bad:
        raise ValueError(f"PeftConfig.{name} must hold non-empty module names or patterns, got {bad!r}")
    return items


@dataclass(kw_only=True)
class PeftConfig(ConfigDict):
    """LoRA adapters on linear layers, applied through Hugging Face ``peft`` by `apply_lora`.

    Which linears (see `automodel_peft.matching`): ``match_all_linear`` (every linear but the output head)
    > ``target_modules`` > every linear (but the output head) except ``exclude_modules``. A plain name is a
    leaf name or dotted suffix (``"q_proj"``, ``"self_attn.q_proj"``); any other pattern is a wildcard /
    regular expression on the whole name (``"*.layers.*.mlp.*_proj"``, ``".*"``, ``"*.(q|v)_proj"``).
    """

    target_modules: list[str] = field(default_factory=list)
    """Linears to adapt: leaf names, dotted suffixes, or wildcards / regular expressions on full names. All
    three selectors empty means ``["*_proj"]`` (with a warning)."""

    exclude_modules: list[str] = field(default_factory=list)
    """Adapt every linear except these (same pattern forms). Not together with ``target_modules``."""

    match_all_linear: bool = False
    """Adapt every linear layer except the output head; not together with either list."""

    target_parameters: list[str] = field(default_factory=list)
    """Parameters to adapt directly, through peft's ``target_parameters``: each a parameter name or a
    dotted suffix of one (``"mlp.experts.gate_up_proj"``). This is how fused MoE experts (3-D
    ``[num_experts, ...]`` weights, not linears) get LoRA: one rank-``dim`` adapter per expert. Adds to
    the linears the other selectors pick; not with DoRA or dropout (peft's ``ParamWrapper`` has
    neither)."""

    dim: int = 8
    """LoRA rank r."""

    alpha: int = 32
    """LoRA alpha: the adapter output is scaled by ``alpha / dim``."""

    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA): a trainable per-output-row magnitude next to A and B."""

    dropout: float = 0.0
    """Dropout probability of the adapter branch, in [0, 1)."""

    dropout_position: Literal["pre", "post"] = "post"
    """``"pre"``: dropout on the adapter's input (peft's own placement); ``"post"``: on the adapter's
    output, ``dropout(B(A(x)))``. Only matters when ``dropout > 0``; ``"post"`` is not available with DoRA."""

    lora_A_init: str = "xavier"
    """Initialisation of A: ``"xavier"`` (uniform) or ``"kaiming"`` (uniform, a=sqrt(5); peft's default). B
    starts at zero."""

    lora_dtype: torch.dtype | None = None
    """dtype of the adapter weights; None keeps the base layer's dtype (on quantized base weights: the
    quantization's compute dtype)."""

    use_memory_efficient_lora: bool = True
    """Accepted for compatibility; has no effect (peft's autograd is used)."""

    use_triton: bool = False
    """Accepted for compatibility; ignored with a warning (no Triton LoRA kernels here)."""

    moe_rank_scaling: bool = False
    """Accepted for compatibility; ignored with a warning (expert adapters, through ``target_parameters``,
    have rank ``dim`` like every other)."""

    def __post_init__(self) -> None:
        for name in (
            "match_all_linear",
            "use_dora",
            "use_memory_efficient_lora",
            "use_triton",
            "moe_rank_scaling",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PeftConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self.target_modules = _as_list(self.target_modules, "target_modules")
        self.exclude_modules = _as_list(self.exclude_modules, "exclude_modules")
        self.target_parameters = _as_list(self.target_parameters, "target_parameters")
        for name in ("target_modules", "exclude_modules"):
            for pattern in getattr(self, name):
                try:
                    pattern_regex(pattern)
                except ValueError as exc:
                    raise ValueError(f"PeftConfig.{name}: {exc}") from None
        if self.target_modules and self.exclude_modules:
            raise ValueError(
                "PeftConfig: target_modules and exclude_modules are mutually exclusive; give the layers to "
                f"adapt (target_modules={self.target_modules}) or the ones to leave out (exclude_modules="
                f"{self.exclude_modules}), not both"
            )
        if self.match_all_linear and (self.target_modules or self.exclude_modules):
            raise ValueError(
                "PeftConfig: match_all_linear=True adapts every linear; it cannot be combined with "
                "target_modules "
                f"={self.target_modules} or exclude_modules={self.exclude_modules}. Drop the lists or set "
                "match_all_linear=False"
            )
        if not (self.target_modules or self.exclude_modules or self.match_all_linear):
            warnings.warn(
                f"PeftConfig: no target_modules, exclude_modules or match_all_linear given; adapting "
                f"{list(DEFAULT_TARGET_MODULES)}",
                stacklevel=3,
            )
            self.target_modules = list(DEFAULT_TARGET_MODULES)
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"PeftConfig.dim={self.dim!r} must be a positive int (the LoRA rank)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise ValueError(f"PeftConfig.alpha={self.alpha!r} must be a positive number")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, int | float)
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(f"PeftConfig.dropout={self.dropout!r} must be in [0, 1)")
        if self.dropout_position not in DROPOUT_POSITIONS:
            raise ValueError(
                f"PeftConfig.dropout_position={self.dropout_position!r}; use one of {list(DROPOUT_POSITIONS)}"
            )
        if self.lora_A_init not in LORA_A_INITS:
            raise ValueError(f"PeftConfig.lora_A_init={self.lora_A_init!r}; use one of {list(LORA_A_INITS)}")
        self.lora_dtype = _parse_dtype(self.lora_dtype)
        if self.target_parameters and (self.use_dora or self.dropout > 0):
            raise ValueError(
                f"PeftConfig.target_parameters={self.target_parameters} adapts parameters with peft's "
                "ParamWrapper, which has no DoRA and no dropout; set use_dora=False and dropout=0, or drop "
                "target_parameters"
            )
        if self.use_dora and self.dropout > 0 and self.dropout_position == "post":
            raise ValueError(
                "PeftConfig: DoRA applies dropout to the adapter's input only; with use_dora=True and "
                f"dropout={self.dropout} set dropout_position='pre' (or dropout=0)"
            )

    @property
    def scaling(self) -> float:
        """``alpha / dim``, the factor applied to the adapter output."""
        return float(self.alpha) / self.dim

    @property
    def post_dropout(self) -> float:
        """Dropout applied after the adapter (``dropout_position="post"``), else 0."""
        return float(self.dropout) if self.dropout_position == "post" else 0.0

    def warn_ignored(self) -> None:
        """Warn about the accepted-but-ignored fields that are switched on."""
        if self.use_triton:
            warnings.warn(
                "PeftConfig.use_triton=True is ignored: there are no Triton LoRA kernels here (and no Triton "
                "on CPU); peft's PyTorch LoRA layers are used",
                stacklevel=3,
            )
        if self.moe_rank_scaling:
            warnings.warn(
                "PeftConfig.moe_rank_scaling=True is ignored: every adapter, experts' included "
                "(target_parameters), has rank dim",
                stacklevel=3,
            )
        if self.use_memory_efficient_lora:
            logger.debug("PeftConfig.use_memory_efficient_lora has no effect: peft's LoRA autograd is used")

    def to_lora_config(
        self, target_modules: Sequence[str] | None = None, **overrides: Any
    ) -> peft.LoraConfig:
        """A plain ``peft.LoraConfig`` with the same adapters.

        Args:
            target_modules: The resolved full module names (what `apply_lora` passes); None translates the
                patterns instead: ``match_all_linear`` / ``exclude_modules`` become peft's ``"all-linear"``
                (which also leaves out the output head) plus a regex of the excludes, and target patterns
                one regex (peft full-matches it on module names; it may then also match non-linear modules,
                which peft refuses: resolving against the model is exact).
            **overrides: Other ``LoraConfig`` fields (e.g. ``task_type``).

        Returns:
            The config. ``lora_dropout`` is set only for ``dropout_position="pre"``; ``"post"`` dropout is
            installed by `apply_lora`. ``lora_A_init="xavier"`` is applied by `apply_lora` /
            `init_adapter_weights` (peft starts from its kaiming-uniform A).
        """
        import peft

        kwargs: dict[str, Any] = {
            "r": self.dim,
            "lora_alpha": self.alpha,
            "lora_dropout": float(self.dropout) if self.dropout_position == "pre" else 0.0,
            "use_dora": self.use_dora,
            "init_lora_weights": True,
            "bias": "none",
        }
        if target_modules is not None:
            kwargs["target_modules"] = list(target_modules)
        elif self.match_all_linear:
            kwargs["target_modules"] = "all-linear"
        elif self.exclude_modules:
            kwargs["target_modules"] = "all-linear"
            kwargs["exclude_modules"] = patterns_to_regex(self.exclude_modules)
        else:
            kwargs["target_modules"] = patterns_to_regex(self.target_modules)
        if self.target_parameters:
            kwargs["target_parameters"] = list(self.target_parameters)
        kwargs.update(overrides)
        return peft.LoraConfig(**kwargs)

    _dict_aliases: ClassVar[Mapping[str, str]] = {"lora_A_init_method": "lora_A_init"}

    def _dict_value(self, name: str, value: Any) -> Any:
        """``lora_dtype`` as its name; lists copied (`to_dict` output is YAML-friendly)."""
        if isinstance(value, torch.dtype):
            return str(value).removeprefix("torch.")
        return list(value) if isinstance(value, list) else value
