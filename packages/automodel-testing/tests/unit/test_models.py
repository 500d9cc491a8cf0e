"""The tiny Hugging Face model factories build, run, are deterministic and round-trip through disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from automodel_testing import TINY_FAMILIES, build_tiny_model, make_batch, save_tiny_checkpoint, tiny_config

pytest.importorskip("transformers")

MOE_FAMILIES = ("qwen3_moe", "mixtral")


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return logits


def test_family_names() -> None:
    assert TINY_FAMILIES == ("llama", "qwen2", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "llama_tied")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_builds_runs_and_is_deterministic(family: str) -> None:
    model = build_tiny_model(family, seed=0)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.use_cache is False
    assert config._attn_implementation == ("eager" if family == "gpt_oss" else "sdpa")
    assert model.training
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (family == "llama_tied")

    batch = make_batch(config.vocab_size, batch_size=2, seq_len=16)
    out = model(**batch)
    assert out.logits.shape == (2, 16, 128)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    again = build_tiny_model(family, seed=0)
    other = build_tiny_model(family, seed=1)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, r) for p, r in zip(model.parameters(), other.parameters(), strict=True))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_families_are_sparse_in_every_layer(family: str) -> None:
    model = build_tiny_model(family)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up_proj.shape[0] == 8  # experts are fused: [num_experts, 2 * width, hidden]
        assert experts.down_proj.shape == (8, 64, 32)
    assert model.config.num_experts_per_tok == 2


def test_seed_does_not_disturb_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("llama", seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("max_shard_size", [None, "100KB"])
def test_checkpoint_round_trip(family: str, max_shard_size: str | None, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_checkpoint(family, tmp_path / "ckpt", seed=3, max_shard_size=max_shard_size)
    assert folder == tmp_path / "ckpt"
    shards = sorted(folder.glob("*.safetensors"))
    if max_shard_size is None:
        assert [p.name for p in shards] == ["model.safetensors"]
    else:
        assert len(shards) > 1
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {p.name for p in shards}

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    reference = build_tiny_model(family, seed=3)
    batch = make_batch(128, batch_size=2, seq_len=12, seed=1)
    assert torch.equal(_logits(loaded, batch), _logits(reference, batch))


def test_dtype_and_overrides() -> None:
    model = build_tiny_model("qwen2", dtype=torch.bfloat16, num_hidden_layers=1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(model.model.layers) == 1


def test_meta_device() -> None:
    model = build_tiny_model("mixtral", meta=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_tiny_config_errors() -> None:
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt9'; known: llama, qwen2"):
        tiny_config("gpt9")
    with pytest.raises(ValueError, match=r"has no field\(s\) \['hidden_sise'\]"):
        tiny_config("llama", hidden_sise=32)
    # Each class's own names: Mixtral counts experts as num_local_experts (num_experts is an alias).
    assert tiny_config("mixtral", num_local_experts=4).num_local_experts == 4
    assert tiny_config("qwen3_moe", attn_implementation="eager")._attn_implementation == "eager"


def test_tiny_config_is_fresh_each_time() -> None:
    first = tiny_config("qwen3_moe")
    first.mlp_only_layers.append(0)
    assert tiny_config("qwen3_moe").mlp_only_layers == []


def test_make_batch() -> None:
    batch = make_batch(50, batch_size=3, seq_len=7, seed=4)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (3, 7)
    assert batch["input_ids"].dtype == torch.int64
    assert int(batch["input_ids"].max()) < 50
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    assert torch.equal(batch["position_ids"], torch.arange(7).repeat(3, 1))
    assert torch.equal(make_batch(50, 3, 7, seed=4)["input_ids"], batch["input_ids"])
    with pytest.raises(ValueError, match="positive sizes"):
        make_batch(50, 0, 7)
