"""The planner's collective traffic is what torch sends: real steps on 2 gloo ranks, byte for byte.

One launch. A tiny fp32 Llama runs one optimizer step of two micro-batches under `FSDP2Manager` in
five layouts: FSDP with its default unit heuristic, with every unit resharded after forward and with
none, and TP without and with sequence parallelism (and a tiny Qwen3-MoE under transformers' own TP
plan, without and with sequence parallelism); and the second step of a two-stage `AutoPipeline`
under 1F1B and interleaved 1F1B (the first also exchanges the stages' shapes). A dispatch mode records
every collective a step issues (FSDP2's c10d calls, DTensor's functional ones, the stages' sends) with
the bytes a rank sends under the ring algorithm, by mesh axis; the test holds them equal to
``estimate_peak(plan).communication`` for the same job (a pipeline rank's own). On 4 ranks (extended):
HSDP, TP beside FSDP with sequence parallelism, and two pipeline stages each sharded by FSDP.

The recording ends after the optimizer step, which reads the gradients: the ``Partial`` gradients of
TP's replicated norms under sequence parallelism are all-reduced by then (by FSDP's reduction, or when
the step reads them), as the plan counts them. Left out: context parallelism (a CPU mesh runs the CPU
runtime's ring kernel, not torch's) and expert parallelism (the plan prices routing's expectation).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from automodel_testing import run_distributed

pytestmark = pytest.mark.distributed

JOBS: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    ("fsdp", {}, {}),
    ("fsdp, every unit resharded", {}, {"reshard_after_forward": True}),
    ("fsdp, none resharded", {}, {"reshard_after_forward": False}),
    ("tp2", {"tp_size": 2}, {}),
    ("tp2+sp", {"tp_size": 2}, {"sequence_parallel": True}),
    # transformers' own plan (Qwen3-MoE: attention's input as one DTensor, the sparse MLP as declared)
    ("tp2, qwen3_moe", {"tp_size": 2}, {"family": "qwen3_moe"}),
    ("tp2+sp, qwen3_moe", {"tp_size": 2}, {"family": "qwen3_moe", "sequence_parallel": True}),
]
MICRO_BATCHES, ROWS, SEQ = 2, 2, 16


class _Traffic(TorchDispatchMode):
    """Bytes one rank sends per kind of collective and group name, as a ring runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[tuple[str, str], float] = {}

    def _add(self, kind: str, group: Any, sent: float) -> None:
        name = group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name
        self.sent[(kind, name)] = self.sent.get((kind, name), 0.0) + sent

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns into plain ops and collectives
        packet, c10d, functional = func._overloadpacket, torch.ops.c10d, torch.ops._c10d_functional
        if packet is c10d._allgather_base_:  # (output, input, group)
            size = args[0].numel() // args[1].numel()
            self._add("all_gather", args[2], (size - 1) * _bytes(args[1]))
        elif packet is c10d._reduce_scatter_base_:  # (output, input, group, ...)
            size = args[1].numel() // args[0].numel()
            self._add("reduce_scatter", args[2], (size - 1) * _bytes(args[0]))
        elif packet is c10d.allreduce_:  # (tensors, group, ...)
            size = dist.ProcessGroup.unbox(args[1]).size()
            self._add("all_reduce", args[1], 2 * (size - 1) / size * sum(_bytes(t) for t in args[0]))
        elif packet is functional.all_gather_into_tensor:  # (input, group size, group name)
            self._add("all_gather", args[2], (args[1] - 1) * _bytes(args[0]))
        elif packet is functional.reduce_scatter_tensor:  # (input, op, group size, group name)
            self._add("reduce_scatter", args[3], (args[2] - 1) / args[2] * _bytes(args[0]))
        elif packet is c10d.send:  # (tensors, group, peer, tag)
            self._add("send", args[1], sum(_bytes(t) for t in args[0]))
        elif packet is functional.all_reduce:  # (input, op, group name)
            size = dist.distributed_c10d._resolve_process_group(args[2]).size()
            self._add("all_reduce", args[2], 2 * (size - 1) / size * _bytes(args[0]))
        return func(*args, **kwargs)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _one_job(sizes: dict[str, int], fields: dict[str, Any]) -> dict[str, dict[str, float]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from transformers import AutoModelForCausalLM

    from automodel_distributed import FSDP2Manager
    from automodel_distributed.config import FSDP2Config
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_planner import PlanInput
    from automodel_planner.estimate import estimate_peak
    from automodel_testing import build_tiny_model, make_batch

    fields = dict(fields)
    family = fields.pop("family", "llama")
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    config = FSDP2Config(mp_policy=fp32, defer_fsdp_grad_sync=True, **fields)
    ctx = MeshContext.build(config, ParallelismSizes(**sizes))
    axes = {}
    for axis in (*(ctx.device_mesh.mesh_dim_names or ()), "dp_shard_cp"):  # and FSDP's flattened one
        with contextlib.suppress(KeyError, RuntimeError):
            axes[ctx.device_mesh[axis].get_group().group_name] = axis
    manager = FSDP2Manager(config, ctx.device_mesh)
    model = manager.parallelize(build_tiny_model(family))
    batch = make_batch(model.config.vocab_size, MICRO_BATCHES * ROWS, SEQ, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    traffic = _Traffic()
    with traffic:
        for micro in range(MICRO_BATCHES):
            manager.set_gradient_sync(model, is_last_microbatch=micro == MICRO_BATCHES - 1)
            rows = slice(micro * ROWS, (micro + 1) * ROWS)
            logits = model(input_ids=batch["input_ids"][rows]).logits
            # Every position's loss, as transformers' causal LM loss takes it (labels shifted, padded).
            sharded = isinstance(logits, DTensor)
            with loss_parallel() if sharded else contextlib.nullcontext():
                vocab = logits.shape[-1]
                F.cross_entropy(logits.reshape(-1, vocab), batch["labels"][rows].reshape(-1)).backward()
        optimizer.step()  # reads the gradients: TP's replicated ones are reduced by then
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plan = PlanInput(
        model=meta, model_config=model.config, layout=ctx.layout, strategy=config, dtype=torch.float32,
        seq_len=SEQ, micro_batch_size=ROWS, accumulation=MICRO_BATCHES,
    )  # fmt: skip
    observed: dict[str, float] = {}
    for (kind, group), sent in traffic.sent.items():
        key = f"{kind} over {axes.get(group, group)}"
        observed[key] = observed.get(key, 0.0) + sent
    return {"observed": observed, "planned": dict(estimate_peak(plan).communication)}


def _pipeline_job(schedule: str, dp_shard: int = 1) -> dict[str, dict[str, float]]:
    """Two stages of a 4-layer tiny Llama, 2 micro-batches of 2 rows; FSDP over ``dp_shard`` ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from automodel_distributed import FSDP2Manager
    from automodel_distributed.config import FSDP2Config
    from automodel_mesh import MeshContext, MeshKind, ParallelismSizes, traffic_of
    from automodel_pipelining import AutoPipeline, PipelineConfig
    from automodel_planner import PlanInput
    from automodel_planner.estimate import _planned_ranks
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    pp = dist.get_world_size() // dp_shard
    ctx = MeshContext.build(MeshKind.FSDP2, ParallelismSizes(pp_size=pp))
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=MICRO_BATCHES * ROWS, pp_microbatch_size=ROWS)
    strategy = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    )
    manager = FSDP2Manager(strategy, ctx.device_mesh)
    model = build_tiny_model("llama", num_hidden_layers=4)
    pipe = AutoPipeline.from_config(config, ctx)
    parallelize = (lambda stage, **_: manager.parallelize(stage)) if dp_shard > 1 else None
    pipe.build(
        build_tiny_model("llama", num_hidden_layers=4), loss_fn=causal_lm_loss, parallelize_fn=parallelize
    )
    batch = make_batch(model.config.vocab_size, MICRO_BATCHES * ROWS, SEQ, seed=5)
    axes = {}
    for axis in ("pp", "dp_shard_cp"):
        with contextlib.suppress(KeyError, RuntimeError):
            axes[ctx.device_mesh[axis].get_group().group_name] = axis
    inputs = {"target": batch["labels"], "position_ids": batch["position_ids"]}
    pipe.step(batch["input_ids"], **inputs)  # the first step also exchanges the stages' shapes
    traffic = _Traffic()
    with traffic:
        pipe.step(batch["input_ids"], **inputs)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plan = PlanInput(
        model=meta, model_config=model.config, layout=ctx.layout, strategy=strategy,
        dtype=torch.float32, seq_len=SEQ, micro_batch_size=ROWS, pipeline=config,
    )  # fmt: skip
    observed = {f"{k} over {axes.get(g, g)}": v for (k, g), v in traffic.sent.items()}
    _, _, terms, ranks = _planned_ranks(plan, None)  # this pipeline rank's, not the largest's
    planned = traffic_of(c for term in terms for c in term.collectives(ranks[pipe.pp_rank]))
    return {"observed": observed, "planned": dict(planned)}


def _jobs(
    jobs: list[tuple[str, dict[str, int], dict[str, Any]]], schedules: tuple[str, ...], dp_shard: int = 1
) -> dict[str, dict[str, dict[str, float]]]:
    warnings.simplefilter("ignore")  # the tiny model's plan, FSDP's view-output, the short schedules'
    out = {label: _one_job(sizes, fields) for label, sizes, fields in jobs}
    return out | {f"pp, {schedule}": _pipeline_job(schedule, dp_shard) for schedule in schedules}


def _by_mechanism(observed: dict[str, float]) -> dict[str, float]:
    """FSDP's all-gathers and reduce-scatters, HSDP's all-reduces, and TP's collectives together."""
    names = {"dp_shard": "FSDP", "dp_shard_cp": "FSDP", "dp_replicate": "HSDP", "tp": "TP", "pp": "PP"}
    out: dict[str, float] = {}
    for key, sent in observed.items():
        kind, axis = key.split(" over ")
        name = "TP" if axis == "tp" else f"{names.get(axis, axis)} {kind}"
        out[name] = out.get(name, 0.0) + sent
    return out


def _check(per_rank: list[dict[str, dict[str, dict[str, float]]]]) -> None:
    for rank, results in enumerate(per_rank):
        for label, job in results.items():
            planned = job["planned"]
            expected = {
                "FSDP all_gather": sum(v for k, v in planned.items() if k.startswith("FSDP all-gather")),
                "FSDP reduce_scatter": planned.get("FSDP reduce-scatter", 0),
                "HSDP all_reduce": planned.get("HSDP all-reduce", 0),
                "TP": sum(v for k, v in planned.items() if k.startswith("TP ")),
                "PP send": planned.get("PP send/recv", 0),
            }
            expected = {k: v for k, v in expected.items() if v}
            observed = _by_mechanism(job["observed"])
            assert observed.keys() == expected.keys(), (rank, label, observed, planned)
            for name, sent in observed.items():
                # The plan rounds each collective's bytes down to an int.
                assert abs(sent - expected[name]) < 4, (rank, label, name, sent, expected[name], planned)


def test_the_planned_traffic_is_what_torch_sends_in_each_layout() -> None:
    _check(run_distributed(_jobs, 2, JOBS, ("1f1b", "interleaved_1f1b"), timeout_s=600))


@pytest.mark.extended
def test_the_planned_traffic_is_what_torch_sends_under_hsdp_and_tp_with_fsdp() -> None:
    jobs = [
        ("hsdp", {"dp_replicate_size": 2}, {}),
        ("tp2 x fsdp2 + sp", {"tp_size": 2}, {"sequence_parallel": True}),
    ]
    _check(run_distributed(_jobs, 4, jobs, ("1f1b",), 2, timeout_s=600))
