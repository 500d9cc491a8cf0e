"""The host copy-in kernel: torch's ``_chunk_cat`` values bit for bit, without its temporary."""

from __future__ import annotations

import platform

import pytest
import torch

from automodel_cpu.copy_in_kernel import (
    chunk_cat_into,
    copy_in_rows,
    expect_copy_in,
    register_host_copy_in,
    take_copy_in,
)

CASES = [
    ([(10, 3)], 4, torch.bfloat16, torch.float32),  # uneven: the last chunk is padding only
    ([(7,), (5, 2, 3), (8, 4)], 2, torch.bfloat16, torch.float32),
    ([(9, 5), (3,)], 4, torch.float32, torch.float32),
    ([(1, 6), (2,)], 4, torch.bfloat16, torch.bfloat16),  # more chunks than rows
    ([(12, 2)], 3, torch.float32, torch.bfloat16),  # narrowing rounds as a copy does
]


@pytest.mark.parametrize(("shapes", "chunks", "dtype", "out_dtype"), CASES)
def test_chunk_cat_into_matches_torch_bit_for_bit(
    shapes: list[tuple[int, ...]], chunks: int, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    expected = torch._chunk_cat(tensors, 0, chunks).to(out_dtype)
    out = torch.full(expected.shape, float("nan"), dtype=out_dtype)  # padding must be written, not left
    chunk_cat_into(tensors, 0, chunks, out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("shapes", "chunks", "dtype", "out_dtype"), CASES)
def test_every_window_of_the_rows_is_the_same_slice_of_torchs(
    shapes: list[tuple[int, ...]], chunks: int, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    """Windows that start and stop inside tensors, inside padding and across both, as the pieces do."""
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    expected = torch._chunk_cat(tensors, 0, chunks).to(out_dtype)
    width = expected.size(1)
    for step in (1, 2, 5, width):
        for start in range(0, width, step):
            stop = min(width, start + step)
            out = torch.full((chunks, stop - start), float("nan"), dtype=out_dtype)
            copy_in_rows(tensors, chunks, start, stop, out)
            assert torch.equal(out, expected[:, start:stop]), (step, start)


def test_an_announced_buffer_is_left_unwritten_and_its_copy_in_handed_back() -> None:
    if not register_host_copy_in():
        pytest.skip("this torch copies in with torch._chunk_cat (no fsdp::chunk_cat_mixed_dtype)")
    grads = [torch.randn(6, 3).to(torch.bfloat16), torch.randn(5).to(torch.bfloat16)]
    expected = torch._chunk_cat(grads, 0, 2).float()
    announced = torch.full((expected.numel(),), float("nan"))
    expect_copy_in(announced)
    torch.ops.fsdp.chunk_cat_mixed_dtype(grads, dim=0, num_chunks=2, out=announced.view(2, -1))
    assert announced.isnan().all(), "the kernel wrote an announced buffer"
    taken = take_copy_in(announced)
    assert taken is not None and taken[1] == 2 and all(a is b for a, b in zip(taken[0], grads, strict=True))
    assert take_copy_in(announced) is None, "a copy-in is handed back once"
    # Not announced (or announced once and already used): written as before.
    plain = torch.full_like(announced, float("nan"))
    torch.ops.fsdp.chunk_cat_mixed_dtype(grads, dim=0, num_chunks=2, out=plain.view(2, -1))
    assert torch.equal(plain.view(2, -1), expected) and take_copy_in(plain) is None


def test_other_dims_take_torchs_kernel() -> None:
    tensors = [torch.randn(3, 5), torch.randn(3, 2).to(torch.bfloat16)]
    expected = torch._chunk_cat([t.float() for t in tensors], 1, 2)
    out = torch.empty_like(expected)
    chunk_cat_into(tensors, 1, 2, out)
    assert torch.equal(out, expected)


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) >> 10


@pytest.mark.skipif(platform.system() != "Linux", reason="peak memory from /proc/self")
def test_registered_copy_in_needs_no_temporary() -> None:
    if not register_host_copy_in():
        pytest.skip("this torch copies in with torch._chunk_cat (no fsdp::chunk_cat_mixed_dtype)")
    assert register_host_copy_in(), "registering twice must be a no-op"
    grad = torch.randn(32 << 20).to(torch.bfloat16)  # 64 MiB, as FSDP2's unsharded gradient
    out = torch.zeros(32 << 20, dtype=torch.float32)  # its fp32 reduce-scatter input
    peaks = {}
    for name, copy_in in (
        ("torch", lambda: torch.ops.aten._chunk_cat.out([grad], 0, 4, out=out.view(4, -1))),
        (
            "ours",
            lambda: torch.ops.fsdp.chunk_cat_mixed_dtype([grad], dim=0, num_chunks=4, out=out.view(4, -1)),
        ),
    ):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        before = _status_mib("VmRSS")
        copy_in()
        peaks[name] = _status_mib("VmHWM") - before
        assert torch.equal(out.view(4, -1), torch._chunk_cat([grad], 0, 4).float())
    # torch's kernel holds the chunked gradients in bf16 before the cast (64 MiB); ours nothing.
    assert peaks["torch"] >= 48 and peaks["ours"] <= 8, peaks
