"""FSDP2Manager parity on real gloo ranks: FSDP2, HSDP, TP, TP+SP and TP x FSDP, with and without
activation checkpointing, for Llama, Qwen2, Mistral and a tied-embedding Llama.

Each launch runs every case of its world size. A case builds the mesh, shards a tiny model with
`FSDP2Manager.parallelize`, trains it three AdamW steps next to the unsharded transformers model and
reports the largest differences; the test asserts fp32 parity within 1e-5 (losses within 1e-4).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_mesh import MeshContext, ParallelismSizes
from automodel_testing import ParityReport, run_distributed, train_parity

pytestmark = pytest.mark.distributed

FAMILIES = ("llama", "qwen2", "mistral", "llama_tied")
FP32_ATOL = 1e-5
STEP_ATOL = 1e-4
BF16_ATOL = 5e-2  # bf16 parameters against an fp32 reference: a few bf16 ulps of the logits

# (label, sizes, config fields); each case runs for every family, without and with full checkpointing.
SETUPS: dict[int, list[tuple[str, dict[str, int], dict[str, Any]]]] = {
    2: [
        ("fsdp2", {}, {}),
        ("tp2", {"tp_size": 2}, {}),
        ("tp2+sp", {"tp_size": 2}, {"sequence_parallel": True}),
    ],
    4: [
        ("fsdp2", {}, {}),
        ("hsdp2x2", {"dp_replicate_size": 2}, {}),
        ("tp2xfsdp2", {"tp_size": 2}, {}),
    ],
}
# Extra single cases: (label, family, sizes, config fields, atol).
_AC = {"activation_checkpointing": True}
_SEL = {"activation_checkpointing": "selective"}
EXTRAS: dict[int, list[tuple[str, str, dict[str, int], dict[str, Any], float]]] = {
    2: [
        ("selective-ac", "llama", {}, _SEL, FP32_ATOL),
        (
            "prefetch",
            "qwen2",
            {},
            {"enable_fsdp2_prefetch": True, "fsdp2_backward_prefetch_depth": 1},
            FP32_ATOL,
        ),
        ("no-reshard", "mistral", {}, {"reshard_after_forward": False}, FP32_ATOL),
        ("cpu-offload", "llama", {}, {"offload_policy": "cpu"}, FP32_ATOL),
        ("bf16-mp+ac", "llama", {}, {"mp_policy": "bf16", **_AC}, BF16_ATOL),
        # One data-parallel rank: FSDP2 wraps the TP model over it for the mixed precision alone.
        ("tp2-bf16-mp", "qwen2", {"tp_size": 2}, {"mp_policy": "bf16"}, BF16_ATOL),
    ],
    4: [
        ("tp2xfsdp2+sp+ac", "llama_tied", {"tp_size": 2}, {"sequence_parallel": True, **_AC}, FP32_ATOL),
        ("hsdp+selective", "qwen2", {"dp_replicate_size": 2}, _SEL, FP32_ATOL),
    ],
}


def _config(fields: dict[str, Any]) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config

    fields = dict(fields)
    if fields.pop("mp_policy", "fp32") == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if fields.pop("offload_policy", None) == "cpu":
        fields["offload_policy"] = CPUOffloadPolicy()  # pinned by default: the manager must unpin it on CPU
    return FSDP2Config(mp_policy=mp, **fields)


def _one_case(family: str, sizes: dict[str, int], fields: dict[str, Any]) -> ParityReport:
    from automodel_distributed import FSDP2Manager

    config = _config(fields)
    ctx = MeshContext.build(config, ParallelismSizes(**sizes))
    manager = FSDP2Manager(config, ctx.device_mesh)
    dp_group = ctx.get_group("dp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pinned-memory fallback warns by design
        return train_parity(
            family,
            manager.parallelize,
            dp_rank=dist.get_rank(dp_group),
            dp_size=ctx.dp_size or 1,
            dp_group=dp_group,
        )


def _deferred_grad_sync() -> float:
    """Two micro-batches with the reduce-scatter deferred to the last: grads equal the full batch's."""
    from automodel_distributed import FSDP2Manager
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch, normalize_fqn, to_full

    config = _config({"defer_fsdp_grad_sync": True})
    ctx = MeshContext.build(config)
    manager = FSDP2Manager(config, ctx.device_mesh)
    reference = build_tiny_model("llama")
    model = manager.parallelize(build_tiny_model("llama"))
    batch = make_batch(reference.config.vocab_size, 8, 16, seed=3)
    causal_lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"]).backward()
    rank, world = dist.get_rank(), dist.get_world_size()
    local = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch.items()}
    for micro in range(2):
        manager.set_gradient_sync(model, is_last_microbatch=micro == 1)
        rows = slice(micro * 2, micro * 2 + 2)
        loss = causal_lm_loss(model(input_ids=local["input_ids"][rows]).logits, local["labels"][rows]) / 2
        loss.backward()
    ref = {normalize_fqn(n): p.grad for n, p in reference.named_parameters()}
    assert world == 2
    return max(
        float((to_full(p.grad) - ref[normalize_fqn(n)]).abs().max())
        for n, p in model.named_parameters()
        if p.grad is not None
    )


def _eval_then_train() -> dict[str, Any]:
    """The no-grad trap: evaluate, then build the optimizer, then train; losses equal the reference.

    After a forward without gradients, units that keep their parameters gathered for backward (the
    root, the last block, the head) would stay gathered, and an optimizer built then would hold the
    unsharded tensors. The control is torch's own ``fully_shard`` without the manager's hook: its root
    stays gathered (so this test can fail).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from automodel_distributed import FSDP2Manager
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    config = _config({})
    ctx = MeshContext.build(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build_tiny_model("llama")
    model = FSDP2Manager(config, ctx.device_mesh).parallelize(build_tiny_model("llama"))
    control = build_tiny_model("llama")
    for layer in control.model.layers:
        fully_shard(layer, mesh=ctx.device_mesh["dp_shard_cp"])
    fully_shard(control, mesh=ctx.device_mesh["dp_shard_cp"], reshard_after_forward=False)
    batch = make_batch(reference.config.vocab_size, 4, 16, seed=5)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)

    def gathered(module: torch.nn.Module) -> list[str]:
        return [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]

    with torch.no_grad():
        ref_eval = causal_lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"])
        got_eval = causal_lm_loss(model(input_ids=batch["input_ids"][rows]).logits, batch["labels"][rows])
        control(input_ids=batch["input_ids"][rows])
    dist.all_reduce(got_eval, op=dist.ReduceOp.AVG)
    out: dict[str, Any] = {
        "eval": abs(float(got_eval) - float(ref_eval)),
        "gathered_after_eval": gathered(model),
        "control_gathered_after_eval": len(gathered(control)),
        "steps": [],
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after the evaluation
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        ref_loss = causal_lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"])
        loss = causal_lm_loss(model(input_ids=batch["input_ids"][rows]).logits, batch["labels"][rows])
        ref_loss.backward()
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        out["steps"].append(abs(float(global_loss) - float(ref_loss)))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return out


class _ScaledEmbedding(torch.nn.Embedding):
    """An embedding with its own forward: backward may read its weight, so the root must stay gathered."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


def _root_reshard() -> dict[str, Any]:
    """Whether the tied root is resharded before the blocks' backward, and the loss after 3 steps.

    ``tied``: the tied Llama (only a plain embedding runs before the blocks); ``scaled``: its embedding
    swapped for a subclass with its own forward, which the early reshard must leave alone. Each reports
    whether the head's weight was the sharded DTensor when the first block's backward ran. ``embedding``:
    under ``reshard_after_forward=False`` an untied Llama's embedding is sharded again when the last
    block's backward starts, while the first block is still gathered.
    """
    from torch.distributed.tensor import DTensor

    from automodel_distributed import FSDP2Manager
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    out: dict[str, Any] = {}
    for case in ("tied", "scaled"):
        config = _config({})
        ctx = MeshContext.build(config)
        model = build_tiny_model("llama_tied")
        if case == "scaled":
            old = model.model.embed_tokens
            model.model.embed_tokens = _ScaledEmbedding(old.num_embeddings, old.embedding_dim)
            model.model.embed_tokens.weight = old.weight
            model.lm_head.weight = old.weight
        model = FSDP2Manager(config, ctx.device_mesh).parallelize(model)
        seen: list[bool] = []
        head = model.lm_head

        def record(*_: Any, seen: list[bool] = seen, head: torch.nn.Module = head) -> None:
            seen.append(isinstance(head.weight, DTensor))

        model.model.layers[0].register_full_backward_pre_hook(record)
        batch = make_batch(model.config.vocab_size, 2, 16, seed=dist.get_rank())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            causal_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"]).backward()
            optimizer.step()
            optimizer.zero_grad()
        out[case] = seen
    # Two forwards, then one backward of the summed losses: the root must stay gathered for both
    # backwards; the gradients equal two separate backwards'.
    grads = []
    for summed in (True, False):
        config = _config({})
        model = FSDP2Manager(config, MeshContext.build(config).device_mesh).parallelize(
            build_tiny_model("llama_tied")
        )
        batches = [make_batch(model.config.vocab_size, 2, 16, seed=10 + i) for i in range(2)]
        losses = [causal_lm_loss(model(input_ids=b["input_ids"]).logits, b["labels"]) for b in batches]
        if summed:
            (losses[0] + losses[1]).backward()
        else:
            losses[1].backward()
            losses[0].backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    out["summed"] = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    # reshard_after_forward=False: an untied plain embedding (its backward gathers nothing) is still
    # resharded after forward, while the blocks stay gathered for backward (the control); the
    # no-reshard parity case checks the numbers.
    config = _config({"reshard_after_forward": False})
    model = FSDP2Manager(config, MeshContext.build(config).device_mesh).parallelize(build_tiny_model("llama"))
    states: list[tuple[bool, bool]] = []

    def sharded(*_: Any) -> None:
        embed, block = model.model.embed_tokens, model.model.layers[0].self_attn.q_proj
        states.append((isinstance(embed.weight, DTensor), isinstance(block.weight, DTensor)))

    model.model.layers[-1].register_full_backward_pre_hook(sharded)  # layers[0]: backward still ahead
    batch = make_batch(model.config.vocab_size, 2, 16, seed=dist.get_rank())
    for _ in range(2):
        causal_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"]).backward()
    out["embedding"] = states
    return out


def _world_one() -> dict[str, Any]:
    """One rank trains in the mixed precision N ranks do; with nothing to cast, nothing is wrapped.

    ``bf16``: FSDP2 over the one-rank mesh with bf16 compute and checkpointing, against a reference made
    by hand: an fp32 master model, a copy of it with bf16 parameters for each step's forward and
    backward, its gradients in fp32 for AdamW. ``fp32_gap`` is how far plain fp32 training (what one
    rank did before) is from that reference, so the comparison can fail. ``fp32``: an fp32 policy leaves
    the model as it is.
    """
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from automodel_distributed import FSDP2Manager
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    def losses(model: torch.nn.Module, cast: torch.dtype | None) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for _ in range(3):
            work = model
            if cast is not None:  # FSDP2 casts the parameters only: buffers (rotary frequencies) stay
                work = copy.deepcopy(model)
                for param in work.parameters():
                    param.data = param.data.to(cast)
            loss = causal_lm_loss(work(input_ids=batch["input_ids"]).logits, batch["labels"])
            loss.backward()
            if cast is not None:
                for master, param in zip(model.parameters(), work.parameters(), strict=True):
                    master.grad = param.grad.float()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(loss.detach()))
        return out

    batch = make_batch(build_tiny_model("llama").config.vocab_size, 4, 16, seed=7)
    reference = losses(build_tiny_model("llama"), torch.bfloat16)
    result: dict[str, Any] = {
        "fp32_gap": max(
            abs(a - b) for a, b in zip(losses(build_tiny_model("llama"), None), reference, strict=True)
        )
    }
    for policy in ("bf16", "fp32"):
        config = _config({"activation_checkpointing": True, "mp_policy": policy})
        ctx = MeshContext.build(config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = FSDP2Manager(config, ctx.device_mesh).parallelize(build_tiny_model("llama"))
        result[policy] = {
            "fsdp": isinstance(model, FSDPModule),
            "wrapped": [isinstance(layer, CheckpointWrapper) for layer in model.model.layers],
            "warned": [str(w.message) for w in caught if "FSDP2Config" in str(w.message)],
            "params": sorted({str(p.dtype) for p in model.parameters()}),
        }
        if policy == "bf16":
            got = losses(model, None)
            result[policy]["loss_gap"] = max(abs(a - b) for a, b in zip(got, reference, strict=True))
    return result


def _plain_torch_by_default() -> list[str]:
    """What of FSDP2's own machinery a default manager replaced on a CPU mesh (nothing, without a runtime)."""
    from torch.distributed.fsdp import FSDPModule

    from automodel_distributed import FSDP2Config, FSDP2Manager
    from automodel_testing import build_tiny_model, make_batch

    config = FSDP2Config()
    model = FSDP2Manager(config, MeshContext.build(config).device_mesh).parallelize(build_tiny_model("llama"))
    batch = make_batch(model.config.vocab_size, 2, 16, seed=0)
    model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
    replaced = []
    for name, module in model.named_modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for comm in ("_all_gather_comm", "_reduce_scatter_comm"):
            kind = type(getattr(group, comm, None))
            if group is not None and not kind.__module__.startswith("torch."):
                replaced.append(f"{name or 'root'}.{comm}: {kind.__module__}.{kind.__name__}")
    return replaced


def _run(world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if world == 2:
        results["plain_torch_by_default"] = _plain_torch_by_default()
        results["deferred_grad_sync"] = _deferred_grad_sync()
        results["eval_then_train"] = _eval_then_train()
        results["root_reshard"] = _root_reshard()
    cases = [
        (f"{label}{'+ac' if ac else ''}/{family}", family, sizes, {**fields, "activation_checkpointing": ac})
        for label, sizes, fields in SETUPS[world]
        for ac in (False, True)
        for family in FAMILIES
    ]
    cases += [
        (f"{label}/{family}", family, sizes, fields) for label, family, sizes, fields, _ in EXTRAS[world]
    ]
    for label, family, sizes, fields in cases:
        results[label] = _one_case(family, sizes, fields)
    return results


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_fsdp2_manager_parity(world: int) -> None:
    per_rank = run_distributed(_run, world, world, timeout_s=900, pg_timeout_s=120)
    atol = {f"{label}/{family}": tol for label, family, _, _, tol in EXTRAS[world]}
    for rank, results in enumerate(per_rank):
        if world == 2:
            # No host runtime given: FSDP2's collectives and their buffers are torch's own.
            assert results.pop("plain_torch_by_default") == []
            assert results.pop("deferred_grad_sync") <= FP32_ATOL
            evaluated = results.pop("eval_then_train")
            assert evaluated["control_gathered_after_eval"] > 0, (
                "the no-grad trap did not show in the control"
            )
            assert evaluated["gathered_after_eval"] == [], evaluated["gathered_after_eval"]
            assert evaluated["eval"] <= FP32_ATOL and max(evaluated["steps"]) <= STEP_ATOL, evaluated
            released = results.pop("root_reshard")
            assert released.pop("summed") <= FP32_ATOL, released
            assert released == {
                "tied": [True] * 3,
                "scaled": [False] * 3,
                "embedding": [(True, False)] * 2,
            }, released
        for label, report in results.items():
            report.check(
                atol=atol.get(label, FP32_ATOL),
                step_atol=max(STEP_ATOL, atol.get(label, 0.0)),
                label=f"rank {rank} {label}",
            )
        assert results["fsdp2/llama"].model_class.startswith("FSDP"), "the model was not sharded"


def test_one_rank_trains_in_the_mixed_precision_of_n_ranks() -> None:
    (result,) = run_distributed(_world_one, 1)
    bf16, fp32 = result["bf16"], result["fp32"]
    assert result["fp32_gap"] > 1e-4, result  # bf16 compute is visibly different from fp32 training
    assert bf16.pop("loss_gap") <= 1e-6, result
    assert bf16 == {"fsdp": True, "wrapped": [True, True], "warned": [], "params": ["torch.float32"]}
    assert fp32 == {"fsdp": False, "wrapped": [True, True], "warned": [], "params": ["torch.float32"]}
