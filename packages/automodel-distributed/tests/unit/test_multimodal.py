"""Parts of vision-language models from their sub-configs, freeze_config, and frozen towers as FSDP units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel_distributed.fsdp2 import frozen_towers, plan_fsdp_units
from automodel_distributed.multimodal import FreezeConfig, apply_freeze_config, model_parts

pytest.importorskip("transformers")

FAMILIES = ("llava", "qwen2_5_vl", "idefics3", "gemma3")


def _vlm(model_type: str) -> nn.Module:
    from transformers import AutoModelForImageTextToText

    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):
        model: nn.Module = AutoModelForImageTextToText.from_config(derive_tiny_config(model_type))
    return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_parts_come_from_the_sub_configs(model_type: str) -> None:
    model = _vlm(model_type)
    parts = model_parts(model)
    config = model.config
    (vision,) = parts.modules("vision")
    assert vision.config is config.vision_config
    language = parts.modules("language")
    assert language[0].config is config.text_config
    assert language[-1] is model.get_output_embeddings()
    # Every parameter belongs to exactly one part.
    names = [name for name, _ in model.named_parameters()]
    assert all(parts.role_of(name) is not None for name in names), [
        n for n in names if parts.role_of(n) is None
    ]
    assert parts.is_multimodal


def test_a_text_model_is_one_language_part() -> None:
    from automodel_testing import build_tiny_model

    parts = model_parts(build_tiny_model("llama", meta=True))
    assert not parts.parts and not parts.is_multimodal


def test_freeze_config_defaults_freeze_the_vision_tower_and_embeddings() -> None:
    model = _vlm("llava")
    frozen = apply_freeze_config(model, {})
    parts = model_parts(model)
    assert set(frozen) == {"vision", "embeddings"}
    assert not any(p.requires_grad for m in parts.modules("vision") for p in m.parameters())
    assert not model.get_input_embeddings().weight.requires_grad
    assert all(p.requires_grad for m in parts.modules("projector") for p in m.parameters())
    assert model.get_output_embeddings().weight.requires_grad


def test_freeze_config_language_model() -> None:
    model = _vlm("qwen2_5_vl")
    apply_freeze_config(
        model, FreezeConfig(freeze_embeddings=False, freeze_vision_tower=False, freeze_language_model=True)
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("model.visual.") for n in trainable)


@pytest.mark.parametrize(
    ("config", "match"), [({"freeze_vision": True}, "freeze_vision"), (3, "freeze_config")]
)
def test_bad_freeze_config_is_refused(config: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FreezeConfig.coerce(config)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_frozen_sharding_places_the_tower_blocks(model_type: str) -> None:
    model = _vlm(model_type)
    apply_freeze_config(model, {"freeze_embeddings": False})
    (tower,) = [fqn for fqn, _ in frozen_towers(model)]

    def tower_units(sharding: str) -> list[str]:
        units = plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding=sharding)
        return [u.fqn for u in units if u.fqn.startswith(tower + ".")]

    assert len(tower_units("per_layer")) >= 4  # the tiny tower's blocks
    assert tower_units("root") == tower_units("replicate") == []
    # Language blocks stay units in every case.
    for sharding in ("root", "per_layer", "replicate"):
        units = plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding=sharding)
        assert sum(1 for u in units if model_parts(model).role_of(u.fqn) == "language") >= 4


def test_a_trainable_tower_is_no_frozen_tower() -> None:
    model = _vlm("llava")
    assert frozen_towers(model) == []
    units = plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding="root")
    assert any(".vision_tower." in u.fqn for u in units)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_checkpointing_scopes_follow_the_parts(model_type: str) -> None:
    from automodel_distributed.layers import blocks_in_scope

    model = _vlm(model_type)
    parts = model_parts(model)
    vision = blocks_in_scope(model, ("vision",))
    language = blocks_in_scope(model, ("language",))
    assert len(vision) >= 4 and len(language) >= 4
    assert {parts.role_of(fqn) for fqn, _ in vision} == {"vision"}
    assert {parts.role_of(fqn) for fqn, _ in language} == {"language"}
