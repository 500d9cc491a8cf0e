"""Compare sharded results with a single-process reference: tensors, parameters and gradients.

Names are compared after `normalize_fqn`, so a model wrapped by activation checkpointing,
``torch.compile``, FSDP1, DDP or peft matches the plain reference model. DTensors are gathered with
``full_tensor()``, which is a collective: call these helpers on every rank of the mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from automodel_modules import is_dtensor, strip_wrapper_segments

__all__ = [
    "assert_grads_close",
    "assert_tensors_close",
    "grads_by_name",
    "normalize_fqn",
    "params_by_name",
    "reference_loss_and_grads",
    "to_full",
]

# Prefixes that wrappers put in front of a name: DDP's `module.`, peft's `base_model.model.`.
_WRAPPER_PREFIXES: tuple[tuple[str, ...], ...] = (("module",), ("base_model", "model"))


def to_full(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``t``; a DTensor is first gathered with ``full_tensor()`` (a collective)."""
    if is_dtensor(t):
        t = t.full_tensor()
    return t.detach().to(device="cpu", copy=True)


def normalize_fqn(name: str) -> str:
    """Strip the name segments that wrappers add, so wrapped and plain parameter names match.

    Removes ``_checkpoint_wrapped_module.``, ``_orig_mod.`` and ``_fsdp_wrapped_module.`` wherever they
    appear, and a leading ``module.`` (DDP) or ``base_model.model.`` (peft), repeatedly.

    Args:
        name: A fully qualified parameter or module name.

    Returns:
        The name as the unwrapped model would spell it.
    """
    parts = strip_wrapper_segments(name).split(".")
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if len(parts) > len(prefix) and tuple(parts[: len(prefix)]) == prefix:
                parts = parts[len(prefix) :]
                stripped = True
    return ".".join(parts)


def _by_normalized_name(pairs: Any, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in pairs:
        key = normalize_fqn(name)
        if key in out:
            raise ValueError(f"two {what} normalize to the same name {key!r} (one of them is {name!r})")
        out[key] = value
    return out


def params_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor, keyed by normalized name (collective for DTensors)."""
    return {
        name: to_full(p) for name, p in _by_normalized_name(model.named_parameters(), "parameters").items()
    }


def _grads_or_none(model: nn.Module) -> dict[str, torch.Tensor | None]:
    params = _by_normalized_name(model.named_parameters(), "parameters")
    return {name: None if p.grad is None else to_full(p.grad) for name, p in params.items()}


def grads_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient as a full CPU tensor, keyed by normalized name.

    Parameters whose ``.grad`` is None are left out. Gathers DTensor gradients (a collective).
    """
    return {name: grad for name, grad in _grads_or_none(model).items() if grad is not None}


def assert_tensors_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, name: str = "tensor"
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` element-wise (compared in float64).

    NaN never matches; equal infinities do. DTensors are gathered first (a collective).

    Args:
        actual: The tensor under test.
        expected: The reference.
        atol: Absolute tolerance (>= 0).
        rtol: Relative tolerance (>= 0).
        name: What the tensors are, for the message.

    Raises:
        ValueError: For a negative tolerance.
        AssertionError: On a shape mismatch or when an element is out of tolerance; the message has the
            name, the max abs diff and where it is.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}")
    a, e = to_full(actual), to_full(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    a64, e64 = a.to(torch.float64), e.to(torch.float64)
    diff = (a64 - e64).abs()
    ok = (diff <= atol + rtol * e64.abs()) | (a64 == e64)
    if bool(ok.all()):
        return
    score = torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")).masked_fill(ok, -1.0)
    flat = int(score.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(score.shape)))
    raise AssertionError(
        f"{name}: max abs diff {float(score.max()):.3e} exceeds atol={atol:g}, rtol={rtol:g} "
        f"at {index}: actual {a64[index].item():.6g} vs expected {e64[index].item():.6g}; "
        f"{int((~ok).sum())}/{ok.numel()} elements differ (dtypes {a.dtype} vs {e.dtype})"
    )


def _grad_table(source: nn.Module | Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    if isinstance(source, nn.Module):
        return _grads_or_none(source)
    return {normalize_fqn(name): grad for name, grad in source.items()}


def assert_grads_close(
    model: nn.Module | Mapping[str, torch.Tensor | None],
    reference_model: nn.Module | Mapping[str, torch.Tensor | None],
    *,
    atol: float,
    rtol: float = 0.0,
) -> None:
    """Assert that two models have the same parameter names and close gradients.

    Either side may also be a name -> grad mapping (e.g. what `grads_by_name` returned on a rank, or
    the grads of `reference_loss_and_grads`). Names are compared after `normalize_fqn`.

    Args:
        model: The model under test (or its grads).
        reference_model: The reference (or its grads).
        atol: Absolute tolerance.
        rtol: Relative tolerance.

    Raises:
        AssertionError: Listing missing and unexpected names, grads that are None on one side only,
            and every gradient out of tolerance.
    """
    actual, expected = _grad_table(model), _grad_table(reference_model)
    problems: list[str] = []
    missing, extra = sorted(expected.keys() - actual.keys()), sorted(actual.keys() - expected.keys())
    if missing:
        problems.append(f"missing from the model: {missing}")
    if extra:
        problems.append(f"not in the reference: {extra}")
    for name in sorted(actual.keys() & expected.keys()):
        got, want = actual[name], expected[name]
        if got is None and want is None:
            continue
        if got is None or want is None:
            side = "the model" if got is None else "the reference"
            problems.append(f"grad of {name} is None in {side} only")
            continue
        try:
            assert_tensors_close(got, want, atol=atol, rtol=rtol, name=f"grad of {name}")
        except AssertionError as exc:
            problems.append(str(exc))
    if problems:
        raise AssertionError("gradients differ:\n  " + "\n  ".join(problems))


def reference_loss_and_grads(
    model: nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """Single-process forward with ``labels`` and backward: the reference for a parallel run.

    Zeroes the model's grads first (``set_to_none``) and leaves the new ones in ``.grad``. The batch is
    moved to the device of the model's first parameter.

    Args:
        model: A Hugging Face causal LM (its output has ``loss`` and ``logits``).
        batch: ``input_ids``, ``labels`` and optionally ``position_ids`` / ``attention_mask``.

    Returns:
        The loss as a float, the logits (detached, on CPU) and the grads by normalized name.
    """
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    output = model(**{key: value.to(device) for key, value in batch.items()})
    output.loss.backward()
    return float(output.loss.item()), to_full(output.logits), grads_by_name(model)
