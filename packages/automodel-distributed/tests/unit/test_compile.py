"""compile_model / compile_blocks: settings mapping and no-ops (fast), two real compiles (slow)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from automodel_distributed.activation_checkpointing import apply_activation_checkpointing
from automodel_distributed.compile import (
    build_compile_config,
    compile_blocks,
    compile_kwargs,
    compile_model,
    compile_module_inplace,
    configure_dynamo,
    configure_torch_dynamo,
    create_compile_config_from_dict,
)
from automodel_distributed.config import CompileConfig
from automodel_testing import assert_grads_close, assert_tensors_close, build_tiny_model, make_batch


@pytest.fixture(autouse=True)
def _restore_dynamo_settings() -> Iterator[None]:
    import torch._dynamo

    saved = (torch._dynamo.config.cache_size_limit, torch._dynamo.config.accumulated_cache_size_limit)
    yield
    torch._dynamo.config.cache_size_limit, torch._dynamo.config.accumulated_cache_size_limit = saved


def test_disabled_is_a_no_op() -> None:
    model = build_tiny_model("llama")
    assert compile_model(model, CompileConfig()) is model


def test_compile_kwargs() -> None:
    assert compile_kwargs(CompileConfig()) == {
        "fullgraph": False,
        "dynamic": False,
        "backend": "inductor",
        "mode": "default",
    }
    tuned = CompileConfig(backend="aot_eager", options={"trace.enabled": False}, fullgraph=True)
    assert compile_kwargs(tuned) == {
        "fullgraph": True,
        "dynamic": False,
        "backend": "aot_eager",
        "options": {"trace.enabled": False},
    }


def test_mode_and_options_together_are_refused_when_compiling() -> None:
    # Accepted by the config (as in the reference system, whose configs build such objects) ...
    config = CompileConfig(enabled=True, mode="reduce-overhead", options={"x": 1})
    # ... and refused before torch.compile sees them.
    with pytest.raises(ValueError, match=r"mode='reduce-overhead' and CompileConfig.options"):
        compile_kwargs(config)
    with pytest.raises(ValueError, match=r"mode='reduce-overhead' and CompileConfig.options"):
        compile_model(nn.Linear(2, 2), config)


def test_reference_defaults_and_builders() -> None:
    assert CompileConfig().options == {} and CompileConfig(options=None).options == {}
    assert build_compile_config(None) == CompileConfig()
    assert build_compile_config({"enabled": True, "mode": "max-autotune"}) == CompileConfig(
        enabled=True, mode="max-autotune"
    )
    config = CompileConfig(backend="eager")
    assert build_compile_config(config) is config
    assert create_compile_config_from_dict({"fullgraph": True}) == CompileConfig(fullgraph=True)
    with pytest.raises(ValueError, match="unknown CompileConfig field"):
        create_compile_config_from_dict({"mode_typo": "x"})


def test_configure_torch_dynamo_never_lowers_the_limits() -> None:
    import torch._dynamo

    saved = torch._dynamo.config.capture_scalar_outputs
    try:
        configure_torch_dynamo(cache_size_limit=300, capture_scalar_outputs=False)
        assert torch._dynamo.config.cache_size_limit == 300
        assert torch._dynamo.config.capture_scalar_outputs is saved
        configure_torch_dynamo(cache_size_limit=10)
        assert torch._dynamo.config.cache_size_limit == 300
        assert torch._dynamo.config.accumulated_cache_size_limit >= 300
        assert torch._dynamo.config.capture_scalar_outputs is True
    finally:
        torch._dynamo.config.capture_scalar_outputs = saved


def test_compile_module_inplace_keeps_the_module() -> None:
    module = nn.Linear(4, 4)
    compile_module_inplace(module, CompileConfig())
    assert getattr(module, "_compiled_call_impl", None) is None
    compile_module_inplace(module, CompileConfig(enabled=True, backend="eager"))
    assert module._compiled_call_impl is not None
    assert [n for n, _ in module.named_parameters()] == ["weight", "bias"]
    x = torch.randn(2, 4)
    assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias))


def test_cache_size_limit_is_applied() -> None:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 8  # torch's default; other tests may have raised it
    configure_dynamo(CompileConfig(dynamo_cache_size_limit=77))
    assert torch._dynamo.config.cache_size_limit == 77
    assert torch._dynamo.config.accumulated_cache_size_limit >= 77
    with pytest.warns(UserWarning, match=r"dynamo_cache_size_limit=20 ignored: .* is already 77"):
        configure_dynamo(CompileConfig(dynamo_cache_size_limit=20))  # never lowered, and it says so
    assert torch._dynamo.config.cache_size_limit == 77


def test_compile_model_wraps_without_compiling_yet_and_renames_parameters() -> None:
    model = build_tiny_model("llama")
    compiled = compile_model(model, CompileConfig(enabled=True, backend="eager"))
    assert compiled is not model
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")


def test_unknown_backend_raises_instead_of_falling_back_to_eager() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(Exception, match="no_such_backend"):
        compile_model(model, CompileConfig(enabled=True, backend="no_such_backend"))
    with pytest.raises(Exception, match="no_such_backend"):
        compile_blocks(model, CompileConfig(backend="no_such_backend"))


def test_compile_blocks_is_in_place_keeps_names_and_is_idempotent() -> None:
    model = build_tiny_model("qwen2")
    names = [name for name, _ in model.named_parameters()]
    assert compile_blocks(model, CompileConfig(backend="eager")) is model
    assert [name for name, _ in model.named_parameters()] == names  # no _orig_mod.
    impls = [layer._compiled_call_impl for layer in model.model.layers]
    assert all(impl is not None for impl in impls)
    compile_blocks(model, CompileConfig(backend="eager"))
    assert [layer._compiled_call_impl for layer in model.model.layers] == impls


@pytest.mark.slow
def test_compile_model_runs_and_matches_eager() -> None:
    batch = make_batch(128, 2, 16)
    reference = build_tiny_model("llama")
    expected = reference(**batch)
    compiled = compile_model(build_tiny_model("llama"), CompileConfig(enabled=True, backend="aot_eager"))
    out = compiled(**batch)
    assert_tensors_close(out.logits, expected.logits, atol=1e-5, name="logits")
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5


@pytest.mark.slow
def test_compile_blocks_with_inductor_and_checkpointing_matches_eager() -> None:
    batch = make_batch(128, 2, 16)
    reference = build_tiny_model("llama")
    expected = reference(**batch)
    expected.loss.backward()
    model = apply_activation_checkpointing(build_tiny_model("llama"), mode="full")
    compile_blocks(model)  # inductor, the default
    out = model(**batch)
    out.loss.backward()
    assert_tensors_close(out.logits, expected.logits, atol=1e-5, name="logits")
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5
    assert_grads_close(model, reference, atol=1e-5)
