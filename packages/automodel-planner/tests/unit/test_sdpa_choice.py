"""The profile runs SDPA as a GPU does where the CPU would take its math path (`CudaSdpaChoice`).

- Multi-head latent attention (DeepSeek-V3's query and key wider than its values) profiles as one
  memory-efficient attention kernel: ``2 b h s^2 (d + d_v)`` FLOPs, no score matmuls, no ``s x s``
  tensor saved, where the CPU's math path showed all three.
- Attention dropout (GPT-2's ``attn_pdrop``), which the CPU's flash kernel does not take and CUDA's
  fused kernels do, profiles as that one kernel too: the same FLOPs and saved bytes as without dropout
  but the dropout's own seed.
- A row of one sequence profiles without the ``s x s`` mask transformers builds when it cannot read
  fake position ids (`unpacked_rows`): what a block saves is linear in the sequence, as on a GPU.
- SDPA's argument handling is kept: grouped key/value heads, a boolean mask, the scale, positional or
  keyword arguments give the math path's output shape and dtype; calls the CPU's flash kernel takes
  are left to it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from automodel_planner.activations import profile_step
from automodel_planner.sdpa_choice import CudaSdpaChoice, unpacked_rows

SEQ = 1024  # long enough that one s x s score matrix outweighs everything a block saves


def _mla_config() -> Any:
    from automodel_testing.tiny import derive_tiny_config

    # DeepSeek-V3's shape of attention: query and key 24 wide (16 + 8 rotary), values 8 wide.
    return derive_tiny_config("deepseek_v3", qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_latent_attention_profiles_as_one_fused_kernel() -> None:
    config = _mla_config()
    heads, qk, v = config.num_attention_heads, 24, config.v_head_dim
    profile = profile_step(config, micro_batch=1, seq_len=SEQ, dtype=torch.bfloat16)
    scores = heads * SEQ * SEQ * 2  # one bf16 score matrix of a block
    for block, saved in zip(profile.compute.blocks, profile.activations.blocks, strict=True):
        assert block.attention_flops == 2.0 * heads * SEQ * SEQ * (qk + v)
        assert block.attention_outputs == heads * SEQ * v
        # The math path's two matmuls ran outside any linear layer, under the attention module.
        assert "self_attn" not in block.matmul_flops, block.matmul_flops
        assert saved.boundary + saved.interior < scores, saved


def test_attention_dropout_profiles_as_the_fused_kernel() -> None:
    from automodel_testing.tiny import derive_tiny_config

    profiles = [
        profile_step(
            derive_tiny_config("gpt2", attn_pdrop=p), micro_batch=1, seq_len=SEQ, dtype=torch.bfloat16
        )
        for p in (0.0, 0.1)
    ]
    plain, dropped = profiles
    width = derive_tiny_config("gpt2").n_embd
    pairs = zip(plain.compute.blocks, plain.activations.blocks, strict=True)
    dropped_pairs = zip(dropped.compute.blocks, dropped.activations.blocks, strict=True)
    for (block, saved), (dropped_block, dropped_saved) in zip(pairs, dropped_pairs, strict=True):
        assert block.attention_flops == dropped_block.attention_flops == 4.0 * SEQ * SEQ * width
        assert dropped_block.matmul_flops == block.matmul_flops  # no score matmuls under "attn"
        # What dropout adds to what a block saves is the kernel's seed and offset, not an s x s mask.
        assert dropped_saved.boundary + dropped_saved.interior < saved.boundary + saved.interior + 64


def test_the_math_path_is_what_it_replaces() -> None:
    # Without the mode the CPU's math path runs: score matmuls and a saved s x s softmax.
    with FakeTensorMode():
        q, k = (torch.empty(1, 4, SEQ, 24, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.empty(1, 4, SEQ, 8, dtype=torch.bfloat16, requires_grad=True)
        fused = {"_scaled_dot_product_efficient_attention"}
        for mode, expected in ((None, {"bmm"}), (CudaSdpaChoice(), fused)):
            ops = _Ops()
            with ops, mode if mode is not None else torch.enable_grad():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert expected <= set(ops.names), ops.names
            assert out.shape == (1, 4, SEQ, 8) and out.dtype == torch.bfloat16
        # One head size but dropout: the CPU's math path again (bmm, bernoulli), the GPU's fused kernel.
        for mode, expected in ((None, {"bmm", "bernoulli_"}), (CudaSdpaChoice(), fused)):
            ops = _Ops()
            with ops, mode if mode is not None else torch.enable_grad():
                out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
            assert expected <= set(ops.names), ops.names
            assert "bmm" not in ops.names or mode is None
            assert out.shape == (1, 4, SEQ, 24) and out.dtype == torch.bfloat16


def test_sdpa_arguments_keep_their_meaning() -> None:
    with FakeTensorMode():
        q = torch.empty(2, 8, 32, 24, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 48, 24, dtype=torch.bfloat16)  # grouped: 4 query heads per key head
        v = torch.empty(2, 2, 48, 8, dtype=torch.bfloat16)
        mask = torch.ones(2, 1, 32, 48, dtype=torch.bool)
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
            ((q, k, v), {"attn_mask": mask, "scale": 0.5, "enable_gqa": True}),
            ((q, k, v, mask, 0.0, False), {"scale": 0.5, "enable_gqa": True}),
        ]
        for args, kwargs in calls:
            math = F.scaled_dot_product_attention(*args, **kwargs)
            ops = _Ops()
            with ops, CudaSdpaChoice():
                fused = F.scaled_dot_product_attention(*args, **kwargs)
            assert "_scaled_dot_product_efficient_attention" in ops.names
            assert (fused.shape, fused.dtype) == (math.shape, math.dtype) == ((2, 8, 32, 8), torch.bfloat16)
        # One head size for all three: the CPU's flash kernel takes it, untouched.
        ops = _Ops()
        with ops, CudaSdpaChoice():
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names


def test_one_sequence_rows_profile_without_a_materialised_mask() -> None:
    from transformers import masking_utils

    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config("llama")
    small, large = (
        profile_step(config, micro_batch=1, seq_len=length, dtype=torch.bfloat16) for length in (SEQ, 2 * SEQ)
    )
    for short, long in zip(small.activations.blocks, large.activations.blocks, strict=True):
        # Linear in the sequence: no s x s additive mask saved per block (the fake forward's, not a GPU's).
        assert long.boundary + long.interior == 2 * (short.boundary + short.interior)
    lookup = masking_utils.find_packed_sequence_indices
    with unpacked_rows():
        assert masking_utils.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]])) is None
    assert masking_utils.find_packed_sequence_indices is lookup
    assert lookup(torch.tensor([[0, 1, 0, 1]])) is not None  # the real lookup sees the packing
