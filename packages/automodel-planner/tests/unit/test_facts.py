"""The memory census (`automodel_planner.facts`): grouped once per model, it equals a walk of every parameter.

The census places one name per group of parameters that every layout places alike
(`automodel_distributed.memory.PlacementRule.key`) instead of every parameter for every layout. Here each
job's census is compared with the same tally made one parameter at a time: dense and expert-parallel
models, frozen and quantized weights, float8 all-gathers, pipeline ranks, several layouts of one model
sharing its memo.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3MoeConfig

from automodel_distributed.config import FSDP2Config
from automodel_distributed.memory import layer_index, placement_rule
from automodel_mesh import MeshKind, ParallelismSizes, resolve_layout
from automodel_planner import PlanInput
from automodel_planner.facts import (
    _FIRST_STAGE_PREFIX,
    _Cast,
    _census,
    _outer,
    _ParamGroup,
    _size,
    _Tally,
    _tp_whole,
)

H, FFN, LAYERS, HEADS, KV, VOCAB = 64, 176, 4, 4, 2, 512


def _model(moe: bool) -> torch.nn.Module:
    shape: dict[str, Any] = dict(
        hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=False,
    )  # fmt: skip
    config: PretrainedConfig
    if moe:
        config = Qwen3MoeConfig(**shape, head_dim=H // HEADS, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, mlp_only_layers=[0])  # fmt: skip
    else:
        config = LlamaConfig(**shape)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _plan(model: torch.nn.Module, sizes: dict[str, int], **changes: object) -> PlanInput:
    plan = PlanInput(
        model=model,
        model_config=model.config,
        layout=resolve_layout(MeshKind.FSDP2, ParallelismSizes(**sizes), 8),
        strategy=FSDP2Config(),
        dtype=torch.bfloat16,
        seq_len=32,
        micro_batch_size=1,
    )
    return dataclasses.replace(plan, **changes)


def _one_at_a_time(plan: PlanInput, owners: dict[int, int]) -> list[_Tally]:
    """The tally of every parameter on its own: a group of one, placed by its own name."""
    rule = placement_rule(
        plan.strategy, plan.layout, plan.model, plan.dtype, outer=_outer(plan), tp_whole=_tp_whole(plan)
    )
    cast = _Cast.of(plan)
    tallies = [_Tally() for _ in range(plan.layout.pp)]
    for name, param in plan.model.named_parameters():
        index = layer_index(name)
        rank = 0
        if plan.layout.pp > 1:
            outside = 0 if name.startswith(_FIRST_STAGE_PREFIX) else plan.layout.pp - 1
            rank = owners.get(index, 0) if index is not None else outside
        stored = float(param.numel() * param.element_size())
        group = _ParamGroup(rule.key(name), name, param, False, _size(plan, param, index), stored)
        tallies[rank].add(rule(name), group, cast)
    return tallies


def _jobs() -> dict[str, tuple[PlanInput, dict[int, int]]]:
    from automodel_quant.fp8 import FP8Config

    dense, moe, frozen = _model(False), _model(True), _model(False)
    for name, param in frozen.named_parameters():
        param.requires_grad_(".mlp." in name)  # attention and the rest frozen: QLoRA's base below
    pp_owners = {b: b * 2 // LAYERS for b in range(LAYERS)}
    shared: dict[str, object] = {}  # one memo for the dense model's layouts, as --suggest shares it
    float8 = FP8Config(enabled=True, enable_fsdp_float8_all_gather=True)
    return {
        "fsdp": (_plan(dense, {}, model_memo=shared), {}),
        "fsdp x tp": (_plan(dense, {"tp_size": 2}, model_memo=shared), {}),
        "hsdp x cp": (_plan(dense, {"dp_replicate_size": 2, "cp_size": 2}, model_memo=shared), {}),
        "pp 2": (_plan(dense, {"pp_size": 2}, model_memo=shared), pp_owners),
        "float8 all-gather": (_plan(dense, {}, fp8=float8), {}),
        "ep 8": (_plan(moe, {"ep_size": 8}), {}),
        "ep 2 x tp 2": (_plan(moe, {"ep_size": 2, "tp_size": 2}), {}),
        "frozen, 4-bit base": (_plan(frozen, {}, base_weight_bits=4), {}),
    }


def test_the_grouped_census_equals_one_parameter_at_a_time() -> None:
    for label, (plan, owners) in _jobs().items():
        _check(label, plan, owners)


def _check(label: str, plan: PlanInput, owners: dict[int, int]) -> None:
    census = _census(plan, owners)
    expected = _one_at_a_time(plan, owners)
    assert len(census.tallies) == len(expected) == plan.layout.pp
    for got, want in zip(census.tallies, expected, strict=True):
        for field in ("params", "grads", "states", "accumulated", "accumulated_elements"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-12), (label, field)
        for field in ("units", "unit_grads", "unit_reduce"):
            got_units, want_units = getattr(got, field), getattr(want, field)
            assert got_units.keys() == want_units.keys(), (label, field)
            for unit, value in want_units.items():
                assert got_units[unit] == pytest.approx(value, rel=1e-12), (label, field, unit)
        assert got.unit_axes == want.unit_axes and got.reduce_separate == want.reduce_separate, label
    assert sum(t.params for t in census.tallies) > 0, label


def test_the_float8_layer_shapes_are_the_blocks_linear_layers() -> None:
    """What `FP8Memory` sizes its casts by: the blocks' ``nn.Linear`` layers, as torchao converts them."""
    from transformers import GPT2Config

    from automodel_planner.facts import _block_linears

    moe = _plan(_model(moe=True), {})
    linears = [
        (m.out_features, m.in_features)
        for fqn, m in moe.model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in fqn
    ]
    shapes, _ = _block_linears(moe)
    assert shapes == linears
    assert (8, H) not in shapes  # the router keeps an (experts, hidden) weight of no linear layer
    # GPT-2's blocks (``transformer.h.<i>``, found by structure) hold Conv1D, (in, out), never converted.
    config = GPT2Config(n_embd=H, n_head=HEADS, n_layer=2, n_positions=64, vocab_size=VOCAB, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert _block_linears(_plan(gpt2, {}))[0] == []
