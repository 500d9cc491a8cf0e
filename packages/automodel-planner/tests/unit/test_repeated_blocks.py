"""Running two blocks of each kind gives the counts of the full fake forward, for mixed-layer families.

One fake model (`build_fake_model`) profiled at several shapes, the shortcut's runs and full runs in
turn, gives what a model built for each profile gives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from automodel_planner.activations import build_fake_model, profile_step

# Families whose layers differ: sliding and full attention (gemma3_text, gpt_oss, cohere2), linear and
# full attention (qwen3_next), convolution and attention (lfm2), dense layers before MoE ones
# (deepseek_v3), MoE every other layer (qwen2_moe with mlp_only_layers), plus a plain Llama.
FAMILIES = {
    "llama": {},
    "gemma3_text": {},
    "gpt_oss": {},
    "cohere2": {},
    "qwen3_next": {},
    "lfm2": {},
    "deepseek_v3": {"first_k_dense_replace": 2},
    "qwen2_moe": {"mlp_only_layers": [1, 4]},
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_repeated_blocks_take_the_counts_they_would_have(model_type: str) -> None:
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config(model_type, **FAMILIES[model_type])
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    config.num_hidden_layers = 8  # tiny configs have too few layers to repeat a kind twice
    if types is not None:
        config.layer_types = [types[i % layers] for i in range(8)]
    sizes: dict[str, Any] = {"micro_batch": 2, "seq_len": 16, "dtype": torch.float32}
    if model_type == "gpt_oss":
        sizes["attn_implementation"] = "eager"  # transformers has no SDPA path for it
    full = profile_step(config, every_block=True, **sizes)
    quick = profile_step(config, **sizes)
    assert quick.activations == full.activations
    assert quick.compute == full.compute
    assert len(full.compute.blocks) == 8 and full.compute.outside.matmul_total > 0
    # Two runs of the full forward agree too: each saved storage is counted once (none reuses the key of
    # a freed one), which MoE blocks, whose routing temporaries come and go, used to break.
    assert profile_step(config, every_block=True, **sizes).activations == full.activations


@pytest.mark.parametrize("model_type", ["qwen2_moe", "gemma3_text"])
def test_one_fake_model_serves_every_shape(model_type: str) -> None:
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config(model_type, **FAMILIES[model_type])
    config.num_hidden_layers = 6
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i % 2] for i in range(6)]
    fake = build_fake_model(config, torch.float32)
    shapes = [(2, 16, 1, False), (1, 32, 2, False), (2, 16, 1, True), (1, 32, 2, False)]
    for micro_batch, seq_len, cp, every_block in shapes:
        sizes: dict[str, Any] = {
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "dtype": torch.float32,
            "cp": cp,
        }
        reused = profile_step(config, every_block=every_block, fake=fake, **sizes)
        fresh = profile_step(config, every_block=every_block, **sizes)
        assert reused == fresh, (micro_batch, seq_len, cp, every_block)
    # The shortcut's replaced forwards are gone: every block runs its class's own again.
    assert not any("forward" in vars(block) for block in fake.model.modules())


def test_only_the_blocks_a_profile_runs_are_made_fake_until_every_block_runs() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    from automodel_distributed.blocks import find_transformer_blocks
    from automodel_planner.repeated_blocks import repeated_blocks
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config("llama")
    config.num_hidden_layers = 5
    fake = build_fake_model(config, torch.float32)
    blocks = find_transformer_blocks(fake.model)
    skipped = repeated_blocks(blocks)
    assert sorted(skipped) == [2, 3, 4]
    for index, (_, block) in enumerate(blocks):
        on_meta = {p.is_meta for p in block.parameters()}
        assert on_meta == {index in skipped}, index
    outside = [fake.model.get_output_embeddings().weight, fake.model.get_input_embeddings().weight]
    assert all(isinstance(weight, FakeTensor) for weight in outside)
    quick = profile_step(config, micro_batch=2, seq_len=16, dtype=torch.float32, fake=fake)
    full = profile_step(config, micro_batch=2, seq_len=16, dtype=torch.float32, fake=fake, every_block=True)
    assert not any(p.is_meta for p in fake.model.parameters())
    assert all(isinstance(b, FakeTensor) for b in fake.model.buffers())
    assert quick.activations == full.activations and quick.compute == full.compute
