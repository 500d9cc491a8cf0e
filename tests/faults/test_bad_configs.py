"""A corpus of bad configurations through instantiate_infrastructure / apply_model_infrastructure.

Each case must raise a clear error (its type and a message naming the offending setting) *before any
collective*, on every rank. Two phases in one launch of two gloo ranks:

- every rank runs every case: each must raise the same error (same type, same message);
- rank 0 alone runs every case while rank 1 only waits on the file system. A case that entered a
  collective (or built a process group) would block until the process-group timeout instead of
  raising at once: its time to error and its error type show it.

The model is a tiny transformers model; the meshes are real (built once, before the cases).
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing import build_tiny_model, run_distributed, save_tiny_checkpoint

pytestmark = [pytest.mark.faults]

PG_TIMEOUT_S = 10.0
# A case that raises in more than this many seconds is counted as "waited on a collective".
FAST_S = 5.0


@contextlib.contextmanager
def _package_missing(name: str) -> Iterator[None]:
    """Make ``import name`` fail as if the distribution were not installed (restored afterwards)."""
    saved = {k: v for k, v in sys.modules.items() if k == name or k.startswith(name + ".")}
    for key in saved:
        del sys.modules[key]
    sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not importable" marker
    try:
        yield
    finally:
        del sys.modules[name]
        sys.modules.update(saved)


def _infra(**kwargs: Any) -> Any:
    from automodel_infra import instantiate_infrastructure

    return instantiate_infrastructure(**kwargs)


def _apply(model: torch.nn.Module, **kwargs: Any) -> Any:
    from automodel_infra import apply_model_infrastructure

    kwargs.setdefault("is_meta_device", True)
    kwargs.setdefault("device", torch.device("cpu"))
    return apply_model_infrastructure(model, **kwargs)


def _fp32_fsdp(**fields: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config

    return FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **fields)


def _full(family: str, mesh: Any, config: Any = None, **apply: Any) -> Any:
    """instantiate + apply on a meta tiny model, like a trainer does."""
    infra = _infra(distributed_config=config or _fp32_fsdp(), mesh=mesh, **apply.pop("infra", {}))
    model = build_tiny_model(family, meta=True, **apply.pop("model", {}))
    return _apply(
        model,
        model_wrapper=infra.model_wrapper,
        mesh=mesh,
        autopipeline=infra.autopipeline,
        parallelize_fn=infra.parallelize_fn,
        qat_quantizer=infra.qat_quantizer,
        **apply,
    )


# ------------------------------------------------------------------------------------------ the corpus
# name -> (mesh, function(meshes, ckpts) raising, accepted exception types, words one of which the message
# must contain). Meshes: "tp2" (tp=2), "ep2" (dp=2, ep=2), "pp2" (pp=2), "dp2" (dp_shard=2).

Case = tuple[
    str, Callable[[dict[str, Any], dict[str, str]], Any], tuple[type[BaseException], ...], tuple[str, ...]
]


def _qat_fp32(m: dict[str, Any], c: dict[str, str]) -> Any:
    from automodel_quant.qat import QATConfig

    return _full("llama", m["dp2"], infra={"qat_config": QATConfig(quantizer_type="int8_dynact_int4weight")})


def _fp8_unsupported(m: dict[str, Any], c: dict[str, str]) -> Any:
    from automodel_quant.fp8 import FP8Config

    return _full(
        "llama",
        m["dp2"],
        fp8_config=FP8Config(enabled=True, recipe_name="rowwise", enable_fsdp_float8_all_gather=True),
    )


def _fp8_dims(m: dict[str, Any], c: dict[str, str]) -> Any:
    """Every linear has a dimension not divisible by 16: float8 cannot run any of them."""
    from automodel_quant.fp8 import FP8Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The warning that lists the layers left in high precision becomes the error this case expects.
        warnings.filterwarnings("error", message="FP8: .* stay in high precision", category=UserWarning)
        return _full(
            "llama",
            m["dp2"],
            fp8_config=FP8Config(enabled=True, emulate=True),
            model={
                "hidden_size": 40,
                "intermediate_size": 72,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
        )


def _missing_peft(m: dict[str, Any], c: dict[str, str]) -> Any:
    with _package_missing("automodel_peft"):
        return _full("llama", m["dp2"], peft_config={"target_modules": ["q_proj"], "dim": 4})


def _pipeline_config() -> Any:
    from automodel_pipelining.config import PipelineConfig

    return PipelineConfig(pp_schedule="1f1b", pp_batch_size=2, pp_microbatch_size=1)


CORPUS: list[Case] = [
    (
        "tp does not divide heads",
        lambda m, c: _full(
            "llama",
            m["tp2"],
            _fp32_fsdp(),
            model={"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3},
        ),
        (ValueError,),
        ("num_attention_heads", "num_key_value_heads", "divisible"),
    ),
    (
        "ep does not divide experts",
        lambda m, c: _full("qwen3_moe", m["ep2"], model={"num_experts": 3}),
        (ValueError,),
        ("num_experts",),
    ),
    (
        "pipeline with tied embeddings",
        lambda m, c: _full("llama_tied", m["pp2"], infra={"pipeline_config": _pipeline_config()}),
        (ValueError,),
        ("tie", "tied"),
    ),
    ("QAT on fp32 weights", _qat_fp32, (ValueError,), ("bfloat16", "dtype", "float32")),
    (
        "FP8 rowwise with float8 all-gather",
        _fp8_unsupported,
        (ValueError,),
        ("enable_fsdp_float8_all_gather", "tensorwise"),
    ),
    (
        "FP8 on layers float8 cannot run (dims % 16)",
        _fp8_dims,
        (UserWarning,),
        ("self_attn.q_proj", "mlp.gate_proj"),
    ),
    (
        "unknown TP plan name",
        lambda m, c: _full("llama", m["tp2"], _fp32_fsdp(tp_plan="no_such_plan")),
        (ValueError,),
        ("tp_plan", "no_such_plan"),
    ),
    (
        "TP plan import path that does not exist",
        lambda m, c: _full("llama", m["tp2"], _fp32_fsdp(tp_plan="not_a_module.PLAN")),
        (ValueError,),
        ("tp_plan", "not_a_module"),
    ),
    (
        "TP plan matching no module",
        lambda m, c: _full("llama", m["tp2"], _fp32_fsdp(tp_plan={"no.such.module": "colwise"})),
        (ValueError,),
        ("tp_plan", "no.such.module", "matches no"),
    ),
    ("optional package missing (peft)", _missing_peft, (ImportError,), ("automodel-peft",)),
    (
        "checkpoint of another architecture",
        lambda m, c: _full(
            "llama", m["dp2"], load_base_model=True, pretrained_model_name_or_path=c["mixtral"]
        ),
        (ValueError,),
        ("checkpoint", "architecture", "missing", "unexpected", "shape"),
    ),
    (
        "checkpoint of other sizes",
        lambda m, c: _full(
            "llama", m["dp2"], load_base_model=True, pretrained_model_name_or_path=c["llama_wide"]
        ),
        (ValueError,),
        ("shape",),
    ),
    (
        "missing checkpoint folder",
        lambda m, c: _full(
            "llama", m["dp2"], load_base_model=True, pretrained_model_name_or_path=c["missing"]
        ),
        (FileNotFoundError, ValueError),
        ("does-not-exist",),
    ),
    (
        "load_base_model without a path",
        lambda m, c: _full("llama", m["dp2"], load_base_model=True),
        (ValueError,),
        ("pretrained_model_name_or_path",),
    ),
    (
        "pipeline mesh without a PipelineConfig",
        lambda m, c: _infra(distributed_config=_fp32_fsdp(), mesh=m["pp2"]),
        (ValueError,),
        ("pipeline_config",),
    ),
    (
        "unknown distributed config type",
        lambda m, c: _infra(distributed_config={"strategy": "fsdp2"}, mesh=m["dp2"]),
        (ValueError,),
        ("distributed config", "FSDP2Config"),
    ),
    (
        "mesh of the wrong type",
        lambda m, c: _infra(distributed_config=_fp32_fsdp(), mesh="dp=2"),
        (ValueError,),
        ("mesh",),
    ),
    (
        "activation checkpointing without a strategy",
        lambda m, c: _infra(activation_checkpointing=True, mesh=m["dp2"]),
        (ValueError,),
        ("activation_checkpointing",),
    ),
    (
        "Megatron-FSDP on a CPU mesh",
        lambda m, c: _full("llama", m["dp2"], _megatron()),
        (ValueError, ImportError, RuntimeError),
        ("megatron", "Megatron", "CUDA", "cuda"),
    ),
    (
        "expert parallelism for a dense model",
        lambda m, c: _full("llama", m["ep2"]),
        (ValueError,),
        ("expert", "MoE", "ep_size"),
    ),
    (
        "DDP on a tensor-parallel mesh",
        lambda m, c: _infra(distributed_config=_ddp(), mesh=m["tp2"]),
        (ValueError,),
        ("DDP", "tp"),
    ),
    (
        "QAT group size that fits no layer, on_unsupported_layer='error'",
        lambda m, c: _full(
            "llama",
            m["dp2"],
            infra={
                "qat_config": _qat(
                    quantizer_type="int4_weight_only", groupsize=256, on_unsupported_layer="error"
                )
            },
            model={"dtype": torch.bfloat16},
        ),
        (ValueError,),
        ("groupsize", "256"),
    ),
    (
        "compile_config of the wrong type",
        lambda m, c: _full("llama", m["dp2"], compile_config="max-autotune"),
        (ValueError,),
        ("compile_config",),
    ),
    (
        "is_meta_device not a bool",
        lambda m, c: _apply(build_tiny_model("llama", meta=True), is_meta_device="yes", mesh=m["dp2"]),
        (ValueError,),
        ("is_meta_device",),
    ),
    (
        "a PEFT config with an unknown field",
        lambda m, c: _full("llama", m["dp2"], peft_config={"target_modules": ["q_proj"], "rank": 4}),
        (ValueError,),
        ("rank",),
    ),
    (
        "LoRA targets that match nothing",
        lambda m, c: _full("llama", m["dp2"], peft_config={"target_modules": ["no_such_proj"]}),
        (ValueError,),
        ("no_such_proj",),
    ),
]


def _ddp() -> Any:
    from automodel_distributed.config import DDPConfig

    return DDPConfig()


def _qat(**fields: Any) -> Any:
    from automodel_quant.qat import QATConfig

    return QATConfig(**fields)


def _megatron() -> Any:
    from automodel_distributed.config import MegatronFSDPConfig

    return MegatronFSDPConfig()


def _meshes() -> dict[str, Any]:
    from automodel_distributed.config import FSDP2Config
    from automodel_mesh import MeshContext, ParallelismSizes

    timeout = PG_TIMEOUT_S / 60
    return {
        "tp2": MeshContext.build(FSDP2Config(), ParallelismSizes(tp_size=2), timeout_minutes=timeout),
        "ep2": MeshContext.build(FSDP2Config(), ParallelismSizes(ep_size=2), timeout_minutes=timeout),
        "pp2": MeshContext.build(FSDP2Config(), ParallelismSizes(pp_size=2), timeout_minutes=timeout),
        "dp2": MeshContext.build(FSDP2Config(), ParallelismSizes(), timeout_minutes=timeout),
    }


def _run_case(index: int, meshes: dict[str, Any], ckpts: dict[str, str]) -> dict[str, Any]:
    name, fn, _, _ = CORPUS[index]
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            if "FP8 on layers" not in name:
                warnings.simplefilter("ignore")
            fn(meshes, ckpts)
    except BaseException as exc:
        return {
            "case": name,
            "type": type(exc).__name__,
            "mro": [k.__name__ for k in type(exc).__mro__],
            "message": str(exc),
            "seconds": time.perf_counter() - start,
            "trace": traceback.format_exc()[-1500:],
        }
    return {"case": name, "type": None, "message": "", "seconds": time.perf_counter() - start}


def corpus_ranks(ckpts: dict[str, str], flag_dir: str) -> dict[str, Any]:
    meshes = _meshes()
    rank = dist.get_rank()
    every = [_run_case(i, meshes, ckpts) for i in range(len(CORPUS))]
    # Phase 2: rank 0 alone; rank 1 waits on a file, taking part in no collective.
    done = Path(flag_dir) / "rank0-done"
    alone: list[dict[str, Any]] = []
    if rank == 0:
        # Cases known to wait on a collective go last: a timed-out gloo group fails every later call.
        order = sorted(range(len(CORPUS)), key=lambda i: CORPUS[i][0] in AFTER_A_COLLECTIVE)
        by_index = {i: _run_case(i, meshes, ckpts) for i in order}
        alone = [by_index[i] for i in range(len(CORPUS))]
        done.write_text("ok")
    else:
        deadline = time.monotonic() + 10 * PG_TIMEOUT_S * len(CORPUS)
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"every": every, "alone": alone}


def _clear(row: dict[str, Any], types: tuple[type[BaseException], ...], words: tuple[str, ...]) -> bool:
    names = {t.__name__ for t in types}
    return bool(set(row.get("mro", [])) & names) and any(w in row["message"] for w in words)


# Cases whose error is only agreed on by a collective (a rank alone would wait for the process-group
# timeout): none since apply_model_infrastructure checks the checkpoint against the meta model first.
# A case listed here is a strict xfail.
AFTER_A_COLLECTIVE: dict[str, str] = {}


# Cases that are not rejected at all (the setting would be ignored silently): none since
# _instantiate_distributed checks the mesh layout against the strategy. A case listed here is a strict xfail.
NOT_REJECTED: dict[str, str] = {}


def _xfails(extra: dict[str, str]) -> list[Any]:
    known = {**NOT_REJECTED, **extra}
    return [
        pytest.param(i, marks=pytest.mark.xfail(strict=True, reason=known[c[0]]), id=c[0].replace(" ", "-"))
        if c[0] in known
        else pytest.param(i, id=c[0].replace(" ", "-"))
        for i, c in enumerate(CORPUS)
    ]


@pytest.fixture(scope="module")
def corpus_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("bad-config-ckpts")
    ckpts = {
        "mixtral": str(save_tiny_checkpoint("mixtral", root / "mixtral")),
        "llama_wide": str(save_tiny_checkpoint("llama", root / "llama_wide", intermediate_size=96)),
        "missing": str(root / "does-not-exist"),
    }
    flags = tmp_path_factory.mktemp("bad-config-flags")
    return run_distributed(corpus_ranks, 2, ckpts, str(flags), timeout_s=360, pg_timeout_s=PG_TIMEOUT_S)


def _describe(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['type']} after {r['seconds']:.1f} s: {r['message'][:300]}\n{r.get('trace', '')}" for r in rows
    )


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", _xfails({}))
def test_clear_error_on_every_rank(
    corpus_results: list[dict[str, Any]], index: int, fault_ledger: Any
) -> None:
    name, _, types, words = CORPUS[index]
    rows = [r["every"][index] for r in corpus_results]
    ok = all(_clear(r, types, words) for r in rows) and len({(r["type"], r["message"]) for r in rows}) == 1
    fault_ledger.bad_input(
        "infrastructure configs: clear, same error on every rank", name, clear=ok, detail=_describe(rows)
    )
    assert ok, f"{name}: expected {[t.__name__ for t in types]} naming one of {words}:\n{_describe(rows)}"


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", _xfails(AFTER_A_COLLECTIVE))
def test_error_comes_before_any_collective(
    corpus_results: list[dict[str, Any]], index: int, fault_ledger: Any
) -> None:
    name, _, types, words = CORPUS[index]
    alone = corpus_results[0]["alone"][index]
    ok = _clear(alone, types, words) and alone["seconds"] < FAST_S
    fault_ledger.bad_input(
        "infrastructure configs: error before any collective (rank 0 alone)",
        name,
        clear=ok,
        detail=_describe([alone]),
    )
    assert ok, f"{name}: rank 0 alone did not fail at once (a collective?):\n{_describe([alone])}"
