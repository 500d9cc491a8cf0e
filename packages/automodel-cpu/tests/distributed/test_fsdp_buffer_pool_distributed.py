"""The CPU runtime's FSDP2 buffers on real gloo ranks: pieces, early release and the deferred copy-in.

Each piece must give exactly what the whole torch collective gives, and FSDP2 trained with it must
take the same steps as plain FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing import run_distributed

pytestmark = pytest.mark.distributed


def _chunked_collectives() -> dict[str, Any]:
    from automodel_cpu.fsdp_buffer_pool import (
        HostBufferPool,
        PooledAllGather,
        PooledReduceScatter,
    )

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    pool = HostBufferPool()
    failures: list[str] = []
    calls = 0
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 37, 1000):  # per rank; pieces of 3 elements leave an uneven tail
            # 24 bytes per rank and piece: 3 fp32 / 6 bf16 elements; whole below the bound
            chunk = 24 * world
            ag, rs = PooledAllGather(pool, chunk_bytes=chunk), PooledReduceScatter(pool, chunk_bytes=chunk)
            shard = torch.randn(numel, generator=torch.Generator().manual_seed(rank + numel)).to(dtype)
            expected = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(expected, shard)
            output = ag.allocate((world * numel,), dtype=dtype, device=torch.device("cpu"))
            # As FSDP2 does: the rank's own input is a view into its slot of the output.
            output[rank * numel : (rank + 1) * numel].copy_(shard)
            work = ag(output, output[rank * numel : (rank + 1) * numel], group, async_op=True)
            if work is not None:
                work.wait()
            if not torch.equal(output, expected):
                failures.append(f"all-gather {dtype} {numel}")
            full = torch.randn(world * numel, generator=torch.Generator().manual_seed(7 * rank + numel)).to(
                dtype
            )
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                want = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(want, full.clone(), op=op)
                got = rs.allocate((numel,), dtype=dtype, device=torch.device("cpu"))
                rs(got, full.clone(), group, op)
                # gloo sums 4 ranks in an order that depends on where a piece starts: bf16 may round
                # differently by an ulp of the partial sums (about 0.02 for these magnitudes).
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-6
                if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                    failures.append(f"reduce-scatter {dtype} {numel} {op}")
            calls += 1
    shapes = sorted((shape[0], str(dtype)) for (shape, dtype, _), kept in pool._buffers.items() for _ in kept)
    return {"failures": failures, "calls": calls, "shapes": shapes, "world": world}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_gloo_collectives_in_pieces_equal_the_whole_collectives(world: int) -> None:
    """Pooled all-gather / reduce-scatter above ``chunk_bytes`` on gloo: same results, piece-sized staging."""
    for result in run_distributed(_chunked_collectives, world, timeout_s=120):
        assert result["failures"] == [], result
        assert result["calls"] == 6
        # Pieces ran through one staging buffer per dtype of 24 bytes per rank (6 fp32 / 12 bf16
        # elements), the only buffers besides the whole-size outputs the collectives were asked for.
        w = result["world"]
        staging = {(w * 6, "torch.float32"), (w * 12, "torch.bfloat16")}
        outputs = {(w * n, str(d)) for n in (1, 37, 1000) for d in ("torch.float32", "torch.bfloat16")}
        outputs |= {(n, str(d)) for n in (1, 37, 1000) for d in ("torch.float32", "torch.bfloat16")}
        assert staging <= set(result["shapes"]) <= staging | outputs, result


def _early_release() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    from automodel_cpu import CPURuntime
    from automodel_cpu.fsdp_buffer_pool import HostBufferPool, PooledReduceScatter
    from automodel_distributed import FSDP2Manager
    from automodel_distributed.config import FSDP2Config
    from automodel_mesh import MeshContext
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    cpu = torch.device("cpu")
    out: dict[str, Any] = {"reduce": {}}
    # Reduce-scatter: an input the comm allocated above the pool's bound is freed once reduced, whole
    # or in pieces; a pooled input and a caller's own tensor are left alone.
    for label, chunk in (("whole", 1 << 30), ("pieces", 24 * world)):
        rs = PooledReduceScatter(HostBufferPool(max_bytes=256), chunk_bytes=chunk)
        full = torch.randn(world * 100, generator=torch.Generator().manual_seed(rank))
        want = torch.empty(100)
        dist.reduce_scatter_tensor(want, full.clone())
        for source in ("unpooled", "pooled", "caller"):
            numel = world * (100 if source != "pooled" else 8)
            if source == "caller":
                buffer = torch.empty(numel)
            else:
                buffer = rs.allocate((numel,), dtype=torch.float32, device=cpu)
            buffer.copy_(full[:numel])
            got = torch.empty(numel // world)
            rs(got, buffer, group, dist.ReduceOp.SUM)
            expected = want if source != "pooled" else None
            out["reduce"][f"{label} {source}"] = (
                buffer.untyped_storage().nbytes(),
                expected is None or bool(torch.allclose(got, expected, atol=1e-6)),
            )
    # All-gather: during a block's forward, FSDP2 no longer holds that block's all-gather output.
    batch = make_batch(64, 2, 16, seed=3)
    for with_runtime in (True, False):
        config = FSDP2Config(host_runtime=CPURuntime() if with_runtime else None)
        manager = FSDP2Manager(config, MeshContext.build(config).device_mesh)
        model = manager.parallelize(build_tiny_model("llama"))
        assert isinstance(model, FSDPModule)
        held: list[bool] = []

        def record(*_: Any, held: list[bool] = held, root: FSDPModule = model) -> None:
            held.append(root._get_fsdp_state()._comm_ctx.all_gather_state is not None)

        model.model.layers[0].mlp.register_forward_hook(record)
        loss = causal_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        loss.backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        out[f"runtime={with_runtime}"] = {"held": held, "loss": float(loss), "grads": grads}
    return out


def _deferred_copy_in() -> dict[str, Any]:
    """Train with every reduce-scatter input deferred and in pieces, next to FSDP2 without our comms."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from automodel_cpu.copy_in_kernel import register_host_copy_in
    from automodel_cpu.fsdp_buffer_pool import HostBufferPool, PooledReduceScatter
    from automodel_distributed import FSDP2Manager
    from automodel_distributed.config import FSDP2Config
    from automodel_mesh import MeshContext
    from automodel_testing import build_tiny_model, causal_lm_loss, make_batch

    class Watching(PooledReduceScatter):
        """Fills each buffer it hands out with NaN, and records whether an input was still all NaN."""

        unwritten: list[bool] = []

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            buffer = super().allocate(size, dtype=dtype, device=device)
            return buffer.fill_(float("nan"))

        def __call__(self, output_tensor: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.unwritten.append(bool(input_tensor.isnan().all()))
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    assert register_host_copy_in(), "torch >= 2.15 has fsdp::chunk_cat_mixed_dtype"
    batch = make_batch(64, 2, 16, seed=dist.get_rank())
    out: dict[str, Any] = {}
    for label, param_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        runs = []
        for deferred in (True, False):
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            config = FSDP2Config(mp_policy=mp)
            model = FSDP2Manager(config, MeshContext.build(config).device_mesh).parallelize(
                build_tiny_model("llama_tied")
            )
            comm = Watching(HostBufferPool(max_bytes=0), chunk_bytes=96, defer_copy_in=True)
            comm.unwritten = []
            for module in model.modules():
                if deferred and isinstance(module, FSDPModule):
                    module.set_custom_reduce_scatter(comm)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for _ in range(2):
                loss = causal_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
                loss.backward()
                losses.append(float(loss))
                optimizer.step()
                optimizer.zero_grad()
            runs.append({"losses": losses, "params": [p.full_tensor() for p in model.parameters()]})
            if deferred:
                out[f"{label} unwritten"] = comm.unwritten
        out[label] = runs
    return out


@pytest.mark.extended  # the opt-in CPU runtime; the pooled collectives above run by default
def test_a_deferred_copy_in_trains_as_fsdp2_and_never_fills_the_input() -> None:
    """Reduce-scatter inputs above the pool's bound stay unwritten; pieces come from the gradients."""
    for result in run_distributed(_deferred_copy_in, 2, timeout_s=180):
        for label in ("fp32", "bf16"):
            unwritten = result[f"{label} unwritten"]
            assert unwritten and all(unwritten), (label, unwritten)
            deferred, plain = result[label]
            assert deferred["losses"] == plain["losses"], label
            for a, b in zip(deferred["params"], plain["params"], strict=True):
                assert torch.equal(a, b), label


def test_collective_buffers_are_freed_once_done() -> None:
    """Host buffers FSDP2 holds past their use (a reduced input, a copied-out all-gather) are freed early.

    The training numbers are those of plain FSDP2 (no host runtime), which keeps them.
    """
    for result in run_distributed(_early_release, 2, timeout_s=180):
        for key, (nbytes, correct) in result["reduce"].items():
            assert correct, key
            assert (nbytes == 0) == key.endswith(" unpooled"), (key, nbytes)
        tuned, untuned = result["runtime=True"], result["runtime=False"]
        assert tuned["held"] == [False] and untuned["held"] == [True], (tuned["held"], untuned["held"])
        assert tuned["loss"] == pytest.approx(untuned["loss"], abs=1e-6)
        for a, b in zip(tuned["grads"], untuned["grads"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
