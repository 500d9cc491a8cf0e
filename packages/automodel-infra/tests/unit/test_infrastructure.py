"""`instantiate_infrastructure` / `apply_model_infrastructure` in one process.

The documented contract (parameter names, order, keyword-only markers, defaults), the 4-tuple result,
the deprecated mesh parameters, every user-error path (raised before the model is touched), the
``ImportError`` of a missing optional component, and the world-size-1 paths against plain transformers.

Checks that need several ranks of a mesh but no data (a ``pp`` axis without a pipeline config, FSDP2
without a mesh) run on torch's ``fake`` process-group backend: real ``DeviceMesh`` objects over four
ranks in this one process, where no collective carries data.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pathlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import automodel_infra
from automodel_distributed.config import CompileConfig, DDPConfig, FSDP2Config
from automodel_infra import infrastructure as infra
from automodel_infra._optional import OPTIONAL_COMPONENTS, import_component
from automodel_infra.infrastructure import apply_model_infrastructure, instantiate_infrastructure
from automodel_mesh import MeshContext, ParallelismSizes
from automodel_testing import build_tiny_model, make_batch, save_tiny_checkpoint

_EMPTY = inspect.Parameter.empty
_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KW = inspect.Parameter.KEYWORD_ONLY
_VAR_KW = inspect.Parameter.VAR_KEYWORD

# (name, kind, default) per parameter, in order: reference/infrastructure-api.txt. `_instantiate_pipeline`
# also takes the strategy config (reference behaviour, section 1.5).
CONTRACT: dict[str, list[tuple[str, Any, Any]]] = {
    "_apply_peft_and_lower_precision": [
        (n, _POS, _EMPTY)
        for n in (
            "model",
            "tp_size",
            "autopipeline",
            "peft_config",
            "quantization_config",
            "fp8_config",
            "qat_quantizer",
        )
    ],
    "_shard_pp": [(n, _POS, _EMPTY) for n in ("autopipeline", "model", "loss_fn", "parallelize_fn")],
    "_shard_ep_fsdp": [(n, _POS, _EMPTY) for n in ("model", "model_wrapper", "parallelize_fn", "mesh")],
    "_instantiate_distributed": [("config", _POS, _EMPTY), ("mesh", _POS, _EMPTY)],
    "_instantiate_pipeline": [
        ("config", _POS, _EMPTY),
        ("mesh", _POS, _EMPTY),
        ("device", _POS, None),
        ("strategy_config", _POS, None),
    ],
    "_instantiate_qat": [("config", _POS, _EMPTY)],
    "parallelize_for_pp": [
        ("model", _POS, _EMPTY),
        ("model_wrapper", _KW, None),
        ("kwargs", _VAR_KW, _EMPTY),
    ],
    "instantiate_infrastructure": [
        ("distributed_config", _KW, None),
        ("pipeline_config", _KW, None),
        ("qat_config", _KW, None),
        ("moe_config", _KW, None),
        ("activation_checkpointing", _KW, False),
        ("device", _KW, None),
        ("mesh", _KW, None),
        ("device_mesh", _KW, None),
        ("moe_mesh", _KW, None),
        ("ep_size", _KW, 1),
    ],
    "apply_model_infrastructure": [
        ("model", _POS, _EMPTY),
        ("is_meta_device", _KW, _EMPTY),
        ("device", _KW, _EMPTY),
        ("model_wrapper", _KW, None),
        ("mesh", _KW, None),
        ("peft_config", _KW, None),
        ("quantization_config", _KW, None),
        ("fp8_config", _KW, None),
        ("qat_quantizer", _KW, None),
        ("loss_fn", _KW, None),
        ("autopipeline", _KW, None),
        ("parallelize_fn", _KW, None),
        ("compile_config", _KW, None),
        ("load_base_model", _KW, False),
        ("cache_dir", _KW, None),
        ("pretrained_model_name_or_path", _KW, ""),
        ("_kwargs", _VAR_KW, _EMPTY),
    ],
}


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama", seed=3)


@pytest.fixture(scope="module")
def reference_logits(checkpoint: pathlib.Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=_batch()["input_ids"]).logits
    return logits


@pytest.fixture
def fake_world() -> Iterator[int]:
    """Four ranks of torch's ``fake`` backend in this process (meshes are real; no data moves)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield 4
    finally:
        dist.destroy_process_group()


@pytest.fixture
def warn_state() -> Iterator[None]:
    """The deprecation warning fires once per process: start each test from 'not warned yet'."""
    saved = infra._LEGACY_WARNED
    infra._LEGACY_WARNED = False
    try:
        yield
    finally:
        infra._LEGACY_WARNED = saved


def _batch() -> dict[str, torch.Tensor]:
    return make_batch(128, 2, 12, seed=5)


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=_batch()["input_ids"]).logits
    return logits


def _fp32_fsdp2() -> FSDP2Config:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before), "modules were added or removed"
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters())


# ------------------------------------------------------------------------------------------ contract


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_signature_matches_the_contract(name: str) -> None:
    params = list(inspect.signature(getattr(infra, name)).parameters.values())
    got = [(p.name, p.kind, p.default) for p in params]
    assert got == CONTRACT[name]


def test_module_exports_the_documented_names() -> None:
    documented = {"logger", *CONTRACT}
    assert documented <= set(infra.__all__)
    assert isinstance(infra.logger, logging.Logger) and infra.logger.name == "automodel_infra.infrastructure"
    assert automodel_infra.apply_model_infrastructure is apply_model_infrastructure


def test_result_unpacks_as_the_documented_4_tuple() -> None:
    result = instantiate_infrastructure(distributed_config=_fp32_fsdp2())
    model_wrapper, autopipeline, parallelize_fn, qat_quantizer = result
    assert isinstance(result, tuple) and len(result) == 4
    assert result.model_wrapper is model_wrapper and type(model_wrapper).__name__ == "FSDP2Manager"
    assert autopipeline is None and parallelize_fn is None and qat_quantizer is None
    assert instantiate_infrastructure() == (None, None, None, None)


def test_qat_config_gives_a_torchao_quantizer() -> None:
    from automodel_quant.qat import QATConfig

    quantizer = instantiate_infrastructure(qat_config=QATConfig(quantizer_type="int8_dynact_int4weight"))[3]
    assert type(quantizer).__name__ == "Int8DynActInt4WeightQATQuantizer"


def test_caller_config_is_not_mutated() -> None:
    config = _fp32_fsdp2()
    manager = instantiate_infrastructure(distributed_config=config, activation_checkpointing=True)[0]
    assert config.activation_checkpointing is False
    assert manager.config.activation_checkpointing in (True, "full")


# ------------------------------------------------------------------------------------------ legacy params


def test_legacy_mesh_parameters_warn_once_and_work(fake_world: int, warn_state: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (1, 1, fake_world, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp")
    )
    with pytest.warns(FutureWarning, match="deprecated") as first:
        manager = instantiate_infrastructure(distributed_config=FSDP2Config(), device_mesh=mesh, ep_size=1)[0]
    assert len([w for w in first if issubclass(w.category, FutureWarning)]) == 1
    assert manager.device_mesh is mesh and manager.mesh.dp_shard_size == fake_world
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        again = instantiate_infrastructure(distributed_config=FSDP2Config(), device_mesh=mesh)[0]
    assert again.device_mesh is mesh


def test_legacy_ep_size_must_match_the_moe_mesh(warn_state: None) -> None:
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="ep_size=2"):
        instantiate_infrastructure(ep_size=2)


def test_mesh_and_legacy_mesh_together_is_an_error(fake_world: int, warn_state: None) -> None:
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes())
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="not both"):
        instantiate_infrastructure(distributed_config=FSDP2Config(), mesh=ctx, device_mesh=ctx.device_mesh)


# ------------------------------------------------------------------------------------------ user errors


def test_unknown_distributed_config_type() -> None:
    with pytest.raises(ValueError, match="Unknown distributed config type: dict"):
        instantiate_infrastructure(distributed_config={"dp_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown distributed config type"):
        infra._instantiate_distributed(object(), MeshContext())  # type: ignore[arg-type]


def test_fsdp2_without_a_mesh_in_a_multi_rank_run(fake_world: int) -> None:
    with pytest.raises(ValueError, match="device_mesh is required for FSDP2Config"):
        instantiate_infrastructure(distributed_config=FSDP2Config())


def test_pp_mesh_without_pipeline_config(fake_world: int) -> None:
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(pp_size=2))
    with pytest.raises(ValueError, match="pp_size=2 but pipeline_config is None"):
        instantiate_infrastructure(distributed_config=FSDP2Config(), mesh=ctx)


def test_context_parallel_hooks_the_attention_of_sdpa_models_only(fake_world: int) -> None:
    from automodel_mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(FSDP2Config(), ParallelismSizes(cp_size=2))
    model = apply_model_infrastructure(
        build_tiny_model("llama", meta=True), is_meta_device=True, device="cpu", mesh=mesh
    )
    attentions = [layer.self_attn for layer in model.model.layers]
    assert attentions and all(len(a._forward_pre_hooks) == 1 for a in attentions)

    eager = build_tiny_model("llama", meta=True, attn_implementation="eager")
    with pytest.raises(ValueError, match="sdpa"):
        apply_model_infrastructure(eager, is_meta_device=True, device="cpu", mesh=mesh)
    assert all(p.is_meta for p in eager.parameters())  # refused before anything was materialised


def test_mesh_must_be_a_mesh_context() -> None:
    with pytest.raises(ValueError, match="MeshContext"):
        instantiate_infrastructure(mesh="fsdp2")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "flag", "match"),
    [
        (FSDP2Config(activation_checkpointing="selective"), True, "contradicts"),
        (FSDP2Config(activation_checkpointing=True), "selective", "contradicts"),
        (None, True, "needs a distributed_config"),
        (FSDP2Config(), "everything", "activation_checkpointing="),
    ],
)
def test_activation_checkpointing_errors(config: Any, flag: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        instantiate_infrastructure(distributed_config=config, activation_checkpointing=flag)


def test_activation_checkpointing_agreeing_settings_are_fine() -> None:
    manager = instantiate_infrastructure(
        distributed_config=FSDP2Config(activation_checkpointing=True), activation_checkpointing=True
    )[0]
    assert manager.config.activation_checkpointing in (True, "full")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"is_meta_device": 1}, "is_meta_device must be a bool"),
        ({"is_meta_device": False, "load_base_model": "yes"}, "load_base_model must be a bool"),
        ({"is_meta_device": False, "compile_config": "max-autotune"}, "compile_config must be"),
        ({"is_meta_device": False, "inject_te_attention": True}, "inject_te_attention"),
        ({"is_meta_device": False, "freeze_config": {"freeze_vision": True}}, "freeze_vision"),
        ({"is_meta_device": False, "freeze_config": {"freeze_vision_tower": 1}}, "freeze_vision_tower"),
        ({"is_meta_device": False, "load_base_model": True}, "needs pretrained_model_name_or_path"),
        ({"is_meta_device": False, "quantization_config": object()}, "only used with peft_config"),
    ],
)
def test_bad_apply_arguments_raise_before_the_model_changes(kwargs: dict[str, Any], match: str) -> None:
    from automodel_peft import PeftConfig

    model = build_tiny_model("llama", seed=1)
    before = _snapshot(model)
    peft = None if "quantization_config" in kwargs else PeftConfig(target_modules=["q_proj"], dim=4)
    with pytest.raises(ValueError, match=match):
        apply_model_infrastructure(model, device="cpu", peft_config=peft, **kwargs)
    _assert_untouched(model, before)


def test_apply_needs_a_module() -> None:
    with pytest.raises(ValueError, match=r"torch\.nn\.Module"):
        apply_model_infrastructure("llama", is_meta_device=True, device="cpu")  # type: ignore[arg-type]


def test_missing_checkpoint_raises_before_the_model_changes(tmp_path: pathlib.Path) -> None:
    from automodel_peft import PeftConfig

    model = build_tiny_model("llama", seed=1)
    before = _snapshot(model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        apply_model_infrastructure(
            model,
            is_meta_device=False,
            device="cpu",
            peft_config=PeftConfig(target_modules=["q_proj"], dim=4),
            load_base_model=True,
            pretrained_model_name_or_path=str(tmp_path / "no-such-checkpoint"),
        )
    _assert_untouched(model, before)


def test_unknown_keywords_are_ignored_with_a_warning() -> None:
    model = build_tiny_model("llama", seed=1)
    with pytest.warns(UserWarning, match="ignores the keyword"):
        apply_model_infrastructure(model, is_meta_device=False, device="cpu", tp_plan={"x": "colwise"})


def test_qat_on_float32_weights_is_a_user_error() -> None:
    from automodel_quant.qat import QATConfig

    quantizer = instantiate_infrastructure(qat_config=QATConfig())[3]
    with pytest.raises(ValueError, match="bfloat16"):
        apply_model_infrastructure(
            build_tiny_model("llama", meta=True), is_meta_device=True, device="cpu", qat_quantizer=quantizer
        )


def test_qat_with_tensor_parallelism_is_refused_before_the_model_changes() -> None:
    from automodel_infra.infrastructure import _apply_peft_and_lower_precision
    from automodel_quant.qat import QATConfig

    model = build_tiny_model("llama", meta=True, dtype=torch.bfloat16)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"QAT with tensor parallelism \(tp_size=2\)"):
        _apply_peft_and_lower_precision(model, 2, None, None, None, None, QATConfig().create_quantizer())
    assert [type(m) for m in model.modules()] == before


# ------------------------------------------------------------------------------------------ optional parts


@pytest.mark.parametrize(
    "module", ["automodel_peft", "automodel_quant.fp8", "automodel_pipelining.autopipeline"]
)
def test_missing_optional_component_names_its_distribution(
    module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `sys.modules[name] = None` is Python's documented way to make an import fail.
    monkeypatch.setitem(sys.modules, module, None)
    distribution, extra = OPTIONAL_COMPONENTS[module.split(".")[0]]
    with pytest.raises(ImportError, match=f"needs {distribution}, which is not installed") as info:
        import_component(module, "the feature")
    assert f"pip install {distribution}" in str(info.value)
    assert f"automodel-infra[{extra}]" in str(info.value)


def test_missing_peft_through_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "automodel_peft", None)
    model = build_tiny_model("llama", meta=True)
    with pytest.raises(ImportError, match="peft_config needs automodel-peft"):
        apply_model_infrastructure(model, is_meta_device=True, device="cpu", peft_config={"dim": 4})


def test_other_import_errors_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "automodel_not_a_component", None)
    with pytest.raises(ModuleNotFoundError) as info:
        import_component("automodel_not_a_component", "x")
    assert "not installed" not in str(info.value)


# ------------------------------------------------------------------------------------------ world size 1


def test_meta_model_loads_the_checkpoint_exactly(
    checkpoint: pathlib.Path, reference_logits: torch.Tensor
) -> None:
    infra_objects = instantiate_infrastructure(distributed_config=_fp32_fsdp2(), device=torch.device("cpu"))
    model = apply_model_infrastructure(
        build_tiny_model("llama", meta=True),
        is_meta_device=True,
        device=torch.device("cpu"),
        model_wrapper=infra_objects.model_wrapper,
        qat_quantizer=infra_objects.qat_quantizer,
        load_base_model=True,
        pretrained_model_name_or_path=str(checkpoint),
    )
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(_logits(model), reference_logits)
    assert all(p.requires_grad for p in model.parameters())


def test_real_model_weights_are_replaced_by_the_checkpoint(
    checkpoint: pathlib.Path, reference_logits: torch.Tensor
) -> None:
    model = build_tiny_model("llama", seed=11)  # not the checkpoint's seed
    assert not torch.equal(_logits(model), reference_logits)
    manager = instantiate_infrastructure(distributed_config=_fp32_fsdp2())[0]
    out = apply_model_infrastructure(
        model,
        is_meta_device=False,
        device="cpu",
        model_wrapper=manager,
        load_base_model=True,
        pretrained_model_name_or_path=str(checkpoint),
    )
    assert out is model
    assert torch.equal(_logits(model), reference_logits)


def test_meta_model_without_loading_is_materialised_and_initialised() -> None:
    model = apply_model_infrastructure(
        build_tiny_model("llama", meta=True), is_meta_device=True, device="cpu"
    )
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.isfinite(_logits(model)).all()
    assert float(model.model.layers[0].self_attn.q_proj.weight.detach().std()) > 0


def test_lora_at_world_1(checkpoint: pathlib.Path, reference_logits: torch.Tensor) -> None:
    from automodel_peft import PeftConfig

    peft_config = PeftConfig(target_modules=["q_proj", "v_proj"], dim=4, alpha=8)
    manager = instantiate_infrastructure(distributed_config=_fp32_fsdp2())[0]
    model = apply_model_infrastructure(
        build_tiny_model("llama", meta=True),
        is_meta_device=True,
        device="cpu",
        model_wrapper=manager,
        peft_config=peft_config,
        load_base_model=True,
        pretrained_model_name_or_path=str(checkpoint),
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # A and B, of q_proj and v_proj, in 2 layers
    assert frozen and not any("lora_" in n for n in frozen)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert all(torch.count_nonzero(p) == 0 for p in lora_b)
    assert all(float(p.abs().max()) > 0 for p in lora_a)
    assert torch.equal(_logits(model), reference_logits)
    model(**_batch()).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert peft_config.dim == 4 and peft_config.target_modules == ["q_proj", "v_proj"]  # not mutated


@pytest.mark.parametrize("is_meta_device", [True, False])
def test_dora_magnitudes_are_the_row_norms_of_the_loaded_weights(
    checkpoint: pathlib.Path, reference_logits: torch.Tensor, is_meta_device: bool
) -> None:
    from automodel_peft import PeftConfig

    model = apply_model_infrastructure(
        build_tiny_model("llama", meta=is_meta_device, seed=5),
        is_meta_device=is_meta_device,
        device="cpu",
        peft_config=PeftConfig(target_modules=["q_proj", "v_proj"], dim=4, use_dora=True),
        load_base_model=True,
        pretrained_model_name_or_path=str(checkpoint),
    )
    layers = [m for m in model.modules() if hasattr(m, "lora_magnitude_vector")]
    assert len(layers) == 4
    for layer in layers:
        norms = torch.linalg.norm(layer.get_base_layer().weight.detach(), dim=1)
        assert torch.equal(layer.lora_magnitude_vector["default"].weight.detach(), norms)
    # B is zero and the magnitudes are the base norms: DoRA starts as the loaded base model.
    torch.testing.assert_close(_logits(model), reference_logits, atol=1e-5, rtol=0)
    assert torch.isfinite(model(**_batch()).loss)


def test_fp8_at_world_1_converts_before_loading(checkpoint: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    from automodel_quant.fp8 import FP8Config, apply_fp8_to_model

    config = FP8Config(
        enabled=True, emulate=True, filter_fqns=["lm_head"], enable_fsdp_float8_all_gather=True
    )
    # No strategy: nothing gathers the float8 weights, and the setting says so instead of acting on nothing.
    with pytest.warns(UserWarning, match="FP8Config.enable_fsdp_float8_all_gather ignored: no FSDP2 unit"):
        model = apply_model_infrastructure(
            build_tiny_model("llama", meta=True),
            is_meta_device=True,
            device="cpu",
            fp8_config=config,
            load_base_model=True,
            pretrained_model_name_or_path=str(checkpoint),
        )
    reference = apply_fp8_to_model(AutoModelForCausalLM.from_pretrained(checkpoint), config=config)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert type(model.lm_head).__name__ == "Linear"
    assert torch.equal(_logits(model), _logits(reference))


def test_ddp_config_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError):
        instantiate_infrastructure(distributed_config=DDPConfig())


def test_compile_config_compiles_each_block_in_place_after_loading(
    checkpoint: pathlib.Path, reference_logits: torch.Tensor
) -> None:
    # backend="eager": dynamo traces the blocks without code generation, so the test stays fast.
    manager = instantiate_infrastructure(distributed_config=_fp32_fsdp2())[0]
    model = apply_model_infrastructure(
        build_tiny_model("llama", meta=True),
        is_meta_device=True,
        device="cpu",
        model_wrapper=manager,
        compile_config={"enabled": True, "backend": "eager"},
        load_base_model=True,
        pretrained_model_name_or_path=str(checkpoint),
    )
    assert all(getattr(block, "_compiled_call_impl", None) is not None for block in model.model.layers)
    assert not any("_orig_mod" in name for name, _ in model.named_parameters())
    assert torch.equal(_logits(model), reference_logits)


def test_disabled_compile_config_compiles_nothing() -> None:
    model = apply_model_infrastructure(
        build_tiny_model("llama", seed=1),
        is_meta_device=False,
        device="cpu",
        compile_config={"enabled": False},
    )
    assert all(getattr(block, "_compiled_call_impl", None) is None for block in model.model.layers)


def test_a_pipeline_or_moe_config_the_mesh_cannot_use_warns() -> None:
    from automodel_moe import MoEParallelizerConfig
    from automodel_pipelining import PipelineConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instantiate_infrastructure(
            distributed_config=FSDP2Config(),
            pipeline_config=PipelineConfig(),
            moe_config=MoEParallelizerConfig(),
            mesh=MeshContext(),
        )
    messages = [str(w.message) for w in caught]
    assert "pipeline_config ignored: the mesh has pp_size=1" in messages, messages
    assert any(m.startswith("moe_config ignored: the mesh has ep_size=1") for m in messages), messages


@pytest.mark.parametrize(
    ("compile_config", "compiled"),
    [
        (None, False),
        (CompileConfig(enabled=True), True),
        (CompileConfig(enabled=True, compile_loss=False), False),
        (CompileConfig(enabled=False), False),
    ],
)
def test_the_default_loss_is_compiled_with_the_compile_config(
    compile_config: CompileConfig | None, compiled: bool
) -> None:
    """The loss `apply_model_infrastructure` gives a pipeline when none is set follows ``compile_loss``."""
    from automodel_distributed.loss import MaskedCrossEntropy
    from automodel_infra.infrastructure import ApplyState, _run_freeze

    required = [
        f.name
        for f in dataclasses.fields(ApplyState)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    state = ApplyState(**{**dict.fromkeys(required), "compile_config": compile_config})
    _run_freeze(state)
    assert isinstance(state.loss_fn, MaskedCrossEntropy) and state.loss_fn.compiled is compiled
