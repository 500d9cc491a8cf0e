"""The model's config, tokenizer (or processor) and meta-device construction (launcher and workers)."""

from __future__ import annotations

from typing import Any

import torch

from automodel_all.cli.config import JobConfig
from automodel_all.cli.default_job import DEFAULT_VOCAB_SIZE, default_model_config
from automodel_all.cli.yaml_source import ConfigError

__all__ = [
    "build_meta_model",
    "is_image_text_model",
    "load_model_config",
    "load_processor",
    "model_dtype",
    "text_tokenizer",
]


def model_dtype(job: JobConfig) -> torch.dtype:
    """The parameter dtype named by ``model.dtype``."""
    dtype = getattr(torch, job.model.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def load_model_config(job: JobConfig, eos_token_id: int | None = None) -> Any:
    """The transformers config of the job's model, with ``model.config_overrides`` applied.

    A folder or a hub id already in the local cache is read without network access; no name gives the
    embedded default (`default_model_config`).

    Raises:
        ConfigError: The model cannot be found locally, or an override names a field the config lacks.
    """
    raw = job.raw
    path = job.model.name_or_path
    if path is None:
        config = default_model_config(DEFAULT_VOCAB_SIZE, eos_token_id or 0)
    else:
        from transformers import AutoConfig

        from automodel_all.cli.folders import model_folder

        model_folder(job)  # a missing path, a file, a folder without config.json: named plainly
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{raw.where('model', 'name_or_path')}: model.name_or_path={path!r} is neither a model "
                f"folder nor a hub id in the local cache ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from None
    for key, value in job.model.config_overrides.items():
        if not hasattr(config, key):
            raise ConfigError(
                f"{raw.where('model', 'config_overrides')}: model.config_overrides: {type(config).__name__} "
                f"has no field {key!r}"
            )
        setattr(config, key, value)
    config.use_cache = False  # activation checkpointing and pipelining need it off
    return config


def is_image_text_model(config: Any) -> bool:
    """Whether transformers builds ``config`` as an image-text-to-text model (its own registry)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def load_processor(path: str) -> Any:
    """The tokenizer of ``path``; for an image-text-to-text model, its processor.

    The processor holds the tokenizer, the image processor and the chat template.
    """
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    try:
        multimodal = is_image_text_model(AutoConfig.from_pretrained(path))
    except (OSError, ValueError):  # a tokenizer-only folder
        multimodal = False
    return AutoProcessor.from_pretrained(path) if multimodal else AutoTokenizer.from_pretrained(path)


def text_tokenizer(tokenizer_or_processor: Any) -> Any:
    """The tokenizer itself, or a processor's tokenizer."""
    return getattr(tokenizer_or_processor, "tokenizer", tokenizer_or_processor)


def build_meta_model(job: JobConfig, config: Any) -> torch.nn.Module:
    """The model of ``config`` on the meta device (no memory), in the job's dtype.

    ``AutoModelForImageTextToText`` for a vision-language config, else ``AutoModelForCausalLM``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_image_text_model(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(
            config, dtype=model_dtype(job), attn_implementation=job.model.attn_implementation
        )
    return model
