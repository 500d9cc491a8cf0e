"""Context parallelism on two real gloo ranks (CPU ring attention) against the single-process model.

One launch: the shard / unshard round trip, then for four families the logits (gathered and put back in
order), the loss (transformers' own loss on pre-shifted labels, summed over the cp ranks) and the
gradients (summed over the cp ranks, as FSDP over ``dp_shard_cp`` does) against the unsharded model, and
a negative control: shifting labels per shard (instead of before sharding) gives a different loss.

(Without `apply_context_parallel` the ranks diverge: transformers builds a mask on the rank whose local
positions are not contiguous, and SDPA then leaves ring attention on that rank only, so the other rank
waits in a collective until it times out. The unit tests check the hooks instead.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel_cpu import CPURuntime
from automodel_cpu.ring_attention_kernel import cpu_ring_attention_available
from automodel_distributed.context_parallel import (
    apply_context_parallel,
    context_parallel_inputs,
    context_parallel_region,
    context_parallel_unshard,
    load_balance_indices,
)
from automodel_mesh import MeshContext
from automodel_testing import build_tiny_model, grads_by_name, make_batch, run_distributed

_RING, _WHY = cpu_ring_attention_available()
pytestmark = [
    pytest.mark.distributed,
    # CP on CPU meshes runs the CPU runtime's ring kernel, which needs torch 2.15's internals.
    pytest.mark.skipif(not _RING, reason=f"this torch lacks the CPU ring kernel's internals: {_WHY}"),
]

FAMILIES = ("llama", "qwen2", "mistral", "llama_tied")
ATOL = 1e-5
CPU = CPURuntime()  # ring attention on CPU tensors
SEQ = 16


def _round_trip(mesh: Any) -> dict[str, Any]:
    rank, size = dist.get_rank(), mesh.cp_size
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 100, (2, SEQ), generator=gen),
        "inputs_embeds": torch.randn(2, SEQ, 3, generator=gen),
        "heads_first": torch.randn(2, 4, SEQ, 5, generator=gen),
        "untouched": torch.randn(7, generator=gen),
    }
    with context_parallel_region(mesh, batch, seq_dims={"heads_first": 2}, host_runtime=CPU) as local:
        order = load_balance_indices(SEQ, size)
        mine = order.chunk(size)[rank]
        shard_ok = (
            torch.equal(local["input_ids"], batch["input_ids"][:, mine])
            and torch.equal(local["inputs_embeds"], batch["inputs_embeds"][:, mine])
            and torch.equal(local["heads_first"], batch["heads_first"][:, :, mine])
        )
        untouched = local["untouched"] is batch["untouched"]
        shards = [local["input_ids"], local["inputs_embeds"], local["heads_first"]]
    full = context_parallel_unshard(mesh, shards, [1, 1, 2])
    return {
        "shard_ok": shard_ok,
        "untouched": untouched,
        "round_trip": [
            torch.equal(full[0], batch["input_ids"]),
            torch.equal(full[1], batch["inputs_embeds"]),
            torch.equal(full[2], batch["heads_first"]),
        ],
        "batch_unmodified": batch["input_ids"].shape[1] == SEQ,
    }


def _parity(family: str, mesh: Any) -> dict[str, float]:
    global_batch = make_batch(128, 2, SEQ, seed=4)
    reference = build_tiny_model(family)
    ref_out = reference(**global_batch)
    ref_out.loss.backward()
    ref_grads = grads_by_name(reference)

    model = apply_context_parallel(build_tiny_model(family))
    batch = context_parallel_inputs(global_batch)
    num_tokens = int((batch["shift_labels"] != -100).sum())
    with context_parallel_region(mesh, batch, host_runtime=CPU) as local:
        out = model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            labels=local["shift_labels"],
            shift_labels=local["shift_labels"],  # transformers' loss then does not shift again
            num_items_in_batch=num_tokens,  # sum of token losses / global count
        )
        out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=mesh.get_group())
    (logits,) = context_parallel_unshard(mesh, [out.logits], [1])
    grads = grads_by_name(model)
    worst = 0.0
    for name, grad in grads.items():
        dist.all_reduce(grad, group=mesh.get_group())
        worst = max(worst, float((grad - ref_grads[name]).abs().max()))
    return {
        "loss": abs(float(loss) - ref_out.loss.item()),
        "logits": float((logits - ref_out.logits.detach()).abs().max()),
        "grads": worst,
        "local_len": float(local["input_ids"].shape[1]),
    }


def _shift_after_sharding_is_wrong(mesh: Any) -> float:
    global_batch = make_batch(128, 2, SEQ, seed=4)
    with torch.no_grad():
        reference_loss = build_tiny_model("llama")(**global_batch).loss.item()
    model = apply_context_parallel(build_tiny_model("llama"))
    batch = context_parallel_inputs({k: v for k, v in global_batch.items() if k != "labels"})
    batch["labels"] = global_batch["labels"]  # sharded as is: transformers shifts each shard
    with (
        context_parallel_region(mesh, batch, seq_dims={"labels": 1}, host_runtime=CPU) as local,
        torch.no_grad(),
    ):
        loss = model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], labels=local["labels"]
        ).loss
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh.get_group())
    return abs(float(loss) - reference_loss)


def _rank_main() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    context = MeshContext.from_meshes(mesh)
    too_short = context_parallel_inputs(make_batch(128, 2, 6))
    errors = []
    cases = (
        (too_short, CPU),  # a 6-token sequence
        (make_batch(128, 2, SEQ), CPU),  # raw labels
        (context_parallel_inputs(make_batch(128, 2, SEQ)), None),  # a CPU mesh without a host runtime
    )
    for bad, runtime in cases:
        try:
            with context_parallel_region(mesh, bad, host_runtime=runtime):
                pass
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return {
        "round_trip": _round_trip(context),  # a MeshContext works as well as the cp mesh
        "parity": {family: _parity(family, mesh) for family in FAMILIES},
        "shift_after_sharding": _shift_after_sharding_is_wrong(mesh),
        "errors": errors,
    }


def test_context_parallel_on_two_ranks() -> None:
    results = run_distributed(_rank_main, 2, timeout_s=240)
    for rank, result in enumerate(results):
        trip = result["round_trip"]
        assert trip["shard_ok"] and trip["untouched"] and trip["batch_unmodified"], f"rank {rank}: {trip}"
        assert trip["round_trip"] == [True, True, True], f"rank {rank}: {trip}"
        for family, diffs in result["parity"].items():
            assert diffs["local_len"] == SEQ // 2
            for what in ("loss", "logits", "grads"):
                assert diffs[what] <= ATOL, f"rank {rank} {family}: {what} differs by {diffs[what]:.3g}"
        assert result["shift_after_sharding"] > 1e-3, "per-shard label shift should not match"
        assert "divisible by 2 * cp_size = 4, got 6" in result["errors"][0]
        assert "got 'labels'" in result["errors"][1]
        # The CPU ring-attention kernel is an explicit opt-in, never switched on behind the caller's back.
        assert "host_runtime=automodel_cpu.CPURuntime()" in result["errors"][2], result["errors"][2]
