"""The CPU ring-attention kernel: the torch internals it relies on exist, and it is scoped to its context."""

from __future__ import annotations

import torch

from automodel_cpu import CPURuntime
from automodel_cpu.ring_attention_kernel import cpu_ring_attention_available


def test_the_internals_it_relies_on_exist_in_this_torch() -> None:
    assert cpu_ring_attention_available() == (True, "")


def test_the_kernel_is_registered_only_while_the_context_is_open() -> None:
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    before = dict(dispatcher._custom_op_handlers)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with CPURuntime().ring_attention():
        assert forward in dispatcher._custom_op_handlers
    assert dispatcher._custom_op_handlers == before  # nothing process-wide is left behind
