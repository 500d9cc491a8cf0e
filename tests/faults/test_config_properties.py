"""Property tests: every config dataclass and every mesh layout, over random field values and sizes.

The property: an input either builds a valid object (every field holds a value of its declared type,
sizes tile the world), or raises a `ValueError` whose message names the offending field. No other
exception, no hang (each test runs under a pytest timeout; hypothesis bounds each example).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel_distributed.config import (
    CompileConfig,
    DDPConfig,
    FSDP2Config,
    MegatronFSDPConfig,
    MultimodalDistributedConfig,
)
from automodel_moe.config import MoEParallelizerConfig
from automodel_peft import PeftConfig
from automodel_pipelining.config import PipelineConfig
from automodel_quant.bnb import BnBQuantizationConfig
from automodel_quant.fp8 import FP8Config
from automodel_quant.qat import QATConfig

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

EXAMPLES = 150
PROPERTY = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same examples on every run: the counts in docs/faults.md are reproducible
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)

# ------------------------------------------------------------------------------------------ values

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-2, 5), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.uint8]),
    st.just(object()),
)
"""Values of every common wrong type (and a few right ones)."""

NAMES = st.lists(
    st.sampled_from(["q_proj", "*_proj", "lm_head", "router", "", "model.layers.0.mlp"]), max_size=3
)


def _field_values(
    cls: type, valid: Mapping[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """Per field: absent (default), a valid value, or junk."""
    names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    optional = {name: st.one_of(valid[name], JUNK) if name in valid else JUNK for name in names}
    return st.fixed_dictionaries({}, optional=optional)


# ------------------------------------------------------------------------------------------ conformance

_LOCALNS: dict[str, Any] = {"torch": torch}
try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    _LOCALNS.update(MixedPrecisionPolicy=MixedPrecisionPolicy, OffloadPolicy=OffloadPolicy)
except ImportError:  # pragma: no cover
    pass

# Fields whose validation deliberately accepts more than the annotation says (documented in the class).
_ALSO_ACCEPTED: dict[tuple[str, str], tuple[type, ...]] = {("PeftConfig", "alpha"): (int, float)}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (a small, strict checker: bool is not an int here)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any or hint is object:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_conforms(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, Sequence, tuple, dict, Mapping) or hint in (list, dict, tuple):
        base = origin or hint
        if base in (list, tuple, Sequence) and not isinstance(value, list | tuple):
            return False
        if base in (dict, Mapping) and not isinstance(value, dict):
            return False
        if base in (list, Sequence) and args:
            return all(_conforms(v, args[0]) for v in value)
        if base is tuple and args and args[-1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return True
    if origin is not None and callable(origin) and getattr(origin, "__name__", "") == "Callable":
        return callable(value)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a hint this checker does not understand: no claim


def _violations(obj: Any) -> list[str]:
    cls = type(obj)
    hints = typing.get_type_hints(cls, localns=_LOCALNS)
    out = []
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        value = getattr(obj, f.name)
        extra = _ALSO_ACCEPTED.get((cls.__name__, f.name))
        if extra and isinstance(value, extra) and not isinstance(value, bool):
            continue
        if not _conforms(value, hints[f.name]):
            out.append(f"{f.name}={value!r} is not a {hints[f.name]}")
        if isinstance(value, float) and not math.isfinite(value):
            out.append(f"{f.name}={value!r} is not finite")
    return out


def _check(
    ledger: Any,
    category: str,
    build: Callable[[], Any],
    kwargs: Mapping[str, Any],
    extra: Callable[[Any], list[str]] | None = None,
) -> None:
    """Build; assert the property; record the outcome."""
    case = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())[:200]
    try:
        obj = build()
    except ValueError as exc:
        message = str(exc)
        named = [n for n in kwargs if n in message]
        ledger.bad_input(category, case, clear=bool(named), detail=message)
        assert named, f"{category}({case}): the ValueError names none of the given fields: {message}"
        return
    except Exception as exc:
        ledger.bad_input(category, case, clear=False, detail=f"{type(exc).__name__}: {exc}")
        raise AssertionError(
            f"{category}({case}) raised {type(exc).__name__}, not ValueError: {exc}"
        ) from exc
    bad = _violations(obj) if dataclasses.is_dataclass(obj) else []
    bad += extra(obj) if extra is not None else []
    ledger.bad_input(category, case, clear=False, valid=not bad, detail="; ".join(bad))
    assert not bad, f"{category}({case}) was accepted with invalid fields: {bad}"


# ------------------------------------------------------------------------------------------ configs

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, "bfloat16", "torch.float32"])
AC = st.sampled_from([False, True, "full", "selective", "FULL"])
SCOPE = st.sampled_from(["all", "language", "language+vision", ["vision", "audio"], "auto", "all,language"])

CONFIGS: dict[str, tuple[type, dict[str, st.SearchStrategy[Any]]]] = {
    "FSDP2Config": (
        FSDP2Config,
        {
            "sequence_parallel": st.booleans(),
            "tp_plan": st.one_of(st.none(), st.just({"lm_head": "colwise"}), st.just("llama")),
            "activation_checkpointing": AC,
            "activation_checkpointing_scope": SCOPE,
            "reshard_after_forward": st.one_of(st.none(), st.booleans(), st.integers(1, 8)),
            "enable_async_tensor_parallel": st.booleans(),
            "fsdp2_backward_prefetch_depth": st.integers(1, 4),
            "fsdp2_forward_prefetch_depth": st.integers(1, 4),
            "autocast_dtype": st.sampled_from([None, torch.bfloat16]),
            "mp_policy": st.none(),
            "multimodal": st.builds(MultimodalDistributedConfig),
        },
    ),
    "MegatronFSDPConfig": (
        MegatronFSDPConfig,
        {
            "zero_dp_strategy": st.integers(-1, 4),
            "megatron_fsdp_unit_modules": st.one_of(st.none(), st.just(["transformers.LlamaDecoderLayer"])),
            "activation_checkpointing": AC,
            "overlap_grad_reduce": st.booleans(),
        },
    ),
    "DDPConfig": (
        DDPConfig,
        {
            "activation_checkpointing": AC,
            "activation_checkpointing_scope": SCOPE,
            "bucket_cap_mb": st.one_of(st.none(), st.floats(0.5, 100), st.integers(1, 50)),
            "autocast_dtype": st.sampled_from([None, torch.bfloat16]),
            "static_graph": st.booleans(),
        },
    ),
    "CompileConfig": (
        CompileConfig,
        {
            "enabled": st.booleans(),
            "mode": st.sampled_from(["default", "reduce-overhead", "max-autotune", "fast"]),
            "options": st.one_of(st.none(), st.just({"triton.cudagraphs": False})),
            "dynamo_cache_size_limit": st.integers(0, 512),
            "backend": st.sampled_from([None, "inductor", "eager"]),
        },
    ),
    "MultimodalDistributedConfig": (
        MultimodalDistributedConfig,
        {"frozen_sharding": st.sampled_from(["root", "per_layer", "replicate", "layer"])},
    ),
    "PipelineConfig": (
        PipelineConfig,
        {
            "pp_schedule": st.sampled_from(
                ["1f1b", "GPipe", "interleaved_1f1b", "zbv", "dualpipev", "2f2b", None]
            ),
            "pp_microbatch_size": st.integers(0, 4),
            "pp_batch_size": st.integers(0, 8),
            "layers_per_stage": st.one_of(st.none(), st.integers(0, 4)),
            "round_virtual_stages_to_pp_multiple": st.sampled_from([None, "up", "down", "sideways"]),
            "module_fqns_per_model_part": st.one_of(
                st.none(), st.just([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "lm_head"]])
            ),
            "dtype": st.sampled_from([None, torch.bfloat16]),
            "pp_seq_len": st.one_of(st.none(), st.integers(0, 64)),
        },
    ),
    "MoEParallelizerConfig": (
        MoEParallelizerConfig,
        {
            "ignore_router_for_ac": st.booleans(),
            "reshard_after_forward": st.booleans(),
            "lm_head_precision": st.sampled_from([None, torch.float32, "float32", "torch.bfloat16", "int4x"]),
            "wrap_outer_model": st.booleans(),
        },
    ),
    "FP8Config": (
        FP8Config,
        {
            "enabled": st.booleans(),
            "recipe_name": st.sampled_from(
                [None, "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"]
            ),
            "enable_fsdp_float8_all_gather": st.booleans(),
            "filter_fqns": NAMES,
            "emulate": st.booleans(),
            "convert_output_head": st.booleans(),
        },
    ),
    "BnBQuantizationConfig": (
        BnBQuantizationConfig,
        {
            "load_in_4bit": st.booleans(),
            "load_in_8bit": st.booleans(),
            "bnb_4bit_quant_type": st.sampled_from(["nf4", "fp4", "int4"]),
            "bnb_4bit_compute_dtype": DTYPES,
            "bnb_4bit_quant_storage": st.sampled_from([torch.bfloat16, torch.uint8, "uint8"]),
            "llm_int8_threshold": st.floats(-1.0, 10.0),
            "llm_int8_skip_modules": NAMES,
            "allow_cpu": st.booleans(),
        },
    ),
    "PeftConfig": (
        PeftConfig,
        {
            "target_modules": NAMES,
            "exclude_modules": NAMES,
            "match_all_linear": st.booleans(),
            "dim": st.integers(-1, 16),
            "alpha": st.one_of(st.integers(-1, 64), st.floats(-1.0, 64.0)),
            "use_dora": st.booleans(),
            "dropout": st.floats(-0.5, 1.5),
            "dropout_position": st.sampled_from(["pre", "post", "middle"]),
            "lora_A_init": st.sampled_from(["xavier", "kaiming", "zeros"]),
            "lora_dtype": st.one_of(st.none(), DTYPES),
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_builds_or_names_the_field(name: str, fault_ledger: Any) -> None:
    cls, valid = CONFIGS[name]

    @PROPERTY
    @given(kwargs=_field_values(cls, valid))
    def check(kwargs: dict[str, Any]) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ignored settings warn; that is not what is tested here
            _check(fault_ledger, name, lambda: cls(**kwargs), kwargs)

    check()


QAT_KWARGS = st.fixed_dictionaries(
    {},
    optional={
        "quantizer_type": st.one_of(
            st.sampled_from(["int8_dynact_int4weight", "int4_weight_only", "int2"]), JUNK
        ),
        "on_unsupported_layer": st.one_of(st.sampled_from(["skip", "error", "warn"]), JUNK),
        "groupsize": st.one_of(st.sampled_from([32, 64, 128, 256, 48]), JUNK),
        "inner_k_tiles": st.one_of(st.sampled_from([2, 4, 8, 3]), JUNK),
        "precision": st.one_of(DTYPES, JUNK),
        "scales_precision": st.one_of(DTYPES, JUNK),
        "padding_allowed": st.one_of(st.booleans(), JUNK),
        "quantizer_kwargs": st.one_of(st.none(), st.just({"groupsize": 32}), JUNK),
        "bogus": JUNK,
    },
)


def _qat_valid(config: QATConfig) -> list[str]:
    bad = []
    if not isinstance(config.quantizer_kwargs, dict):
        bad.append(f"quantizer_kwargs={config.quantizer_kwargs!r}")
    for key in ("precision", "scales_precision"):
        if key in config.quantizer_kwargs and not isinstance(config.quantizer_kwargs[key], torch.dtype):
            bad.append(f"{key}={config.quantizer_kwargs[key]!r}")
    tiles = config.quantizer_kwargs.get("inner_k_tiles")
    if tiles is not None and (isinstance(tiles, bool) or not isinstance(tiles, int)):
        bad.append(f"inner_k_tiles={tiles!r}")
    return bad


def test_qat_config_builds_or_names_the_field(fault_ledger: Any) -> None:
    @PROPERTY
    @given(kwargs=QAT_KWARGS)
    def check(kwargs: dict[str, Any]) -> None:
        _check(fault_ledger, "QATConfig", lambda: QATConfig(**kwargs), kwargs, extra=_qat_valid)

    check()
