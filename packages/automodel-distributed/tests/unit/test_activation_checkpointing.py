"""Activation checkpointing: numerics equal to no checkpointing, KV cache off, idempotence, SAC policy."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

import automodel_distributed.activation_checkpointing as ac
from automodel_distributed.activation_checkpointing import (
    apply_activation_checkpointing,
    apply_submodule_checkpointing,
    disable_kv_cache,
    resolve_checkpointing_mode,
    selective_checkpoint_policy,
    unwrap_checkpoint_wrapper,
)
from automodel_testing import (
    TINY_FAMILIES,
    assert_grads_close,
    assert_tensors_close,
    build_tiny_model,
    make_batch,
    reference_loss_and_grads,
)

# Recompute runs the same kernels on the same inputs: on CPU the results are bit-identical (measured 0.0).
ATOL = 1e-6


def _wrappers(model: torch.nn.Module) -> list[CheckpointWrapper]:
    return [m for m in model.modules() if isinstance(m, CheckpointWrapper)]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_checkpointed_model_matches_the_plain_one(family: str, mode: Any) -> None:
    batch = make_batch(128, 2, 16, seed=3)
    ref_loss, ref_logits, ref_grads = reference_loss_and_grads(build_tiny_model(family), batch)
    model = apply_activation_checkpointing(build_tiny_model(family), mode=mode)
    assert len(_wrappers(model)) == 2
    loss, logits, grads = reference_loss_and_grads(model, batch)
    assert abs(loss - ref_loss) <= ATOL
    assert_tensors_close(logits, ref_logits, atol=ATOL, name="logits")
    assert_grads_close(grads, ref_grads, atol=ATOL)


def test_use_cache_is_turned_off_on_the_model_and_nested_configs(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import LlamaConfig

    model = build_tiny_model("llama", use_cache=True)
    model.config.text_config = LlamaConfig(use_cache=True)  # a sub-config, as composite models have
    with caplog.at_level(logging.INFO, logger="automodel_distributed.activation_checkpointing"):
        apply_activation_checkpointing(model, mode="full")
    assert model.config.use_cache is False
    assert model.config.text_config.use_cache is False
    assert "use_cache=False" in caplog.text
    out = model(**make_batch(128, 1, 8))
    assert getattr(out, "cache", getattr(out, "past_key_values", None)) is None  # 5.17: past_key_values
    assert disable_kv_cache(model) == []  # nothing left to change


def test_a_kv_cache_breaks_recompute_which_is_why_it_is_turned_off() -> None:
    # Negative control: torch's wrapper alone, cache still on (eager attention) -> the recomputed forward
    # appends to the cache a second time and the shapes no longer match.
    batch = make_batch(128, 2, 16)
    broken = build_tiny_model("llama", use_cache=True, attn_implementation="eager")
    for i, layer in enumerate(broken.model.layers):
        broken.model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    with pytest.raises(RuntimeError, match="must match the size"):
        broken(**batch).loss.backward()
    ref_loss, _, ref_grads = reference_loss_and_grads(
        build_tiny_model("llama", attn_implementation="eager"), batch
    )
    fixed = build_tiny_model("llama", use_cache=True, attn_implementation="eager")
    apply_activation_checkpointing(fixed, mode="full")
    loss, _, grads = reference_loss_and_grads(fixed, batch)
    assert abs(loss - ref_loss) <= ATOL
    assert_grads_close(grads, ref_grads, atol=ATOL)


def test_idempotent_and_a_different_mode_on_wrapped_blocks_warns(caplog: pytest.LogCaptureFixture) -> None:
    model = build_tiny_model("llama")
    apply_activation_checkpointing(model, mode="full")
    first = list(model.model.layers)
    apply_activation_checkpointing(model, mode="full")
    assert list(model.model.layers) == first
    assert all(not isinstance(w._checkpoint_wrapped_module, CheckpointWrapper) for w in _wrappers(model))
    with caplog.at_level(logging.WARNING, logger="automodel_distributed.activation_checkpointing"):
        apply_activation_checkpointing(model, mode="selective")
    assert "already wrapped" in caplog.text
    assert list(model.model.layers) == first


def test_parameter_names_gain_the_wrapper_segment() -> None:
    model = apply_activation_checkpointing(build_tiny_model("llama"), mode="selective")
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names


def test_scope_that_selects_nothing_wraps_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model = build_tiny_model("llama", use_cache=True)
    with caplog.at_level(logging.WARNING, logger="automodel_distributed.activation_checkpointing"):
        apply_activation_checkpointing(model, mode="full", scope=("vision",))
    assert _wrappers(model) == []
    assert model.config.use_cache is True  # untouched when nothing is checkpointed
    assert "nothing wrapped" in caplog.text


def test_peft_model() -> None:
    peft = pytest.importorskip("peft")
    batch = make_batch(128, 2, 16)
    lora = {"r": 2, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    torch.manual_seed(0)  # the random (non-zero) LoRA init must be the same on both sides
    ref = peft.get_peft_model(build_tiny_model("llama"), peft.LoraConfig(**lora))
    ref_loss, _, ref_grads = reference_loss_and_grads(ref, batch)
    torch.manual_seed(0)
    model = peft.get_peft_model(build_tiny_model("llama"), peft.LoraConfig(**lora))
    apply_activation_checkpointing(model, mode="full")
    assert len(_wrappers(model)) == 2
    loss, _, grads = reference_loss_and_grads(model, batch)
    assert abs(loss - ref_loss) <= ATOL
    assert_grads_close(grads, ref_grads, atol=ATOL)


def test_selective_policy_saves_every_other_matmul_attention_and_collectives() -> None:
    policy = selective_checkpoint_policy()
    ctx = SelectiveCheckpointContext(is_recompute=False)
    aten = torch.ops.aten
    decisions = [
        policy(ctx, aten.mm.default),
        policy(ctx, aten.relu.default),
        policy(ctx, aten.addmm.default),
        policy(ctx, aten.mm.default),
        policy(ctx, aten._scaled_dot_product_flash_attention_for_cpu.default),
        policy(ctx, torch.ops._c10d_functional.reduce_scatter_tensor.default),
        policy(ctx, aten.topk.default),
    ]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert decisions == [save, recompute, recompute, save, save, save, recompute]
    # A fresh policy (one per block call) starts counting again.
    assert selective_checkpoint_policy()(ctx, aten.mm.default) is save


def test_host_reads_of_accelerator_tensors_are_saved_so_recompute_syncs_nothing() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    ctx = SelectiveCheckpointContext(is_recompute=False)
    host = torch.zeros(2, dtype=torch.long)
    with FakeTensorMode():  # CUDA tensors without a GPU: the policy reads devices only
        counts = torch.zeros(2, dtype=torch.long, device="cuda")
    for policy in (selective_checkpoint_policy(), selective_checkpoint_policy(save_matmuls=False)):
        # `.tolist()` / `.cpu()` of a device tensor, and `.item()`: each waits for the device.
        assert policy(ctx, aten._to_copy.default, counts, device=torch.device("cpu")) is save
        assert policy(ctx, aten._to_copy.default, counts, device="cpu") is save
        assert policy(ctx, aten._local_scalar_dense.default, counts) is save
        # A dtype cast on the device, or a host tensor read on the host, is no sync.
        assert policy(ctx, aten._to_copy.default, counts, dtype=torch.float32) is recompute
        assert policy(ctx, aten._local_scalar_dense.default, host) is recompute
        assert policy(ctx, aten._to_copy.default, host, device="cpu") is recompute


def test_selective_mode_uses_the_policy_in_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, CheckpointPolicy]] = []

    def spying_policy(*args: Any, **kwargs: Any) -> Any:
        inner = selective_checkpoint_policy(*args, **kwargs)  # the real one (imported before the patch)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            decision = inner(ctx, op, *args, **kwargs)
            seen.append((str(op), decision))
            return decision

        return policy

    monkeypatch.setattr(ac, "selective_checkpoint_policy", spying_policy)
    model = apply_activation_checkpointing(build_tiny_model("llama"), mode="selective")
    model(**make_batch(128, 2, 16)).loss.backward()
    saved = {op for op, decision in seen if decision is CheckpointPolicy.MUST_SAVE}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in saved
    assert "aten.mm.default" in saved
    recomputed = {op for op, decision in seen if decision is CheckpointPolicy.PREFER_RECOMPUTE}
    assert "aten.mm.default" in recomputed  # the other half of the matmuls


def test_invalid_mode() -> None:
    with pytest.raises(ValueError, match="mode='partial'"):
        apply_activation_checkpointing(build_tiny_model("llama"), mode="partial")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "mode"),
    [(False, None), (None, None), (True, "full"), ("full", "full"), ("selective", "selective")],
)
def test_resolve_checkpointing_mode(setting: object, mode: str | None) -> None:
    assert resolve_checkpointing_mode(setting) == mode


def test_resolve_checkpointing_mode_rejects_other_values() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        resolve_checkpointing_mode("some")


def test_meta_device_models_are_wrapped_without_allocating() -> None:
    model = apply_activation_checkpointing(build_tiny_model("mixtral", meta=True), mode="selective")
    assert len(_wrappers(model)) == 2
    assert all(p.is_meta for p in model.parameters())


def test_submodule_checkpointing_matches_the_plain_model() -> None:
    batch = make_batch(128, 2, 16, seed=5)
    ref_loss, ref_logits, ref_grads = reference_loss_and_grads(
        build_tiny_model("llama", use_cache=False), batch
    )
    model = build_tiny_model("llama", use_cache=False)
    counts = apply_submodule_checkpointing(model.model.layers, has_kv_sharing=False)
    assert counts == {"mlp": 2, "attention": 2, "pre_norm": 2, "post_norm": 2}
    assert isinstance(model.model.layers[0].self_attn, CheckpointWrapper)
    assert apply_submodule_checkpointing(model.model.layers, has_kv_sharing=False) == dict.fromkeys(counts, 0)
    loss, logits, grads = reference_loss_and_grads(model, batch)
    assert abs(loss - ref_loss) <= ATOL
    assert_tensors_close(logits, ref_logits, atol=ATOL, name="logits")
    # Parameter names gain the wrapper segment; strip it to compare with the plain model.
    assert_grads_close(
        {k.replace("._checkpoint_wrapped_module", ""): v for k, v in grads.items()}, ref_grads, atol=ATOL
    )
    shared = build_tiny_model("llama")
    kv = apply_submodule_checkpointing(shared.model.layers, has_kv_sharing=True)
    assert kv["attention"] == 0 and not isinstance(shared.model.layers[0].self_attn, CheckpointWrapper)


def test_submodule_checkpointing_wraps_an_aliased_child_once_under_its_own_name() -> None:
    # One mixer serving as attention and MLP through properties (as hybrid / linear-attention layers do).
    class Mixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = Mixer()

        @property
        def mlp(self) -> torch.nn.Module:
            return self.mixer

        @property
        def self_attn(self) -> torch.nn.Module:
            return self.mixer

    layer = Layer()
    keys = list(layer.state_dict())  # the wrapper's state-dict hook keeps these names
    counts = apply_submodule_checkpointing([layer], has_kv_sharing=False)
    assert counts == {"mlp": 1, "attention": 0, "pre_norm": 0, "post_norm": 0}
    assert [name for name, _ in layer.named_children()] == ["mixer"]
    assert isinstance(layer.mixer, CheckpointWrapper) and layer.mlp is layer.mixer
    assert isinstance(unwrap_checkpoint_wrapper(layer.mixer), Mixer)
    assert list(layer.state_dict()) == keys
    assert unwrap_checkpoint_wrapper(layer) is layer


def test_scope_none_or_empty_means_all() -> None:
    from automodel_distributed.config import DDPConfig, FSDP2Config, normalize_activation_checkpointing_scope

    assert FSDP2Config(activation_checkpointing_scope=None).activation_checkpointing_scope == ("all",)
    assert DDPConfig(activation_checkpointing_scope=None).activation_checkpointing_scope == ("all",)
    assert normalize_activation_checkpointing_scope("") == ("all",)
    assert normalize_activation_checkpointing_scope("language+vision") == ("language", "vision")
    with pytest.raises(ValueError, match="cannot be combined"):
        normalize_activation_checkpointing_scope(["all", "vision"])
