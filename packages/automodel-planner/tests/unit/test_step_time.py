"""The time model: FLOPs from the fake forward, torchtitan's count, hardware, and what each setting moves."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel_distributed.config import FSDP2Config
from automodel_mesh import MeshKind, ParallelismSizes, resolve_layout
from automodel_planner import PlanInput
from automodel_planner.activations import profile_step
from automodel_planner.estimate import estimate_peak, estimate_throughput
from automodel_planner.hardware import DEVICES, cluster_from_mapping, parse_cluster
from automodel_planner.step_time import DEFAULT_EFFICIENCY, model_flops_per_token, weight_kinds

H, FFN, LAYERS, HEADS, KV, VOCAB = 256, 704, 8, 8, 2, 1000


def _config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=False,
    )  # fmt: skip


def _meta_model(config: LlamaConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _plan(world: int = 8, seq: int = 512, **changes: object) -> PlanInput:
    config = _config()
    sizes = changes.pop("sizes", {})
    plan = PlanInput(
        model=_meta_model(config),
        model_config=config,
        layout=resolve_layout(MeshKind.FSDP2, ParallelismSizes(**sizes), world),  # type: ignore[arg-type]
        strategy=FSDP2Config(),
        dtype=torch.bfloat16,
        seq_len=seq,
        micro_batch_size=2,
    )
    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


def _non_embedding_params(config: LlamaConfig) -> int:
    head_dim = H // HEADS
    attention = H * HEADS * head_dim * 2 + H * KV * head_dim * 2
    mlp = 3 * H * FFN
    return LAYERS * (attention + mlp) + H * VOCAB  # the LM head counts; the embedding does not


def test_the_fake_forward_counts_every_matmul_and_the_attention_exactly() -> None:
    config, batch, seq = _config(), 2, 128
    compute = profile_step(config, micro_batch=batch, seq_len=seq, dtype=torch.bfloat16).compute
    tokens = batch * seq
    # Weight matmuls only: some transformers versions compute the rotary angles as a matmul too.
    matmuls = sum(b.matmul_total for b in compute.blocks) + compute.outside.matmul_flops["lm_head"]
    assert matmuls == 2 * _non_embedding_params(config) * tokens
    assert compute.blocks[0].matmul_flops["self_attn.q_proj"] == 2 * tokens * H * H
    assert all(b.attention_flops == 4 * batch * HEADS * seq * seq * (H // HEADS) for b in compute.blocks)
    assert all(b.causal_attention_flops == b.attention_flops for b in compute.blocks)  # is_causal, no mask
    assert all(b.attention_outputs == batch * HEADS * seq * (H // HEADS) for b in compute.blocks)
    assert all(b.memory_bytes > 0 for b in compute.blocks) and compute.outside.memory_bytes > 0
    # Selective checkpointing recomputes every other matmul of a block's call (the 2nd, 4th, ...): of
    # Llama's q, k, v, o, gate, up, down, it saves q, v, gate and down.
    recomputed = {"self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"}
    for block in compute.blocks:
        assert set(block.recomputed_matmul_flops) == recomputed
        assert all(block.recomputed_matmul_flops[n] == block.matmul_flops[n] for n in recomputed)
    k_proj = {
        "input": compute.blocks[0].matmul_input_bytes["self_attn.k_proj"],
        "weight": compute.blocks[0].matmul_weight_bytes["self_attn.k_proj"],
        "output": compute.blocks[0].matmul_output_bytes["self_attn.k_proj"],
    }
    assert k_proj == {
        "input": tokens * H * 2,
        "weight": H * KV * (H // HEADS) * 2,
        "output": tokens * KV * (H // HEADS) * 2,
    }


def test_a_matmul_takes_the_longer_of_its_flops_and_its_bytes() -> None:
    from automodel_planner.compute import BlockCompute
    from automodel_planner.step_time import StepOptions, WeightKind, _block_pass, _Rates

    h100 = parse_cluster("8xH100")
    # A wide matmul (compute-bound) and a thin one (64 outputs per row: bound by the input it reads).
    tokens, width = 8192, 4096
    block = BlockCompute(
        matmul_flops={"wide": 2.0 * tokens * width * width, "thin": 2.0 * tokens * width * 64},
        matmul_input_bytes={"wide": tokens * width * 2.0, "thin": tokens * width * 2.0},
        matmul_weight_bytes={"wide": width * width * 2.0, "thin": width * 64 * 2.0},
        matmul_output_bytes={"wide": tokens * width * 2.0, "thin": tokens * 64 * 2.0},
    )

    def forward(name: str, tp: int, style: str | None, fp8: bool = False) -> float:
        one = BlockCompute(
            **{f: {name: getattr(block, f)[name]} for f in vars(block) if f.startswith("matmul")}
        )
        options = StepOptions(fp8=fp8)
        rates = _Rates.of(h100, DEFAULT_EFFICIENCY, options)
        kinds = lambda index, module: WeightKind(True, True, True, style)  # noqa: E731
        return _block_pass(one, 0, kinds, rates, tp, options).forward

    rates = _Rates.of(h100, DEFAULT_EFFICIENCY, StepOptions())
    assert forward("wide", 1, None) == pytest.approx(block.matmul_flops["wide"] / rates.matmul)
    thin = (tokens * width + width * 64 + tokens * 64) * 2.0
    assert forward("thin", 1, None) == pytest.approx(thin / rates.eager_memory)
    # Column-parallel: the whole gathered input, a 1/tp of the weight and output; float8 operands: 1 byte.
    colwise = tokens * width * 2.0 + (width * 64 + tokens * 64) * 2.0 / 4
    assert forward("thin", 4, "colwise") == pytest.approx(colwise / rates.eager_memory)
    fp8 = (tokens * width + width * 64 / 4) + tokens * 64 * 2.0 / 4
    assert forward("thin", 4, "colwise", fp8=True) == pytest.approx(fp8 / rates.eager_memory)


def test_model_flops_are_torchtitans_count_and_a_frozen_weight_drops_its_weight_gradient() -> None:
    config, seq = _config(), 256
    model = _meta_model(config)
    from automodel_distributed.blocks import find_transformer_blocks

    compute = profile_step(config, micro_batch=1, seq_len=seq, dtype=torch.bfloat16).compute
    kinds = weight_kinds(model, find_transformer_blocks(model))
    torchtitan = 6 * _non_embedding_params(config) + 12 * LAYERS * HEADS * (H // HEADS) * seq
    assert model_flops_per_token(compute, kinds) == torchtitan
    for param in model.model.layers.parameters():
        param.requires_grad_(False)
    frozen = model_flops_per_token(compute, weight_kinds(model, find_transformer_blocks(model)))
    block_matmuls = 2 * (_non_embedding_params(config) - H * VOCAB)
    assert frozen == torchtitan - block_matmuls  # 3x -> 2x forward for every block weight


def test_clusters_parse_and_groups_inside_a_node_use_nvlink() -> None:
    cluster = parse_cluster("16 x h100")
    assert cluster.device is DEVICES["h100"] and cluster.nodes == 2
    nvlink, network, sent = (
        DEVICES["h100"].intra_node_bytes_per_s,
        DEVICES["h100"].inter_node_bytes_per_s,
        1e9,
    )
    assert cluster.seconds(sent, "ring", 8, 1) == sent / nvlink  # one node
    # One rank per node: the whole ring runs over each rank's network link.
    assert cluster.seconds(sent, "ring", 2, 8) == pytest.approx(sent / network)
    # Eight ranks per node: eight rings, one per network link, each carrying a rank's share into the
    # node (every chunk but one passes it) while NVLink carries it inside; the slower counts (the network).
    assert sent / nvlink < sent / (8 * network) == cluster.seconds(sent, "ring", 16, 1)
    # Four per node (the other four in another group): four links.
    assert cluster.seconds(sent, "ring", 8, 2) == pytest.approx(sent / (4 * network))
    assert cluster.seconds(sent, "all_to_all", 16, 1) == pytest.approx(sent * 8 / 15 / network)
    assert cluster.seconds(sent, "p2p", 2, 8) == sent / network
    # DeepEP's exchange (a `NodeFanout`): every copy on NVLink, its network share on the rank's link.
    fanout = SimpleNamespace(network_share=lambda ranks_per_node: 0.25 if ranks_per_node < 16 else 0.0)
    assert cluster.seconds(sent, "all_to_all", 16, 1, fanout) == pytest.approx(sent * 0.25 / network)
    assert cluster.seconds(sent, "all_to_all", 8, 1, fanout) == sent / nvlink  # one node
    own = cluster_from_mapping({"gpus": 4, "device": "A100", "gpus_per_node": 4, "inter_node_gbps": 200})
    assert own.device.inter_node_bytes_per_s == 25e9 and own.gpus_per_node == 4
    for bad, fragment in (
        ("8H100", "expected GPUs x device"),
        ("0xH100", "at least 1"),
        ("8xV100", "unknown"),
    ):
        with pytest.raises(ValueError, match=fragment):
            parse_cluster(bad)
    with pytest.raises(ValueError, match=r"cluster\.gpus"):
        cluster_from_mapping({"device": "H100"})
    with pytest.raises(ValueError, match="unknown key"):
        cluster_from_mapping({"gpus": 8, "device": "H100", "nvlink": 1})
    own_device = {
        "name": "X", "bf16_flops": 1e15, "fp8_flops": None, "hbm_bytes_per_s": 3e12, "memory_bytes": 2**36,
        "intra_node_bytes_per_s": 4e11,
    }  # fmt: skip
    assert cluster_from_mapping({"gpus": 8, "device": own_device}).device.sm_count == 132
    # Unmeasured, a device's best matmul is the H100's share of its peak (792.1 of 989 TFLOPS).
    assert cluster_from_mapping({"gpus": 8, "device": own_device}).device.matmul_share == pytest.approx(
        0.8006, abs=1e-4
    )
    for changes, fragment in (
        ({"sm_count": 16}, r"cluster\.device: sm_count: 16 SMs cannot host the 32 NCCL channels"),
        ({"matmul_share": 1.2}, r"cluster\.device: matmul_share: expected a share of the peak in \(0, 1\]"),
        ({"hbm_bytes_per_s": 0}, r"cluster\.device: hbm_bytes_per_s: expected a positive number"),
        ({"memory_bytes": "80GB"}, r"cluster\.device: memory_bytes: expected a positive number, got '80GB'"),
    ):
        with pytest.raises(ValueError, match=fragment):
            cluster_from_mapping({"gpus": 8, "device": {**own_device, **changes}})
    for bad in (0, None):
        with pytest.raises(ValueError, match=r"cluster\.gpus_per_node: expected a positive number"):
            cluster_from_mapping({"gpus": 8, "device": "H100", "gpus_per_node": bad})


def test_a_masked_attention_call_computes_its_whole_score_matrix() -> None:
    from transformers import MistralConfig

    # A sliding window shorter than the sequence: transformers hands SDPA a mask, and SDPA's fused
    # kernels compute every score of a masked call; a causal call without one, half of them.
    fields = {
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
    }
    fields |= {"num_key_value_heads": KV, "vocab_size": VOCAB}
    sliding = MistralConfig(**fields, sliding_window=128)
    causal = MistralConfig(**fields, sliding_window=None)
    profiles = [
        profile_step(c, micro_batch=2, seq_len=512, dtype=torch.bfloat16).compute for c in (sliding, causal)
    ]
    assert [b.causal_attention_flops for b in profiles[0].blocks] == [0.0, 0.0]
    assert all(b.causal_attention_flops == b.attention_flops > 0 for b in profiles[1].blocks)
    assert profiles[0].blocks[0].attention_flops == profiles[1].blocks[0].attention_flops

    from automodel_planner.hardware import Cluster
    from automodel_planner.step_time import StepOptions, _block_pass, _Rates

    rates = _Rates.of(Cluster(DEVICES["h100"], 1, 8), DEFAULT_EFFICIENCY, StepOptions())
    kinds = weight_kinds(_meta_model(_config()), [])  # no block weights: the attention alone
    masked, unmasked = (_block_pass(p.blocks[0], -1, kinds, rates, 1, StepOptions()) for p in profiles)
    assert masked.attention_forward == pytest.approx(2 * unmasked.attention_forward)

    # flash-attn's kernel (and FlexAttention's) takes the window and skips the tiles outside it: the
    # band of 128 keys before each of 512 queries (the first 128 see fewer).
    flash = profile_step(
        sliding, micro_batch=2, seq_len=512, dtype=torch.bfloat16, attn_implementation="flash_attention_2"
    )
    band = (128 * 129 / 2 + (512 - 128) * 128) / 512**2
    for block in flash.compute.blocks:
        assert block.window_attention_flops == block.causal_attention_flops == block.attention_flops
        assert block.window_band_flops == pytest.approx(band * block.attention_flops)
    windowed = _block_pass(flash.compute.blocks[0], -1, kinds, rates, 1, StepOptions())
    assert windowed.attention_forward == pytest.approx(2 * band * unmasked.attention_forward)


def test_each_nccl_operation_pays_the_latency_nccls_tuner_gives_it() -> None:
    from automodel_planner.estimate import _planned_ranks
    from automodel_planner.step_time import _exposed, _Pass

    us = 1e-6
    cluster = parse_cluster("16xH100")  # two NVLink nodes: 14 ring steps inside, 1 across the network
    simple, ll128 = (8.4 + 14 * 3.4 + 14.0) * us, (14.0 + 14 * 1.9 + 4.0) * us
    assert cluster.nccl_latency(16, 1, 1e-6) == pytest.approx(ll128 + 1e-6 * (128 / 120 - 1))  # small: LL128
    assert cluster.nccl_latency(16, 1, 1.0) == pytest.approx(simple)  # large: Simple's full bandwidth
    assert cluster.nccl_latency(2, 8, 1.0) == pytest.approx((8.4 + 14.0) * us)  # one rank per node
    assert cluster.nccl_latency(1, 1, 1.0) == 0.0
    pcie = parse_cluster("8xH100-PCIe")  # no LL128 off NVLink; PCIe's step
    assert pcie.nccl_latency(8, 1, 1e-6) == pytest.approx((8.4 + 7 * 5.7) * us)
    # An all-reduce over 64 nodes, a rank in each: a ring's 126 network steps or a tree's 6 levels each
    # way; the tree's LL128 wins a small one, the ring's Simple (its whole bandwidth) a large one.
    big = parse_cluster("512xH100")
    tree = (14.0 + 2 * 6 * 8.5) * us
    assert big.nccl_latency(64, 8, 1e-6, all_reduce=True) == pytest.approx(
        tree + 1e-6 * (64 / 63 / (0.92 * 120 / 128) - 1)
    )
    assert big.nccl_latency(64, 8, 1.0, all_reduce=True) == pytest.approx((8.4 + 126 * 14.0) * us)

    # The time model pays it per operation: FSDP's per unit, TP's per collective of a block.
    plan = _plan(world=16, sizes={"tp_size": 2})
    step = estimate_throughput(plan, cluster)
    _, _, terms, (facts,) = _planned_ranks(plan, None)
    collectives = [c for term in terms for c in term.collectives(facts)]
    fsdp = next(c for c in collectives if c.name.startswith("FSDP all-gather"))
    tp = next(c for c in collectives if c.name.startswith("TP all-reduce"))
    assert fsdp.operations == len(facts.units) > LAYERS  # a unit per block, and those outside them
    # Without sequence parallelism, as halves of all-reduces: the two row-parallel outputs in forward,
    # in backward the input gradients of attention and the MLP (q, k and v's summed; gate and up's).
    assert tp.operations == 2 * 2 + 2 * 2
    size, stride = plan.layout.group("tp")
    exposed, _, _ = _exposed([tp], facts, cluster, DEFAULT_EFFICIENCY, _Pass(), async_tp=False)
    each = cluster.seconds(tp.bytes_per_call / tp.operations, "ring", size, stride)
    each /= DEFAULT_EFFICIENCY.network
    latency = cluster.nccl_latency(size, stride, each)
    assert latency > 0
    assert exposed[f"exposed {tp.name}"] == pytest.approx(tp.calls * tp.operations * (each + latency))
    assert step.parts[f"exposed {tp.name}"] == pytest.approx(tp.calls * tp.operations * (each + latency))


def test_each_setting_moves_the_step_the_way_the_hardware_says() -> None:
    h100 = parse_cluster("8xH100")
    base = estimate_throughput(_plan(), h100)
    assert base.step_seconds > 0 and 0 < base.mfu < 1
    assert base.tokens_per_step == 2 * 8 * 512
    compiled = estimate_throughput(_plan(compile=True), h100)
    assert compiled.step_seconds < base.step_seconds
    full = estimate_throughput(_plan(strategy=FSDP2Config(activation_checkpointing="full")), h100)
    selective = estimate_throughput(_plan(strategy=FSDP2Config(activation_checkpointing="selective")), h100)
    assert base.parts["recompute"] == 0 < selective.parts["recompute"] < full.parts["recompute"]
    assert full.model_flops_per_token == base.model_flops_per_token, "recompute is not model FLOPs"
    from automodel_quant.fp8 import FP8Config

    fp8 = FP8Config(enabled=True)
    # This small model's step waits on its all-gathers (NCCL's latency per unit), whatever float8 saves.
    assert estimate_throughput(_plan(fp8=fp8), h100).parts["compute"] < base.parts["compute"]
    a100 = parse_cluster("8xA100")
    assert estimate_throughput(_plan(), a100).step_seconds > base.step_seconds
    # A matmul runs at a fraction of the best rate the part reaches (its measured share of the peak).
    from automodel_planner.step_time import StepOptions, _Rates

    for cluster, best in ((a100, 267.9e12), (h100, 792.1e12)):
        rates = _Rates.of(cluster, DEFAULT_EFFICIENCY, StepOptions())
        assert rates.matmul == pytest.approx(best * DEFAULT_EFFICIENCY.matmul, rel=1e-3)
    with pytest.raises(ValueError, match="float8 tensor cores"):  # torchao's float8 cannot run there
        estimate_throughput(_plan(fp8=fp8), a100)
    with pytest.raises(ValueError, match="the cluster has 16 GPUs"):
        estimate_throughput(_plan(), parse_cluster("16xH100"))


def test_collectives_are_exposed_where_they_cannot_hide_and_across_nodes_more() -> None:
    inside = estimate_throughput(_plan(world=8), parse_cluster("8xH100"))
    across = estimate_throughput(_plan(world=16), parse_cluster("16xH100"))
    fsdp = [k for k in inside.parts if k.startswith("exposed FSDP")]
    assert fsdp and all(across.parts[k] > inside.parts[k] for k in fsdp)
    tp = estimate_throughput(_plan(sizes={"tp_size": 2}), parse_cluster("8xH100"))
    assert tp.parts["exposed TP all-reduce (or AG+RS)"] > 0
    async_tp = estimate_throughput(
        _plan(
            sizes={"tp_size": 2},
            strategy=FSDP2Config(
                sequence_parallel=True, enable_async_tensor_parallel=True, enable_compile=True
            ),
        ),
        parse_cluster("8xH100"),
    )
    assert async_tp.parts["exposed TP all-reduce (or AG+RS)"] < tp.parts["exposed TP all-reduce (or AG+RS)"]


def test_a_recompute_repeats_the_forward_collectives_and_async_tp_hides_only_behind_paired_matmuls() -> None:
    from types import SimpleNamespace

    from automodel_moe.memory import ExpertMemory
    from automodel_planner.step_time import _add_partial_sums, _micro_pipelined, _Pass, _Segment

    h100, name = parse_cluster("8xH100"), "exposed TP all-reduce (or AG+RS)"

    def tp_exposed(save_ops: tuple[str, ...] | None = None, **strategy: Any) -> float:
        plan = _plan(
            sizes={"tp_size": 2},
            strategy=FSDP2Config(sequence_parallel=True, **strategy),
            selective_save_ops=save_ops,
        )
        return estimate_throughput(plan, h100).parts[name]

    plain = tp_exposed()
    # Full checkpointing runs each block's forward twice: 2 + 2 all-reduces' worth -> 4 + 2.
    assert tp_exposed(activation_checkpointing="full") == pytest.approx(1.5 * plain)
    # Selective checkpointing saves the collectives' outputs (SELECTIVE_AC_ALWAYS_SAVE_OPS).
    assert tp_exposed(activation_checkpointing="selective") == pytest.approx(plain)
    # torchtitan's save list has no all-gather: its two all-gathers per block run again, 8 -> 10.
    torchtitan = ("aten.mm.default", "_c10d_functional.reduce_scatter_tensor.default")
    assert tp_exposed(torchtitan, activation_checkpointing="selective") == pytest.approx(1.25 * plain)
    assert tp_exposed(torchtitan) == pytest.approx(plain), "no checkpointing, nothing recomputed"
    assert 0 < tp_exposed(enable_async_tensor_parallel=True, enable_compile=True) < plain
    # Async TP sums the partial products of each row-parallel layer (o_proj, down_proj: b x s x H each,
    # bf16) in a kernel of its own: (1 + 1/tp) of them per forward. Not in backward: Llama's column-parallel
    # groups (q, k, v; gate, up) sum their input gradients before the reduce-scatter, which stays unfused.
    plan = _plan(
        sizes={"tp_size": 2},
        strategy=FSDP2Config(sequence_parallel=True, enable_async_tensor_parallel=True, enable_compile=True),
    )
    rate = h100.device.hbm_bytes_per_s * DEFAULT_EFFICIENCY.memory  # eager: no fusion applies
    sums = LAYERS * 2 * (2 * 512 * H * 2) * 1.5 / rate  # blocks x 2 layers x (rows x seq x H x 2 B) x 1.5
    synchronous = dataclasses.replace(plan, strategy=FSDP2Config(sequence_parallel=True, enable_compile=True))
    added = (
        estimate_throughput(plan, h100).parts["compute"]
        - estimate_throughput(synchronous, h100).parts["compute"]
    )
    # ... and moves the sequence dim in its fused kernels: of the plain collectives' 8 layout copies per
    # block (read and write the gathered b x s x H), backward's 2 grouped reduce-scatters' stay.
    copies = LAYERS * 6 * 2 * (2 * 512 * H * 2) / rate
    assert added == pytest.approx(sums - copies, rel=1e-6)
    # A fused projection (one matmul in its column-parallel group: Phi-3's qkv_proj) is fused in
    # backward too, and sums its input gradient there.
    one = _Pass()
    fused = _Segment("colwise", 1.0, 1, 100.0)
    layer = _Segment("rowwise", 0.1, 1, 50.0)
    group = _Segment("colwise", 1.0, 2, 100.0)
    _add_partial_sums(one, [fused, layer, group], 1.0, "full")
    assert (one.forward, one.backward, one.recompute) == (50.0, 100.0, 50.0)
    facts = SimpleNamespace(tokens=64, hidden_size=8, element_size=2, top_k=2, blocks=[0], accumulation=1)
    once, twice = (
        ExpertMemory(ep_size=4).collectives(SimpleNamespace(**vars(facts), forward_runs=r)) for r in (1, 2)
    )
    assert twice[0].bytes_per_call == pytest.approx(1.5 * once[0].bytes_per_call)

    # A Llama block pairs four collectives with [q, k, v] (one all-gather), o, [gate, up] and down.
    lookup = weight_kinds(_plan().model, [("model.layers.0", _plan().model.model.layers[0])])
    assert [lookup(0, n).tp_style for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")] == [
        "colwise", "rowwise", "rowwise",
    ]  # fmt: skip

    # Each collective (0.5 s) hides behind (tp - 1) / tp of its matmuls: at tp 4, 0.75 s of 1.0 s hides
    # it all, 0.075 s of 0.1 s leaves 0.425 s. In backward the row-parallel layers' all-gathers hide the
    # same; the column-parallel groups' reduce-scatters are fused only for a group of one matmul (a fused
    # qkv or gate_up projection): Llama's [q, k, v] and [gate, up] expose theirs whole (0.5 s each).
    def llama(matmuls: int, recomputed: float = 1.0) -> tuple[_Segment, ...]:
        """``recomputed``: the share of each segment's matmul seconds a recompute runs again."""
        return tuple(
            _Segment(style, seconds, count, recomputed_seconds=recomputed * seconds)
            for style, seconds, count in (
                ("colwise", 1.0, matmuls), ("rowwise", 0.1, 1), ("colwise", 3.0, matmuls), ("rowwise", 0.5, 1)
            )
        )  # fmt: skip

    rank = SimpleNamespace(layout=SimpleNamespace(tp=4), forward_runs=1, gather_runs=1)
    forward = 0.425 + 0.125
    assert _micro_pipelined(8 * 0.5, [llama(3)], rank) == pytest.approx(forward + (0.5 + 0.425 + 0.5 + 0.125))
    assert _micro_pipelined(8 * 0.5, [llama(1)], rank) == pytest.approx(2 * forward), "fused in backward"
    assert _micro_pipelined(8 * 0.5, [()], rank) == pytest.approx(8 * 0.5), "unpaired: all exposed"
    recomputed = SimpleNamespace(layout=SimpleNamespace(tp=4), forward_runs=2, gather_runs=2)
    assert _micro_pipelined(12 * 0.5, [llama(1)], recomputed) == pytest.approx(3 * forward)
    # Selective checkpointing that does not save the all-gathers (torchtitan's) gathers again in
    # backward, hidden behind the matmuls it recomputes only (the weight gradients that also read the
    # gathered input are not fused): half of them, 0.5 - 0.375 and 0.5 - 0.5 * 2.25; a sixth (Llama 3
    # 8B's q, k, v: k alone), 0.5 - 0.125 and 0.5 - 0.375; none, both whole.
    regathered = SimpleNamespace(layout=SimpleNamespace(tp=4), forward_runs=1, gather_runs=2)
    assert _micro_pipelined(10 * 0.5, [llama(1, 1 / 2)], regathered) == pytest.approx(
        2 * forward + 0.125 + 0.0
    )
    assert _micro_pipelined(10 * 0.5, [llama(1, 1 / 6)], regathered) == pytest.approx(
        2 * forward + 0.375 + 0.125
    )
    assert _micro_pipelined(10 * 0.5, [llama(1, 0.0)], regathered) == pytest.approx(2 * forward + 1.0)


def test_ring_attention_pays_its_merges_for_each_step_after_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from automodel_planner import step_time

    h100 = parse_cluster("8xH100")
    eager = h100.device.hbm_bytes_per_s * step_time.DEFAULT_EFFICIENCY.memory  # merges are not compiled

    def step(cp: int, merges: bool) -> step_time.StepTime:
        # Forward 40 and backward 20 bytes per output element, 4 and 8 per key/value element.
        for name, value in (
            ("OUTPUT_FORWARD", 40),
            ("OUTPUT_BACKWARD", 20),
            ("KV_FORWARD", 4),
            ("KV_BACKWARD", 8),
        ):
            monkeypatch.setattr(step_time, f"_RING_{name}", float(value) if merges else 0.0)
        strategy = FSDP2Config(activation_checkpointing="full", enable_compile=True)
        return estimate_throughput(_plan(sizes={"cp_size": cp}, strategy=strategy), h100)

    outputs = 2 * HEADS * (512 // 4) * (H // HEADS)  # one micro-batch's attention output on a rank
    keys_values = 2 * 2 * KV * (512 // 4) * (H // HEADS)  # its grouped keys and values
    with_merges, without = step(4, True), step(4, False)
    forward = 3 * (40 * outputs + 4 * keys_values) / eager  # three steps after the first
    backward = 3 * (20 * outputs + 8 * keys_values) / eager
    assert with_merges.parts["compute"] - without.parts["compute"] == pytest.approx(
        LAYERS * (forward + backward)
    )
    assert with_merges.parts["recompute"] - without.parts["recompute"] == pytest.approx(LAYERS * forward)
    assert step(1, True).parts == step(1, False).parts, "no ring, no merges"


def test_a_pipeline_pays_its_bubble_and_interleaving_shrinks_it() -> None:
    from automodel_pipelining.config import PipelineConfig

    def piped(schedule: str, **extra: object) -> dict[str, float]:
        config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=1, **extra)  # type: ignore[arg-type]
        plan = _plan(world=4, sizes={"pp_size": 4}, pipeline=config, micro_batch_size=1)
        return estimate_throughput(plan, parse_cluster("4xH100")).parts

    def stage_pass(parts: dict[str, float]) -> float:  # the slowest rank's pass: compute and its sends
        return (parts["compute"] + parts["recompute"] + parts["exposed PP send/recv"]) / 8

    one_f_one_b = piped("1f1b")
    interleaved = piped("interleaved_1f1b", layers_per_stage=1)  # 8 stages: 2 per rank
    assert one_f_one_b["pipeline bubble"] == pytest.approx(3 * stage_pass(one_f_one_b))  # (pp - 1) passes
    assert interleaved["pipeline bubble"] == pytest.approx(3 / 2 * stage_pass(interleaved))  # / v
    # Each of a rank's two stages sends its activations and gradients (counted per stage by
    # automodel_pipelining's test_each_stage_of_a_rank_sends_its_activations_and_gradients).
    assert interleaved["exposed PP send/recv"] > one_f_one_b["exposed PP send/recv"]

    # What a pass waits for call by call (here TP's collectives) lengthens it on the schedule too.
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=8, pp_microbatch_size=1)
    plan = _plan(world=8, sizes={"pp_size": 4, "tp_size": 2}, pipeline=config, micro_batch_size=1)
    step = estimate_throughput(plan, parse_cluster("8xH100"))
    passes = 8
    in_pass = sum(
        v for k, v in step.parts.items() if k.startswith("exposed TP") or k.startswith("exposed PP")
    )
    assert in_pass > 0
    busy = step.parts["compute"] + step.parts["recompute"] + in_pass  # the slowest rank's, all passes
    assert step.parts["pipeline bubble"] >= 3 * busy / passes * (1 - 1e-9)


def test_ring_attention_hides_each_gather_behind_one_step_of_its_attention() -> None:
    from types import SimpleNamespace

    from automodel_mesh import Collective, Overlap
    from automodel_planner.step_time import _exposed, _Pass

    cluster = parse_cluster("16xH100")
    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(cp_size=2), 16)
    facts = SimpleNamespace(accumulation=1, layout=layout, blocks=[0, 1], units=[1.0])
    size, stride = layout.group("cp")
    transfer = cluster.seconds(1e9, "ring", size, stride) / DEFAULT_EFFICIENCY.network
    gather = transfer + cluster.nccl_latency(size, stride, transfer)  # one NCCL operation each
    one = _Pass(attention_forward=4 * gather, attention_backward=10 * gather)  # 2 blocks x 2 steps
    collectives = [
        Collective("gather", "cp", 1e9, 6, Overlap.RING_STEP_FORWARD),  # 3 per block: over a step each
        Collective("gather", "cp", 1e9, 2, Overlap.RING_STEP_BACKWARD),  # hidden by a backward step
        Collective("last", "cp", 1e9, 2, Overlap.EXPOSED),
    ]
    parts, in_pass, overlapped = _exposed(
        collectives, facts, cluster, DEFAULT_EFFICIENCY, one, async_tp=False
    )
    assert parts["exposed gather"] == pytest.approx(0.0)  # a step (4 / 4 = 1 gather's time) hides each
    assert overlapped == pytest.approx(8 * gather)  # every hidden gather runs beside a step
    one = _Pass(attention_forward=2 * gather, attention_backward=10 * gather)
    parts, in_pass, overlapped = _exposed(
        collectives, facts, cluster, DEFAULT_EFFICIENCY, one, async_tp=False
    )
    assert parts["exposed gather"] == pytest.approx(6 * gather / 2)  # half of each forward gather shows
    assert parts["exposed last"] == pytest.approx(2 * gather)
    assert in_pass == pytest.approx(5 * gather)
    assert overlapped == pytest.approx(6 * gather / 2 + 2 * gather)  # what shows does not run beside


def test_a_pipeline_stage_gathers_and_reduces_its_fsdp_units_as_its_root_module_lets_torch() -> None:
    from automodel_distributed.memory import StageSync, StrategyMemory
    from automodel_mesh import Overlap

    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(pp_size=2, dp_replicate_size=2), 16)
    facts = SimpleNamespace(
        layout=layout, accumulation=4, units=[100, 100], unit_reduce=[200, 200], grads=50.0,
        unit_axes=["dp_shard_cp", "dp_shard_cp"], tokens=1, hidden_size=1, element_size=2, blocks=[0],
    )  # fmt: skip

    def calls(stage: StageSync | None, **config: Any) -> dict[str, tuple[float, Overlap]]:
        term = StrategyMemory(FSDP2Config(**config), reshard=False, stage=stage)
        return {c.name: (c.calls, c.overlap) for c in term.collectives(facts)}

    gathered, reduced, replicas = "FSDP all-gather x1", "FSDP reduce-scatter", "HSDP all-reduce"
    # Without a pipeline: each pass gathers again (FSDP reshards after every backward); deferred
    # gradients reduce in the last pass's backward, else in every one.
    assert calls(None) == {
        gathered: (4, Overlap.FORWARD),
        reduced: (1, Overlap.BACKWARD),
        replicas: (1, Overlap.BACKWARD),
    }
    assert calls(None, defer_fsdp_grad_sync=False)[replicas] == (4, Overlap.BACKWARD)
    # An FSDP root under torch's stage: gathered once per run, reduced after the stage's last backward.
    torch_stage = StageSync.for_stage(root_is_fsdp=True, defer=True, patch_nested=False)
    after = Overlap.AFTER_LAST_BACKWARD
    assert calls(torch_stage) == {gathered: (1, Overlap.FORWARD), reduced: (1, after), replicas: (1, after)}
    per_micro_batch = StageSync.for_stage(root_is_fsdp=True, defer=False, patch_nested=False)
    assert calls(per_micro_batch)[gathered][0] == 1 and calls(per_micro_batch)[reduced] == (
        4,
        Overlap.BACKWARD,
    )
    # A root that is not FSDP's: FSDP's own hooks reshard after every backward and reduce in it, unless
    # the patched stage defers the nested units' reduction to the last micro-batch.
    unmanaged = StageSync.for_stage(root_is_fsdp=False, defer=True, patch_nested=False)
    assert calls(unmanaged)[gathered] == (4, Overlap.FORWARD) and calls(unmanaged)[reduced][0] == 4
    patched = StageSync.for_stage(root_is_fsdp=False, defer=True, patch_nested=True)
    assert calls(patched)[gathered][0] == 4 and calls(patched)[reduced] == (1, Overlap.BACKWARD)
    # Gradients stay unsharded over the micro-batches (the memory line, AccumulateGrad's traffic) unless
    # every micro-batch reduces them.
    kept = {s: StrategyMemory(FSDP2Config(), reshard=False, stage=s).deferred(4) for s in (None, torch_stage)}
    assert kept == {None: True, torch_stage: True}
    assert not StrategyMemory(FSDP2Config(), reshard=False, stage=unmanaged).deferred(4)
    assert StrategyMemory(FSDP2Config(), reshard=False, stage=patched).deferred(4)


def test_a_reduction_after_the_last_backward_shows_but_for_the_ranks_drain() -> None:
    from automodel_mesh import Collective, Overlap
    from automodel_planner.step_time import _exposed, _Pass

    cluster = parse_cluster("64xH100")
    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(pp_size=4), 64)
    size, stride = layout.group("dp_shard_cp")
    transfer = cluster.seconds(1e9, "ring", size, stride) / DEFAULT_EFFICIENCY.network
    seconds = transfer + cluster.nccl_latency(size, stride, transfer)
    reduction = Collective("reduce-scatter", "dp_shard_cp", 1e9, 1, Overlap.AFTER_LAST_BACKWARD)
    one = _Pass(forward=seconds, backward=0.25 * seconds, recompute=0.25 * seconds)

    def exposed(rank: int, stages: int) -> tuple[float, float]:
        facts = SimpleNamespace(
            accumulation=8, layout=layout, blocks=[0, 1], units=[1.0], index=rank, stage_blocks=[[0]] * stages
        )
        parts, in_pass, overlapped = _exposed([reduction], facts, cluster, DEFAULT_EFFICIENCY, one, False)
        assert in_pass == 0.0  # after the rank's passes, not inside them
        return parts["exposed reduce-scatter"], overlapped

    assert exposed(0, 1) == (pytest.approx(seconds), 0.0)  # the last rank to finish: all of it shows
    assert exposed(1, 1)[0] == pytest.approx(0.5 * seconds)  # one pass's backward of drain before it
    assert exposed(1, 2)[0] == pytest.approx(0.75 * seconds)  # a chunk's, under two stages per rank
    assert exposed(3, 1)[0] == 0.0
    assert exposed(1, 0)[0] == pytest.approx(0.5 * seconds)  # a rank whose stages hold no block


def test_compute_beside_a_hidden_collective_loses_the_sms_its_nccl_kernels_hold() -> None:
    from automodel_mesh import Collective, Overlap
    from automodel_planner.step_time import OVERLAP_PART, _exposed, _Pass

    cluster = parse_cluster("16xH100")
    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(), 16)
    facts = SimpleNamespace(accumulation=1, layout=layout, blocks=[0, 1], units=[1.0, 1.0])
    gather = Collective("all-gather", "dp_shard", 1e9, 2, Overlap.FORWARD)
    exposure = _exposed([gather], facts, cluster, DEFAULT_EFFICIENCY, _Pass(forward=10.0), async_tp=False)
    # The first unit's gather has nothing to hide behind; the other one's runs beside the forward.
    assert exposure.overlapped == pytest.approx(exposure.parts["exposed all-gather"])
    assert estimate_throughput(_plan(world=1), parse_cluster("1xH100")).parts[OVERLAP_PART] == 0.0
    plan = _plan(world=16)
    step = estimate_throughput(plan, cluster)
    assert step.parts[OVERLAP_PART] > 0
    for changes in ({"nccl_channels": 16}, {"sm_count": 264}):  # the share of the SMs NCCL holds
        device = dataclasses.replace(cluster.device, **changes)
        halved = estimate_throughput(plan, dataclasses.replace(cluster, device=device))
        assert halved.parts[OVERLAP_PART] == pytest.approx(step.parts[OVERLAP_PART] / 2)


def test_gpus_are_found_by_the_names_cuda_reports_and_flops_per_token_is_the_time_models_count() -> None:
    from automodel_planner import device_named, flops_per_token

    for reported, key in (
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
    ):
        assert device_named(reported) is DEVICES[key], reported
    for other in ("NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090", "cpu"):
        assert device_named(other) is None, other
    plan = _plan()
    assert flops_per_token(plan) == estimate_throughput(plan, parse_cluster("8xH100")).model_flops_per_token


def test_plans_of_one_model_share_what_the_planner_derives_from_it() -> None:
    """`PlanInput.model_memo`: computed once per model object, the same estimates as without sharing."""
    plan = _plan()
    calls: list[int] = []

    def count() -> int:
        calls.append(1)
        return len(calls)

    tp = dataclasses.replace(plan, layout=resolve_layout(MeshKind.FSDP2, ParallelismSizes(tp_size=2), 8))
    assert plan.model_fact("probe", count) == tp.model_fact("probe", count) == 1  # one memo, one model
    other = dataclasses.replace(plan, model=_meta_model(_config()))  # the dict travels with the copy
    assert other.model_fact("probe", count) == 2  # another model object: computed again
    cluster = parse_cluster("8xH100")
    for shared in (plan, tp):
        estimate_throughput(shared, cluster)
    assert {"outer_units", "weight_kinds"} <= set(plan.model_memo)
    fresh = dataclasses.replace(tp, model_memo={})
    assert estimate_throughput(tp, cluster).parts == estimate_throughput(fresh, cluster).parts


def test_float8_all_gather_moves_the_converted_weights_in_one_byte() -> None:
    """``enable_fsdp_float8_all_gather``: the blocks' linear weights are gathered in float8, the rest
    (embedding, norms, the output head FP8 training keeps) in bf16; gradients are reduced as before."""
    from automodel_quant.fp8 import FP8Config

    plain = _plan(fp8=FP8Config(enabled=True))
    float8 = _plan(fp8=FP8Config(enabled=True, enable_fsdp_float8_all_gather=True))
    linear = LAYERS * H * (2 * H + 2 * KV * H // HEADS + 3 * FFN)  # q, o, k, v, gate, up, down
    everything = sum(p.numel() for p in plain.model.parameters())
    block = sum(p.numel() for p in plain.model.model.layers[0].parameters())
    world = plain.layout.dp_shard
    per_pass = {
        name: estimate_peak(plan).communication["FSDP all-gather x2"] / ((world - 1) / world)
        for name, plan in (("plain", plain), ("float8", float8))
    }
    # Forward gathers every unit; backward again every block but the last (the heuristic keeps it
    # gathered, as it does the LM head; the embedding's backward reads no weight).
    again = (LAYERS - 1) / LAYERS
    assert per_pass["plain"] == pytest.approx(2 * everything + 2 * block * LAYERS * again, rel=1e-6)
    expected = 2 * everything - linear + (2 * block * LAYERS - linear) * again
    assert per_pass["float8"] == pytest.approx(expected, rel=1e-6)
    reduced = [estimate_peak(p).communication["FSDP reduce-scatter"] for p in (plain, float8)]
    assert reduced[0] == reduced[1]


def test_a_compiled_loss_keeps_the_logits_in_their_dtype_not_an_fp32_copy() -> None:
    """``compiled_loss``: the head saves the bf16 logits and their bf16 gradient where the eager loss keeps
    the fp32 log-probabilities and their fp32 gradient (`MaskedCrossEntropy`'s test measures both);
    under TP the vocabulary-parallel loss stays eager."""
    tokens = 2 * 512  # micro-batch x sequence
    drop = (4 + 4 - 2 - 2) * tokens * VOCAB
    for sizes, expected in (({}, drop), ({"tp_size": 2}, 0)):
        eager, compiled = (
            estimate_peak(_plan(sizes=sizes, compiled_loss=flag)).lines["activations"]
            for flag in (False, True)
        )
        assert eager - compiled == expected
    cluster = parse_cluster("8xH100")
    times = [
        estimate_throughput(_plan(compiled_loss=flag), cluster).parts["compute"] for flag in (False, True)
    ]
    assert times[1] < times[0]  # and its elementwise ops are fused


def test_a_lora_adapter_adds_the_traffic_of_its_thin_matmuls_and_elementwise_ops() -> None:
    """Each adapted linear moves ``lora_traffic_bytes`` of its input and output at the HBM rate, on top
    of its frozen base: the same model with its base frozen and no adapters is the difference."""
    from automodel_peft import PeftConfig, apply_lora_to_linear_modules

    adapted = _meta_model(_config())
    apply_lora_to_linear_modules(adapted, PeftConfig(target_modules=["*_proj"], dim=8, alpha=16))
    frozen = _meta_model(_config()).requires_grad_(False)  # what the adapters leave frozen: everything
    cluster = parse_cluster("8xH100")
    world = _plan(world=8)
    seconds = {
        label: estimate_throughput(dataclasses.replace(world, model=model), cluster).parts["compute"]
        for label, model in (("adapted", adapted), ("frozen", frozen))
    }
    tokens, element = 2 * 512, 2  # micro-batch x sequence, bf16
    inputs = 6 * H + FFN  # q, k, v, o, gate, up read H; down reads FFN
    outputs = 2 * H + 2 * KV * H // HEADS + 2 * FFN + H  # q, o, k, v, gate, up, down
    per_layer = tokens * element * ((inputs + 6 * outputs) + (5 * inputs + 4 * outputs))
    rate = DEVICES["h100"].hbm_bytes_per_s * DEFAULT_EFFICIENCY.memory
    assert seconds["adapted"] - seconds["frozen"] == pytest.approx(LAYERS * per_layer / rate, rel=1e-6)


def test_context_parallel_gathers_each_blocks_keys_and_values_per_forward_run_and_again_in_backward() -> None:
    from types import SimpleNamespace

    from automodel_distributed.memory import StrategyMemory
    from automodel_mesh import Overlap

    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(cp_size=4, tp_size=2), 8)
    facts = SimpleNamespace(
        layout=layout, accumulation=2, blocks=[0, 1, 2], forward_runs=2, gather_runs=2, tokens=100,
        hidden_size=H, element_size=2, attention=(KV, H // HEADS), units=[], grads=0.0,
        pipelined=False, unit_reduce=[], unit_axes=[], reduce_separate=False,
    )  # fmt: skip
    term = StrategyMemory(FSDP2Config(activation_checkpointing="full"), reshard=True)
    cp = {(c.name, c.overlap): c for c in term.collectives(facts) if c.axis == "cp"}
    local = 2 * 100 * KV * (H // HEADS) * 2 / 2  # K and V of 100 tokens, half the heads (tp 2), bf16
    forward = cp[("CP K/V all-gather", Overlap.RING_STEP_FORWARD)]
    assert (forward.bytes_per_call, forward.calls) == (3 * local, 3 * 2 * 2)  # 3 blocks x 2 passes x 2 runs
    assert cp[("CP K/V all-gather", Overlap.RING_STEP_BACKWARD)].calls == 3 * 2
    passed_on = cp[("CP K/V gradients", Overlap.RING_STEP_BACKWARD)]
    assert (passed_on.bytes_per_call, passed_on.calls) == (2 * local, 3 * 2 * 3)  # fp32; cp - 1 steps
    assert cp[("CP K/V gradients", Overlap.EXPOSED)].calls == 3 * 2  # the last, waited for at once
    assert term.buffers(facts)["CP all-gathered K/V"] == 4 * local


def test_the_attention_kernel_sets_the_attention_rate_and_an_unknown_one_is_refused() -> None:
    from automodel_planner.estimate import _attention_kernel
    from automodel_planner.step_time import ATTENTION_KERNEL_SPEED

    h100 = parse_cluster("8xH100")

    def compute(**changes: Any) -> float:
        return estimate_throughput(_plan(seq=4096, **changes), h100).parts["compute"]

    fa2, cudnn = compute(), compute(attention_kernel="cudnn")
    assert compute(attention_kernel="fa3") < cudnn < fa2
    assert _attention_kernel(_plan(attn_implementation="flash_attention_3")) == "fa3"
    assert _attention_kernel(_plan(attn_implementation="flash_attention_2")) == "fa2"
    profile = profile_step(_config(), micro_batch=2, seq_len=4096, dtype=torch.bfloat16).compute
    attention = sum(b.attention_flops for b in profile.blocks) / 2 * 3.5  # causal; forward + backward
    rate = h100.device.bf16_flops * DEFAULT_EFFICIENCY.attention
    assert fa2 - cudnn == pytest.approx(attention / rate * (1 - 1 / ATTENTION_KERNEL_SPEED["cudnn"]))
    with pytest.raises(ValueError, match="attention_kernel: 'fa9'"):
        compute(attention_kernel="fa9")


def test_gradients_deferred_over_the_passes_are_added_up_in_device_memory() -> None:
    from types import SimpleNamespace

    from automodel_distributed.memory import StrategyMemory

    # fp32 parameters (400 bytes, 100 elements) whose gradients come in bf16: the first backward's are
    # cast (200 read, 400 written), each of the 3 later ones added in place (200 + 400 read, 400 written).
    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(), 8)
    facts = SimpleNamespace(
        accumulation=4, accumulated=400.0, accumulated_elements=100.0, element_size=2, layout=layout
    )
    deferred = StrategyMemory(FSDP2Config(), reshard=True)
    assert deferred.traffic(facts) == 600 + 3 * 1000
    assert StrategyMemory(FSDP2Config(defer_fsdp_grad_sync=False), reshard=True).traffic(facts) == 0.0
    assert deferred.traffic(SimpleNamespace(**{**vars(facts), "accumulation": 1})) == 0.0

    h100 = parse_cluster("8xH100")
    plan = _plan(accumulation=4)
    without = dataclasses.replace(plan, strategy=FSDP2Config(defer_fsdp_grad_sync=False))
    added = (
        estimate_throughput(plan, h100).parts["compute"] - estimate_throughput(without, h100).parts["compute"]
    )
    params = sum(p.numel() for p in plan.model.parameters())  # bf16 model: gradients in its dtype
    rate = h100.device.hbm_bytes_per_s * DEFAULT_EFFICIENCY.memory
    assert added == pytest.approx((4 * params + 3 * 6 * params) / rate, rel=1e-3)


def test_sequence_parallel_copies_each_gathered_tensor_to_and_from_the_rank_major_layout() -> None:
    from automodel_distributed.memory import StrategyMemory

    layout = resolve_layout(MeshKind.FSDP2, ParallelismSizes(tp_size=8), 8)
    runs = {"forward_runs": 1, "gather_runs": 1}
    facts = SimpleNamespace(
        layout=layout, tokens=100, rows=2, hidden_size=10, element_size=2, blocks=[0, 1], accumulation=3,
        accumulated=0.0, **runs,
    )  # fmt: skip
    copy, per_step = 2 * 100 * 10 * 2, 2 * 3  # read and write the gathered tensor; 2 blocks x 3 passes

    def traffic(facts: SimpleNamespace, **strategy: Any) -> float:
        config = FSDP2Config(defer_fsdp_grad_sync=False, **strategy)
        return StrategyMemory(config, reshard=True).traffic(facts)

    # Two all-gathers and two reduce-scatters per block in forward, mirrored in backward.
    assert traffic(facts, sequence_parallel=True) == 8 * copy * per_step
    one_row = SimpleNamespace(**{**vars(facts), "rows": 1})  # the all-gathers' result is a view
    assert traffic(one_row, sequence_parallel=True) == 4 * copy * per_step
    recomputed = SimpleNamespace(**{**vars(facts), "forward_runs": 2, "gather_runs": 2})
    assert traffic(recomputed, sequence_parallel=True) == 12 * copy * per_step
    fused = {"sequence_parallel": True, "enable_async_tensor_parallel": True, "enable_compile": True}
    assert traffic(facts, **fused) == 2 * copy * per_step  # backward's grouped reduce-scatters only
    assert traffic(facts) == 0.0  # no SP: TP all-reduces in place

    h100 = parse_cluster("8xH100")
    sp = _plan(sizes={"tp_size": 2}, strategy=FSDP2Config(sequence_parallel=True))
    plain = _plan(sizes={"tp_size": 2})
    added = estimate_throughput(sp, h100).parts["compute"] - estimate_throughput(plain, h100).parts["compute"]
    gathered = 2 * 512 * H * 2  # micro-batch 2 x 512 tokens, bf16
    rate = h100.device.hbm_bytes_per_s * DEFAULT_EFFICIENCY.memory
    assert added == pytest.approx(8 * 2 * gathered * LAYERS / rate, rel=1e-3)


def _moe_plan(ep: int) -> PlanInput:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=H, intermediate_size=FFN, moe_intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=H // HEADS, num_experts=64,
        num_experts_per_tok=2, vocab_size=VOCAB, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return PlanInput(
        model=model,
        model_config=config,
        layout=resolve_layout(MeshKind.FSDP2, ParallelismSizes(ep_size=ep), 8),
        strategy=FSDP2Config(),
        dtype=torch.bfloat16,
        seq_len=32,
        micro_batch_size=1,
    )


def test_an_expert_parallel_rank_reads_only_its_experts_weights() -> None:
    # 32 tokens meet 64 experts: the experts' matmuls are bound by reading the stacked weights.
    cluster = parse_cluster("8xH100")
    whole, sharded = (estimate_throughput(_moe_plan(ep), cluster) for ep in (1, 8))
    experts = 2 * 64 * 3 * H * 512 * 2  # two layers' gate, up and down weights, bf16
    rate = cluster.device.hbm_bytes_per_s * DEFAULT_EFFICIENCY.memory
    # Each layer's experts matmuls read the weights in forward and twice in backward (trainable).
    saved = 3 * experts * (1 - 1 / 8) / rate
    assert whole.parts["compute"] - sharded.parts["compute"] == pytest.approx(saved, rel=0.05)


def test_a_loop_of_pipeline_runs_pays_each_runs_bubble_and_reduction() -> None:
    from automodel_pipelining.config import PipelineConfig

    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=8, pp_microbatch_size=1)
    one = _plan(world=8, sizes={"pp_size": 4}, pipeline=config, micro_batch_size=1)
    cluster = parse_cluster("8xH100")
    single, looped = (estimate_throughput(dataclasses.replace(one, pipeline_runs=n), cluster) for n in (1, 3))
    assert looped.tokens_per_step == 3 * single.tokens_per_step == 3 * 8 * 2 * 512
    for part, seconds in single.parts.items():
        assert looped.parts[part] == pytest.approx(seconds * (1 if part == "optimizer" else 3)), part
    with pytest.raises(ValueError, match="more than 1 needs a pipeline"):
        _plan(pipeline_runs=2)
    # One run of three times the rows spreads one bubble over them: faster than three runs.
    longer = dataclasses.replace(one, pipeline=dataclasses.replace(config, pp_batch_size=24))
    assert estimate_throughput(longer, cluster).tokens_per_s_per_gpu > looped.tokens_per_s_per_gpu


def test_fsdp_reduces_experts_over_ep_shard_and_the_rest_over_dp_shard() -> None:
    from automodel_distributed.memory import StrategyMemory
    from automodel_planner.estimate import _planned_ranks

    def reductions(ep: int) -> dict[str, float]:
        plan = _moe_plan(ep)
        _, _, terms, ranks = _planned_ranks(plan, {})
        strategy = next(t for t in terms if isinstance(t, StrategyMemory))
        return {c.axis: c.total for c in strategy.collectives(ranks[0]) if c.name == "FSDP reduce-scatter"}

    plan = _moe_plan(1)
    experts = sum(p.numel() for n, p in plan.model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for p in plan.model.parameters()) - experts
    fp32 = 4  # FSDP2Config's default policy reduces in fp32
    # ep 8 = dp_shard 8: each expert lives on one rank, nothing reduces it; the rest over dp_shard.
    assert reductions(8) == {"dp_shard_cp": pytest.approx(7 / 8 * rest * fp32)}
    # ep 4: ep_shard 2 shards a rank's quarter of the experts; it reduces them over its two ranks.
    assert reductions(4) == {
        "dp_shard_cp": pytest.approx(7 / 8 * rest * fp32),
        "ep_shard": pytest.approx(1 / 2 * experts / 4 * fp32),
    }
