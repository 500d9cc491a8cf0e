"""docs/migrating.md's mapping from NeMo AutoModel to automodel holds: names, signatures, config defaults.

The reference is not installed here (CI has only the locked environment). Its expectations are data:

- ``tools/compat/reference_api.json``: every public name of the reference's infrastructure modules with
  its parameters and defaults, read from nemo-automodel 0.7.0's sources by ``tools/reference_api.py``;
- ``tools/compat/mapping.toml``: what automodel offers for each name;
- `SECTION_2` below: the config fields and defaults that section 2 of
  ``reference/nemo-automodel-behaviour.md`` documents (the contract; where 0.7.0 moved on, the mapping
  says so).

Checks: every reference name has a row and every row a reason where one is due; every target imports;
every ``same`` or ``renamed`` row takes the reference's parameters with its literal defaults;
docs/migrating.md shows the table the data gives; the configs are built with the documented defaults;
the behaviours issue 17 found different are the reference's now.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import compat_mapping as cm  # noqa: E402

MAPPING = cm.load_mapping()
SNAPSHOT = cm.load_snapshot()
ROWS = [(module, row) for module, rows in cm.rows(MAPPING, SNAPSHOT).items() for row in rows]

# A "same" row whose declared default differs while the behaviour is the reference's: why.
EQUIVALENT_DEFAULTS = {
    (
        "components.utils.compile_utils",
        "CompileConfig",
        "options",
    ): "the reference's __init__ turns None into {}",
}

# Section 2 of nemo-automodel-behaviour.md: class -> {field: documented default}.
SECTION_2: dict[str, dict[str, Any]] = {
    "automodel_mesh.ParallelismSizes": {
        "dp_size": None, "dp_replicate_size": None, "tp_size": 1, "pp_size": 1, "cp_size": 1, "ep_size": 1,
    },
    "automodel_mesh.MeshContext": {"device_mesh": None, "moe_mesh": None, "process_group": None},
    "automodel_infra.DistributedSetup": {
        "strategy_config": None, "pipeline_config": None, "moe_parallel_config": None,
        "activation_checkpointing": False,
    },
    "automodel_distributed.config.FSDP2Config": {
        "sequence_parallel": False, "tp_plan": None, "patch_is_packed_sequence": False,
        "offload_policy": None,
        "autocast_dtype": None, "activation_checkpointing": False, "activation_checkpointing_scope": ("all",),
        "defer_fsdp_grad_sync": True, "reshard_after_forward": None, "enable_async_tensor_parallel": False,
        "enable_compile": False, "enable_fsdp2_prefetch": False, "fsdp2_backward_prefetch_depth": 2,
        "fsdp2_forward_prefetch_depth": 1,
    },
    "automodel_distributed.config.MegatronFSDPConfig": {
        "megatron_fsdp_unit_modules": None, "zero_dp_strategy": 3, "init_fsdp_with_meta_device": False,
        "grad_reduce_in_fp32": False, "preserve_fp32_weights": False, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "check_for_nan_in_grad": True, "report_nan_in_param_grad": False,
        "average_in_collective": False, "disable_bucketing": False, "calculate_per_token_loss": False,
        "keep_fp8_transpose_cache": False, "nccl_ub": False, "fsdp_double_buffer": False,
        "activation_checkpointing": False,
    },
    "automodel_distributed.config.DDPConfig": {
        "activation_checkpointing": False, "activation_checkpointing_scope": ("all",),
        "broadcast_buffers": False,
        "find_unused_parameters": False, "static_graph": False, "bucket_cap_mb": None,
        "gradient_as_bucket_view": False, "autocast_dtype": None,
    },
    "automodel_moe.config.MoEParallelizerConfig": {
        "ignore_router_for_ac": True, "reshard_after_forward": False, "lm_head_precision": None,
        "wrap_outer_model": True, "mp_policy": None,
    },
    "automodel_pipelining.config.PipelineConfig": {
        "pp_schedule": "1f1b", "pp_schedule_csv": None, "pp_microbatch_size": 1, "pp_batch_size": 1,
        "layers_per_stage": None, "round_virtual_stages_to_pp_multiple": None,
        "module_fqns_per_model_part": None, "patch_inner_model": True, "patch_causal_lm_model": True,
        "patch_stage_backward_maybe_with_nosync": False,
        "dtype": None, "scale_grads_in_schedule": False, "loss_fn": None, "pp_seq_len": None,
    },
    "automodel_quant.qat.QATConfig": {"quantizer_type": "int8_dynact_int4weight"},
    "automodel_quant.fp8.FP8Config": {
        "enabled": False, "recipe_name": None, "enable_fsdp_float8_all_gather": False,
        "precompute_float8_dynamic_scale_for_fsdp": False, "force_recompute_fp8_weight_in_bwd": False,
        "filter_fqns": [], "emulate": False,
    },
    "automodel_peft.PeftConfig": {
        "exclude_modules": [], "match_all_linear": False, "dim": 8, "alpha": 32, "use_dora": False,
        "dropout": 0.0, "dropout_position": "post", "lora_A_init": "xavier", "lora_dtype": None,
        "use_memory_efficient_lora": True, "use_triton": False, "moe_rank_scaling": False,
    },
    "automodel_distributed.config.CompileConfig": {
        "enabled": False, "mode": "default", "fullgraph": False, "dynamic": False, "backend": None,
        "options": {},
        "dynamo_cache_size_limit": 256,
    },
}  # fmt: skip


def _id(item: tuple[str, cm.Row]) -> str:
    return f"{item[0]}.{item[1].name}"


def test_every_reference_name_has_a_row_with_its_reason() -> None:
    assert cm.check(MAPPING, SNAPSHOT) == []
    assert len(ROWS) == sum(len(names) for names in SNAPSHOT["modules"].values())
    # The names issue 17 listed as missing are provided now.
    provided = {(m, r.name) for m, r in ROWS if r.status != "not provided"}
    for module, name in [
        ("components._peft.lora", "LinearLoRA"),
        ("components.distributed.parallel_styles", "ColwiseParallelLora"),
        ("components.distributed.parallel_styles", "RowwiseParallelLora"),
        ("components.distributed.parallel_styles", "translate_to_lora"),
        ("components.distributed.parallelizer", "get_hf_tp_shard_plan"),
        ("components.distributed.activation_checkpointing", "apply_submodule_checkpointing"),
        ("components.utils.compile_utils", "build_compile_config"),
        ("components.utils.compile_utils", "configure_torch_dynamo"),
        ("components.quantization.fp8", "create_fp8_config_from_dict"),
        ("components.distributed.config", "normalize_activation_checkpointing_scope"),
        ("components.distributed.config", "DistributedSetup"),
    ]:
        assert (module, name) in provided, (module, name)


@pytest.mark.parametrize("item", [i for i in ROWS if i[1].target is not None], ids=_id)
def test_target_exists(item: tuple[str, cm.Row]) -> None:
    _, row = item
    assert row.target is not None
    cm.resolve(row.target)


@pytest.mark.parametrize("item", [i for i in ROWS if i[1].status in ("same", "renamed")], ids=_id)
def test_same_and_renamed_rows_take_the_reference_parameters(item: tuple[str, cm.Row]) -> None:
    module, row = item
    problems = cm.signature_problems(row, SNAPSHOT["modules"][module][row.name])
    problems = [p for p in problems if (module, row.name, p.split(":")[0]) not in EQUIVALENT_DEFAULTS]
    assert problems == [], (
        f"{row.target} (mapped as {row.status!r}): {problems}; fix it or map it as 'different'"
    )


def test_signature_check_can_fail() -> None:
    # A wrong mapping is caught: FP8Config is not PeftConfig.
    row = cm.Row("PeftConfig", "same", "automodel_quant.fp8.FP8Config")
    assert cm.signature_problems(row, SNAPSHOT["modules"]["components._peft.lora"]["PeftConfig"])


def test_docs_table_is_current() -> None:
    text = cm.DOCS.read_text(encoding="utf-8")
    assert cm.update_docs(text, cm.render_table(MAPPING, SNAPSHOT)) == text, (
        "docs/migrating.md is stale: run python tools/compat_mapping.py"
    )


@pytest.mark.parametrize("path", sorted(SECTION_2))
def test_config_defaults_of_section_2(path: str) -> None:
    cls = cm.resolve(path)
    if path == "automodel_infra.DistributedSetup":
        from automodel_mesh import MeshContext

        instance = cls(mesh_context=MeshContext())
    elif path == "automodel_peft.PeftConfig":
        with pytest.warns(UserWarning, match="no target_modules"):
            instance = cls()
        assert instance.target_modules == ["*_proj"]  # the reference's default when nothing is given
    else:
        instance = cls()
    names = {f.name for f in dataclasses.fields(cls)}
    for field, want in SECTION_2[path].items():
        assert field in names, f"{path} has no field {field!r}"
        got = getattr(instance, field)
        assert type(got) is type(want) and got == want, f"{path}.{field}: {got!r}, documented {want!r}"


def test_fsdp2_default_mixed_precision_is_the_documented_one() -> None:
    from automodel_distributed.config import FSDP2Config

    policy = FSDP2Config().mp_policy
    assert policy is not None
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16, torch.float32, torch.bfloat16, True,
    )  # fmt: skip


def test_behaviours_that_issue_17_found_different() -> None:
    from torch import nn

    from automodel_distributed.config import CompileConfig, DDPConfig, FSDP2Config
    from automodel_mesh import MeshContext
    from automodel_quant.fp8 import FP8Config, build_fp8_config, verify_fp8_conversion

    assert MeshContext().parallelize_axis_kwargs()["dp_axis_names"] == ("dp_shard_cp",)
    assert MeshContext().pipeline_axis_kwargs()["dp_axis_names"] == ("dp_shard_cp",)
    assert FSDP2Config(activation_checkpointing_scope=None).activation_checkpointing_scope == ("all",)
    assert DDPConfig(activation_checkpointing_scope=None).activation_checkpointing_scope == ("all",)
    assert CompileConfig().options == {}
    assert CompileConfig(mode="reduce-overhead", options={"x": 1}).mode == "reduce-overhead"
    assert build_fp8_config(None) == FP8Config(enabled=False)
    assert list(FP8Config().to_dict()) == [
        "enabled", "fp8_recipe_name", "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "force_recompute_fp8_weight_in_bwd", "fp8_filter_fqns", "fp8_emulate",
    ]  # fmt: skip
    stats = verify_fp8_conversion(nn.Linear(16, 16))
    assert set(stats) == {"linear_count", "fp8_count", "conversion_rate", "fp8_modules", "success"}
