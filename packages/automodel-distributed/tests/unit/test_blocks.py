"""Transformer-block discovery (`find_transformer_blocks`) and layer-group scoping (`blocks_in_scope`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from automodel_distributed.blocks import (
    LAYER_GROUP_MARKERS,
    block_group,
    blocks_in_scope,
    find_transformer_blocks,
    no_split_module_names,
)
from automodel_testing import TINY_FAMILIES, build_tiny_model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = InnerBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.proj(x))


class InnerBlock(nn.Module):
    """Also declared as a no-split class, but nested in `Block`: not a block of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class VisionBlock(Block):
    pass


class ToyVLM(nn.Module):
    """A composite model: a vision tower, a projector and a language model, each with blocks."""

    _no_split_modules = ("Block", "VisionBlock", "InnerBlock")

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = nn.Module()
        self.vision_tower.blocks = nn.ModuleList([VisionBlock(), VisionBlock()])
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.layers = nn.ModuleList([Block()])
        self.language_model = nn.Module()
        self.language_model.layers = nn.ModuleList([Block(), Block(), Block()])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_families_have_their_decoder_layers_as_blocks(family: str) -> None:
    model = build_tiny_model(family, meta=True)
    blocks = find_transformer_blocks(model)
    assert [fqn for fqn, _ in blocks] == ["model.layers.0", "model.layers.1"]
    assert [module for _, module in blocks] == list(model.model.layers)
    assert no_split_module_names(model) == frozenset(model._no_split_modules)


def test_blocks_come_in_module_order_and_nested_no_split_classes_are_not_blocks() -> None:
    fqns = [fqn for fqn, _ in find_transformer_blocks(ToyVLM())]
    assert fqns == [
        "vision_tower.blocks.0",
        "vision_tower.blocks.1",
        "multi_modal_projector.layers.0",
        "language_model.layers.0",
        "language_model.layers.1",
        "language_model.layers.2",
    ]


def test_checkpoint_wrapped_blocks_are_returned_as_the_wrapper_under_the_plain_fqn() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_tiny_model("llama")
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    blocks = find_transformer_blocks(model)
    assert [fqn for fqn, _ in blocks] == ["model.layers.0", "model.layers.1"]
    assert blocks[1][1] is model.model.layers[1]
    assert type(blocks[1][1]).__name__ == "CheckpointWrapper"


def test_peft_wrapped_model() -> None:
    peft = pytest.importorskip("peft")
    model = build_tiny_model("qwen2")
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    blocks = find_transformer_blocks(peft_model)
    assert [fqn for fqn, _ in blocks] == [
        "base_model.model.model.layers.0",
        "base_model.model.model.layers.1",
    ]
    assert blocks[0][1] is model.model.layers[0]


def test_whole_model_compile_wrapper_is_stripped_from_fqns() -> None:
    model = build_tiny_model("llama")
    compiled = torch.compile(model, backend="eager")  # wrapping only: nothing is compiled until called
    assert [fqn for fqn, _ in find_transformer_blocks(compiled)] == ["model.layers.0", "model.layers.1"]


def test_fallback_to_block_containers_when_nothing_is_declared() -> None:
    model = nn.Module()
    model.transformer = nn.Module()
    model.transformer.h = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    model.head = nn.Linear(2, 2)
    assert [fqn for fqn, _ in find_transformer_blocks(model)] == ["transformer.h.0", "transformer.h.1"]


def test_declared_classes_that_are_absent_fall_back_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Module()
    model._no_split_modules = ["NotHere"]
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    with caplog.at_level(logging.WARNING, logger="automodel_distributed.blocks"):
        assert [fqn for fqn, _ in find_transformer_blocks(model)] == ["layers.0"]
    assert "NotHere" in caplog.text


def test_no_blocks_raises_naming_the_class_and_the_fix() -> None:
    class Headless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = nn.Sequential(nn.Linear(2, 2))

    with pytest.raises(ValueError, match=r"Headless.*_no_split_modules = \['YourBlockClassName'\]"):
        find_transformer_blocks(Headless())


@pytest.mark.parametrize(
    ("fqn", "group"),
    [
        ("model.layers.3", "language"),
        ("model.language_model.layers.0", "language"),
        ("model.vision_tower.encoder.layers.0", "vision"),
        ("visual.blocks.2", "vision"),
        ("model.visualizer.blocks.2", "language"),  # markers match whole FQN components only
        ("model.audio_tower.layers.1", "audio"),
        ("model.multi_modal_projector.layers.0", "multimodal"),
        ("vision_tower._checkpoint_wrapped_module.blocks.0", "vision"),
    ],
)
def test_block_group(fqn: str, group: str) -> None:
    assert block_group(fqn) == group


def test_marker_table_is_data() -> None:
    assert set(LAYER_GROUP_MARKERS) == {"vision", "audio", "multimodal"}
    assert all(isinstance(m, tuple) and m for m in LAYER_GROUP_MARKERS.values())


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        (("all",), 6),
        (("language",), 3),
        (("vision",), 2),
        (("multimodal",), 3),  # the towers and the projector: everything but the language model
        (("language", "vision"), 5),
        (("audio",), 0),
    ],
)
def test_blocks_in_scope(scope: tuple[str, ...], expected: int) -> None:
    blocks = blocks_in_scope(ToyVLM(), scope)
    assert len(blocks) == expected
    if scope == ("vision",):
        assert [fqn for fqn, _ in blocks] == ["vision_tower.blocks.0", "vision_tower.blocks.1"]


@pytest.mark.parametrize("scope", [(), ("all", "language"), ("language+vision",), ("default",)])
def test_blocks_in_scope_rejects_unnormalised_scopes(scope: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="scope"):
        blocks_in_scope(ToyVLM(), scope)
