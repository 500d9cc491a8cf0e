"""Every decoder-only text family that transformers ships, read from transformers' own registry.

`decoder_families` starts from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (every model type with a causal-LM
head) and removes what is not a decoder-only text model, each with its reason:

- encoder-only types (also in ``MODEL_FOR_MASKED_LM_MAPPING_NAMES``; their causal-LM head is a BERT-style
  encoder run with ``is_decoder=True``);
- encoder-decoder types (in ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` or ``is_encoder_decoder``);
- vision-language types (in ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``; their text decoders are
  separate ``*_text`` types, which stay);
- the types in `EXCLUDED`, each with the reason transformers' registry cannot tell.

No family is hand-picked for inclusion: a new transformers release adds its new decoders to the matrix
by itself. transformers is imported when a function is called, not at import.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "EXCLUDED",
    "DecoderFamily",
    "VisionLanguageFamily",
    "decoder_families",
    "excluded_families",
    "vlm_families",
]

EXCLUDED: Mapping[str, str] = {
    "bert-generation": "encoder-only: a BERT encoder run with is_decoder=True (BertGenerationDecoder)",
    "xlnet": "permutation language model: attends bidirectionally unless given a perm_mask",
    "cpmant": "not a causal decoder: CPM-Ant attends over a prompt/segment layout built from its inputs",
    "moshi": "speech-text model: its causal LM consumes audio codebooks beside the text tokens",
    "musicgen": "text-to-music model: its causal LM predicts audio codebooks",
    "musicgen_melody": "text-to-music model: its causal LM predicts audio codebooks",
    "phi4_multimodal": "multimodal model (vision and audio towers inside the causal LM)",
    "moss_transcribe_diarize": "speech model (audio encoder + text decoder)",
    "trocr": "decoder of a vision encoder-decoder (cross-attention to image features)",
    "gemma4_assistant": "assistant head of a Gemma 4 model: its default config does not validate alone",
    "gemma4_unified_assistant": "assistant head of a Gemma 4 model: needs the backbone's hidden states",
    "dots3_note": "vision-language model (image and audio towers): its text decoder is dots3_note_text",
}
"""Decoder model types left out on purpose: model type -> why (what the registry cannot tell)."""


@dataclass(frozen=True)
class DecoderFamily:
    """One decoder-only text family of transformers."""

    model_type: str
    """``config.model_type`` (the registry key)."""
    model_class: str
    """The ``*ForCausalLM`` class transformers maps the type to."""


@functools.cache
def _registry() -> tuple[tuple[DecoderFamily, ...], tuple[tuple[str, str], ...]]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    seq2seq = auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    vision = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    kept: list[DecoderFamily] = []
    dropped: list[tuple[str, str]] = []
    for model_type in sorted(causal):
        config_class = CONFIG_MAPPING[model_type]
        if model_type in EXCLUDED:
            reason = EXCLUDED[model_type]
        elif model_type in masked:
            reason = "encoder-only (masked LM; its causal-LM head runs the encoder with is_decoder=True)"
        elif model_type in seq2seq or getattr(config_class, "is_encoder_decoder", False):
            reason = "encoder-decoder"
        elif model_type in vision:
            reason = "vision-language model (image-text-to-text; see the VLM matrix)"
        else:
            kept.append(DecoderFamily(model_type, str(causal[model_type])))
            continue
        dropped.append((model_type, reason))
    return tuple(kept), tuple(dropped)


def decoder_families() -> tuple[DecoderFamily, ...]:
    """Every decoder-only text family of the installed transformers, sorted by model type."""
    return _registry()[0]


def excluded_families() -> dict[str, str]:
    """The causal-LM model types that are not decoder-only text models: model type -> reason."""
    return dict(_registry()[1])


@dataclass(frozen=True)
class VisionLanguageFamily:
    """One image-text-to-text family of transformers."""

    model_type: str
    """``config.model_type`` (the registry key)."""
    model_class: str
    """The class ``AutoModelForImageTextToText`` maps the type to."""


def vlm_families() -> tuple[VisionLanguageFamily, ...]:
    """Every image-text-to-text family of the installed transformers (``MODEL_FOR_IMAGE_TEXT_TO_TEXT``).

    Sorted by model type; none is hand-picked or left out (a family the tiny rules cannot build is
    reported by the matrix as transformers' own error).
    """
    from transformers.models.auto import modeling_auto as auto

    names = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return tuple(VisionLanguageFamily(t, str(names[t])) for t in sorted(names))
