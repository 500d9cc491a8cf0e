"""Single-process load and materialisation: meta models, wrappers, strictness, dtypes, buffers, init."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from automodel_checkpoint import (
    CheckpointMismatchError,
    initialize_model_weights,
    load_base_model,
    load_hf_checkpoint,
    materialize_meta_tensors,
    register_buffer_initializer,
    reinitialize_non_persistent_buffers,
    verify_materialized,
)
from automodel_peft import init_adapter_weights
from automodel_testing import build_tiny_model, make_batch, save_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=3)


def _reference(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path)


def _logits(model: nn.Module) -> torch.Tensor:
    batch = make_batch(128, 2, 12, seed=5)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "mistral"])
@pytest.mark.parametrize("max_shard_size", [None, "30KB"])
def test_meta_model_loads_like_from_pretrained(
    tmp_path: Path, family: str, max_shard_size: str | None
) -> None:
    path = save_tiny_checkpoint(family, tmp_path, seed=4, max_shard_size=max_shard_size)
    model = build_tiny_model(family, meta=True)
    report = load_hf_checkpoint(model, path)
    assert torch.equal(_logits(model), _logits(_reference(path)))
    assert not report.missing and not report.unexpected and report.bytes_read > 0
    verify_materialized(model)
    if family == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bin_fallback(tmp_path: Path, ckpt: Path) -> None:
    torch.save(load_file(ckpt / "model.safetensors"), tmp_path / "pytorch_model.bin")
    model = build_tiny_model("llama", meta=True)
    report = load_hf_checkpoint(model, tmp_path)
    assert report.format == "bin"
    assert torch.equal(_logits(model), _logits(_reference(ckpt)))


def test_wrapped_models(ckpt: Path) -> None:
    import peft

    from automodel_distributed.activation_checkpointing import apply_activation_checkpointing

    expected = _logits(_reference(ckpt))
    ac = apply_activation_checkpointing(build_tiny_model("llama", meta=True), mode="full")
    assert any("_checkpoint_wrapped_module" in n for n, _ in ac.named_parameters())
    load_hf_checkpoint(ac, ckpt)
    assert torch.equal(_logits(ac), expected)
    lora = peft.get_peft_model(
        build_tiny_model("llama", meta=True), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    report = load_hf_checkpoint(lora, ckpt, init_adapters=init_adapter_weights)  # adapters: their owner's
    assert not report.missing  # adapters are not expected in a base checkpoint
    lora_b = [p for n, p in lora.named_parameters() if "lora_B" in n]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)  # B = 0: the adapted model is the base
    assert all(torch.count_nonzero(p) > 0 for n, p in lora.named_parameters() if "lora_A" in n)
    assert torch.allclose(_logits(lora), expected, atol=1e-6)
    compiled: Any = torch.compile(build_tiny_model("llama", meta=True))  # lazy: nothing compiles here
    load_hf_checkpoint(compiled, ckpt)
    assert torch.equal(_logits(compiled._orig_mod), expected)


def _edited(tmp_path: Path, ckpt: Path, edit: Any) -> Path:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    out = tmp_path / "edited"
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_strict_errors_list_keys_and_leave_model_untouched(tmp_path: Path, ckpt: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t.pop("model.norm.weight")
        t["model.extra.bias"] = torch.zeros(2)
        t["lm_head.weight"] = torch.zeros(3, 3)
        t["model.layers.0.input_layernorm.weight"] = t["model.layers.0.input_layernorm.weight"].to(
            torch.int64
        )

    path = _edited(tmp_path, ckpt, edit)
    model = build_tiny_model("llama", meta=True)
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(model, path)
    err = info.value
    assert err.missing == ["model.norm.weight"] and err.unexpected == ["model.extra.bias"]
    assert err.shape_mismatches == {"lm_head.weight": ((3, 3), (128, 64))}
    assert list(err.dtype_mismatches) == ["model.layers.0.input_layernorm.weight"]
    text = str(err)
    assert "model.norm.weight" in text and "model.extra.bias" in text and "strict=False" in text
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was materialised


def test_non_strict_initialises_what_is_missing(tmp_path: Path, ckpt: Path) -> None:
    path = _edited(
        tmp_path, ckpt, lambda t: (t.pop("model.norm.weight"), t.__setitem__("x.y", torch.ones(1)))
    )
    model = build_tiny_model("llama", meta=True)
    report = load_hf_checkpoint(model, path, strict=False)
    assert report.missing == ["model.norm.weight"] and report.unexpected == ["x.y"]
    assert torch.equal(model.model.norm.weight, torch.ones(64))  # transformers' init of an RMSNorm
    reference = _reference(ckpt)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_dtype_cast(tmp_path: Path) -> None:
    path = save_tiny_checkpoint("llama", tmp_path, seed=2, dtype=torch.bfloat16)
    model = build_tiny_model("llama", meta=True)
    report = load_hf_checkpoint(model, path)
    assert report.cast and model.lm_head.weight.dtype == torch.float32
    expected = _reference(path).lm_head.weight.float()
    assert torch.equal(model.lm_head.weight, expected)
    with pytest.raises(CheckpointMismatchError, match="dtype mismatch"):
        load_hf_checkpoint(build_tiny_model("llama", meta=True), path, allow_dtype_cast=False)


def test_key_mapping(tmp_path: Path, ckpt: Path) -> None:
    def rename(t: dict[str, torch.Tensor]) -> None:
        for k in [k for k in t if k.startswith("model.")]:
            t["decoder." + k[len("model.") :]] = t.pop(k)

    path = _edited(tmp_path, ckpt, rename)
    with pytest.raises(CheckpointMismatchError, match="missing"):
        load_hf_checkpoint(build_tiny_model("llama", meta=True), path)
    model = build_tiny_model("llama", meta=True)
    load_hf_checkpoint(model, path, key_mapping={r"^decoder\.": "model."})
    assert torch.equal(_logits(model), _logits(_reference(ckpt)))


def test_initialize_model_weights_materialises_only_meta() -> None:
    model = build_tiny_model("llama", meta=True)
    kept = nn.Parameter(torch.full((128, 64), 7.0))
    model.lm_head.weight = kept
    initialize_model_weights(model, "cpu")
    verify_materialized(model)
    assert model.lm_head.weight is kept and torch.all(kept == 7.0)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    std = float(model.model.layers[0].mlp.up_proj.weight.detach().std())
    assert 0.015 < std < 0.025  # initializer_range 0.02
    fresh = build_tiny_model("llama")
    for name, buf in fresh.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name


def test_adapters_are_initialised_once_by_their_owner() -> None:
    import peft

    import automodel_peft

    def adapted() -> torch.nn.Module:
        lora = peft.LoraConfig(r=2, target_modules=["v_proj"])
        return peft.get_peft_model(build_tiny_model("llama", meta=True), lora)

    calls: list[list[float]] = []
    owner = automodel_peft.adapter_initializer({"lora_A_init": "xavier"})

    def init_adapters(model: torch.nn.Module) -> None:
        # The base init never touched the adapters: they are still the uninitialised storage.
        calls.append([float(p.abs().sum()) for n, p in model.named_parameters() if "lora_B" in n])
        owner(model)

    model = adapted()
    initialize_model_weights(model, "cpu", init_adapters=init_adapters)
    assert len(calls) == 1
    verify_materialized(model)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            assert torch.count_nonzero(p) == 0
        if "lora_A" in name:
            assert torch.count_nonzero(p) > 0
    with pytest.raises(ValueError, match="lora_A_init='bogus'"):
        initialize_model_weights(
            adapted(), "cpu", init_adapters=automodel_peft.adapter_initializer({"lora_A_init": "bogus"})
        )
    # Without the owner, adapters stay uninitialised, and verification names who initialises them.
    left = adapted()
    initialize_model_weights(left, "cpu")
    with pytest.raises(RuntimeError, match=r"init_adapters=automodel_peft\.init_adapter_weights"):
        verify_materialized(left)


def test_uninitialised_tensors_fail_loudly() -> None:
    model = build_tiny_model("llama", meta=True)
    materialize_meta_tensors(model, "cpu")
    with pytest.raises(RuntimeError, match="never initialised or loaded"):
        verify_materialized(model)
    still_meta = build_tiny_model("llama", meta=True)
    with pytest.raises(RuntimeError, match="still on meta"):
        verify_materialized(still_meta)


class _Sinusoid(nn.Module):
    """A module with a non-persistent buffer and no config: needs a registered initializer."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(float(n)), persistent=False)


def test_non_persistent_buffers_without_initializer() -> None:
    with torch.device("meta"):
        module = nn.Sequential(_Sinusoid(4))
    with pytest.raises(ValueError, match="register_buffer_initializer"):
        reinitialize_non_persistent_buffers(module, "cpu")
    register_buffer_initializer(_Sinusoid, lambda m: {"table": torch.arange(4.0)})
    assert reinitialize_non_persistent_buffers(module, "cpu") == ["0.table"]
    assert torch.equal(module[0].table, torch.arange(4.0))


class _Unregistered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(2), persistent=False)


def test_unrecomputable_buffer_fails_before_any_write(ckpt: Path) -> None:
    model = build_tiny_model("llama", meta=True)
    with torch.device("meta"):
        model.extra = _Unregistered()
    with pytest.raises(ValueError, match=r"extra \(_Unregistered: 'table'\)"):
        load_hf_checkpoint(model, ckpt)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_load_base_model_entry(ckpt: Path) -> None:
    model = build_tiny_model("llama", meta=True)
    assert load_base_model(model, "cpu", None, str(ckpt)) is model
    assert torch.equal(_logits(model), _logits(_reference(ckpt)))
    only_init = build_tiny_model("llama_tied", meta=True)
    load_base_model(only_init, "cpu", None, "unused", load_base_model=False)
    verify_materialized(only_init)
    assert only_init.lm_head.weight is only_init.model.embed_tokens.weight


# Buffers that only the model's own construction computes: Gemma's embed_scale (an __init__ argument, set by
# _init_weights), MiniMax's decay tables (_init_weights), DeepSeek-V3's router correction bias (persistent:
# in the checkpoint), Apertus' xIELU constants (persistent buffers of an activation module).
@pytest.mark.parametrize("family", ["gemma", "minimax", "deepseek_v3", "apertus"])
def test_buffers_come_from_the_models_own_construction(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config(family)
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # persistent buffers that differ from their initial value must come from the file
        for name, buf in saved.named_buffers():
            module, _, leaf = name.rpartition(".")
            owner = saved.get_submodule(module)
            if leaf not in owner._non_persistent_buffers_set and buf.is_floating_point():
                buf.add_(0.5)
    saved.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    load_hf_checkpoint(model, tmp_path)
    verify_materialized(model)
    reference = _reference(tmp_path)
    for (name, ours), (_, theirs) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)


def test_keys_save_pretrained_writes_load_where_transformers_renamings_miss_them(tmp_path: Path) -> None:
    """A Gemma 3 model with a ShieldGemma 2 config: from_pretrained misses its language model, we do not.

    transformers saves the language model as ``model.language_model.model.*`` and on load applies
    ShieldGemma 2's prefix change first, so its own round trip leaves those tensors missing (initialised
    anew). Our loader finds them by the save direction; our save writes what save_pretrained writes.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    from automodel_checkpoint import save_hf_checkpoint
    from automodel_testing.tiny import derive_tiny_config

    torch.manual_seed(0)
    original = AutoModelForImageTextToText.from_config(derive_tiny_config("shieldgemma2"))
    original.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", output_loading_info=True)
    saved = load_file(next((tmp_path / "hf").glob("*.safetensors")))
    renamed = [k for k in saved if ".language_model.model." in k]
    assert renamed and len(info["missing_keys"]) == len(renamed)  # transformers' own round trip misses them
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp_path / "hf"))
    report = load_hf_checkpoint(model, tmp_path / "hf")
    assert not report.missing and not report.unexpected
    expected = original.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
    save_hf_checkpoint(model, tmp_path / "ours")
    ours, theirs = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("ours", "hf"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
