"""The model's config, tokenizer (or processor) and meta-device construction (launcher and workers)."""

from __future__ import annotations

from typing import Any

import torch

from automodel_all.cli.config import JobConfig, build_job
from automodel_all.cli.default_job import DEFAULT_VOCAB_SIZE, default_model_config
from automodel_all.cli.yaml_source import ConfigError, RawJob

__all__ = [
    "adapt_experts_too",
    "build_meta_model",
    "is_image_text_model",
    "load_model_config",
    "load_processor",
    "model_class",
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


def _auto_class(config: Any) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language config, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text_model(config) else AutoModelForCausalLM


def model_class(config: Any) -> type | None:
    """The transformers class `build_meta_model` builds for ``config`` (None: no class for it)."""
    from transformers.models.auto.auto_factory import _get_model_class  # the class from_config builds

    try:
        cls: type = _get_model_class(config, _auto_class(config)._model_mapping)
    except KeyError:
        return None
    return cls


def build_meta_model(
    job: JobConfig, config: Any, where: str = "model.attn_implementation"
) -> torch.nn.Module:
    """The model of ``config`` on the meta device (no memory), in the job's dtype.

    ``AutoModelForImageTextToText`` for a vision-language config, else ``AutoModelForCausalLM``.
    ``where``: how an error names the attention implementation (the job file's line or the option).

    Raises:
        ConfigError: transformers cannot build the model from ``config`` (its error quoted), or the
            attention implementation's package is missing.
    """
    auto = _auto_class(config)
    try:
        with torch.device("meta"):
            model = auto.from_config(
                config, dtype=model_dtype(job), attn_implementation=job.model.attn_implementation
            )
    except ImportError as exc:  # the attention kernel's package (flash-attn's) is not installed here
        raise ConfigError(
            f"{where}: {job.model.attn_implementation!r} needs a package this machine "
            f"lacks ({exc}); install it, or choose sdpa"
        ) from None
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:  # transformers' own refusal
        raise ConfigError(
            f"model: transformers cannot build {type(config).__name__} from its config "
            f"({type(exc).__name__}: {exc}); check model.name_or_path's config.json and "
            "model.config_overrides, or model.attn_implementation"
        ) from None
    return model


def adapt_experts_too(raw: RawJob, job: JobConfig, model_config: Any) -> JobConfig:
    """``--lora`` on a mixture-of-experts model: its stacked expert weights get adapters too.

    ``peft.match_all_linear`` adapts every linear layer; the experts of most transformers MoE families
    are not linear modules but 3-D weights, which peft adapts through ``target_parameters``. When the
    job adapts every linear and names no parameters itself, the experts found in the model's structure
    (`automodel_moe.expert_weight_targets`, on a meta model) are written into ``raw`` as
    ``peft.target_parameters``, so that the workers, the plan and ``run.json`` see the same job. DoRA
    and adapter dropout have no form for such weights (peft's ``ParamWrapper``): the experts then stay
    frozen, with a warning.

    Returns:
        The job, rebuilt from ``raw`` when it changed.
    """
    import warnings

    peft = job.peft
    if peft is None or not peft.match_all_linear or peft.target_parameters:
        return job
    from automodel_moe import expert_weight_targets

    targets = expert_weight_targets(build_meta_model(job, model_config))
    if not targets:
        return job
    if peft.use_dora or peft.dropout:
        warnings.warn(
            f"{raw.where('peft')}: the experts' stacked weights ({', '.join(targets)}) get no adapters: "
            "peft has no DoRA or adapter dropout for them; only the linear layers are adapted",
            stacklevel=2,
        )
        return job
    raw.set("peft", "target_parameters", targets, "--lora on a mixture-of-experts model")
    return build_job(raw)
