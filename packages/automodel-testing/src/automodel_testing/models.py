"""Tiny Hugging Face causal-LM factories for tests (needs the ``[hf]`` extra).

Every family in `TINY_FAMILIES` builds in milliseconds on CPU: hidden size 64, 2 layers, 4 attention
heads over 2 key-value heads, a vocabulary of 128, ``use_cache=False`` and SDPA attention (eager for
GPT-OSS, whose sinks SDPA cannot run). The MoE
families have 8 experts, top-2 routing and an expert intermediate size of 32. transformers is imported
only when a factory is called.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = ["TINY_FAMILIES", "build_tiny_model", "make_batch", "save_tiny_checkpoint", "tiny_config"]

_COMMON: Mapping[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "use_cache": False,
    "tie_word_embeddings": False,
}

# family -> (transformers config class, fields on top of _COMMON). Field names are each class's own.
_FAMILIES: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,  # every layer is a sparse MoE layer ...
            "mlp_only_layers": [],  # ... and none is forced dense
        },
    ),
    # Mixtral has no dense MLP: each expert's width is `intermediate_size`.
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # GPT-OSS: transposed, interleaved gate/up experts with biases, stored fused on disk. Its attention
    # sinks have no SDPA path in transformers: eager attention.
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "head_dim": 16,
            "attn_implementation": "eager",
        },
    ),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
}

TINY_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
"""Names accepted by `tiny_config`, `build_tiny_model` and `save_tiny_checkpoint`."""

# Constructor arguments of every PreTrainedConfig that are not dataclass fields.
_CONSTRUCTOR_ONLY = frozenset({"attn_implementation", "experts_implementation", "output_attentions"})


def _config_class(family: str) -> Any:
    if family not in _FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    transformers = importlib.import_module("transformers")
    return getattr(transformers, _FAMILIES[family][0])


def _check_override_names(family: str, config_class: Any, overrides: Mapping[str, Any]) -> None:
    known = {field.name for field in dataclasses.fields(config_class)}
    known |= set(getattr(config_class, "attribute_map", {})) | _CONSTRUCTOR_ONLY
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"{config_class.__name__} (family {family!r}) has no field(s) {unknown}; "
            "PreTrainedConfig would store them silently and the model would ignore them."
        )


def tiny_config(family: str, **overrides: Any) -> PreTrainedConfig:
    """Build the tiny configuration of one family.

    Args:
        family: One of `TINY_FAMILIES`.
        **overrides: Config fields to change (the family's own field names, e.g. ``num_experts`` for
            Qwen3-MoE but ``num_local_experts`` for Mixtral), plus ``attn_implementation``.

    Returns:
        A fresh config (``attn_implementation="sdpa"`` unless overridden); mutating it affects nothing else.

    Raises:
        ValueError: For an unknown family or a name that is not a field of the family's config class.
    """
    config_class = _config_class(family)
    _check_override_names(family, config_class, overrides)
    fields = {
        "attn_implementation": "sdpa",
        **_COMMON,
        **copy.deepcopy(dict(_FAMILIES[family][1])),
        **overrides,
    }
    config: PreTrainedConfig = config_class(**fields)
    return config


def build_tiny_model(
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    meta: bool = False,
    **overrides: Any,
) -> PreTrainedModel:
    """Build a tiny causal LM with ``AutoModelForCausalLM.from_config``.

    Weights are initialised on CPU under ``torch.manual_seed(seed)`` (inside ``fork_rng``, so the
    caller's RNG state is untouched) and then moved to ``device``: the same seed gives the same weights
    on every device.

    Args:
        family: One of `TINY_FAMILIES`.
        seed: Seed of the weight initialisation.
        dtype: Parameter dtype.
        device: Where the model ends up; ignored when ``meta`` is True.
        meta: Build on the meta device (no storage, no initialisation); non-persistent buffers such
            as rotary ``inv_freq`` are on meta too and must be recomputed after ``to_empty``.
        **overrides: Config fields, as for `tiny_config`.

    Returns:
        The model, in training mode.

    Raises:
        ValueError: For an unknown family or config field.
    """
    config = tiny_config(family, **overrides)
    transformers = importlib.import_module("transformers")
    if meta:
        with torch.device("meta"):
            model: PreTrainedModel = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        # PreTrainedModel.to is wrapped by a decorator whose stub mypy misreads; it moves in place.
        cast(Any, model).to(device)
    model.train()
    return model


def save_tiny_checkpoint(
    family: str,
    directory: str | pathlib.Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> pathlib.Path:
    """Save a tiny model with ``save_pretrained`` (safetensors) so that ``from_pretrained`` can load it.

    The weights are those of ``build_tiny_model(family, seed=seed, dtype=dtype, **overrides)``. Note that
    transformers saves MoE experts in their original per-expert layout (e.g. Mixtral's
    ``block_sparse_moe.experts.N.w1.weight``), not in the fused in-memory layout.

    Args:
        family: One of `TINY_FAMILIES`.
        directory: Folder to write (created if missing).
        seed: Seed of the weight initialisation.
        dtype: dtype of the saved weights.
        max_shard_size: e.g. ``"100KB"`` to split the weights into several files plus a
            ``model.safetensors.index.json``; None writes a single ``model.safetensors``.
        **overrides: Config fields, as for `tiny_config`.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: For an unknown family or config field.
    """
    model = build_tiny_model(family, seed=seed, dtype=dtype, **overrides)
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def make_batch(vocab_size: int, batch_size: int, seq_len: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic random causal-LM batch.

    Args:
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        batch_size: Number of sequences.
        seq_len: Tokens per sequence.
        seed: Seed of a private generator (the global RNG is not touched).

    Returns:
        ``input_ids`` (int64, ``[batch_size, seq_len]``), ``labels`` (a clone of ``input_ids``: the
        model shifts them) and ``position_ids`` (an explicit ``arange`` per row, which sequence
        parallelism needs).

    Raises:
        ValueError: If a size is not positive.
    """
    sizes = {"vocab_size": vocab_size, "batch_size": batch_size, "seq_len": seq_len}
    bad = {name: value for name, value in sizes.items() if value < 1}
    if bad:
        raise ValueError(f"make_batch needs positive sizes, got {bad}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch_size, -1).contiguous()
    return {"input_ids": input_ids, "labels": input_ids.clone(), "position_ids": position_ids}
