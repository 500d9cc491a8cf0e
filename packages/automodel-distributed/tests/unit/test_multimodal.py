"""Parts of vision-language models from their sub-configs, freeze_config, and frozen towers as FSDP units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel_distributed.fsdp2_units import frozen_towers, plan_fsdp_units
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
    from automodel_distributed.blocks import blocks_in_scope

    model = _vlm(model_type)
    parts = model_parts(model)
    vision = blocks_in_scope(model, ("vision",))
    language = blocks_in_scope(model, ("language",))
    assert len(vision) >= 4 and len(language) >= 4
    assert {parts.role_of(fqn) for fqn, _ in vision} == {"vision"}
    assert {parts.role_of(fqn) for fqn, _ in language} == {"language"}


def _undeclared(tower_fqn: str, module: nn.Module) -> bool:
    from automodel_distributed.blocks import no_split_module_names

    declared = no_split_module_names(module)
    return not any(type(m).__name__ in declared for m in module.get_submodule(tower_fqn).modules())


@pytest.mark.parametrize("model_type", ["got_ocr2", "pp_chart2table"])
def test_undeclared_tower_blocks_come_from_the_towers_structure(model_type: str) -> None:
    from automodel_distributed.activation_checkpointing import apply_activation_checkpointing
    from automodel_distributed.blocks import blocks_in_scope

    model = _vlm(model_type)
    (tower,) = [fqn for fqn, _ in model_parts(model).parts["vision"]]
    assert _undeclared(tower, model)  # the premise: its block class is in no _no_split_modules
    layers = [n for n, m in model.get_submodule(tower).named_modules() if isinstance(m, nn.ModuleList)]
    expected = [
        f"{tower}.{lst}.{i}" for lst in layers for i in range(len(model.get_submodule(f"{tower}.{lst}")))
    ]
    assert [fqn for fqn, _ in blocks_in_scope(model, ("vision",))] == expected and len(expected) >= 4
    apply_freeze_config(model, {"freeze_embeddings": False})
    units = [u.fqn for u in plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding="per_layer")]
    assert [u for u in units if u.startswith(tower + ".")] == expected
    apply_activation_checkpointing(model, mode="full", scope=("vision",))
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    assert wrapped == expected


@pytest.mark.parametrize("model_type", ["idefics2", "ovis2"])
def test_declared_parts_of_tower_layers_give_way_to_the_whole_layers(model_type: str) -> None:
    """Idefics2 / Ovis2 declare their vision attention, not the encoder layer around it: the layer is
    the block (a per_layer unit or a checkpoint of the attention alone would leave the MLP out)."""
    from automodel_distributed.blocks import blocks_in_scope, no_split_module_names

    model = _vlm(model_type)
    (tower,) = [fqn for fqn, _ in model_parts(model).parts["vision"]]
    declared = no_split_module_names(model)
    attention = [n for n, m in model.get_submodule(tower).named_modules() if type(m).__name__ in declared]
    assert attention and all(n.rsplit(".", 1)[-1] in ("self_attn", "attention") for n in attention)
    (layers,) = [n for n, m in model.get_submodule(tower).named_modules() if isinstance(m, nn.ModuleList)]
    expected = [f"{tower}.{layers}.{i}" for i in range(len(model.get_submodule(f"{tower}.{layers}")))]
    assert [fqn for fqn, _ in blocks_in_scope(model, ("vision",))] == expected
    apply_freeze_config(model, {"freeze_embeddings": False})
    units = [u.fqn for u in plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding="per_layer")]
    assert [u for u in units if u.startswith(tower + ".")] == expected


def _blockless_got_ocr2() -> nn.Module:
    """GOT-OCR2 with its vision encoder's block list emptied: a tower with no repeated blocks."""
    model = _vlm("got_ocr2")
    model.model.vision_tower.layers = nn.ModuleList()
    return model


def test_per_layer_is_refused_for_a_frozen_tower_without_blocks() -> None:
    model = _blockless_got_ocr2()
    apply_freeze_config(model, {"freeze_embeddings": False})
    refusal = r"frozen_sharding='per_layer'.*model\.vision_tower.*'root' or 'replicate'"
    with pytest.raises(ValueError, match=refusal):
        plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding="per_layer")
    for sharding in ("root", "replicate"):
        plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding=sharding)  # accepted


@pytest.mark.parametrize("scope", [("vision",), ("multimodal",), ("language", "vision")])
def test_a_checkpointing_scope_naming_a_tower_without_blocks_is_refused(scope: tuple[str, ...]) -> None:
    from automodel_distributed.activation_checkpointing import apply_activation_checkpointing

    model = _blockless_got_ocr2()
    refusal = r"activation_checkpointing_scope=.*model\.vision_tower.*_no_split_modules"
    with pytest.raises(ValueError, match=refusal):
        apply_activation_checkpointing(model, mode="full", scope=scope)
    apply_activation_checkpointing(model, mode="full", scope=("language",))  # accepted


def test_both_towers_of_video_llava_are_vision_parts_and_frozen() -> None:
    model = _vlm("video_llava")
    towers = dict(model_parts(model).parts["vision"])
    assert set(towers) == {"model.image_tower", "model.video_tower"}
    apply_freeze_config(model, {"freeze_embeddings": False})
    for fqn in towers:
        assert not any(p.requires_grad for p in model.get_submodule(fqn).parameters())
    assert {fqn for fqn, _ in frozen_towers(model)} >= set(towers)
    units = plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding="per_layer")
    for fqn in towers:
        assert sum(1 for u in units if u.fqn.startswith(fqn + ".encoder.layers.")) == 4
    units = plan_fsdp_units(model, reshard_after_forward=None, frozen_sharding="root")
    assert not [u.fqn for u in units if any(u.fqn.startswith(f + ".") for f in towers)]
