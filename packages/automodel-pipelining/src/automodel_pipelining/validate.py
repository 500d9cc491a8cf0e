"""Which models the pipeline split supports, checked before anything is copied or sharded."""

from __future__ import annotations

from typing import Any

from torch import nn

from automodel_modules import embedding_module, find_hf_model

__all__ = ["MULTIMODAL_CONFIG_FIELDS", "validate_hf_model_for_pipeline_support"]

MULTIMODAL_CONFIG_FIELDS: tuple[str, ...] = ("vision_config", "audio_config", "speech_config", "image_config")
"""Config fields whose presence marks a multimodal model."""


def _tied(model: nn.Module) -> bool:
    inp, out = embedding_module(model, "input"), embedding_module(model, "output")
    weight_in = getattr(inp, "weight", None)
    weight_out = getattr(out, "weight", None)
    return weight_in is not None and weight_in is weight_out


def _multimodal_fields(config: Any) -> list[str]:
    fields = [name for name in MULTIMODAL_CONFIG_FIELDS if getattr(config, name, None) is not None]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text(decoder=True)
        except (TypeError, ValueError):
            text = get_text()
        if text is not None and text is not config and not fields:
            fields.append("text_config")
    return fields


def validate_hf_model_for_pipeline_support(model: nn.Module) -> None:
    """Raise a `ValueError` saying why ``model`` cannot be split into pipeline stages, if it cannot.

    Rejected:

    - tied input and output embeddings (``lm_head.weight is embed_tokens.weight``): the first and the last
      stage would each need the one shared weight, and its two gradients would never meet;
    - encoder-decoder models (``config.is_encoder_decoder``): the stage forward runs one decoder stack;
    - multimodal models (a ``vision_config``/``audio_config``/... or a separate text config), unless the
      model class sets ``_pp_keep_self_forward = True`` to say that its own forward handles stage inputs
      (then build the pipeline with ``patch_inner_model=False, patch_causal_lm_model=False``).

    Preconditions: none; meta-device models work. Nothing is mutated.

    Raises:
        ValueError: The model is not supported; the message names the reason and the way out.
    """
    _, hf_model = find_hf_model(model)
    name = type(hf_model).__name__
    config = getattr(hf_model, "config", None)
    if bool(getattr(config, "is_encoder_decoder", False)):
        raise ValueError(
            f"{name} is an encoder-decoder model (config.is_encoder_decoder=True); pipeline parallelism "
            "supports decoder-only language models"
        )
    if _tied(hf_model):
        raise ValueError(
            f"{name} ties its input and output embeddings (the LM head weight is the embedding weight): "
            "they would live on the first and the last pipeline stage. Untie them (load with "
            "tie_word_embeddings=False) or do not use pipeline parallelism for this model"
        )
    fields = _multimodal_fields(config) if config is not None else []
    if fields and not getattr(hf_model, "_pp_keep_self_forward", False):
        raise ValueError(
            f"{name} is multimodal (its config has {', '.join(fields)}); the pipeline stage forward handles "
            "text decoders only. Pipeline its language model alone, or set `_pp_keep_self_forward = True` on "
            "a model class whose forward takes stage inputs"
        )
