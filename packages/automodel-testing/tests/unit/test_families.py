"""The model matrix's families come from transformers' registry, and their tiny configs keep each
family's structure at a tiny size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from automodel_testing.families import EXCLUDED, decoder_families, excluded_families
from automodel_testing.tiny import FAMILY_OVERRIDES, NUM_LAYERS, VOCAB_SIZE, derive_tiny_config
from automodel_testing.versions import older_transformers

MAX_PARAMS = 3_000_000


def test_families_are_the_registry_minus_listed_exclusions() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kept = {f.model_type for f in decoder_families()}
    dropped = excluded_families()
    assert kept | set(dropped) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not kept & set(dropped)
    assert all(reason for reason in dropped.values())
    assert set(EXCLUDED) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) <= set(dropped)  # those it has
    # The families people train most are in, whatever the registry holds next to them.
    assert {"llama", "gemma2", "qwen3_moe", "deepseek_v3", "gpt2", "mamba"} <= kept
    # Encoder-only, encoder-decoder and vision-language types are out, each with its reason.
    assert "encoder-only" in dropped["bert"] and dropped["marian"] == "encoder-decoder"
    assert "vision-language" in dropped["gemma3"]


def _random_fields(fields: dict[str, object], prefix: str = "") -> dict[str, float]:
    """Non-zero probabilities of dropout, stochastic depth, layer drop or jitter, sub-configs included."""
    found: dict[str, float] = {}
    for name, value in fields.items():
        if isinstance(value, dict):
            found.update(_random_fields(value, f"{prefix}{name}."))
        elif isinstance(value, float) and ("drop" in name or "jitter" in name) and value != 0.0:
            found[prefix + name] = value
    return found


def _meta(config: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config)
    return model


OLDER_TRANSFORMERS = older_transformers()
"""Older than the locked transformers (the `oldest` session): some families' own configs and models
fail there, which the locked version's run must never excuse."""


@pytest.mark.parametrize("family", [f.model_type for f in decoder_families()])
def test_every_tiny_config_is_tiny_and_keeps_the_family_structure(family: str) -> None:
    from transformers import CONFIG_MAPPING

    try:
        config = derive_tiny_config(family)
    except ValueError as exc:
        if not OLDER_TRANSFORMERS:
            raise
        pytest.skip(f"this older transformers cannot configure {family}: {exc}")
    assert config.to_dict().get("use_cache", False) is False
    assert _random_fields(config.to_dict()) == {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = getattr(config, name, None)
        for token in ids if isinstance(ids, list) else [ids]:
            assert token is None or token < VOCAB_SIZE, (name, token)
    layer_types = getattr(config, "layer_types", None)
    try:
        defaults = CONFIG_MAPPING[family]().to_dict()
    except (TypeError, ValueError):
        defaults = {}
    default_types = defaults.get("layer_types")
    if isinstance(layer_types, list) and isinstance(default_types, list) and default_types:
        # Every kind of layer the family has is still there (a short window may add sliding layers),
        # unless the family's override spells its layer kinds out (its comment says why).
        if "layer_types" not in FAMILY_OVERRIDES.get(family, {}):
            assert set(layer_types) >= set(default_types)
        assert len(layer_types) == NUM_LAYERS
    try:
        model = _meta(config)
    except (AttributeError, RuntimeError) as exc:  # transformers itself cannot build it (the matrix says so)
        if isinstance(exc, RuntimeError) and not OLDER_TRANSFORMERS:
            raise
        pytest.skip(f"transformers cannot build {family}: {exc}")
    assert 0 < sum(p.numel() for p in model.parameters()) <= MAX_PARAMS


def test_overrides_win_and_unknown_types_are_named() -> None:
    assert derive_tiny_config("llama", hidden_size=32).hidden_size == 32
    with pytest.raises(ValueError, match="no config for model type 'no_such_model'"):
        derive_tiny_config("no_such_model")


def test_sizes_follow_each_family_field_names_and_relations() -> None:
    gpt2 = derive_tiny_config("gpt2")  # n_embd, n_layer, n_head through attribute_map
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head) == (64, NUM_LAYERS, 4)
    mla = derive_tiny_config("deepseek_v3")  # multi-head latent attention sizes add up
    assert mla.qk_head_dim == mla.qk_rope_head_dim + mla.qk_nope_head_dim
    assert mla.num_key_value_heads == mla.num_attention_heads  # MHA stays MHA
    assert derive_tiny_config("mistral").num_key_value_heads == 2  # GQA stays GQA
    assert derive_tiny_config("zaya").num_experts_per_tok == 1  # never above the family's own value
    gemma3 = derive_tiny_config("gemma3_text")
    assert set(gemma3.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma3.sliding_window < 16  # shorter than the test sequence, so that it matters


def test_vlm_families_are_the_image_text_to_text_registry() -> None:
    from transformers.models.auto import modeling_auto

    from automodel_testing.families import vlm_families

    names = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    assert [f.model_type for f in vlm_families()] == sorted(names)


def test_no_tiny_vlm_config_keeps_a_random_layer() -> None:
    """A VLM trains in ``train()`` mode: any dropout left on makes the parity checks compare noise.

    Qianfan-OCR's vision tower defaults to ``drop_path_rate=0.1`` (stochastic depth): it gave the VLM
    matrix a first-logits difference of 8.6e-4 under LoRA that looked like a loading bug.
    """
    from automodel_testing.families import vlm_families

    assert derive_tiny_config("qianfan_ocr").vision_config.drop_path_rate == 0.0
    left = {}
    for family in vlm_families():
        try:
            config = derive_tiny_config(family.model_type)
        except Exception:  # transformers' own validators (not all ValueErrors) refuse some tiny configs
            continue  # the matrix reports such a family itself
        left.update({f"{family.model_type}.{k}": v for k, v in _random_fields(config.to_dict()).items()})
    assert left == {}


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl", "qwen3_vl", "gemma3", "internvl"])
def test_tiny_vision_towers_see_tiny_images(model_type: str) -> None:
    from automodel_testing.tiny import IMAGE_PATCHES

    config = derive_tiny_config(model_type)
    vision, text = config.vision_config, config.text_config
    patch = vision.patch_size if isinstance(vision.patch_size, int) else vision.patch_size[0]
    image = getattr(vision, "image_size", None)
    if image is not None:
        assert (image if isinstance(image, int) else image[0]) == IMAGE_PATCHES * patch
    if getattr(vision, "out_hidden_size", None) is not None:
        assert vision.out_hidden_size == text.hidden_size  # the tower projects to the text width
    sections = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
    if sections:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        assert sum(sections) == head_dim // 2
    depth = vision.depth if hasattr(vision, "depth") else vision.num_hidden_layers
    for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        assert all(0 <= i < depth for i in getattr(vision, name, None) or [])
