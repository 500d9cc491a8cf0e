"""The strategy's planner arithmetic: FSDP2's gathered units and collective buffers, parameter placement."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel_distributed import FSDP2Config
from automodel_distributed.config import DDPConfig
from automodel_distributed.memory import fsdp_buffer_bytes, fsdp_comm_buffer_bytes, placement_rule
from automodel_mesh import MeshContext, ParallelismSizes


def _config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, vocab_size=320, use_cache=False,
    )  # fmt: skip


def test_fsdp_buffers_and_bad_sizes() -> None:
    assert fsdp_buffer_bytes([10, 30, 20], shard=4) == 30 + 20 + 30
    assert fsdp_buffer_bytes([10, 30], shard=1) == 0
    # A frozen unit makes no gradient: the fresh gradient is the largest *trainable* unit's.
    assert fsdp_buffer_bytes([10, 30, 20], shard=4, unit_grad_bytes=[10, 0, 5]) == 30 + 20 + 10
    # Nothing reshards (pipelining, reshard_after_forward=False): every unit stays gathered.
    assert fsdp_buffer_bytes([10, 30, 20], shard=4, reshard=False) == 60
    # ... except a unit freed after forward anyway (a plain embedding): gathered alone, first.
    freed = [True, False, False]
    assert fsdp_buffer_bytes([10, 30, 20], shard=4, reshard=False, always_resharded=freed) == 50
    assert fsdp_buffer_bytes([90, 30, 20], shard=4, reshard=False, always_resharded=freed) == 90


def test_fsdp_comm_buffers_are_two_per_size_of_consecutive_units_one_per_other_size() -> None:
    from automodel_distributed.fsdp2_units import plan_fsdp_units

    model = AutoModelForCausalLM.from_config(_config())
    units = [
        sum(p.numel() * 4 for p in plan.module.parameters())
        for plan in plan_fsdp_units(model, reshard_after_forward=None)
    ]
    embed, *blocks, head = units
    assert embed == head and len(set(blocks)) == 1 and blocks[0] != embed
    root = model.config.hidden_size * 4  # the final norm
    # In forward order: the root, the embedding, the blocks (one after another), the head.
    ordered = [root, *units]
    assert fsdp_comm_buffer_bytes(ordered, shard=2) == root + embed + 2 * blocks[0]
    assert fsdp_comm_buffer_bytes(ordered, shard=1) == 0
    assert fsdp_comm_buffer_bytes([6, 8, 6], shard=2) == 6 + 8  # not consecutive: one buffer is reused
    # bf16 all-gathers, fp32 reduce-scatters: separate buffers; on the tuned host one all-gather per size.
    half = [size // 2 for size in ordered]
    gathers = (root + embed + 2 * blocks[0]) // 2
    assert fsdp_comm_buffer_bytes(half, shard=2, reduce_bytes=ordered) == gathers + root + embed + blocks[0]
    tuned = fsdp_comm_buffer_bytes(half, shard=2, reduce_bytes=ordered, host_tuned=True)
    assert tuned == (root + embed + blocks[0]) // 2 + root + embed + blocks[0]


def test_placement_follows_the_strategy_and_its_units() -> None:
    model = AutoModelForCausalLM.from_config(_config())
    layout = MeshContext.resolve(FSDP2Config(), ParallelismSizes(tp_size=2), world_size=8)
    place = placement_rule(FSDP2Config(), layout, model, torch.float32)
    block = place("model.layers.1.mlp.up_proj.weight")
    assert block.divisors == (8, 8, 8) and block.shard == 8 and block.gathered_over == 4 and block.gathered
    assert block.unit == (4, "block1")
    assert place("model.norm.weight").unit == (0, "root")
    assert place("model.embed_tokens.weight").unit == (1, "model.embed_tokens")
    ddp = placement_rule(
        DDPConfig(), MeshContext.resolve(DDPConfig(), None, world_size=4), model, torch.float32
    )
    kept = ddp("model.layers.0.mlp.up_proj.weight")
    assert kept.divisors == (1, 1, 1) and not kept.gathered  # every rank holds everything


def test_blocks_not_named_layers_are_found_from_the_models_structure() -> None:
    """GPT-2's blocks are ``transformer.h.<i>``: each is its own FSDP unit, as `plan_fsdp_units` makes it."""
    from transformers import GPT2Config

    from automodel_distributed.fsdp2_units import plan_fsdp_units

    config = GPT2Config(
        n_embd=64, n_head=4, n_layer=3, n_positions=32, vocab_size=128, bos_token_id=0, eos_token_id=0,
        use_cache=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    layout = MeshContext.resolve(FSDP2Config(), None, world_size=4)
    place = placement_rule(FSDP2Config(), layout, model, torch.float32)
    for index in range(3):
        assert place(f"transformer.h.{index}.mlp.c_fc.weight").unit == (2 + 2 * index, f"block{index}")
        assert place.key(f"transformer.h.{index}.attn.c_attn.bias")[0] == index
    assert place("transformer.wte.weight").unit == (0, "root")  # tied to the head: the root's, as at runtime
    units = {place(name).unit for name, _ in model.named_parameters()}
    planned = [plan.fqn for plan in plan_fsdp_units(model, reshard_after_forward=None)]
    assert len(units) == len(planned) + 1  # each unit the runtime makes, and the root (the final norm)


def test_tensor_parallelism_keeps_norms_and_row_parallel_biases_whole() -> None:
    """`tp_replicated_parameters`: what the plan's column- and row-parallel layers do not split."""
    from automodel_distributed.memory import tp_replicated_parameters, tp_styled_modules
    from automodel_testing import build_tiny_model

    model = build_tiny_model("qwen2")  # q, k and v carry biases: column-parallel ones are split
    whole = tp_replicated_parameters(model, tp_styled_modules(model, FSDP2Config(), 2))
    norms = {n for n, _ in model.named_parameters() if n.endswith("norm.weight")}
    assert norms and norms <= whole
    split = ("q_proj.weight", "q_proj.bias", "o_proj.weight", "down_proj.weight")
    assert not any(n.endswith(split) for n in whole)
    assert "model.embed_tokens.weight" not in whole and "lm_head.weight" not in whole
