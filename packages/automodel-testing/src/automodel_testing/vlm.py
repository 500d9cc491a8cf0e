"""Batches with images for tiny vision-language models, through each family's own image processor.

`image_inputs` runs the image processor that transformers registers for the model type
(``IMAGE_PROCESSOR_MAPPING_NAMES``, its Pillow backend) on random images of the tiny tower's image size,
with resizing, cropping and tiling turned off and the patch and merge sizes of the tower, so the
pixels match the tiny config. `image_batch` counts the image tokens each image becomes by running the
model's own ``get_image_features`` and writes that many image placeholder tokens into each row; what
the family's processor would add around them (start/end markers) is not needed by the models.

No family is named here: every choice is read from the config, the image processor's attributes and
the model's forward signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "IMAGE_CHAT_TEMPLATE",
    "IMAGE_TOKEN_FIELDS",
    "image_batch",
    "image_inputs",
    "image_token_id",
    "save_tiny_llava",
]

IMAGE_TOKEN_FIELDS: tuple[str, ...] = ("image_token_id", "image_token_index")
"""Config fields naming the placeholder token that image features replace."""

_OFF = ("do_resize", "do_center_crop", "do_image_splitting", "crop_to_patches", "do_pan_and_scan")
"""Image-processor switches turned off: the tiny image already has the tower's size, in one tile."""


def image_token_id(config: Any) -> int:
    """The image placeholder token of a vision-language config.

    Raises:
        ValueError: The config names none of `IMAGE_TOKEN_FIELDS`.
    """
    for name in IMAGE_TOKEN_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(config).__name__} has none of {list(IMAGE_TOKEN_FIELDS)}")


def _side(vision: Any) -> tuple[int, int]:
    patch = vision.patch_size if isinstance(vision.patch_size, int) else vision.patch_size[0]
    image = getattr(vision, "image_size", None)
    if isinstance(image, int):
        return image, patch
    if isinstance(image, list | tuple):
        return int(image[0]), patch
    from automodel_testing.tiny import IMAGE_PATCHES

    # Towers without a fixed image size (patch sequences with a grid): the tiny image's patches times
    # the merge of patches, so the merged grid is IMAGE_PATCHES / 2 per side.
    return IMAGE_PATCHES * patch, patch


def image_inputs(config: Any, images: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Processor outputs (``pixel_values`` and friends) for ``images`` random images, one per row.

    Args:
        config: A vision-language config with a ``vision_config``.
        images: How many rows (one image each).
        seed: Seed of the random pixels.

    Raises:
        ValueError: transformers registers no image processor for the model type.
    """
    import numpy as np
    import transformers
    from transformers.models.auto import image_processing_auto

    # The merged registry (standard and non-standard names); the module does not re-export it for mypy.
    names = vars(image_processing_auto)["IMAGE_PROCESSOR_MAPPING_NAMES"].get(config.model_type)
    if not names or "pil" not in names:
        raise ValueError(f"transformers registers no Pillow image processor for {config.model_type!r}")
    processor_class = getattr(transformers, names["pil"])
    default = processor_class()
    vision = config.vision_config
    side, patch = _side(vision)
    kwargs: dict[str, Any] = {name: False for name in _OFF if getattr(default, name, None) is not None}
    if getattr(default, "patch_size", None) is not None:
        kwargs["patch_size"] = (
            patch if isinstance(default.patch_size, int) else {"height": patch, "width": patch}
        )
    for name, source in (
        ("merge_size", "spatial_merge_size"),
        ("temporal_patch_size", "temporal_patch_size"),
    ):
        if getattr(default, name, None) is not None and getattr(vision, source, None) is not None:
            kwargs[name] = getattr(vision, source)
    if isinstance(getattr(default, "max_image_size", None), Mapping):
        kwargs["max_image_size"] = {key: side for key in default.max_image_size}
    rng = np.random.default_rng(seed)
    pixels = [[rng.integers(0, 256, (side, side, 3), dtype=np.uint8)] for _ in range(images)]
    out = processor_class(**kwargs)(images=pixels, return_tensors="pt")
    return {key: value for key, value in out.items() if isinstance(value, torch.Tensor)}


def _feature_rows(features: Any) -> int:
    if hasattr(features, "pooler_output") and features.pooler_output is not None:
        features = features.pooler_output
    elif hasattr(features, "last_hidden_state") and not isinstance(features, torch.Tensor):
        features = features.last_hidden_state
    if isinstance(features, list | tuple):
        return sum(_feature_rows(f) for f in features)
    assert isinstance(features, torch.Tensor), f"unexpected image features {type(features).__name__}"
    return int(features.reshape(-1, features.shape[-1]).shape[0])


def _accepts(fn: Any, name: str) -> bool:
    parameters = inspect.signature(fn).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def image_batch(
    model: nn.Module, rows: int, seq: int, *, seed: int = 7
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A batch of ``rows`` rows, each one image then text, for a materialised vision-language model.

    Returns:
        ``(inputs, labels)``: the model's keyword inputs (``input_ids``, the processor's outputs, and
        ``token_type_ids`` / ``mm_token_type_ids`` marking image tokens where the forward takes them)
        and next-token labels (already shifted; ``-100`` on image placeholders and their predecessors).

    Raises:
        ValueError: The image tokens do not fit in ``seq``.
    """
    vlm: Any = model  # a transformers vision-language model (its attributes are not typed)
    config = vlm.config
    pixels = image_inputs(config, rows)
    features_fn = vlm.get_image_features
    with torch.no_grad():
        accepted = {k: v for k, v in pixels.items() if _accepts(features_fn, k)}
        per_image = _feature_rows(features_fn(**accepted)) // rows
    text = seq + 1 - per_image
    if text < 2:
        raise ValueError(f"{per_image} image tokens per image do not fit in sequences of {seq}")
    token = image_token_id(config)
    vocab = config.get_text_config().vocab_size
    reserved = {
        token,
        *(
            v
            for k, v in config.to_dict().items()
            if k.endswith(("token_id", "token_index")) and isinstance(v, int)
        ),
    }
    allowed = torch.tensor([t for t in range(vocab) if t not in reserved])
    generator = torch.Generator().manual_seed(seed)
    words = allowed[torch.randint(0, len(allowed), (rows, text), generator=generator)]
    image = torch.full((rows, per_image), token)
    tokens = torch.cat([words[:, :1], image, words[:, 1:]], dim=1)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    labels[labels == token] = -100
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, **pixels}
    is_image = (input_ids == token).long()
    for name in ("token_type_ids", "mm_token_type_ids"):
        if _accepts(type(model).forward, name) and name in inspect.signature(type(model).forward).parameters:
            inputs[name] = is_image
    return inputs, labels


IMAGE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize + ': ' }}"
    "{%- if message['role'] == 'assistant' -%}{% generation %}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{{ eos_token }}{% endgeneration %}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<image>{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}"
)
"""Plain-text roles; the image part is LLaVA's ``<image>`` placeholder; EOS ends each answer."""


def save_tiny_llava(folder: str | Path, words: Sequence[str], *, seed: int = 0) -> Path:
    """A tiny LLaVA and its processor, saved in ``folder`` for ``automodel train`` tests.

    The model is `automodel_testing.tiny.derive_tiny_config` of ``llava`` (CLIP tower + Llama); the
    processor is ``LlavaProcessor`` with a word-level tokenizer over ``words`` (plus ``<pad>``,
    ``<eos>``, ``<unk>``, ``<image>`` and the template's role words), the CLIP image processor at the
    tower's image size and `IMAGE_CHAT_TEMPLATE`. Nothing is downloaded. Returns ``folder``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        AutoModelForImageTextToText,
        CLIPImageProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    from automodel_testing.tiny import derive_tiny_config

    specials = ["<pad>", "<eos>", "<unk>", "<image>"]
    ordinary = sorted({"User", "Assistant", "System", ":", *words} - set(specials))
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + ordinary)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config = derive_tiny_config("llava")
    side = config.vision_config.image_size
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_index = tokenizer.convert_tokens_to_ids("<image>")
    config.text_config.pad_token_id = tokenizer.pad_token_id
    config.text_config.eos_token_id = tokenizer.eos_token_id
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        ),
        tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's class token
        chat_template=IMAGE_CHAT_TEMPLATE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    out = Path(folder)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
