"""The model matrix: every decoder family transformers ships x every layout, through the public API.

Families come from transformers' own registry (`automodel_testing.families.decoder_families`), with
tiny configs derived from each family's defaults (`automodel_testing.tiny.derive_tiny_config`). For each
family the parent process builds the model, checks that plain transformers runs it (forward and
backward; a family transformers itself cannot run is reported as such and not launched) and saves it
with ``save_pretrained``. Every layout then runs in one launch of real gloo ranks; on each rank, for
each family:

- a meta model (``AutoModelForCausalLM.from_config`` on the meta device) goes through
  `instantiate_infrastructure` and `apply_model_infrastructure(..., load_base_model=True)` with the
  checkpoint;
- the reference is ``from_pretrained`` of the same checkpoint in one process (with the same LoRA
  adapters for the LoRA layouts, their random ``A`` matrices copied from the ranks);
- on the same global batch (4 rows of 16 tokens, labels pre-shifted): the first logits, the first
  loss, the first gradient norm, and the losses after each of `STEPS` SGD steps must equal the
  reference within `ATOL` (fp32).

A case either **works** (every check passes), is **refused** (every rank raised the same `ValueError`
from the public API: a clear error before any collective), or **fails** (anything else: another
exception, a difference, a refusal on some ranks only). A failure fails the test: there is no silent
difference. The default run (``distributed`` marker) runs `FAST_FAMILIES` under every layout, one launch
per layout; ``uvx nox -s models`` runs every family (``models`` marker) and writes the JSON that
``tools/models_doc.py`` turns into docs/models.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing import DistributedRunError, run_distributed
from automodel_testing.matrix import (
    Row,
    assert_no_failure,
    merge_ranks,
    prepare_checkpoints,
    read_progress,
    record_families,
    refusal,
)

ROWS, SEQ, STEPS, LR = 4, 16, 2, 0.1
ATOL = 1e-5
"""fp32 tolerance of logits, losses and the gradient norm (observed differences are ~1e-7)."""
REPORT_ENV = "AUTOMODEL_MODEL_MATRIX_REPORT"
"""Where the ``models`` session's run writes its JSON (default: build/models/matrix.json)."""
ROOT = pathlib.Path(__file__).resolve().parents[2]

FAST_FAMILIES: tuple[str, ...] = (
    "llama",  # the plain decoder
    "gemma2",  # scaled embeddings, soft-capped logits and attention, sliding/global layers
    "cohere2",  # per-layer sliding/global attention with rotary only on sliding layers
    "olmo3",  # per-layer-type rotary embeddings
    "deepseek_v3",  # MLA attention, grouped top-k routing with a correction-bias buffer, dense+MoE
    "gpt2",  # Conv1D projections, learned positions, tied-only naming
    "qwen3_next",  # linear-attention layers beside full attention, shared experts
    "granite",  # embedding, residual and logit multipliers
)
"""Families of the default run's slice: one of each mechanism the fixes of the matrix are about."""


@dataclass(frozen=True)
class Layout:
    """One way of sharding, as the public API's configs express it."""

    name: str
    world_size: int
    sizes: dict[str, int] = field(default_factory=dict)
    """`ParallelismSizes` fields."""
    sequence_parallel: bool = False
    pp_schedule: str | None = None
    lora: bool = False
    activation_checkpointing: bool = False


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("fsdp2", 2),
        Layout("hsdp", 4, {"dp_replicate_size": 2}),
        Layout("tp", 2, {"tp_size": 2}),
        Layout("tp_sp", 2, {"tp_size": 2}, sequence_parallel=True),
        Layout("cp", 2, {"cp_size": 2}),
        Layout("pp_1f1b", 2, {"pp_size": 2}, pp_schedule="1f1b"),
        Layout("pp_interleaved", 2, {"pp_size": 2}, pp_schedule="interleaved_1f1b"),
        Layout("lora_fsdp2", 2, lora=True),
        Layout("lora_tp", 2, {"tp_size": 2}, lora=True),
        Layout("ac", 2, activation_checkpointing=True),
    )
}


# ------------------------------------------------------------------------------------ checkpoints


def _quiet() -> contextlib.AbstractContextManager[None]:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("automodel_infra").setLevel(logging.WARNING)
    return warnings.catch_warnings(action="ignore")


def prepare_family(model_type: str, root: pathlib.Path) -> dict[str, Any]:
    """Build the tiny model of ``model_type``, check transformers runs it, and save it.

    Returns:
        ``{"path": folder}``, or ``{"reference_error": why}`` when transformers itself cannot build or
        run the tiny model (forward and backward in one process).
    """
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    with _quiet():
        try:
            config = derive_tiny_config(model_type)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1234)
                model = AutoModelForCausalLM.from_config(config)
            ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids).loss.backward()
        except Exception as exc:
            return {"reference_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        path = root / model_type
        model.save_pretrained(path)
    return {"path": str(path)}


# ------------------------------------------------------------------------------------ rank side


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).unsqueeze(0).expand(ROWS, -1).contiguous()
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].contiguous(), "position_ids": positions}


def _token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropies (labels already shifted); DTensor logits are gathered."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum"
    )


class _CapturingLoss(torch.nn.Module):
    """The pipeline's last-stage loss: token sum / denominator; keeps each microbatch's logits."""

    def __init__(self, denominator: float) -> None:
        super().__init__()
        self.denominator = denominator
        self.logits: list[torch.Tensor] = []

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.detach().float().clone())
        return _token_sum(logits, labels) / self.denominator


@dataclass
class _Axes:
    """This rank's place in the layout (sizes and coordinates of the mesh axes the checks need)."""

    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    tp_rank: int
    pp_size: int

    @property
    def averaging_ranks(self) -> int:
        """Ranks FSDP averages gradients over (data parallel x context parallel)."""
        return self.dp_size * self.cp_size


def _axes(ctx: Any) -> _Axes:
    def coordinate(name: str) -> int:
        return (
            ctx.submesh(name).get_local_rank() if ctx.has_axis(name) and ctx.submesh(name).size() > 1 else 0
        )

    return _Axes(
        dp_size=ctx.dp_size or 1,
        dp_rank=coordinate("dp"),
        cp_size=ctx.cp_size,
        cp_rank=coordinate("cp"),
        tp_rank=coordinate("tp"),
        pp_size=ctx.pp_size,
    )


def _world_sum(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return float(value)


def _reference(path: str, lora: bool) -> Any:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.train()
    if lora:
        from automodel_peft import apply_lora_to_linear_modules

        apply_lora_to_linear_modules(ref, _peft_config())
    return ref


def _peft_config() -> Any:
    from automodel_peft import PeftConfig

    return PeftConfig(match_all_linear=True, dim=4, alpha=8)


def _copy_adapters(parts: list[Any], ref: Any) -> None:
    """Give the reference the ranks' (random, rank-0-seeded) LoRA ``A`` matrices."""
    from automodel_testing import normalize_fqn, to_full

    local = {
        normalize_fqn(n): to_full(p) for part in parts for n, p in part.named_parameters() if "lora_" in n
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for item in gathered:
            for name, tensor in item.items():
                ref_params[name].copy_(tensor)


def _grad_square_sum(parts: list[Any], axes: _Axes) -> float:
    """Sum of squared gradient entries over the whole model (each full gradient counted once)."""
    from automodel_testing import to_full

    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        for param in part.parameters():
            if param.grad is not None:
                total += to_full(param.grad).double().square().sum()
    counted = axes.dp_rank == 0 and axes.cp_rank == 0 and axes.tp_rank == 0
    return _world_sum(total if counted else torch.zeros((), dtype=torch.float64))


def _strategy(layout: Layout) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config

    return FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        sequence_parallel=layout.sequence_parallel,
        activation_checkpointing=layout.activation_checkpointing,
    )


def _run_family(layout: Layout, ctx: Any, path: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_pipelining.config import PipelineConfig

    torch.manual_seed(0)
    axes = _axes(ctx)
    batch = _batch(AutoConfig.from_pretrained(path).vocab_size)
    tokens = ROWS * SEQ
    denominator = tokens / axes.averaging_ranks
    rows_per_dp = ROWS // axes.dp_size
    rows = slice(axes.dp_rank * rows_per_dp, (axes.dp_rank + 1) * rows_per_dp)
    local = {k: v[rows] for k, v in batch.items()}
    pipelined = layout.pp_schedule is not None
    loss_fn = _CapturingLoss(denominator)
    strategy = _strategy(layout)
    try:
        infra = instantiate_infrastructure(
            distributed_config=strategy,
            pipeline_config=PipelineConfig(
                pp_schedule=layout.pp_schedule, pp_batch_size=rows_per_dp, pp_microbatch_size=1
            )
            if pipelined
            else None,
            device=torch.device("cpu"),
            mesh=ctx,
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        result = apply_model_infrastructure(
            model,
            is_meta_device=True,
            device=torch.device("cpu"),
            model_wrapper=infra.model_wrapper,
            mesh=ctx,
            peft_config=_peft_config() if layout.lora else None,
            loss_fn=loss_fn,
            autopipeline=infra.autopipeline,
            parallelize_fn=infra.parallelize_fn,
            load_base_model=True,
            pretrained_model_name_or_path=path,
        )
    except ValueError as exc:
        return refusal(exc)
    try:
        return _train(layout, ctx, axes, result, batch, local, rows, loss_fn, path)
    except ValueError as exc:  # a refusal that depends on the batch (a sequence longer than a window)
        return refusal(exc)


def _train(
    layout: Layout,
    ctx: Any,
    axes: _Axes,
    result: Any,
    batch: dict[str, torch.Tensor],
    local: dict[str, torch.Tensor],
    rows: slice,
    loss_fn: _CapturingLoss,
    path: str,
) -> dict[str, Any]:
    tokens = ROWS * SEQ
    denominator = tokens / axes.averaging_ranks
    pipelined = layout.pp_schedule is not None
    parts = list(result.parts) if pipelined else [result]
    ref = _reference(path, layout.lora)
    if layout.lora:
        _copy_adapters(parts, ref)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters() if p.requires_grad], lr=LR)
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for step in range(STEPS + 1):
        ref_logits = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        ref_loss = _token_sum(ref_logits, batch["labels"]) / tokens
        ref_loss.backward()
        local_sum, logits = _forward_backward(layout, ctx, axes, result, local, loss_fn, denominator)
        owns_loss = axes.tp_rank == 0 and (not pipelined or result.info.has_last_stage)
        out["losses"].append(_world_sum(local_sum if owns_loss else torch.zeros(())) / tokens)
        out["ref_losses"].append(float(ref_loss))
        if step == 0:
            expected = ref_logits.detach()[rows]
            out["logits"] = float((logits - expected).abs().max()) if logits is not None else 0.0
            ref_norm = sum(
                float(p.grad.double().square().sum()) for p in ref.parameters() if p.grad is not None
            )
            ours_norm = _grad_square_sum(parts, axes) ** 0.5
            out["grad_norm"] = abs(ours_norm - ref_norm**0.5)
            # Relative, so a family whose gradients are tiny still proves its gradients arrive.
            out["grad_rel"] = out["grad_norm"] / ref_norm**0.5 if ref_norm > 0 else float("inf")
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    out["loss_diff"] = max(abs(a - b) for a, b in zip(out["losses"], out["ref_losses"], strict=True))
    ok = out["logits"] <= ATOL and out["loss_diff"] <= ATOL and out["grad_norm"] <= ATOL * 10
    # Training must show: the loss falls, or, for a family whose two SGD steps move the loss by less than
    # float32 resolves (the reference does not fall either), the gradients agree to 0.1% of their norm.
    reference_flat = out["ref_losses"][-1] >= out["ref_losses"][0]
    trains = out["losses"][-1] < out["losses"][0] or (reference_flat and out["grad_rel"] <= 1e-3)
    out["status"] = "works" if ok and trains else "fails"
    if not trains:
        out["message"] = f"the loss does not fall: {out['losses']}"
    elif not ok:
        out["message"] = (
            f"differs from transformers: logits {out['logits']:.2e}, losses {out['loss_diff']:.2e}, "
            f"gradient norm {out['grad_norm']:.2e}"
        )
    return out


def _forward_backward(
    layout: Layout,
    ctx: Any,
    axes: _Axes,
    model: Any,
    local: dict[str, torch.Tensor],
    loss_fn: _CapturingLoss,
    denominator: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward and backward of this rank's rows; returns (its token-loss sum, its logits)."""
    from automodel_testing import to_full

    if layout.pp_schedule is not None:
        loss_fn.logits.clear()
        losses = model.step(local["input_ids"], target=local["labels"], position_ids=local["position_ids"])
        total = sum((loss.detach().float() for loss in losses), torch.zeros(())) * denominator
        # One row per microbatch; torch's schedule calls the loss once more the first time (to infer
        # the gradient shapes), so keep the last ones.
        logits = torch.cat(loss_fn.logits[-local["input_ids"].shape[0] :]) if loss_fn.logits else None
        return total, logits
    if axes.cp_size > 1:
        from automodel_distributed.context_parallel import (
            context_parallel_inputs,
            context_parallel_region,
            context_parallel_unshard,
        )

        prepared = context_parallel_inputs(
            {
                "input_ids": local["input_ids"],
                "position_ids": local["position_ids"],
                "shift_labels": local["labels"],
            }
        )
        # CPU meshes run torch's ring attention through the explicit CPU kernel switch.
        with context_parallel_region(ctx, prepared, cpu_ring_attention=ctx.device_type == "cpu") as shard:
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss_sum = _token_sum(logits, shard["shift_labels"])
            (loss_sum / denominator).backward()
        (full,) = context_parallel_unshard(ctx, [logits.detach().float()], [1])
        return loss_sum.detach(), full
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss_sum = _token_sum(logits, local["labels"])
    (loss_sum / denominator).backward()
    return loss_sum.detach(), to_full(logits).float()


def run_layout(layout_name: str, checkpoints: dict[str, str], progress: str) -> None:
    """Every family of ``checkpoints`` under one layout, on this rank (called on every rank).

    Each result goes to ``progress/rank<r>.jsonl`` as soon as it is known. A family that raises (anything
    but a refusal) may leave the process group out of step (a pipeline peer waiting for a send that
    never comes), so the launch stops there; the parent launches again for the families left.
    """
    from automodel_mesh import MeshContext, ParallelismSizes

    layout = LAYOUTS[layout_name]

    def after_each(family: str, result: dict[str, Any]) -> None:
        if "traceback" in result:
            raise RuntimeError(f"{family} failed under {layout_name}; relaunching for the rest")
        dist.barrier()

    with _quiet():
        ctx = MeshContext.build(_strategy(layout), ParallelismSizes(**layout.sizes))
        record_families(
            lambda path: _run_family(layout, ctx, path),
            checkpoints,
            pathlib.Path(progress) / f"rank{dist.get_rank()}.jsonl",
            after_each=after_each,
        )


# ------------------------------------------------------------------------------------ parent side


def run_matrix(layout_name: str, checkpoints: dict[str, str]) -> list[Row]:
    """``layout_name`` over ``checkpoints``, one merged row per family.

    One launch runs every family; when a family fails with an exception (or a rank dies or hangs), the
    launch stops, that family is a failure, and a new launch runs the families after it.
    """
    layout = LAYOUTS[layout_name]
    rows: dict[str, Row] = {}
    left = dict(checkpoints)
    with tempfile.TemporaryDirectory(prefix=f"matrix-{layout_name}-") as tmp:
        while left:
            folder = pathlib.Path(tmp, str(len(rows)))
            folder.mkdir()
            error = ""
            try:
                run_distributed(
                    run_layout,
                    layout.world_size,
                    layout_name,
                    left,
                    str(folder),
                    timeout_s=3600,
                    pg_timeout_s=60,
                )
            except DistributedRunError as exc:
                error = str(exc)
            done = read_progress(folder, layout.world_size)
            for family in left:
                if len(done.get(family, [])) == layout.world_size:
                    rows[family] = merge_ranks(family, layout_name, done[family])
                    if any("traceback" in r for r in done[family]):
                        break  # the ranks stopped on purpose after this family; relaunch for the rest
                    continue
                # The family this launch stopped at: a rank raised, died or hung there.
                recorded = "; ".join(r.get("message", "") for r in done.get(family, []))
                rows[family] = Row(family, layout_name, "fails", f"{recorded}\n{error[-2500:]}".strip())
                break
            left = {f: p for f, p in left.items() if f not in rows}
    return [rows[family] for family in checkpoints]


@pytest.fixture(scope="module")
def fast_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return prepare_checkpoints(prepare_family, FAST_FAMILIES, tmp_path_factory.mktemp("matrix_fast"))


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_fast_slice(layout_name: str, fast_checkpoints: dict[str, str]) -> None:
    assert_no_failure(run_matrix(layout_name, fast_checkpoints))


@pytest.fixture(scope="module")
def all_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    from automodel_testing.families import decoder_families

    root = tmp_path_factory.mktemp("matrix_all")
    paths, broken = {}, {}
    for family in decoder_families():
        prepared = prepare_family(family.model_type, root)
        if "path" in prepared:
            paths[family.model_type] = prepared["path"]
        else:
            broken[family.model_type] = prepared["reference_error"]
    return paths, broken


@pytest.fixture(scope="module")
def report() -> Iterator[dict[str, Any]]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    data: dict[str, Any] = {
        "layouts": {},
        "rows": [],
        "commit": commit or "unknown",
        "date": time.strftime("%Y-%m-%d"),
        "load": "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg()),
    }
    yield data
    target = pathlib.Path(os.environ.get(REPORT_ENV, ROOT / "build" / "models" / "matrix.json"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")


@pytest.mark.models
@pytest.mark.timeout(3 * 3600)  # every family in one launch per layout (a failure relaunches for the rest)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_full_matrix(
    layout_name: str, all_checkpoints: tuple[dict[str, str], dict[str, str]], report: dict[str, Any]
) -> None:
    import transformers

    from automodel_testing.families import excluded_families

    paths, broken = all_checkpoints
    rows = run_matrix(layout_name, paths)
    report["transformers"] = transformers.__version__
    report["excluded"] = excluded_families()
    report["reference_errors"] = broken
    report["layouts"][layout_name] = asdict(LAYOUTS[layout_name])
    report["rows"].extend(asdict(row) for row in rows)
    assert_no_failure(rows)
