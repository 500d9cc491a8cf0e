"""`estimate_step_time`: one optimizer step's time on a cluster, part by part, and the throughput it gives.

The work comes from the fake forward (`automodel_planner.compute`), the collectives from each package's
planner term (`automodel_mesh.Collective`), the hardware from `automodel_planner.hardware`; what
fraction of the hardware's peaks each kind of op reaches is `Efficiency`, the model's only free
parameters (fitted on published runs: `automodel_planner.published`). Per rank:

- **compute** per micro-batch pass: each matmul's FLOPs at the matmul rate (float8's for the blocks'
  linear layers under ``fp8``: a fraction of the best rate a large matmul reaches on the device, its
  measured share of the peak, `Device.matmul_share`), or its bytes (input, weight and output on the
  rank) at the HBM rate where they take longer (a roofline: under TP a grouped key/value projection
  keeps a few heads and reads the whole gathered input; under expert parallelism an experts module's
  matmuls read the rank's ``1 / ep`` of its stacked weights), the attention kernels' FLOPs (halved for a
  causal call without a mask; a masked one, a sliding window's, computes every score in SDPA's fused
  kernels, and flash-attn's and FlexAttention's the window's band only) at the attention rate
  (FlashAttention-2's, times the kernel's measured speed: `ATTENTION_KERNEL_SPEED`), every other op's
  bytes at the HBM rate (times the fused share under ``compile`` inside the blocks, and outside them,
  where the loss's upcast and log-softmax dominate, under a compiled loss only: the per-block compile
  leaves it eager). Backward is twice a trainable matmul's forward (input and weight gradients) and once
  a frozen one's (input gradient only), 2.5 times attention's (flash attention's backward runs five
  matmuls to the forward's two) and twice the memory-bound ops'. Recompute adds the blocks' forward
  (full checkpointing) or the matmuls and memory-bound ops selective checkpointing does not save: every
  other matmul of a block's call, the 2nd, 4th, ... (automodel's policy and torchtitan's alike: a Llama
  3 8B block recomputes k, o and up: 37% of its matmul FLOPs, not half). Tensor parallelism divides a
  block's work by ``tp``. A LoRA adapter's thin matmuls and elementwise ops move activations for a few
  FLOPs: its layer's input and output bytes, counted op by op
  (`automodel_peft.memory.lora_traffic_bytes`), at the HBM rate.
- **collectives**, by what they hide behind (`automodel_mesh.Overlap`), as torch runs them: FSDP2's
  all-gathers are prefetched one unit ahead, so only the first unit's and whatever exceeds the
  forward compute is exposed; backward's all-gathers, reduce-scatters and HSDP all-reduces run behind
  the backward still to come, exposing the last unit's and any excess (a reduction made once per step
  under gradient accumulation has only the last pass's backward). Under a pipeline, a stage whose root
  module is FSDP's keeps its units gathered over a run and its gradients unsharded until its last
  backward, then reduces them and waits (`automodel_distributed.memory.StageSync`): nothing hides them
  but the drain of the schedule, ``r`` chunk backwards on pipeline rank ``r``; ring attention (torch's,
  all-gather rotation) gathers a block's K/V as its first, local step starts and waits for them when
  that step ends, so each gather hides behind a ``1 / cp`` of the block's attention (in each forward run,
  and again in backward), as each chunk's K/V gradients do, passed on one step ahead in backward but
  the last, which is waited for at once; TP's collectives are those its plan's styles issue
  (`automodel_distributed.tensor_parallel.traffic`: without sequence parallelism each row-parallel
  layer all-reduces its output in forward, and in backward the input gradient of each column-parallel
  group that takes its input as a DTensor (the built-in plans' attention and MLP: q, k and v's summed)
  or else of each column-parallel layer; with it each group gathers its input once and reduce-scatters
  the summed gradient; the embedding's, the head's and a vocab-parallel loss's beside them); TP's and
  EP's collectives and a stage's send/receive are
  exposed, and a recompute under full checkpointing issues a block's forward collectives again, and
  one under selective checkpointing its all-gathers when it does not save their outputs (torchtitan's
  save list: the column-parallel matmuls' weight gradients need the gathered input). Under async TP
  each of a block's TP collectives is micro-pipelined with the matmuls it feeds or is fed by, as torch's
  micro-pipeline pass fuses them (the all-gather before a column-parallel group, the reduce-scatter
  after a row-parallel layer, in forward, recompute and, mirrored, backward): cut in ``tp`` chunks, it
  hides behind all but one chunk of those matmuls, and only its excess over them is exposed; the
  fused matmul-reduce-scatter then sums the ranks' partial products in a kernel of its own, reading the
  row-parallel layer's whole unreduced output and writing a ``1 / tp`` of it (HBM rate). In backward
  torch fuses a reduce-scatter of one matmul's output only: a column-parallel group of several matmuls
  (q, k, v; gate, up) sums their input gradients first, and its reduce-scatter stays exposed. A
  collective's time is its group's links'
  (`Cluster.seconds`, from `MeshLayout.group`): NVLink inside a node; across nodes one ring per
  network link the group has in a node, each carrying a rank's share into the node; and each of its
  NCCL operations (an FSDP unit's all-gather, one of a TP block's collectives, an HSDP unit's
  all-reduce) adds the latency NCCL's own tuner gives its ranks and nodes under the algorithm and
  protocol it picks (`Cluster.nccl_latency`: a base, and a latency per ring step, NVLink's or the
  network's, or per tree level).
- **collectives beside compute**: a NCCL kernel runs one CTA per channel (``src/enqueue.cc``), each
  holding an SM for as long as the collective runs, latency included; the compute beside it gets the
  rest. For every second a collective hides (an FSDP or HSDP one's hidden share, a ring attention
  gather inside its step), compute loses ``Device.nccl_channels / Device.sm_count`` of a second
  (`OVERLAP_PART`; 32 of an H100's 132 SMs). Async TP's micro-pipelined collectives run on
  symmetric memory, not NCCL, and are not counted; nor is the HBM bandwidth NCCL's copies take.
- **ring attention** (context parallelism) merges each ring step's output into the running one in
  fp32 after every step but the first, and accumulates the gradients likewise in backward, packing
  the keys and values (and their fp32 gradients) it passes on: eager memory traffic per element of
  the attention's output and of the keys and values the kernel receives (`_RING_OUTPUT_FORWARD`,
  `_RING_KV_FORWARD`, `_RING_OUTPUT_BACKWARD`, `_RING_KV_BACKWARD`): a model that repeats its
  key/value heads before the kernel (torchtitan's Llama) moves four times a grouped one's.
- **expert parallelism**'s dispatch and combine (`automodel_moe.memory.ExpertExchange`) are exposed;
  automodel's exchange sends a token once per routed expert, evenly over the ``ep`` ranks; DeepEP's
  (which other frameworks run) once per destination rank, crossing the network once per destination
  node and forwarded over NVLink there, so its bytes follow from where the router puts a token's
  experts (any ``top_k`` alike, or NeMo AutoModel's fake balanced gate: consecutive experts).
- **pipeline**: the slowest stage's pass times the schedule's length, ``n_micro + (pp - 1) / v`` passes
  for ``v`` stages per rank (1F1B, GPipe and interleaved schedules alike; the ``(pp - 1) / v`` is the
  bubble), once per run of the schedule (`PlanInput.pipeline_runs`: a loop of runs before the
  optimizer step pays each run's bubble and gradient reduction). A pass's length is its compute and
  what it waits for call by call (TP's and EP's collectives, its send/receive, ring attention's excess
  over its steps).
- **the terms' own kernels** (`PlannerTerm.traffic`: gradients deferred over the passes are added up
  by autograd's AccumulateGrad, reading both and writing the sum; under sequence parallelism, the
  copies that move the sequence dim to and from the rank-major layout NCCL gathers and scatters in,
  torch's own in eager and compiled code alike) at the HBM rate, in backward.
- **optimizer**: AdamW reads and writes its fp32 state, parameters and gradients once (HBM rate).

Model FLOPs (for MFU) are counted as torchtitan counts them: three times the forward's matmul FLOPs of
trainable weights (``6 N`` per token for ``N`` non-embedding parameters, experts at their active share)
plus the attention's whole score matrix (``12 L h d s``); a frozen weight counts its forward and input
gradient only. No process group, no device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import nn

from automodel_distributed.memory import TP_BLOCK_COLLECTIVE
from automodel_mesh import Collective, Overlap
from automodel_planner.compute import BlockCompute, ComputeProfile
from automodel_planner.hardware import Cluster

__all__ = [
    "ATTENTION_KERNEL_SPEED",
    "DEFAULT_EFFICIENCY",
    "OVERLAP_PART",
    "Efficiency",
    "StepOptions",
    "StepTime",
    "WeightKind",
    "estimate_step_time",
    "model_flops_per_token",
    "weight_kinds",
]

_ATTENTION_BACKWARD = 2.5
_MEMORY_BACKWARD = 2.0
# Ring attention's eager traffic for each ring step after the first (torch's `_templated_ring_attention`
# and its backward, fp32 accumulation, round-robin load balancing): bytes per element of a block's
# attention output and per element of the keys and values the kernel receives (bf16). Half the steps of
# a rank are partial (they update the second half of its queries only), so a merge covers 3/4 of the
# output on average and the partial steps concatenate the whole.
_RING_OUTPUT_FORWARD = 0.75 * (6 + 12 + 8 + 12) + 8 / 2
"""Forward, per output element (`_SDPAMerger`): the step's output cast to fp32 (6) and merged into the
running fp32 output by the log-sum-exps (a difference, a product and a difference: 12, 8, 12), over
3/4 of the output; the partial steps' concatenation of the whole (8, half the steps)."""
_RING_KV_FORWARD = 4.0
"""Forward, per key/value element: the keys and values packed into one buffer for the next rank."""
_RING_OUTPUT_BACKWARD = (10 + 13) / 2
"""Backward, per output element: the step's query gradient added to the fp32 accumulator (10), or to
its second half and the whole concatenated again (13) on a partial step."""
_RING_KV_BACKWARD = (10 + 13) / 2 + 8 + 4
"""Backward, per key/value element: the key and value gradients accumulated in fp32 likewise (10 or
13), packed into one fp32 buffer for the next rank (8), and the keys and values packed again (4)."""
ATTENTION_KERNEL_SPEED: dict[str, float] = {"fa2": 1.0, "cudnn": 529 / 333, "fa3": 602 / 333}
"""Each attention kernel's speed relative to FlashAttention-2 (``Efficiency.attention``'s kernel): the
FlashAttention-3 paper's measurements (Shah et al., 2024, figure 5: H100 SXM5, causal forward, head
dim 128, 8k tokens: FA2 333, cuDNN 529, FA3 602 TFLOP/s). torch's SDPA runs FA2 by default (its flash
backend comes first in its priority order); Transformer Engine's fused attention runs cuDNN's."""
OVERLAP_PART = "SMs held by overlapped NCCL kernels"
"""The step part of the compute slowed while collectives run beside it (`StepTime.parts`)."""
_ADAMW_TRAFFIC = 3.5
"""AdamW's bytes moved per byte of its state: it reads and writes both moments (2x), and reads and
writes the fp32 parameter and reads the gradient (12 bytes per 8 of state)."""


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the hardware's peaks, per kind of op (the time model's free parameters).

    The defaults are `automodel_planner.published.fit_efficiency` on the calibration rows of
    ``published_runs.toml`` (``python tools/throughput_doc.py --fit`` prints them), rounded, except two
    the calibration rows cannot tell apart: ``network`` (they run inside one node) and ``attention``
    (10-15% of their step: any value trades against ``matmul``), which is measured instead.
    """

    matmul: float = 0.794
    """Of the device's best bf16 matmul rate (its peak times `Device.matmul_share`, a measured
    ceiling), by a transformer's large matmuls."""
    fp8_matmul: float = 0.687
    """Of the device's best fp8 matmul rate (`Device.fp8_matmul_share` of its fp8 peak), by float8
    matmuls (with their scaling)."""
    attention: float = 0.337
    """Of the dense bf16 peak, by flash attention (on the causal half of the score matrix): torch's SDPA
    flash backend is FlashAttention-2, which the FlashAttention-3 paper (Shah et al., 2024, figure 5)
    measures at 333 TFLOP/s causal forward on an H100 SXM5 (989 peak) at head dim 128 and 8k tokens."""
    memory: float = 0.903
    """Of the HBM bandwidth, by eager elementwise kernels (norms, activations, rotary, casts, loss)."""
    compiled_traffic: float = 0.477
    """The share of eager's memory-bound bytes a compiled block still moves (fusion)."""
    network: float = 0.8
    """Of a link's bandwidth, by NCCL's collectives (its bus bandwidth)."""


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class StepOptions:
    """The job's settings that change time but not the model: compile, float8, async TP."""

    compile: bool = False
    fp8: bool = False
    async_tp: bool = False
    checkpointing: Any = False
    """``False``, ``"full"`` or ``"selective"``."""
    compiled_loss: bool = False
    """The loss is compiled: the elementwise ops outside the blocks (the loss's upcast, log-softmax and
    gradient dominate them) move the compiled share of their bytes; else they run eager."""
    attention_kernel: str = "fa2"
    """The attention kernel: a key of `ATTENTION_KERNEL_SPEED`."""


@dataclass
class StepTime:
    """One optimizer step: seconds by part (the slowest rank's), tokens and FLOPs."""

    parts: dict[str, float] = field(default_factory=dict)
    """Part -> seconds: compute, recompute, each exposed collective, the pipeline bubble, optimizer."""
    tokens_per_step: int = 0
    world_size: int = 1
    model_flops_per_token: float = 0.0
    peak_flops: float = 0.0
    """The device's dense bf16 peak (MFU's denominator)."""
    rank: str = ""

    @property
    def step_seconds(self) -> float:
        """The sum of the parts."""
        return sum(self.parts.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Tokens per second per GPU."""
        return self.tokens_per_step / self.step_seconds / self.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs per second per GPU over the device's dense bf16 peak."""
        return self.tokens_per_s_per_gpu * self.model_flops_per_token / self.peak_flops

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``automodel plan --json``'s ``throughput``)."""
        return {
            "step_seconds": self.step_seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "model_flops_per_token": self.model_flops_per_token,
            "tokens_per_step": self.tokens_per_step,
            "slowest_rank": self.rank,
            "breakdown_seconds": dict(self.parts),
        }


class WeightKind(NamedTuple):
    """What the time model needs of the module that ran a matmul."""

    trainable: bool
    linear: bool
    """A linear layer (float8 training converts the blocks' ones)."""
    weighted: bool
    """Holds weights (a rotary embedding multiplying positions does not: work, but not model FLOPs)."""
    tp_style: str | None = None
    """``"colwise"`` or ``"rowwise"`` where the model's tensor-parallel plan shards it, else None."""
    adapted: bool = False
    """Wrapped by a LoRA adapter (peft's ``base_layer``): `lora_traffic_bytes` adds its work."""
    experts: bool = False
    """An experts module sharded by expert parallelism: a rank's matmuls read its ``1 / ep`` of the
    stacked weights."""


WeightKinds = Callable[[int, str], WeightKind]
"""``(block or -1, module name in it) -> WeightKind``."""


def weight_kinds(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], experts: Collection[str] = ()
) -> WeightKinds:
    """What the time model needs of each matmul's module in ``model`` (the job's, adapters applied).

    Returns a lookup by block index and the module's name inside the block (``self_attn.q_proj``), or
    by the whole name for modules outside the blocks (block ``-1``). A module wrapped by an adapter
    (peft's ``base_layer``) is judged by the wrapped layer. Unknown names count as trainable linears
    outside any tensor-parallel plan. The plan's styles are the model's own
    (`automodel_distributed.tensor_parallel.sharded_layer_kinds`); ``experts`` names the experts
    modules expert parallelism shards (`automodel_moe.find_experts`).
    """
    from automodel_distributed.tensor_parallel import sharded_layer_kinds

    styles = sharded_layer_kinds(model)
    kinds: dict[tuple[int, str], WeightKind] = {}
    for index, (prefix, block) in enumerate(blocks):
        for name, module in block.named_modules():
            fqn = f"{prefix}.{name}" if name else prefix
            kinds[(index, name)] = _kind(module, styles.get(fqn), fqn in experts)
    for name, module in model.named_modules():
        kinds.setdefault((-1, name), _kind(module, styles.get(name), name in experts))

    def lookup(block: int, name: str) -> WeightKind:
        return kinds.get((block, name), WeightKind(True, True, True))

    return lookup


def _kind(module: nn.Module, tp_style: str | None, experts: bool) -> WeightKind:
    layer = getattr(module, "base_layer", module)
    own = list(layer.parameters(recurse=False))
    trainable = any(p.requires_grad for p in own) if own else True
    linear = isinstance(layer, nn.Linear)
    return WeightKind(trainable, linear, bool(own), tp_style, layer is not module, experts)


@dataclass(frozen=True)
class _Rates:
    matmul: float
    fp8: float
    attention: float
    memory: float
    eager_memory: float
    """The HBM rate of ops outside compiled graphs (ring attention's merges)."""
    fused_memory: float
    """The HBM rate of ops in a compiled graph (a compiled loss, whatever the blocks do)."""

    @classmethod
    def of(cls, cluster: Cluster, efficiency: Efficiency, options: StepOptions) -> _Rates:
        device = cluster.device
        fp8_peak = device.fp8_flops if device.fp8_flops is not None else device.bf16_flops
        traffic = efficiency.compiled_traffic if options.compile else 1.0
        kernel = ATTENTION_KERNEL_SPEED[options.attention_kernel]
        matmul = device.bf16_flops * device.matmul_share * efficiency.matmul
        return cls(
            matmul=matmul,
            fp8=fp8_peak * device.fp8_matmul_share * efficiency.fp8_matmul if options.fp8 else matmul,
            attention=device.bf16_flops * efficiency.attention * kernel,
            memory=device.hbm_bytes_per_s * efficiency.memory / traffic,
            eager_memory=device.hbm_bytes_per_s * efficiency.memory,
            fused_memory=device.hbm_bytes_per_s * efficiency.memory / efficiency.compiled_traffic,
        )


@dataclass
class _Pass:
    """Seconds of one micro-batch pass on one rank, by phase."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    attention_forward: float = 0.0
    """Of one forward run: the attention kernels (what ring attention's steps hide behind)."""
    attention_backward: float = 0.0
    """Of backward: the attention kernels."""
    tp_segments: list[tuple[_Segment, ...]] = field(default_factory=list)
    """Per block: the matmuls each TP collective is micro-pipelined with under async TP (each
    column-parallel group after its all-gather, each row-parallel layer before its reduce-scatter), in
    forward order."""


@dataclass
class _Segment:
    """The matmuls of a block that one TP collective feeds (all-gather) or is fed by (reduce-scatter)."""

    style: str
    """``colwise`` (a group sharing one gathered input) or ``rowwise`` (one layer)."""
    seconds: float = 0.0
    """Their forward seconds on one rank."""
    matmuls: int = 0
    summed_bytes: float = 0.0
    """Bytes a fused reduce-scatter of this segment sums, before TP: a row-parallel layer's output (in
    forward), a single-matmul column-parallel group's input gradient (in backward)."""
    recomputed_seconds: float = 0.0
    """Of ``seconds``, those a recompute runs again (all under full checkpointing; under selective, the
    matmuls whose outputs it does not save)."""

    @property
    def fused_in_backward(self) -> bool:
        """Whether torch fuses this segment's collective in backward (mirrored).

        A row-parallel layer's output-gradient all-gather feeds one matmul (fused). A column-parallel
        group's input gradient is the sum of its matmuls' partial gradients, and torch's pass fuses a
        reduce-scatter of one matmul's output only (``micro_pipeline_tp._find_producer_matmul``).
        """
        return self.style == "rowwise" or self.matmuls == 1


def _block_pass(
    block: BlockCompute,
    index: int,
    kinds: WeightKinds,
    rates: _Rates,
    tp: int,
    options: StepOptions,
    ep: int = 1,
) -> _Pass:
    out = _Pass()
    checkpointing = options.checkpointing if index >= 0 else False
    segments: list[_Segment] = []
    previous: str | None = None
    for name, flops in block.matmul_flops.items():
        kind = kinds(index, name)
        low_precision = kind.linear and index >= 0 and options.fp8
        # A matmul takes the longer of its FLOPs and its bytes (a roofline): a thin one (a grouped
        # key/value projection cut by TP) is bound by the activation it reads or writes.
        seconds = max(
            flops / tp / (rates.fp8 if low_precision else rates.matmul),
            _matmul_bytes(block, name, kind.tp_style, tp, low_precision, ep if kind.experts else 1)
            / rates.eager_memory,
        )
        out.forward += seconds
        out.backward += seconds * (2.0 if kind.trainable else 1.0)
        recomputed = seconds if checkpointing == "full" else 0.0
        if checkpointing == "selective":  # the matmuls whose outputs the policy does not save
            recomputed = seconds * block.recomputed_matmul_flops.get(name, 0.0) / flops if flops else 0.0
        out.recompute += recomputed
        if kind.tp_style == "rowwise" or (kind.tp_style == "colwise" and previous != "colwise"):
            # A new column-parallel group (one all-gather feeds it whole) or a row-parallel layer.
            summed = block.matmul_output_bytes if kind.tp_style == "rowwise" else block.matmul_input_bytes
            segments.append(_Segment(kind.tp_style, summed_bytes=summed.get(name, 0.0)))
        if kind.tp_style in ("colwise", "rowwise"):
            segments[-1].seconds += seconds
            segments[-1].recomputed_seconds += recomputed
            segments[-1].matmuls += 1
        previous = kind.tp_style or previous
        if kind.adapted and index >= 0:
            _add_adapter(out, block, name, kind.tp_style, tp, rates.memory, bool(checkpointing))
    # A causal call without a mask computes half its score matrix (a windowed one its band); any other
    # call all of it.
    flops = block.attention_flops - block.causal_attention_flops / 2
    flops += block.window_band_flops - block.window_attention_flops / 2
    attention = flops / tp / rates.attention
    # Outside the blocks (index -1) only a compiled loss fuses: the per-block compile leaves it eager.
    outside_rate = rates.fused_memory if options.compiled_loss else rates.eager_memory
    memory_rate = rates.memory if index >= 0 else outside_rate
    memory = block.memory_bytes / tp / memory_rate
    out.forward += attention + memory
    out.backward += _ATTENTION_BACKWARD * attention + _MEMORY_BACKWARD * memory
    out.attention_forward += attention
    out.attention_backward += _ATTENTION_BACKWARD * attention
    if index >= 0:
        out.tp_segments.append(tuple(segments))
    if checkpointing == "full":
        out.recompute += attention + memory
    elif checkpointing == "selective":
        out.recompute += memory
    if options.async_tp and tp > 1 and index >= 0:
        _add_partial_sums(out, segments, (1 + 1 / tp) / rates.eager_memory, checkpointing)
    return out


def _rank_bytes(read: float, written: float, style: str | None, tp: int) -> tuple[float, float]:
    """A layer's input and output bytes on one of ``tp`` ranks.

    A column-parallel layer reads its whole (gathered) input and writes a ``1 / tp`` of its output, a
    row-parallel one the reverse (its output unreduced); any other layer's work is divided like its FLOPs.
    """
    if style == "colwise":
        return read, written / tp
    if style == "rowwise":
        return read / tp, written
    return read / tp, written / tp


def _matmul_bytes(
    block: BlockCompute, name: str, style: str | None, tp: int, low_precision: bool, ep: int = 1
) -> float:
    """Bytes one of a layer's matmuls moves on a rank.

    Forward, input gradient and weight gradient each read two of input, weight and output and write the
    third. Float8 reads its operands in one byte. ``ep``: the shards of the weight beyond ``tp`` (an
    experts module's under expert parallelism: the rank's tokens meet its experts only).
    """
    read, written = _rank_bytes(
        block.matmul_input_bytes.get(name, 0.0), block.matmul_output_bytes.get(name, 0.0), style, tp
    )
    operands = read + block.matmul_weight_bytes.get(name, 0.0) / tp / ep
    return operands / 2 + written if low_precision else operands + written


def _add_adapter(
    one: _Pass, block: BlockCompute, name: str, style: str | None, tp: int, rate: float, recomputed: bool
) -> None:
    """Add a LoRA adapter's traffic on the layer ``name`` to a block's pass (mutates ``one``).

    ``automodel_peft.memory.lora_traffic_bytes`` of the layer's input and output on the rank: a
    column-parallel layer reads its whole input and writes a ``1 / tp`` of its output, a row-parallel
    one the reverse. Its elementwise part is fused under compile like the block's (``rate``); the
    forward runs again in a recompute.
    """
    from automodel_peft.memory import lora_traffic_bytes

    read, written = _rank_bytes(
        block.matmul_input_bytes.get(name, 0.0), block.matmul_output_bytes.get(name, 0.0), style, tp
    )
    forward, backward = lora_traffic_bytes(read, written)
    one.forward += forward / rate
    one.backward += backward / rate
    if recomputed:
        one.recompute += forward / rate


def _add_partial_sums(one: _Pass, segments: list[_Segment], per_byte: float, checkpointing: Any) -> None:
    """Add async TP's reductions of partial sums to a block's pass (mutates ``one``).

    torch's fused matmul-reduce-scatter (``_fused_matmul_reduce_scatter``) gathers every rank's partial
    products of the rank's rows into one buffer and sums them in a kernel of its own on the compute
    stream: it reads the whole unreduced tensor and writes a ``1 / tp`` of it (``per_byte``: the
    seconds of that per byte). In each forward run (a full recompute's too) that is every row-parallel
    layer's output; in backward, the input gradient of each column-parallel group torch fuses
    (`_Segment.fused_in_backward`).
    """
    forward = sum(s.summed_bytes for s in segments if s.style == "rowwise") * per_byte
    backward = sum(s.summed_bytes for s in segments if s.style == "colwise" and s.fused_in_backward)
    one.forward += forward
    one.backward += backward * per_byte
    if checkpointing == "full":
        one.recompute += forward


def _rank_pass(
    facts: Any, compute: ComputeProfile, kinds: WeightKinds, rates: _Rates, options: StepOptions
) -> _Pass:
    tp, cp = facts.layout.tp, facts.layout.cp
    total = _Pass()
    count = len(compute.blocks)
    parts: list[tuple[BlockCompute, int]] = [(compute.blocks[b], b) for b in facts.blocks if b < count]
    if facts.last_stage:
        parts.append((compute.outside, -1))
    for block, index in parts:
        scaled = dataclasses.replace(  # each query meets cp times the keys of the rank's shard
            block,
            attention_flops=block.attention_flops * cp,
            causal_attention_flops=block.causal_attention_flops * cp,
        )
        one = _block_pass(scaled, index, kinds, rates, tp, options, facts.layout.ep)
        if cp > 1 and index >= 0:
            kv_heads, head_dim = facts.attention
            keys_values = 2.0 * facts.tokens * kv_heads * head_dim  # what the kernel gets, before TP
            steps = (cp - 1) / tp / rates.eager_memory
            _add_ring_merges(one, block.attention_outputs * steps, keys_values * steps, options)
        for name in vars(total):
            setattr(total, name, getattr(total, name) + getattr(one, name))
    return total


def _add_ring_merges(one: _Pass, outputs: float, keys_values: float, options: StepOptions) -> None:
    """Add ring attention's merges to a block's pass (mutates ``one``).

    Each ring step after the first merges its output into the running one in forward (again in a full
    recompute; selective checkpointing saves the attention's output) and accumulates the gradients of
    its query, keys and values in backward. ``outputs`` and ``keys_values``: the seconds of moving one
    byte per element of the attention's output, and of its keys and values, once in every ring step
    after the first.
    """
    forward = _RING_OUTPUT_FORWARD * outputs + _RING_KV_FORWARD * keys_values
    one.forward += forward
    one.backward += _RING_OUTPUT_BACKWARD * outputs + _RING_KV_BACKWARD * keys_values
    if options.checkpointing == "full":
        one.recompute += forward


class _Exposure(NamedTuple):
    """What a rank's collectives cost beyond its compute (`_exposed`)."""

    parts: dict[str, float]
    """``exposed <collective>`` -> seconds the step waits for it."""
    in_pass: float
    """Seconds exposed call by call, per pass: they lengthen each pass on a pipeline's schedule."""
    overlapped: float
    """Seconds NCCL kernels run beside compute (the hidden share of the collectives that hide)."""


def _exposed(
    collectives: list[Collective],
    facts: Any,
    cluster: Cluster,
    efficiency: Efficiency,
    one: _Pass,
    async_tp: bool,
) -> _Exposure:
    """Seconds each collective adds to the step beyond what hides behind compute, and what hides.

    See the module doc. A collective issued in every pass hides behind that pass's compute; one issued
    once per step (the gradient reduction under accumulation or a pipeline) only behind the last pass's.
    What is exposed call by call (TP's, EP's, a stage's send/receive, ring attention's excess over its
    steps) lengthens every pass, and a pipeline's schedule with it. Async TP's micro-pipelined
    collectives are not counted as overlapped NCCL kernels: torch runs them on symmetric memory.
    """
    passes, layout = facts.accumulation, facts.layout
    per_pass = {Overlap.FORWARD: one.forward, Overlap.BACKWARD: one.backward + one.recompute}
    # A ring attention step: a 1 / cp of one block's attention in that phase (the steps do equal work).
    steps = max(len(facts.blocks), 1) * layout.cp
    per_step = {
        Overlap.RING_STEP_FORWARD: one.attention_forward / steps,
        Overlap.RING_STEP_BACKWARD: one.attention_backward / steps,
    }
    out: dict[str, float] = {}
    in_pass = overlapped = 0.0
    pooled: dict[Overlap, list[tuple[str, float, bool]]] = {}
    after: list[tuple[str, float]] = []
    for c in collectives:
        size, stride = (layout.world_size, 1) if c.axis == "world" else layout.group(c.axis)
        per_call = (
            cluster.seconds(c.bytes_per_call, c.pattern, size, stride, c.node_fanout) / efficiency.network
        )
        if c.pattern == "ring" and c.operations > 0:  # each NCCL operation's latency
            each = per_call / c.operations
            per_call += c.operations * cluster.nccl_latency(size, stride, each, c.all_reduce)
        seconds = c.calls * per_call
        if c.overlap in per_step:  # call by call: each hides behind one step only
            seconds = c.calls * max(per_call - per_step[c.overlap], 0.0)
            overlapped += c.calls * min(per_call, per_step[c.overlap])
        elif c.overlap is Overlap.AFTER_LAST_BACKWARD:
            after.append((c.name, seconds))
            continue
        elif c.overlap is Overlap.EXPOSED:
            if async_tp and c.name == TP_BLOCK_COLLECTIVE and c.calls:  # no calls: a stage without blocks
                seconds = _micro_pipelined(seconds / c.calls, one.tp_segments, facts) * passes
        else:
            pooled.setdefault(c.overlap, []).append((c.name, seconds, c.calls >= passes))
            continue
        out[c.name] = out.get(c.name, 0.0) + seconds
        in_pass += seconds / passes
    for overlap, entries in pooled.items():
        every = sum(seconds for _, seconds, each in entries if each) / passes
        once = sum(seconds for _, seconds, each in entries if not each)
        total = every * passes + once
        # FSDP's first all-gather and last reduction have nothing to hide behind: one unit's share.
        edge = (every + once) / max(len(facts.units), 1)
        window = per_pass[overlap]
        exposed = (passes - 1) * max(every - window, 0.0) + max(every + once - window, 0.0) + edge
        overlapped += max(total - exposed, 0.0)
        for name, seconds, _ in entries:
            out[name] = out.get(name, 0.0) + (exposed * seconds / total if total else 0.0)
    if after:  # a pipeline rank's reductions after its last backward
        chunks = max(len(facts.stage_blocks), 1)  # a rank whose stages hold no block drains as one
        _add_drained(out, after, facts.index * (one.backward + one.recompute) / chunks)
    return _Exposure({f"exposed {name}": seconds for name, seconds in out.items()}, in_pass, overlapped)


def _add_drained(out: dict[str, float], after: list[tuple[str, float]], drain: float) -> None:
    """Add the reductions a pipeline rank waits for after its last backward to ``out`` (mutated).

    They run one after another once the rank's last stage chunk has run its backward; pipeline rank
    ``r`` does so ``r`` chunk backwards before rank 0 (1F1B's and the interleaved schedules' drain passes
    each last micro-batch's gradient down the ranks), idle time they fill before being exposed.
    """
    total = sum(seconds for _, seconds in after)
    exposed = max(total - drain, 0.0)
    for name, seconds in after:
        out[name] = out.get(name, 0.0) + (exposed * seconds / total if total else 0.0)


def _micro_pipelined(per_block: float, segments: list[tuple[_Segment, ...]], facts: Any) -> float:
    """Seconds one pass's TP collectives add under async TP (see the module doc).

    ``per_block`` is one block's TP traffic time in a pass: two all-gathers in each of the forward's
    gather runs, two reduce-scatters in each of its runs, and the same four in backward (the TP term's
    count). Each is paired with one of the block's segments in forward order; one without a segment
    hides behind nothing, nor does the backward collective of a segment torch does not fuse there
    (`_Segment.fused_in_backward`). A recompute hides behind the segment's matmuls it runs again: all
    of them under full checkpointing; under selective checkpointing, which gathers again what it did
    not save, those whose outputs it did not save (`_Segment.recomputed_seconds`): the gathered input
    also feeds the weight gradients, as the second operand of their matmuls, which torch's pass does not
    fuse (``micro_pipeline_tp._find_consumer_matmuls`` takes a matmul whose first operand it is).
    """
    tp = facts.layout.tp
    runs = (facts.gather_runs, facts.forward_runs) * 2  # all-gather, reduce-scatter, in forward order
    each = per_block / (2 * (runs[0] + runs[1]) + 4)
    out = 0.0
    for block in segments:
        for i in range(4):
            segment = block[i] if i < len(block) else None
            share = (tp - 1) / tp
            hidden = segment.seconds * share if segment is not None else 0.0
            forward = max(each - hidden, 0.0)
            recompute = max(each - (segment.recomputed_seconds * share if segment is not None else 0.0), 0.0)
            backward = forward if segment is not None and segment.fused_in_backward else each
            out += forward + (runs[i] - 1) * recompute + backward
    return out


def estimate_step_time(
    *,
    ranks: Sequence[Any],
    terms: Sequence[Any],
    compute: ComputeProfile,
    kinds: WeightKinds,
    cluster: Cluster,
    tokens_per_step: int,
    options: StepOptions,
    stages_per_rank: int = 1,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> StepTime:
    """The step time of the slowest rank, by part, and the throughput it gives.

    Args:
        ranks: Every pipeline rank's facts (`automodel_planner.facts.RankFacts`; one without pipelining).
        terms: The job's planner terms (their ``collectives``).
        compute: The fake forward's work for one micro-batch on one rank (before TP).
        kinds: `weight_kinds` of the job's model.
        cluster: The hardware.
        tokens_per_step: Tokens of the global batch.
        options: Compile, float8, async TP, checkpointing.
        stages_per_rank: ``v`` of a looped pipeline schedule.
        efficiency: The achievable fractions.
    """
    rates = _Rates.of(cluster, efficiency, options)
    slowest: tuple[float, StepTime] | None = None
    pipelined = ranks[0].pipelined
    passes_by_rank = [_rank_pass(f, compute, kinds, rates, options) for f in ranks]
    for facts, one in zip(ranks, passes_by_rank, strict=True):
        # The terms' own kernels (deferred gradients' accumulation), spread over the passes' backward.
        one.backward += sum(t.traffic(facts) for t in terms) / facts.accumulation / rates.eager_memory
    exposed_by_rank = [
        _exposed(
            [c for term in terms for c in term.collectives(f)], f, cluster, efficiency, one, options.async_tp
        )
        for f, one in zip(ranks, passes_by_rank, strict=True)
    ]
    # A pass's length on the schedule: its compute and what it waits for on its own critical path.
    lengths = [
        p.forward + p.backward + p.recompute + e.in_pass
        for p, e in zip(passes_by_rank, exposed_by_rank, strict=True)
    ]
    stage_pass = max(lengths)
    # A NCCL kernel holds one SM per channel for as long as it runs (one CTA per channel, NVIDIA/nccl
    # src/enqueue.cc): the compute beside it does that share less of its work meanwhile.
    held = cluster.device.nccl_channels / cluster.device.sm_count
    for facts, one, (exposed, _, overlapped), length in zip(
        ranks, passes_by_rank, exposed_by_rank, lengths, strict=True
    ):
        passes = facts.accumulation
        step = StepTime(rank=facts.label)
        step.parts["compute"] = passes * (one.forward + one.backward)
        step.parts["recompute"] = passes * one.recompute
        if pipelined:
            bubble = (facts.layout.pp - 1) / stages_per_rank * stage_pass
            # Every rank waits for the slowest stage: its passes set the pace.
            step.parts["pipeline bubble"] = bubble + passes * (stage_pass - length)
        step.parts.update(exposed)
        step.parts[OVERLAP_PART] = overlapped * held
        memory_rate = cluster.device.hbm_bytes_per_s * efficiency.memory
        step.parts["optimizer"] = _ADAMW_TRAFFIC * facts.states / memory_rate
        if slowest is None or step.step_seconds > slowest[0]:
            slowest = (step.step_seconds, step)
    assert slowest is not None, "no rank"
    result = slowest[1]
    result.tokens_per_step = tokens_per_step
    result.world_size = ranks[0].layout.world_size
    result.model_flops_per_token = model_flops_per_token(compute, kinds, cp=ranks[0].layout.cp)
    result.peak_flops = cluster.device.bf16_flops
    return result


def model_flops_per_token(compute: ComputeProfile, kinds: WeightKinds, *, cp: int = 1) -> float:
    """Training FLOPs per token as torchtitan counts them (see the module doc), from the fake forward.

    Under context parallelism the profile is one rank's shard of the sequence, whose attention saw
    only its own keys: each query meets ``cp`` times as many in the real step.
    """
    flops = 0.0
    parts = [(b, i) for i, b in enumerate(compute.blocks)] + [(compute.outside, -1)]
    for block, index in parts:
        for name, value in block.matmul_flops.items():
            kind = kinds(index, name)
            flops += value * (3.0 if kind.trainable else 2.0) if kind.weighted else 0.0
        flops += 3.0 * block.attention_flops * cp
    return flops / compute.tokens
