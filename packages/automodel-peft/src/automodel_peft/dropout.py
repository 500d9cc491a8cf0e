"""``dropout_position="post"``: dropout on the adapter's output, ``dropout(B(A(x)))``.

peft applies LoRA dropout to the adapter's input only. For "post", the adapter's ``lora_B`` linear gets
a parameter-free ``post_dropout`` child and a forward hook that applies it to ``lora_B``'s output, so
parameter names (and the saved adapter format) are unchanged and ``train()`` / ``eval()`` switch it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["POST_DROPOUT_NAME", "install_post_dropout", "post_dropout_of"]

POST_DROPOUT_NAME = "post_dropout"


def _apply_post_dropout(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    dropout = getattr(module, POST_DROPOUT_NAME)
    result: torch.Tensor = dropout(output)
    return result


def install_post_dropout(lora_b: nn.Module, p: float) -> None:
    """Make ``lora_b`` (an adapter's B linear) apply ``Dropout(p)`` to its output. Mutates it.

    Raises:
        ValueError: ``p`` outside (0, 1) or a post-dropout already installed.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"post-dropout probability must be in (0, 1), got {p}")
    if hasattr(lora_b, POST_DROPOUT_NAME):
        raise ValueError(f"{type(lora_b).__name__} already has a post-dropout")
    lora_b.add_module(POST_DROPOUT_NAME, nn.Dropout(p))
    lora_b.register_forward_hook(_apply_post_dropout)


def post_dropout_of(lora_b: nn.Module) -> float:
    """The post-dropout probability installed on ``lora_b`` (0 when none)."""
    dropout = getattr(lora_b, POST_DROPOUT_NAME, None)
    return float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0
