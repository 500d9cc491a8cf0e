"""AutoPipeline parity on real gloo ranks: every schedule on 2 and 4 pipeline ranks, PP x FSDP2, PP x TP
and PP x FSDP2 x TP, for tiny Llama and Qwen2 models with more layers than stages.

Each case builds the mesh, splits a tiny model with `AutoPipeline`, runs a step on a batch and compares
the mean microbatch loss and every parameter gradient with the unsplit transformers model on the same
(global) batch, then trains a few AdamW steps side by side and compares the losses. One launch runs
every case of its world size; the test process asserts fp32 parity (grads 1e-5, losses 1e-4) and that
the stages together own every parameter of the model exactly once per pipeline.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing import run_distributed

pytestmark = pytest.mark.distributed

GRAD_ATOL = 1e-5
LOSS_ATOL = 1e-4
SEQ = 8


@dataclass(frozen=True)
class Case:
    """One pipeline setup; ``sizes`` are `ParallelismSizes` fields (dp is inferred from the world size)."""

    label: str
    family: str
    schedule: str
    layers: int
    batch: int  # rows per data-parallel replica (pp_batch_size)
    microbatch: int = 1
    sizes: dict[str, int] = field(default_factory=dict)  # {}: pure pipeline over every rank
    fsdp: bool = False  # parallelize each stage with FSDP2Manager (FSDP over dp, TP over tp)
    fsdp_fields: dict[str, Any] = field(default_factory=dict)  # extra FSDP2Config fields
    per_module_fsdp: bool = False  # fully_shard each module with parameters on its own (no FSDP stage root)
    patch_nosync: bool = False  # patch_stage_backward_maybe_with_nosync
    fqns: tuple[tuple[str, ...], ...] | None = None  # module_fqns_per_model_part
    defer_fsdp_grad_sync: bool = True
    scale_grads_in_schedule: bool = False
    layers_per_stage: int | None = None
    csv: bool = False
    pp_seq_len: int | None = None
    balance_stages: bool = False
    vocab: int | None = None  # vocab_size override (a heavier LM head)
    steps: int = 3
    masked_ce: bool = False  # the loss through MaskedCrossEntropy, which takes DTensor logits as they are


@dataclass
class Report:
    label: str
    loss: float = 0.0
    grads: float = 0.0
    worst: str = ""
    steps: float = 0.0
    eval: float = 0.0
    reduce_scatters: int = 0
    step_losses: list[float] = field(default_factory=list)
    reference_step_losses: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    reference_names: list[str] = field(default_factory=list)
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    stage_ids: list[int] = field(default_factory=list)
    kept_outputs: int = 0  # last-stage outputs torch still holds after the steps (none: nobody reads them)
    dtensor_logits: int = 0  # micro-batches whose logits reached the loss as a DTensor (not gathered)
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------ on the ranks


def _csv_file(pp_size: int, n_microbatches: int) -> str:
    """A looped-BFS style compute-only schedule for 2 stages per rank (stages r and r + W)."""
    rows = []
    for rank in range(pp_size):
        first, second = rank, rank + pp_size
        row = [f"{first}F{m}" for m in range(n_microbatches)]
        row += [f"{second}F{m}" for m in range(n_microbatches)]
        row += [f"{second}B{m}" for m in range(n_microbatches)]
        row += [f"{first}B{m}" for m in range(n_microbatches)]
        rows.append(",".join(row))
    handle, path = tempfile.mkstemp(suffix=".csv", prefix="pp-schedule-")
    with os.fdopen(handle, "w") as out:
        out.write("\n".join(rows) + "\n")
    return path


def _fully_shard_each_module(ctx: Any) -> Any:
    """FSDP on every parameter-holding module of a stage, with no FSDP root on the stage itself."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)

    def parallelize(stage: torch.nn.Module, **_mesh_kwargs: Any) -> torch.nn.Module:
        inner = stage.model  # type: ignore[union-attr]
        # Other stages' layers are parameter-free stand-ins in the full-length container.
        units = [*inner.layers, inner.embed_tokens, inner.norm, stage.lm_head]
        for unit in units:
            if unit is not None and next(unit.parameters(), None) is not None:
                fully_shard(unit, mesh=ctx.submesh("dp_shard_cp"), mp_policy=mp)
        return stage

    return parallelize


def _parallelize_fn(case: Case, ctx: Any) -> Any:
    if case.per_module_fsdp:
        return _fully_shard_each_module(ctx)
    if not case.fsdp and ctx.tp_size == 1:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed import FSDP2Config, FSDP2Manager

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    manager = FSDP2Manager(FSDP2Config(mp_policy=mp, **case.fsdp_fields), ctx.device_mesh)

    def parallelize(stage: torch.nn.Module, **_mesh_kwargs: Any) -> torch.nn.Module:
        return manager.parallelize(stage)

    return parallelize


class _ShiftedMaskedCE(torch.nn.Module):
    """`causal_lm_loss` through `MaskedCrossEntropy`; counts the DTensor logits it is handed."""

    def __init__(self) -> None:
        from automodel_distributed.loss import MaskedCrossEntropy

        super().__init__()
        self.ce = MaskedCrossEntropy(reduction="mean")
        self.accepts_dtensor_logits = self.ce.accepts_dtensor_logits
        self.dtensor_logits = 0

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from automodel_modules import is_dtensor

        self.dtensor_logits += int(is_dtensor(logits))
        return self.ce(logits[:, :-1], labels[:, 1:].to(logits.device))


def _run_case(case: Case) -> Report:
    from automodel_mesh import MeshContext, MeshKind, ParallelismSizes
    from automodel_pipelining import AutoPipeline, PipelineConfig
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch, normalize_fqn, to_full

    start = time.perf_counter()
    sizes = case.sizes or {"pp_size": dist.get_world_size()}
    ctx = MeshContext.build(MeshKind.FSDP2, ParallelismSizes(**sizes))
    dp_size = ctx.dp_size or 1
    dp_rank = ctx.submesh("dp").get_local_rank() if dp_size > 1 else 0
    tp_rank = ctx.submesh("tp").get_local_rank() if ctx.tp_size > 1 else 0
    overrides = {"num_hidden_layers": case.layers}
    if case.vocab is not None:
        overrides["vocab_size"] = case.vocab
    reference = build_tiny_model(case.family, seed=0, **overrides)
    model = build_tiny_model(case.family, seed=0, **overrides)
    batch = make_batch(reference.config.vocab_size, case.batch * dp_size, SEQ, seed=1)
    rows = slice(dp_rank * case.batch, (dp_rank + 1) * case.batch)
    local = {k: v[rows] for k, v in batch.items()}

    n_mb = case.batch // case.microbatch
    csv_path = _csv_file(ctx.pp_size, n_mb) if case.csv else None
    config = PipelineConfig(
        pp_schedule=case.schedule,
        pp_schedule_csv=csv_path,
        pp_batch_size=case.batch,
        pp_microbatch_size=case.microbatch,
        layers_per_stage=case.layers_per_stage,
        scale_grads_in_schedule=case.scale_grads_in_schedule,
        pp_seq_len=case.pp_seq_len,
        patch_stage_backward_maybe_with_nosync=case.patch_nosync,
        module_fqns_per_model_part=case.fqns,
        balance_stages=case.balance_stages,
    )
    pipe = AutoPipeline.from_config(config, ctx, defer_fsdp_grad_sync=case.defer_fsdp_grad_sync)
    loss_fn = _ShiftedMaskedCE() if case.masked_ce else causal_lm_loss
    pipe.build(model, loss_fn=loss_fn, parallelize_fn=_parallelize_fn(case, ctx))
    dp_group = ctx.get_group("dp") if dp_size > 1 else None

    def pipeline_step() -> float:
        for part in pipe.parts:
            part.zero_grad(set_to_none=True)
        losses = pipe.step(local["input_ids"], target=local["labels"], position_ids=local["position_ids"])
        if torch.is_grad_enabled() and not case.scale_grads_in_schedule:
            pipe.scale_grads()
        loss = pipe.mean_loss(losses)
        if dp_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
        return float(loss.item())

    def reference_step() -> float:
        reference.zero_grad(set_to_none=True)
        logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = causal_lm_loss(logits, batch["labels"])
        if torch.is_grad_enabled():
            loss.backward()
        return float(loss.item())

    def counted_pipeline_step() -> tuple[float, int]:
        # Count FSDP's gradient reduce-scatters to see when gradients are synchronised.
        original, calls = dist.reduce_scatter_single, [0]

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counting
        try:
            return pipeline_step(), calls[0]
        finally:
            dist.reduce_scatter_single = original

    report = Report(label=case.label, pp_rank=pipe.pp_rank, dp_rank=dp_rank, tp_rank=tp_rank)
    report.stage_ids = list(pipe.stage_ids)
    report.reference_names = sorted(normalize_fqn(n) for n, _ in reference.named_parameters())
    params = [p for part in pipe.parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_grads: dict[str, torch.Tensor] = {}
    for step in range(case.steps):
        if step == case.steps - 1:  # evaluate (forward only), then train on: eval -> train switch
            with torch.no_grad():
                report.eval = abs(pipeline_step() - reference_step())
        if step == 0:
            loss, report.reduce_scatters = counted_pipeline_step()
        else:
            loss = pipeline_step()
        ref_loss = reference_step()
        report.step_losses.append(loss)
        report.reference_step_losses.append(ref_loss)
        if step == 0:
            report.loss = abs(loss - ref_loss)
            ref_grads = {normalize_fqn(n): p.grad.detach().clone() for n, p in reference.named_parameters()}
            for part in pipe.parts:
                for name, param in part.named_parameters():
                    key = normalize_fqn(name)
                    report.names.append(key)
                    if param.grad is None:
                        report.grads, report.worst = float("inf"), f"{key} (no grad)"
                        continue
                    diff = float((to_full(param.grad) - ref_grads[key]).abs().max())
                    if diff >= report.grads:
                        report.grads, report.worst = diff, key
        opt.step()
        ref_opt.step()
    report.steps = max(
        abs(a - b) for a, b in zip(report.step_losses, report.reference_step_losses, strict=True)
    )
    report.kept_outputs = sum(len(stage.output_chunks) for stage in pipe._stages)
    report.dtensor_logits = loss_fn.dtensor_logits if isinstance(loss_fn, _ShiftedMaskedCE) else 0
    if csv_path is not None:
        os.unlink(csv_path)
    report.seconds = time.perf_counter() - start
    return report


def run_cases(cases: list[Case]) -> list[Report]:
    """Every case on this rank; the results are compared in the test process."""
    torch.manual_seed(0)
    out = []
    for case in cases:
        out.append(_run_case(case))
        dist.barrier()
    return out


# ------------------------------------------------------------------------------------------ the tests

SCHEDULES_2 = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv",
    "dualpipev",
)


def _check(results: list[list[Report]], cases: list[Case]) -> list[str]:
    """Assert parity and full, unique parameter ownership; return one line per case."""
    lines = []
    problems = []
    for index, case in enumerate(cases):
        reports = [rank_reports[index] for rank_reports in results]
        worst = max(reports, key=lambda r: r.grads)
        loss = max(r.loss for r in reports)
        steps = max(r.steps for r in reports)
        # Every pipeline (one per dp x tp coordinate) owns each parameter exactly once.
        by_replica: dict[tuple[int, int], list[str]] = {}
        for r in reports:
            by_replica.setdefault((r.dp_rank, r.tp_rank), []).extend(r.names)
        for replica, names in by_replica.items():
            if sorted(names) != reports[0].reference_names:
                missing = sorted(set(reports[0].reference_names) - set(names))
                extra = sorted(
                    n for n in set(names) if names.count(n) > 1 or n not in reports[0].reference_names
                )
                problems.append(
                    f"{case.label}: replica {replica} owns missing={missing[:4]} extra={extra[:4]}"
                )
        if any(r.kept_outputs for r in reports):
            problems.append(
                f"{case.label}: the last stage kept {max(r.kept_outputs for r in reports)} outputs"
            )
        if not worst.grads <= GRAD_ATOL:
            problems.append(f"{case.label}: grads differ by {worst.grads:.3g} ({worst.worst}) > {GRAD_ATOL}")
        evaluation = max(r.eval for r in reports)
        if not evaluation <= LOSS_ATOL:
            problems.append(f"{case.label}: evaluation loss differs by {evaluation:.3g}")
        if not loss <= LOSS_ATOL or not steps <= LOSS_ATOL:
            problems.append(
                f"{case.label}: losses differ by {loss:.3g} / steps {steps:.3g}: "
                f"{worst.step_losses} vs {worst.reference_step_losses}"
            )
        stages = sorted({(r.pp_rank, tuple(r.stage_ids)) for r in reports})
        lines.append(
            f"{case.label}: loss {loss:.2e} grads {worst.grads:.2e} steps {steps:.2e} eval {evaluation:.2e} "
            f"stages {stages} "
            f"{max(r.seconds for r in reports):.1f}s"
        )
    print("\n".join(lines))
    assert not problems, "\n".join(problems)
    return lines


def test_every_schedule_on_two_pipeline_ranks() -> None:
    cases = []
    for schedule in SCHEDULES_2:
        cases.append(Case(f"pp2 {schedule} llama-6", "llama", schedule, layers=6, batch=4))
    cases += [
        Case(
            "pp2 1f1b qwen2-5 scaled-in-schedule",
            "qwen2",
            "1f1b",
            layers=5,
            batch=4,
            scale_grads_in_schedule=True,
        ),
        Case(
            "pp2 interleaved_1f1b qwen2-4 mb2", "qwen2", "interleaved_1f1b", layers=4, batch=4, microbatch=2
        ),
        Case("pp2 zbv qwen2-4", "qwen2", "zbv", layers=4, batch=4),
        Case(
            "pp2 dualpipev qwen2-6 scaled",
            "qwen2",
            "dualpipev",
            layers=6,
            batch=4,
            scale_grads_in_schedule=True,
        ),
        Case("pp2 csv llama-4", "llama", "1f1b", layers=4, batch=2, csv=True),
        Case(
            "pp2 looped_bfs layers_per_stage=1", "llama", "looped_bfs", layers=4, batch=2, layers_per_stage=1
        ),
        Case("pp2 gpipe static pp_seq_len", "qwen2", "gpipe", layers=3, batch=2, pp_seq_len=SEQ),
        # A 2048-token head is 3.6 layers of this model's matmul work: 5 layers, then 1 and the head.
        Case(
            "pp2 1f1b llama-6 balance_stages",
            "llama",
            "1f1b",
            layers=6,
            batch=2,
            balance_stages=True,
            vocab=2048,
        ),
        Case(
            "pp2 1f1b llama-4 explicit uneven split",
            "llama",
            "1f1b",
            layers=4,
            batch=2,
            fqns=(
                ("model.embed_tokens", "model.layers.0", "model.rotary_emb"),
                (
                    "model.layers.1",
                    "model.layers.2",
                    "model.layers.3",
                    "model.norm",
                    "lm_head",
                    "model.rotary_emb",
                ),
            ),
        ),
    ]
    results = run_distributed(run_cases, 2, cases, timeout_s=240)
    _check(results, cases)
    balanced = next(i for i, c in enumerate(cases) if c.balance_stages)
    layers_per_rank = [
        len({n.split(".")[2] for n in rank[balanced].names if n.startswith("model.layers.")})
        for rank in results
    ]
    assert layers_per_rank == [5, 1], layers_per_rank


@pytest.mark.extended  # the schedules' mechanism is proved on two ranks above
def test_every_schedule_on_four_ranks_and_pp_x_fsdp_x_tp() -> None:
    cases = [Case(f"pp4 {s} llama-9", "llama", s, layers=9, batch=8) for s in SCHEDULES_2]
    cases += [
        Case("pp4 1f1b qwen2-6", "qwen2", "1f1b", layers=6, batch=4),
        Case(
            "pp2xfsdp2 1f1b llama-4 activation-checkpointing",
            "llama",
            "1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2},
            fsdp=True,
            fsdp_fields={"activation_checkpointing": True},
        ),
        Case(
            "pp2xfsdp2 gpipe qwen2-4 deferred",
            "qwen2",
            "gpipe",
            layers=4,
            batch=2,
            sizes={"pp_size": 2},
            fsdp=True,
        ),
        Case(
            "pp2xfsdp2 gpipe qwen2-4 reduce-per-microbatch",
            "qwen2",
            "gpipe",
            layers=4,
            batch=2,
            sizes={"pp_size": 2},
            fsdp=True,
            defer_fsdp_grad_sync=False,
        ),
        Case(
            "pp2xfsdp2 interleaved_1f1b llama-5",
            "llama",
            "interleaved_1f1b",
            layers=5,
            batch=2,
            sizes={"pp_size": 2},
            fsdp=True,
        ),
        Case("pp2xfsdp2 zbv qwen2-4", "qwen2", "zbv", layers=4, batch=4, sizes={"pp_size": 2}, fsdp=True),
        Case(
            "pp2xfsdp2 1f1b llama-4 per-module FSDP",
            "llama",
            "1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2},
            per_module_fsdp=True,
        ),
        Case(
            "pp2xfsdp2 1f1b llama-4 per-module FSDP nosync-patched",
            "llama",
            "1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2},
            per_module_fsdp=True,
            patch_nosync=True,
        ),
        Case("pp2xtp2 1f1b llama-4", "llama", "1f1b", layers=4, batch=2, sizes={"pp_size": 2, "tp_size": 2}),
        Case(
            "pp2xtp2 interleaved_1f1b qwen2-4",
            "qwen2",
            "interleaved_1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2, "tp_size": 2},
        ),
        # Sequence parallelism: stages send and receive each rank's slice of the sequence (static shapes
        # are the slices: a whole-sequence send would not fit them). Llama: a registered Megatron-style
        # plan; Mixtral: the form derived from transformers' plan, whose stages cut their last output.
        Case(  # and the loss takes the last stage's logits vocab-sharded (no rank gathers them)
            "pp2xtp2+sp 1f1b llama-4 static, MaskedCrossEntropy",
            "llama",
            "1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2, "tp_size": 2},
            fsdp=True,
            fsdp_fields={"sequence_parallel": True},
            pp_seq_len=SEQ,
            masked_ce=True,
        ),
        Case(
            "pp2xtp2+sp interleaved_1f1b mixtral-4 static",
            "mixtral",
            "interleaved_1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2, "tp_size": 2},
            fsdp=True,
            fsdp_fields={"sequence_parallel": True},
            pp_seq_len=SEQ,
        ),
    ]
    results = run_distributed(run_cases, 4, cases, timeout_s=300)
    _check(results, cases)
    masked = cases.index(next(c for c in cases if c.masked_ce))
    last_stage = [r[masked] for r in results if r[masked].pp_rank == 1]
    assert last_stage and all(r.dtensor_logits > 0 for r in last_stage), last_stage
    # defer_fsdp_grad_sync: one reduce-scatter per FSDP unit and step, or one per unit and microbatch
    # (except the input embedding, whose gradient FSDP reduces when the stage is finalised).
    deferred = [r[cases.index(next(c for c in cases if c.label.endswith("deferred")))] for r in results]
    eager = [r[cases.index(next(c for c in cases if c.label.endswith("per-microbatch")))] for r in results]
    n_mb = 2
    for d, e in zip(deferred, eager, strict=True):
        assert d.reduce_scatters > 0, "FSDP reduced no gradients"
        assert d.reduce_scatters < e.reduce_scatters <= n_mb * d.reduce_scatters, (d, e)
        if d.pp_rank == 1:  # last stage: no embedding
            assert e.reduce_scatters == n_mb * d.reduce_scatters, (d.reduce_scatters, e.reduce_scatters)
    # patch_stage_backward_maybe_with_nosync: FSDP modules inside a stage (no FSDP root) defer too.
    plain = [r[cases.index(next(c for c in cases if c.label.endswith("per-module FSDP")))] for r in results]
    patched = [r[cases.index(next(c for c in cases if c.label.endswith("nosync-patched")))] for r in results]
    for p, q in zip(plain, patched, strict=True):
        assert 0 < q.reduce_scatters < p.reduce_scatters == n_mb * q.reduce_scatters, (p, q)


@pytest.mark.extended
def test_pp_x_fsdp_x_tp_on_eight_ranks() -> None:
    cases = [
        Case(
            "pp2xfsdp2xtp2 1f1b llama-4",
            "llama",
            "1f1b",
            layers=4,
            batch=2,
            sizes={"pp_size": 2, "tp_size": 2},
            fsdp=True,
            steps=2,
        ),
    ]
    results = run_distributed(run_cases, 8, cases, timeout_s=300)
    _check(results, cases)
