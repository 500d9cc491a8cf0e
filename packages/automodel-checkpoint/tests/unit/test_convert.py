"""Fused MoE tensors from per-expert checkpoints, described with transformers' conversion mapping.

Proofs: `pieces` of any box of a stack/concat description equal that box of the real stacked tensor; a
meta Qwen3-MoE or Mixtral model loaded by `load_hf_checkpoint` gives exactly the logits of
``from_pretrained``; `save_hf_checkpoint` writes the tensors ``save_pretrained`` writes (names and
values); an operation that cannot be described, or a missing expert, fails before anything is written.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from automodel_checkpoint import (
    CheckpointMismatchError,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from automodel_checkpoint.convert import (
    Computed,
    Node,
    Part,
    Source,
    UnsupportedConversionError,
    _cat,
    _stack,
    compute,
    model_conversions,
    pieces,
    plan_conversions,
    sources,
)
from automodel_testing import build_tiny_model, make_batch, save_tiny_checkpoint

FAMILIES = ("qwen3_moe", "mixtral")


def _materialise(node: Node, values: dict[str, torch.Tensor]) -> torch.Tensor:
    if isinstance(node, Source):
        return values[node.key]
    parts = [_materialise(p, values) for p in node.parts]
    return torch.stack(parts, node.dim) if node.__class__.__name__ == "Stack" else torch.cat(parts, node.dim)


def test_pieces_of_every_box_match_the_real_tensor() -> None:
    gen = torch.Generator().manual_seed(0)
    values = {f"e{e}.{w}": torch.randn(3, 5, generator=gen) for e in range(4) for w in ("g", "u")}
    # gate_up: [E, 2I, H] = cat(stack(gate), stack(up)) along dim 1 (the qwen3_moe / mixtral converter)
    gates = _stack(0, [Source(f"e{e}.g", (3, 5)) for e in range(4)])
    ups = _stack(0, [Source(f"e{e}.u", (3, 5)) for e in range(4)])
    last = _cat(
        -1,
        [
            _stack(-1, [Source("e0.g", (3, 5)), Source("e1.g", (3, 5))]),
            _stack(-1, [Source("e2.g", (3, 5)), Source("e3.g", (3, 5)), Source("e0.u", (3, 5))]),
        ],
    )
    for node in (_cat(1, [gates, ups]), last):
        full = _materialise(node, values)
        assert node.shape == tuple(full.shape)
        for start in itertools.product(*(range(0, n, 2) for n in node.shape)):
            shape = tuple(min(3, n - s) for s, n in zip(start, node.shape, strict=True))
            out = torch.full(shape, float("nan"))
            for p in pieces(node, start, shape):
                region = tuple(slice(s, s + n) for s, n in zip(p.start, p.shape, strict=True))
                out[p.index] = values[p.key][region]
            box = tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))
            assert torch.equal(out, full[box]), (start, shape)


def test_pieces_skip_sources_outside_the_box() -> None:
    node = _stack(0, [Source(f"e{e}", (2, 2)) for e in range(8)])
    assert sorted({p.key for p in pieces(node, (4, 0, 0), (4, 2, 2))}) == ["e4", "e5", "e6", "e7"]


def test_shapes_that_do_not_stack_are_named() -> None:
    with pytest.raises(ValueError, match=r"cannot stack .* vs \[.b \[2, 3\]"):
        _stack(0, [Source("a", (3, 2)), Source("b", (2, 3))])


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_moe_model_loads_exactly_like_from_pretrained(family: str, tmp_path: Path) -> None:
    src = save_tiny_checkpoint(family, tmp_path / "src", seed=5)
    model = build_tiny_model(family, meta=True)
    report = load_hf_checkpoint(model, src)
    assert report.missing == [] and report.unexpected == []
    assert any(k.endswith("experts.gate_up_proj") for k in report.loaded)
    ref = AutoModelForCausalLM.from_pretrained(str(src))
    ids = make_batch(128, 2, 10, seed=1)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_save_writes_what_save_pretrained_writes(family: str, tmp_path: Path) -> None:
    src = save_tiny_checkpoint(family, tmp_path / "src", seed=6)
    model = build_tiny_model(family, meta=True)
    load_hf_checkpoint(model, src)
    dst = save_hf_checkpoint(model, tmp_path / "dst", max_shard_size="200KB")
    expected = load_file(src / "model.safetensors")
    got: dict[str, torch.Tensor] = {}
    for file in dst.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    back = AutoModelForCausalLM.from_pretrained(str(dst))
    ids = make_batch(128, 2, 10, seed=2)["input_ids"]
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_missing_expert_fails_before_any_write(tmp_path: Path) -> None:
    src = save_tiny_checkpoint("qwen3_moe", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    model = build_tiny_model("qwen3_moe", meta=True)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj.*up_proj.weight': 7"):
        load_hf_checkpoint(model, src)
    assert all(p.is_meta for p in model.parameters())
    # Every expert of one weight missing: the fused tensor has the wrong shape.
    for e in range(8):
        del tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
    del tensors["model.layers.1.mlp.experts.3.gate_proj.weight"]
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_checkpoint(model, src)
    assert err.value.shape_mismatches == {
        "model.layers.0.mlp.experts.gate_up_proj": ((8, 32, 64), (8, 64, 64)),
        "model.layers.1.mlp.experts.gate_up_proj": ((7, 64, 64), (8, 64, 64)),
        "model.layers.1.mlp.experts.down_proj": ((7, 64, 32), (8, 64, 32)),
    }
    assert all(p.is_meta for p in model.parameters())


def test_an_operation_that_cannot_be_sliced_is_computed_by_transformers() -> None:
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    converter = WeightConverter(
        source_patterns="mlp.experts.*.down_proj.weight",
        target_patterns="mlp.experts.down_proj",
        operations=[MergeModulelist(dim=0), Transpose(1, 2)],
    )
    keys = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": (4, 2) for e in range(2)}
    target = "model.layers.0.mlp.experts.down_proj"
    plan = plan_conversions(keys, [target], [converter])
    node = plan.fused[target]
    assert isinstance(node, Computed) and node.shape == (2, 2, 4)
    assert [s.key for s in sources(node)] == sorted(keys)
    whole = {k: torch.randn(4, 2) for k in keys}
    out = compute(node, whole, None)
    assert torch.equal(out[target], torch.stack([whole[k] for k in sorted(keys)]).transpose(1, 2))
    with pytest.raises(TypeError, match="computed from whole tensors"):
        list(pieces(node, (0, 0, 0), (2, 2, 4)))


def test_a_fused_projection_is_chunked_slice_by_slice() -> None:
    from transformers.core_model_loading import Chunk, WeightConverter

    converter = WeightConverter(
        source_patterns="query_key_value",
        target_patterns=["q_proj", "k_proj", "v_proj"],
        operations=[Chunk(0)],
    )
    keys = {"model.layers.0.self_attn.query_key_value.weight": (12, 4)}
    model_keys = [f"model.layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]
    plan = plan_conversions(keys, model_keys, [converter])
    assert sorted(plan.fused) == sorted(model_keys)
    k_node = plan.fused["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k_node, Part) and k_node.shape == (4, 4)
    # rows 1..2 of k_proj are rows 5..6 of the fused tensor
    (piece,) = pieces(k_node, (1, 0), (2, 4))
    assert piece.key == next(iter(keys)) and piece.start == (5, 0) and piece.shape == (2, 4)


def test_a_converter_that_cannot_run_on_shapes_is_named() -> None:
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class DataDependent(ConversionOps):  # its output shape depends on the values
        def convert(self, input_dict: Any, source_patterns: Any, target_patterns: Any, **kwargs: Any) -> Any:
            tensor = next(iter(input_dict.values()))[0]
            return {target_patterns[0]: tensor[: int(tensor.sum())]}

    converter = WeightConverter(
        source_patterns="packed", target_patterns="weight", operations=[DataDependent()]
    )
    with pytest.raises(UnsupportedConversionError, match=r"DataDependent.*cannot be described"):
        plan_conversions({"layers.0.packed": (4,)}, ["layers.0.weight"], [converter])


def test_dense_models_have_only_renamings() -> None:
    from transformers.core_model_loading import WeightConverter

    transforms = model_conversions(build_tiny_model("llama", meta=True))
    assert not any(isinstance(t, WeightConverter) for t in transforms)
    assert model_conversions(torch.nn.Linear(2, 2)) == []


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return out


def test_a_fused_qkv_that_loading_chunks_is_saved_fused_again(tmp_path: Path) -> None:
    """Qianfan-OCR's vision tower stores ``attn.qkv`` fused; the model holds ``q_proj``/``k_proj``/``v_proj``.

    Loading chunks it slice by slice; saving must concatenate the three back (it used to write one of
    them under the fused name: ``[64, 64]`` for ``[192, 64]``, which ``from_pretrained`` refuses).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    from automodel_testing.tiny import derive_tiny_config

    torch.manual_seed(3)
    original = AutoModelForImageTextToText.from_config(derive_tiny_config("qianfan_ocr"))
    original.save_pretrained(tmp_path / "src")
    on_disk = _safetensors(tmp_path / "src")
    assert any(k.endswith("attn.qkv.weight") for k in on_disk)  # the fused layout this test is about
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp_path / "src"))
    load_hf_checkpoint(model, tmp_path / "src")
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path / "src", dtype=torch.float32)
    ours = model.state_dict()
    assert sorted(ours) == sorted(ref.state_dict())
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    dst = save_hf_checkpoint(model, tmp_path / "dst")
    saved = _safetensors(dst)
    assert sorted(saved) == sorted(on_disk)
    for key, tensor in on_disk.items():
        assert torch.equal(saved[key], tensor), key
    back = AutoModelForImageTextToText.from_pretrained(dst, dtype=torch.float32).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
