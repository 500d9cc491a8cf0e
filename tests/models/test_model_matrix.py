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
  reference within `ATOL` (fp32); when only the losses after the steps are off, they may instead equal
  within `ATOL` the reference made to sum in the layout's order (`_losses_in_sharding_order`,
  `automodel_testing.matrix.judge`): the updates amplify the first step's rounding.

A case either **works** (every check passes), is **refused** (every rank raised the same `ValueError`
from the public API: a clear error before any collective), is **upstream** (plain transformers itself
fails the reference run that way: in bf16 for a bf16 layout), or **fails** (anything else: another
exception, a difference, a refusal on some ranks only). A failure fails the test: there is no silent
difference. The default run (``distributed`` marker) runs `FAST_FAMILIES` under every layout without
experts (`BF16_FAST_FAMILIES` under the bf16 ones) and `EP_FAST_FAMILIES` under
`EP_FAST_LAYOUTS`, one launch per layout, the layouts of two ranks only; ``uvx nox -s
distributed_extended`` adds the 4-rank layouts and `MORE_FAST_FAMILIES` (``extended``); ``uvx nox -s models``
runs every family (``models`` marker; the expert-parallel layouts over the MoE families) and writes the
JSON that ``tools/models_doc.py`` turns into docs/models.md and the table of docs/moe.md. A run in chunks
selects families with `FAMILIES_ENV` and layouts with ``-k``, each chunk into its own report.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing.ep_reference import combine_like_expert_parallel
from automodel_testing.matrix import (
    Row,
    assert_no_failure,
    barrier_or_stop,
    gradient_difference,
    judge,
    judge_low_precision,
    launch_layout,
    prepare_checkpoints,
    record_families,
    refusal,
    select_families,
    sgd_parity,
    squared_grad_sum,
    upstream_failure,
)
from automodel_testing.tp_reference import split_like_tensor_parallel

ROWS, SEQ, STEPS, LR = 4, 16, 2, 0.1
ATOL = 1e-5
"""fp32 tolerance of logits, losses and the gradient norm (observed differences are ~1e-7)."""
BF16_FACTOR, BF16_FLOOR, BF16_USED = 4.0, 2.0**-8, 1e-5
"""bf16 layouts (`automodel_testing.matrix.judge_low_precision`): the case's error against the fp32
reference may be at most `BF16_FACTOR` times that of transformers run in bf16 on the same checkpoint,
batch and steps, plus `BF16_FLOOR`. Both round every matmul to bf16's 8 mantissa bits, in different
orders (sharded reductions, fp32 gradient reduction and fp32 master weights on our side), so their
errors have the same size and neither is the other's; one error may still cancel by chance in a single
number (a gradient norm), so a difference within bf16's unit roundoff (2^-8, relative for norms above
1) always passes. Under tensor parallelism the transformers bf16 run splits each tp-sharded linear as
TP does (`automodel_testing.tp_reference`): a row-parallel layer's partial products are rounded before
they are added, an error of the sharding itself that a whole-matmul reference does not have; under
expert parallelism its routed experts combine their outputs as transformers' ``AllToAllEP`` does
(`automodel_testing.ep_reference`). The case's
logits must differ from fp32 by more than `BF16_USED` (fp32 runs differ by about 1e-7), or the bf16
policy acted on nothing."""
REPORT_ENV = "AUTOMODEL_MODEL_MATRIX_REPORT"
"""Where the ``models`` session's run writes its JSON (default: build/models/matrix.json)."""
FAMILIES_ENV = "AUTOMODEL_MODEL_MATRIX_FAMILIES"
"""Which families the ``models`` run covers (`automodel_testing.matrix.select_families`: unset, every
family; ``jetmoe,llama4_text``; or a slice ``0:40`` of the registry). The report then lists the families
it ran, and the page says which ones it did not."""
ROOT = pathlib.Path(__file__).resolve().parents[2]

FAST_FAMILIES: tuple[str, ...] = (
    "llama",  # the plain decoder
    "gemma2",  # scaled embeddings, soft-capped logits and attention, sliding/global layers
    "deepseek_v3",  # MLA attention, grouped top-k routing with a correction-bias buffer, dense+MoE
    "qwen3_next",  # linear-attention layers beside full attention, shared experts
)
"""Families of the default run's slice: the mechanisms most layouts have had to learn."""

MORE_FAST_FAMILIES: tuple[str, ...] = (
    "cohere2",  # per-layer sliding/global attention with rotary only on sliding layers
    "olmo3",  # per-layer-type rotary embeddings
    "gpt2",  # Conv1D projections, learned positions, tied-only naming
    "granite",  # embedding, residual and logit multipliers
)
"""The slice's other mechanisms, under the same layouts in ``uvx nox -s distributed_extended``."""

BF16_FAST_FAMILIES: tuple[str, ...] = (
    "llama",  # the plain decoder
    "gemma2",  # a buffer transformers computes in the compute dtype (the embedding scale)
    "deepseek_v3",  # routers transformers keeps in fp32 beside bf16 experts
    "qwen3_next",  # linear-attention parameters kept in fp32
    "minimax",  # buffers transformers computes in the compute dtype (decay tables)
    "ctrl",  # tied embeddings: a pipeline stage's stand-in for the other side under FSDP2's bf16 policy
)
"""The default run's families under the bf16 layouts: one of each precision mechanism
(`automodel_distributed.kept_precision`); the fp32 layouts cover the sharding mechanisms of the others."""


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
    """LoRA on every linear and, in a MoE model, on the experts' stacked weights
    (``PeftConfig.target_parameters``), as ``automodel train --lora`` adapts them."""
    activation_checkpointing: bool = False
    moe: bool = False
    """Expert parallelism (``moe_config=MoEParallelizerConfig()``): MoE families only, the others are
    skipped."""
    bf16: bool = False
    """FSDP2Config's default mixed precision (bf16 compute, fp32 master weights and gradient reduction)
    instead of fp32, judged against transformers in bf16 (`BF16_FACTOR`)."""


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("fsdp2", 2),
        Layout("hsdp", 4, {"dp_replicate_size": 2}),
        Layout("tp", 2, {"tp_size": 2}),
        Layout("tp_sp", 2, {"tp_size": 2}, sequence_parallel=True),
        Layout("cp", 2, {"cp_size": 2}),
        Layout("cp_a2a", 2, {"cp_size": 2, "cp_ulysses_degree": 2}),
        Layout("cp_ring_a2a", 4, {"cp_size": 4, "cp_ulysses_degree": 2}),
        Layout("cp_tp", 4, {"cp_size": 2, "tp_size": 2}),
        Layout("cp_pp", 4, {"cp_size": 2, "pp_size": 2}, pp_schedule="1f1b"),
        Layout("cp_ep", 2, {"cp_size": 2, "ep_size": 2}, moe=True),
        Layout("pp_1f1b", 2, {"pp_size": 2}, pp_schedule="1f1b"),
        Layout("pp_interleaved", 2, {"pp_size": 2}, pp_schedule="interleaved_1f1b"),
        Layout("lora_fsdp2", 2, lora=True),
        Layout("lora_tp", 2, {"tp_size": 2}, lora=True),
        Layout("ac", 2, activation_checkpointing=True),
        Layout("ep2", 2, {"ep_size": 2}, moe=True),
        Layout("ep2_shard2", 4, {"ep_size": 2}, moe=True),
        Layout("ep2_hsdp", 4, {"dp_replicate_size": 2, "ep_size": 2}, moe=True),
        Layout("ep2_tp2", 4, {"tp_size": 2, "ep_size": 2}, moe=True),
        Layout("ep2_pp2", 4, {"pp_size": 2, "ep_size": 2}, pp_schedule="1f1b", moe=True),
        Layout("ep2_lora", 2, {"ep_size": 2}, lora=True, moe=True),
        Layout("ep2_tp2_lora", 4, {"tp_size": 2, "ep_size": 2}, lora=True, moe=True),
        Layout("ep2_pp2_lora", 4, {"pp_size": 2, "ep_size": 2}, pp_schedule="1f1b", lora=True, moe=True),
        Layout("ep2_ac", 2, {"ep_size": 2}, activation_checkpointing=True, moe=True),
        Layout("fsdp2_bf16", 2, bf16=True),
        Layout("tp_bf16", 2, {"tp_size": 2}, bf16=True),
        Layout("pp_bf16", 2, {"pp_size": 2}, pp_schedule="1f1b", bf16=True),
        Layout("ep2_bf16", 2, {"ep_size": 2}, moe=True, bf16=True),
    )
}

EP_FAST_FAMILIES: tuple[str, ...] = (
    "qwen3_moe",  # softmax top-k routing, fused experts
    "deepseek_v3",  # grouped top-k with a correction-bias buffer, shared experts, dense + MoE layers
    "gpt_oss",  # transposed, interleaved gate/up with biases and a clamped gate, sink attention
)
"""The MoE families of the default run's slice."""

EP_FAST_LAYOUTS: tuple[str, ...] = ("ep2", "ep2_lora", "ep2_bf16")
"""The expert-parallel layouts of the default run's slice: 2-rank launches through the public API
(checkpoint load into a meta model, experts on ``ep`` and out of FSDP, full fine-tuning, and LoRA on
attention and on the fused experts). The other expert-parallel layouts (the 4-rank ones and ep2_ac) run
over every MoE family in ``uvx nox -s models`` only; the
default run also covers ep 2, ep 4, ep 2 x ep_shard 2, activation checkpointing and the EP x TP placement
in ``packages/automodel-moe/tests/distributed/test_moe_ep.py``."""


# ------------------------------------------------------------------------------------ checkpoints


def _quiet() -> contextlib.AbstractContextManager[None]:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("automodel_infra").setLevel(logging.WARNING)
    return warnings.catch_warnings(action="ignore")


def prepare_family(model_type: str, root: pathlib.Path, **overrides: Any) -> dict[str, Any]:
    """Build the tiny model of ``model_type`` (``overrides``: config fields), check transformers runs it,
    and save it under ``root``.

    Returns:
        ``{"path": folder}``, or ``{"reference_error": why}`` when transformers itself cannot build or
        run the tiny model (forward and backward in one process).
    """
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    with _quiet():
        try:
            config = derive_tiny_config(model_type, **overrides)
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


def _world_max(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64, device="cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def _world_sum(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return float(value)


def _reference(path: str, peft_config: Any, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    ref.train()
    if peft_config is not None:
        from automodel_peft import apply_lora_to_linear_modules

        apply_lora_to_linear_modules(ref, peft_config)
    return ref


def _peft_config(layout: Layout, model: Any) -> Any:
    """Every linear and, in a MoE model, the experts' stacked weights (found structurally)."""
    from automodel_peft import PeftConfig

    if not layout.lora:
        return None
    from automodel_moe import expert_weight_targets

    experts = expert_weight_targets(model)  # as `automodel train --lora` adapts them (none when dense)
    return PeftConfig(match_all_linear=True, dim=4, alpha=8, target_parameters=experts)


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
    total = squared_grad_sum(p for part in parts for p in part.parameters())
    counted = axes.dp_rank == 0 and axes.cp_rank == 0 and axes.tp_rank == 0
    return _world_sum(torch.tensor(total if counted else 0.0, dtype=torch.float64))


def _strategy(layout: Layout) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return FSDP2Config(
        # bf16 layouts keep the default policy: what a user gets without choosing one.
        **({} if layout.bf16 else {"mp_policy": fp32}),
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
    moe_config = None
    if layout.moe:
        from automodel_moe import MoEParallelizerConfig

        moe_config = MoEParallelizerConfig()
    try:
        infra = instantiate_infrastructure(
            distributed_config=strategy,
            pipeline_config=PipelineConfig(
                pp_schedule=layout.pp_schedule, pp_batch_size=rows_per_dp, pp_microbatch_size=1
            )
            if pipelined
            else None,
            moe_config=moe_config,
            device=torch.device("cpu"),
            mesh=ctx,
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        peft_config = _peft_config(layout, model)
        result = apply_model_infrastructure(
            model,
            is_meta_device=True,
            device=torch.device("cpu"),
            model_wrapper=infra.model_wrapper,
            mesh=ctx,
            peft_config=peft_config,
            loss_fn=loss_fn,
            autopipeline=infra.autopipeline,
            parallelize_fn=infra.parallelize_fn,
            load_base_model=True,
            pretrained_model_name_or_path=path,
        )
    except ValueError as exc:
        return refusal(exc)
    try:
        return _train(layout, ctx, axes, result, batch, local, rows, loss_fn, path, peft_config)
    except ValueError as exc:  # a refusal that depends on the batch (a sequence longer than a window)
        return refusal(exc)


def _check_experts_sharded(parts: list[Any], ep_size: int, pipelined: bool) -> None:
    """Every experts module this rank holds is cut over ``ep`` (parity alone would pass with EP off)."""
    from torch.distributed.tensor import DTensor

    from automodel_moe import find_experts

    sites = [site for part in parts for site in find_experts(part)]
    assert sites or pipelined, "expert parallelism: this rank holds no experts module"
    for site in sites:
        local = getattr(site.core, site.num_experts_attr)
        assert local * ep_size == site.num_experts, (site.fqn, local, site.num_experts)
        for name in site.params:
            param = site.core._parameters[name]
            mesh_dims = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
            assert "ep" in mesh_dims, f"{site.fqn}.{name} is not sharded over ep (mesh dims {mesh_dims})"


class _Routing:
    """The experts each token picks in each routed MoE layer, in the first forward of a model.

    Under bf16 a token whose router scores nearly tie can pick another expert than in fp32 (as
    transformers itself does under another summation order): its logits then move by far more than
    bf16's rounding while every other token stays within it. The judge leaves such tokens out of the
    logits comparison (counting them) and fails the case if more of them flip than `BF16_FACTOR` times
    those transformers' own bf16 run flips, plus `ROUTING_FLIP_FLOOR`: a dispatch bug moves many
    tokens, a tie a few.
    """

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.picked: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str) -> Any:
        def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            index = args[1]
            index = index.to_local() if hasattr(index, "to_local") else index
            self.picked.setdefault(name, index.detach().sort(dim=-1).values)

        return record

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    @staticmethod
    def flipped(ours: _Routing, reference: _Routing, tokens: slice, whole: bool = False) -> torch.Tensor:
        """Per token of ``tokens``: whether any layer of ours picked other experts than the reference.

        ``whole``: ours saw the whole batch too (a single-process model), not only ``tokens``.
        """
        flips: torch.Tensor | None = None
        for name, mine in ours.picked.items():
            differ = ((mine[tokens] if whole else mine) != reference.picked[name][tokens]).any(dim=-1)
            flips = differ if flips is None else flips | differ
        assert flips is not None, "no routed layer recorded"
        return flips


ROUTING_FLIP_FLOOR = 2
"""Tokens whose routing may flip in a bf16 expert-parallel case beyond `BF16_FACTOR` times
transformers' own bf16 flips (`_Routing`)."""


def _routed_modules(model: Any) -> dict[str, torch.nn.Module]:
    from automodel_moe import find_experts
    from automodel_moe.registry import ExpertsCall
    from automodel_testing.numerics import normalize_fqn

    return {normalize_fqn(s.fqn): s.module for s in find_experts(model) if s.call is ExpertsCall.ROUTED}


def _routed_experts(parts: list[Any]) -> list[str]:
    """Names of the experts modules the parts run through transformers' ``AllToAllEP``."""
    from automodel_moe import find_experts
    from automodel_moe.registry import ExpertsCall

    return [site.fqn for part in parts for site in find_experts(part) if site.call is ExpertsCall.ROUTED]


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
    peft_config: Any,
) -> dict[str, Any]:
    tokens = ROWS * SEQ
    denominator = tokens / axes.averaging_ranks
    pipelined = layout.pp_schedule is not None
    parts = list(result.parts) if pipelined else [result]
    if layout.moe:
        _check_experts_sharded(parts, layout.sizes["ep_size"], pipelined)
    ref = _reference(path, peft_config)
    if layout.lora:
        _copy_adapters(parts, ref)
    adapters = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters() if p.requires_grad], lr=LR)
    optimizers = [ref_opt, opt]
    # bf16 layouts: transformers in bf16 beside the fp32 reference, to size the error bf16 brings.
    low = _reference(path, peft_config, torch.bfloat16) if layout.bf16 else None
    if low is not None and (why := _fails_to_train(low, batch)) is not None:
        return upstream_failure(why, "in bf16")
    if (
        low is not None and layout.sizes.get("tp_size", 1) > 1
    ):  # round the partial sums as TP does (`tp_reference`)
        assert split_like_tensor_parallel(low, parts), "tp layout without a tp-sharded linear"
    routing: tuple[_Routing, _Routing, _Routing] | None = None
    if low is not None and layout.moe:  # combine routed experts as AllToAllEP does (`ep_reference`)
        combine_like_expert_parallel(low, _routed_experts(parts))
        mine = {name: m for part in parts for name, m in _routed_modules(part).items()}
        if mine and not pipelined:
            routing = (_Routing(mine), _Routing(_routed_modules(ref)), _Routing(_routed_modules(low)))
    if low is not None:
        optimizers.append(torch.optim.SGD(low.parameters(), lr=LR))
    out: dict[str, Any] = {}
    low_out: dict[str, Any] = {"losses": []}
    logits: dict[str, torch.Tensor | None] = {}

    def reference() -> float:
        logits["ref"] = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = _token_sum(logits["ref"], batch["labels"]) / tokens
        loss.backward()
        if low is not None:
            logits["low"] = low(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            low_loss = _token_sum(logits["low"], batch["labels"]) / tokens
            low_loss.backward()
            low_out["losses"].append(float(low_loss))
        return float(loss)

    def ours() -> float:
        local_sum, logits["ours"] = _forward_backward(layout, ctx, axes, result, local, loss_fn, denominator)
        owns_loss = axes.tp_rank == 0 and (not pipelined or result.info.has_last_stage)
        return _world_sum(local_sum if owns_loss else torch.zeros(())) / tokens

    def first() -> None:
        mine, expected = logits["ours"], logits["ref"]
        assert expected is not None
        per_token = (mine - expected.detach()[rows]).abs().amax(dim=-1) if mine is not None else None
        low_ties: torch.Tensor | None = None  # transformers bf16's own routing ties, over the whole batch
        if routing is not None and per_token is not None:
            for recorder in routing:
                recorder.close()
            flips = _Routing.flipped(routing[0], routing[1], slice(rows.start * SEQ, rows.stop * SEQ))
            flips = flips.reshape(per_token.shape)
            out["routing_flips"] = _world_sum(flips.sum())
            low_ties = _Routing.flipped(routing[2], routing[1], slice(None), whole=True).reshape(ROWS, SEQ)
            low_out["routing_flips"] = _world_sum(low_ties[rows].sum())
            per_token = per_token.masked_fill(flips, 0.0)
        mine_diff = float(per_token.max()) if per_token is not None else 0.0
        # A pipeline's first stage holds no logits: every rank judges the largest difference.
        out["logits"] = _world_max(mine_diff)
        out.update(gradient_difference(_grad_square_sum(parts, axes), ref))
        if low is not None and (low_logits := logits["low"]) is not None:
            low_token = (low_logits.detach().float() - expected.detach()).abs().amax(dim=-1)
            low_out["logits"] = float(
                (low_token if low_ties is None else low_token.masked_fill(low_ties, 0)).max()
            )
            low_out.update(gradient_difference(squared_grad_sum(low.parameters()), ref))

    out.update(sgd_parity(STEPS, reference, ours, optimizers, first=first))
    exported = _export_problems(parts, peft_config)
    if low is not None:
        verdict = judge_low_precision(out, low_out, factor=BF16_FACTOR, floor=BF16_FLOOR, used=BF16_USED)
        flips, low_flips = out.get("routing_flips", 0), low_out.get("routing_flips", 0)
        if flips > BF16_FACTOR * low_flips + ROUTING_FLIP_FLOOR and verdict["status"] == "works":
            verdict.update(
                status="fails",
                message=f"routing differs from fp32 for {flips:g} of {ROWS * SEQ} tokens (transformers "
                f"bf16: {low_flips:g})",
            )
        elif flips:
            note = f"{flips:g} routing tie(s) left out of the logits comparison"
            verdict["message"] = "; ".join(m for m in (verdict.get("message"), note) if m)
        if exported:
            verdict.update(
                status="fails", message="; ".join(m for m in (verdict.get("message"), *exported) if m)
            )
        return verdict

    def in_order() -> list[float] | None:
        return _losses_in_sharding_order(path, peft_config, adapters, parts, batch)

    return judge(out, ATOL, exported, reordered=in_order)


def _losses_in_sharding_order(
    path: str, peft_config: Any, trainable: dict[str, torch.Tensor], parts: list[Any], batch: dict[str, Any]
) -> list[float] | None:
    """The reference's `sgd_parity` losses when transformers sums as the sharded ``parts`` do.

    A fresh fp32 reference with the initial ``trainable`` values (the LoRA adapters the ranks drew) whose
    tp-sharded linears add their partial products as TP does and whose routed experts combine as
    ``AllToAllEP`` does; None when the layout reorders no sum. No collective.
    """
    model = _reference(path, peft_config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in trainable.items():
            params[name].copy_(value)
    reordered = split_like_tensor_parallel(model, parts) + combine_like_expert_parallel(
        model, _routed_experts(parts)
    )
    if not reordered:
        return None
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS + 1):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = _token_sum(logits, batch["labels"]) / (ROWS * SEQ)
        loss.backward()
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _export_problems(parts: list[Any], peft_config: Any) -> list[str]:
    """Export the trained model as `automodel train` does; transformers alone must reload it exactly.

    Every rank writes its share (`save_hf_checkpoint` of this rank's parts; the adapters with
    `save_adapters` in the PEFT format under LoRA); then every rank loads the folder with
    ``from_pretrained`` (and ``PeftModel.from_pretrained``), which must find every key, and each of its
    parameters must equal the trained model's, gathered whole (`to_full`), bit for bit. Collective;
    every rank returns every rank's findings.
    """
    import shutil
    import tempfile

    from automodel_checkpoint import save_hf_checkpoint
    from automodel_testing import normalize_fqn, to_full

    where: list[Any] = [tempfile.mkdtemp(prefix="matrix-export-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    folder = pathlib.Path(where[0])
    try:  # a refusal (a ValueError on every rank) leaves through here too
        save_hf_checkpoint(parts, folder / "hf", max_shard_size="100KB")
        if peft_config is not None:
            from automodel_peft import save_adapters

            save_adapters(parts, folder / "hf" / "adapter")
        mine = {normalize_fqn(n): to_full(p).detach() for part in parts for n, p in part.named_parameters()}
        found = _reload_problems(folder / "hf", mine)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return sorted({problem for problems in everyone for problem in problems})


def _reload_problems(folder: pathlib.Path, mine: dict[str, torch.Tensor]) -> list[str]:
    """What differs between the parameters ``from_pretrained`` reads from ``folder`` and ``mine``."""
    from transformers import AutoModelForCausalLM

    from automodel_testing import normalize_fqn

    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        if (folder / "adapter").is_dir():
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, folder / "adapter")
    except Exception as exc:  # reported as the case's failure
        return [f"export: transformers cannot load it: {type(exc).__name__}: {str(exc)[:300]}"]
    absent = [k for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)]
    if absent:
        return [f"export: from_pretrained reports {', '.join(f'{k} {list(info[k])[:3]}' for k in absent)}"]
    loaded = {normalize_fqn(n).removeprefix("base_model.model."): p for n, p in model.named_parameters()}
    missing = sorted(set(mine) - set(loaded))
    differ = sorted(n for n in set(mine) & set(loaded) if not torch.equal(loaded[n].detach(), mine[n]))
    problems = [f"export: reloaded without {missing[:3]}"] if missing else []
    return problems + ([f"export: reloaded other values for {differ[:3]}"] if differ else [])


def _fails_to_train(model: Any, batch: dict[str, torch.Tensor]) -> Exception | None:
    """The exception one forward and backward of ``model`` raises on ``batch``, if any (grads cleared)."""
    try:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        _token_sum(logits, batch["labels"]).backward()
    except Exception as exc:  # any error of transformers' own: the case has no reference
        return exc
    finally:
        model.zero_grad(set_to_none=True)
    return None


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

    region: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(local)
    if axes.cp_size > 1:
        from automodel_cpu import CPURuntime
        from automodel_distributed.context_parallel import context_parallel_inputs, context_parallel_region

        prepared = context_parallel_inputs(
            {
                "input_ids": local["input_ids"],
                "position_ids": local["position_ids"],
                "shift_labels": local["labels"],
            }
        )
        # CPU meshes run torch's ring attention through the CPU runtime's kernel.
        runtime = CPURuntime() if ctx.device_type == "cpu" else None
        ulysses = layout.sizes.get("cp_ulysses_degree", 1)
        region = context_parallel_region(
            ctx,
            prepared,
            host_runtime=runtime,
            ulysses_degree=ulysses,
            model=model.parts if layout.pp_schedule is not None else model,
        )
    if layout.pp_schedule is not None:
        loss_fn.logits.clear()
        with region as shard:
            labels = shard["shift_labels" if axes.cp_size > 1 else "labels"]
            losses = model.step(shard["input_ids"], target=labels, position_ids=shard["position_ids"])
        total = sum((loss.detach().float() for loss in losses), torch.zeros(())) * denominator
        # One row per microbatch; torch's schedule calls the loss once more the first time (to infer
        # the gradient shapes), so keep the last ones.
        logits = torch.cat(loss_fn.logits[-local["input_ids"].shape[0] :]) if loss_fn.logits else None
        return total, _cp_unshard(ctx, axes, logits, layout.sizes.get("cp_ulysses_degree", 1))
    if axes.cp_size > 1:
        with region as shard:
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss_sum = _token_sum(logits, shard["shift_labels"])
            (loss_sum / denominator).backward()
        return loss_sum.detach(), _cp_unshard(ctx, axes, logits, layout.sizes.get("cp_ulysses_degree", 1))
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss_sum = _token_sum(logits, local["labels"])
    (loss_sum / denominator).backward()
    return loss_sum.detach(), to_full(logits).float()


def _cp_unshard(ctx: Any, axes: _Axes, logits: torch.Tensor | None, ulysses: int) -> torch.Tensor | None:
    """This rank's sequence shard of the logits, gathered over ``cp`` in the original order.

    Every rank of a ``cp`` group runs the same pipeline stage, so they hold logits or not together.
    """
    if logits is None or axes.cp_size == 1:
        return logits
    from automodel_distributed.context_parallel import context_parallel_unshard

    if hasattr(logits, "full_tensor"):  # tensor-parallel logits (cp x tp)
        logits = logits.full_tensor()
    (full,) = context_parallel_unshard(ctx, [logits.detach().float()], [1], ulysses_degree=ulysses)
    return full


def run_layout(layout_name: str, checkpoints: dict[str, str], progress: str) -> None:
    """Every family of ``checkpoints`` under one layout, on this rank (called on every rank).

    Each result goes to ``progress/rank<r>.jsonl`` as soon as it is known. A family that raises (anything
    but a refusal) may leave the process group out of step (a pipeline peer waiting for a send that
    never comes), so the launch stops there; the parent launches again for the families left.
    """
    from automodel_mesh import MeshContext, ParallelismSizes

    layout = LAYOUTS[layout_name]
    with _quiet():
        ctx = MeshContext.build(_strategy(layout), ParallelismSizes(**layout.sizes))
        record_families(
            lambda path: _run_family(layout, ctx, path),
            checkpoints,
            pathlib.Path(progress) / f"rank{dist.get_rank()}.jsonl",
            after_each=barrier_or_stop(layout_name),
        )


# ------------------------------------------------------------------------------------ parent side


def run_matrix(layout_name: str, checkpoints: dict[str, str]) -> list[Row]:
    """``layout_name`` over ``checkpoints``, one merged row per family (`launch_layout`: one launch runs
    every family; after a family that raised, a new launch runs the families after it)."""
    return launch_layout(run_layout, layout_name, LAYOUTS[layout_name].world_size, checkpoints)


def _has_experts(model_type: str, overrides: dict[str, Any]) -> bool:
    """Whether the family's tiny model has experts modules (structurally: `automodel_moe.has_experts`)."""
    from transformers import AutoModelForCausalLM

    from automodel_moe import has_experts
    from automodel_testing.tiny import derive_tiny_config

    with _quiet(), torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(derive_tiny_config(model_type, **overrides))
        except Exception:  # a family that does not build: the decoder layouts report it
            return False
    return has_experts(model)


@pytest.fixture(scope="module")
def fast_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    families = tuple(dict.fromkeys(FAST_FAMILIES + BF16_FAST_FAMILIES + EP_FAST_FAMILIES))
    return prepare_checkpoints(prepare_family, families, tmp_path_factory.mktemp("matrix_fast"))


@pytest.fixture(scope="module")
def more_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return prepare_checkpoints(prepare_family, MORE_FAST_FAMILIES, tmp_path_factory.mktemp("matrix_more"))


def _fast_slice(layout_name: str, checkpoints: dict[str, str]) -> None:
    from automodel_cpu.ring_attention_kernel import cpu_ring_attention_available

    ring, why = cpu_ring_attention_available()
    sizes = LAYOUTS[layout_name].sizes
    ring_layout = sizes.get("cp_size", 1) > sizes.get("cp_ulysses_degree", 1)
    if ring_layout and not ring:  # an older torch (`oldest`)
        pytest.skip(f"CP on CPU needs the ring kernel's torch internals: {why}")
    assert_no_failure(run_matrix(layout_name, checkpoints))


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout_name",
    [
        pytest.param(name, marks=[pytest.mark.extended] if layout.world_size > 2 else [])
        for name, layout in LAYOUTS.items()
        if not layout.moe or name in EP_FAST_LAYOUTS
    ],
)
def test_fast_slice(layout_name: str, fast_checkpoints: dict[str, str]) -> None:
    layout = LAYOUTS[layout_name]
    families = EP_FAST_FAMILIES if layout.moe else BF16_FAST_FAMILIES if layout.bf16 else FAST_FAMILIES
    _fast_slice(layout_name, {f: fast_checkpoints[f] for f in families})


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout_name", [n for n, layout in LAYOUTS.items() if not layout.moe and not layout.bf16]
)
def test_fast_slice_more_families(layout_name: str, more_checkpoints: dict[str, str]) -> None:
    _fast_slice(layout_name, more_checkpoints)


def _selected(families: Sequence[Any]) -> list[Any]:
    """The registry's families that `FAMILIES_ENV` selects (all when it is unset)."""
    names = select_families([f.model_type for f in families], os.environ.get(FAMILIES_ENV))
    return [f for f in families if f.model_type in names]


@pytest.fixture(scope="module")
def all_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    from automodel_testing.families import decoder_families

    root = tmp_path_factory.mktemp("matrix_all")
    paths, broken = {}, {}
    for family in _selected(decoder_families()):
        prepared = prepare_family(family.model_type, root)
        if "path" in prepared:
            paths[family.model_type] = prepared["path"]
        else:
            broken[family.model_type] = prepared["reference_error"]
    return paths, broken


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    """The MoE families' checkpoints (and the ones transformers cannot run): the families whose tiny model
    has experts, those of `MOE_OVERRIDES` (dense or single-expert by default) as their MoE variant.

    Built apart from `all_checkpoints`, so a run of the expert-parallel layouts alone (``-k ep2``) builds
    only these.
    """
    from automodel_testing.families import decoder_families
    from automodel_testing.tiny import MOE_OVERRIDES

    root = tmp_path_factory.mktemp("matrix_moe")
    paths, broken = {}, {}
    for family in _selected(decoder_families()):
        overrides = dict(MOE_OVERRIDES.get(family.model_type, {}))
        if not _has_experts(family.model_type, overrides):
            continue
        prepared = prepare_family(family.model_type, root, **overrides)
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
def test_full_matrix(layout_name: str, request: pytest.FixtureRequest, report: dict[str, Any]) -> None:
    import transformers

    from automodel_testing.families import excluded_families

    checkpoints = "moe_checkpoints" if LAYOUTS[layout_name].moe else "all_checkpoints"
    paths, broken = request.getfixturevalue(checkpoints)
    rows = run_matrix(layout_name, paths)
    report["transformers"] = transformers.__version__
    report["excluded"] = excluded_families()
    report.setdefault("reference_errors", {}).update(broken)
    report["layouts"][layout_name] = asdict(LAYOUTS[layout_name])
    report["rows"].extend(asdict(row) for row in rows)
    if os.environ.get(FAMILIES_ENV):  # a chunk: the page says which families the run left out
        from automodel_testing.families import decoder_families

        report["registry"] = sorted(
            {*report.get("registry", []), *(f.model_type for f in decoder_families())}
        )
        report["families"] = sorted({*report.get("families", []), *paths, *broken})
    assert_no_failure(rows)
