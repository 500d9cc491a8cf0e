"""The CPU ring-attention kernel: the torch internals it relies on exist, and it is scoped to its context."""

from __future__ import annotations

import re

import pytest
import torch

from automodel_cpu import CPURuntime
from automodel_cpu.ring_attention_kernel import cpu_ring_attention_available

AVAILABLE, WHY = cpu_ring_attention_available()
LOCKED = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
"""The kernel was written against torch 2.15's internals: from there on their absence is a failure."""


def test_the_internals_it_relies_on_exist_in_this_torch() -> None:
    if not LOCKED and not AVAILABLE:
        pytest.skip(f"torch {torch.__version__} predates the internals ({WHY})")
    assert (AVAILABLE, WHY) == (True, "")


def test_without_the_internals_it_refuses_naming_the_torch() -> None:
    if AVAILABLE:
        pytest.skip("this torch has the internals")
    with (
        pytest.raises(RuntimeError, match=re.escape(f"this torch {torch.__version__} lacks")),
        CPURuntime().ring_attention(),
    ):
        pass


@pytest.mark.skipif(not AVAILABLE, reason=f"this torch lacks the internals: {WHY}")
def test_the_kernel_is_registered_only_while_the_context_is_open() -> None:
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    before = dict(dispatcher._custom_op_handlers)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with CPURuntime().ring_attention():
        assert forward in dispatcher._custom_op_handlers
    assert dispatcher._custom_op_handlers == before  # nothing process-wide is left behind
