"""Which linears a PeftConfig adapts: leaf names, suffixes, wildcards, excludes, the output head."""

from __future__ import annotations

import pytest
from torch import nn

from automodel_peft import PeftConfig, resolve_target_modules
from automodel_peft.matching import ModuleMatcher, is_causal_lm
from automodel_peft.patterns import patterns_to_regex
from automodel_testing import build_tiny_model


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return build_tiny_model("llama", meta=True)


def _leaves(names: list[str]) -> set[str]:
    return {n.rsplit(".", 1)[1] for n in names}


def test_leaf_names_match_at_any_depth(llama: nn.Module) -> None:
    names = resolve_target_modules(llama, PeftConfig(target_modules=["q_proj", "v_proj"]))
    assert names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]


def test_wildcards_cover_the_whole_name(llama: nn.Module) -> None:
    names = resolve_target_modules(llama, PeftConfig(target_modules=["*.layers.1.mlp.*_proj"]))
    assert names == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    ]
    assert (
        resolve_target_modules(llama, PeftConfig(target_modules=["mlp.*"])) == []
    )  # must match the whole name
    assert len(resolve_target_modules(llama, PeftConfig(target_modules=["*_proj"]))) == 14
    suffix = resolve_target_modules(llama, PeftConfig(target_modules=["layers.0.self_attn.o_proj"]))
    assert suffix == ["model.layers.0.self_attn.o_proj"]


def test_only_linears_are_matched(llama: nn.Module) -> None:
    assert resolve_target_modules(llama, PeftConfig(target_modules=["*mlp*", "*embed*"])) == [
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    ]


def test_match_all_and_exclude_leave_the_output_head_out(llama: nn.Module) -> None:
    everything = resolve_target_modules(llama, PeftConfig(match_all_linear=True))
    assert len(everything) == 14 and "lm_head" not in everything
    excluded = resolve_target_modules(llama, PeftConfig(exclude_modules=["down_proj", "*.layers.1.*"]))
    assert _leaves(excluded) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}
    assert all(".layers.0." in n for n in excluded)
    assert resolve_target_modules(llama, PeftConfig(target_modules=["lm_head"])) == ["lm_head"]


def test_adapters_and_wrapped_names() -> None:
    import peft

    model = build_tiny_model("llama", meta=True)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), model)
    names = resolve_target_modules(model, PeftConfig(match_all_linear=True))
    assert not any("lora_" in n or n.endswith("base_layer") for n in names)
    matcher = ModuleMatcher(PeftConfig(target_modules=["q_proj"]))
    assert matcher.match(nn.Linear(2, 2), "model._checkpoint_wrapped_module.layers.0.q_proj")
    assert not matcher.match(nn.Embedding(2, 2), "q_proj")


def test_regex_form_and_causal_lm_detection(llama: nn.Module) -> None:
    import re

    regex = re.compile(patterns_to_regex(["q_proj", "*.mlp.*"]))
    assert regex.fullmatch("q_proj") and regex.fullmatch("a.b.q_proj") and not regex.fullmatch("a.xq_proj")
    assert regex.fullmatch("model.layers.0.mlp.up_proj")
    assert is_causal_lm(llama)
    assert not is_causal_lm(nn.Sequential(nn.Linear(2, 2)))


class _Grouped(nn.Linear):
    """Borrows nn.Linear's weight but computes something else (one value per row)."""

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x.sum(-1)


def test_broad_selectors_leave_linears_with_their_own_forward_out() -> None:
    matcher = ModuleMatcher(PeftConfig(match_all_linear=True))
    assert matcher.match(nn.Linear(2, 2), "a.proj") and not matcher.match(_Grouped(2, 2), "a.proj")
    assert not ModuleMatcher(PeftConfig(exclude_modules=["other"])).match(_Grouped(2, 2), "a.proj")
    # named in target_modules, it is adapted
    assert ModuleMatcher(PeftConfig(target_modules=["proj"])).match(_Grouped(2, 2), "a.proj")


def test_regular_expressions_and_the_reference_wildcards(llama: nn.Module) -> None:
    # Issue 17: the reference matches target patterns as regular expressions and wildcards; ".*" used to
    # raise "matches no linear layer" because its "." was escaped.
    everything = resolve_target_modules(llama, PeftConfig(target_modules=[".*"]))
    assert len(everything) == 15 and "lm_head" in everything  # named patterns may adapt the head
    assert _leaves(resolve_target_modules(llama, PeftConfig(target_modules=["*.(q|v)_proj"]))) == {
        "q_proj",
        "v_proj",
    }
    assert resolve_target_modules(llama, PeftConfig(target_modules=["model.layers.[1].mlp.down_proj"])) == [
        "model.layers.1.mlp.down_proj"
    ]
    # ".*" after a whole segment is "the segment or below it", so layers.1 never matches layers.10.
    many = build_tiny_model("llama", num_hidden_layers=11, meta=True)
    below = resolve_target_modules(many, PeftConfig(target_modules=["*.layers.1.*"]))
    assert below and all(".layers.1." in n for n in below)
    assert all(
        ".layers.1." in n for n in resolve_target_modules(many, PeftConfig(target_modules=["*layers.1.*"]))
    )
    # ... but after a name fragment it is any text, as in the reference ("*mlp.*" reaches mlp's children).
    assert len(resolve_target_modules(llama, PeftConfig(target_modules=["*mlp.*"]))) == 6
    assert len(resolve_target_modules(llama, PeftConfig(exclude_modules=[".*_proj"]))) == 0
    with pytest.raises(ValueError, match=r"PeftConfig.target_modules: target pattern '\*.\(q_proj' is not"):
        PeftConfig(target_modules=["*.(q_proj"])


def test_conv1d_and_linears_computed_their_own_way_are_matched() -> None:
    import torch
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.pytorch_utils import Conv1D

    matcher = ModuleMatcher(PeftConfig(match_all_linear=True))
    assert matcher.match(Conv1D(8, 4), "h.0.attn.c_attn")  # GPT-2's linear, weight stored (in, out)
    assert matcher.match(FalconLinear(4, 8), "h.0.mlp.dense_h_to_4h")  # its own forward, a linear map
    with torch.device("meta"):  # models are adapted on meta, before sharding
        assert matcher.match(FalconLinear(4, 8), "h.0.mlp.dense_h_to_4h")


def test_an_entry_that_names_no_linear_is_reported(llama: nn.Module) -> None:
    from automodel_peft.matching import unmatched_patterns

    assert unmatched_patterns(llama, ["q_proj", "qproj", "*.mlp.*", "*.experts.*", "lm_head"]) == [
        "qproj",
        "*.experts.*",
    ]


def test_apply_lora_warns_naming_the_entries_that_adapt_nothing() -> None:
    import warnings

    from automodel_peft import apply_lora

    model = build_tiny_model("llama")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_lora(model, PeftConfig(target_modules=["q_proj", "gate_porj"]))
        apply_lora(build_tiny_model("llama"), PeftConfig(target_modules=["q_proj"]))  # all match: quiet
    assert [str(w.message) for w in seen] == [
        "PeftConfig.target_modules entries ['gate_porj'] match no linear layer of LlamaForCausalLM and act "
        "on nothing; check the names (fused expert weights are parameters: see target_parameters)"
    ]
