"""Registries of tensor-parallel plans: per model class, and by name (for ``FSDP2Config(tp_plan="name")``).

The per-class registry starts with the built-in plans of `automodel_distributed.tensor_parallel.plans`
(keyed by class name, so no transformers model class is imported to register them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from automodel_distributed.tensor_parallel.plans import BUILTIN_TP_PLANS
from automodel_distributed.tensor_parallel.styles import to_parallel_style

__all__ = [
    "PlanFactory",
    "PlanMapping",
    "PlanSource",
    "register_named_tp_plan",
    "register_tp_plan",
    "registered_plan_for",
]

PlanMapping: TypeAlias = Mapping[str, ParallelStyle | str]
"""FQN pattern -> `ParallelStyle` or style name."""
PlanFactory: TypeAlias = Callable[[nn.Module, bool], PlanMapping]
"""``factory(model, sequence_parallel) -> plan``: a plan computed from the model."""
PlanSource: TypeAlias = PlanMapping | PlanFactory


@dataclass(frozen=True)
class _Registration:
    plan: PlanSource
    sequence_parallel_plan: PlanMapping | None
    builtin: bool = False


_BY_CLASS: dict[type, _Registration] = {}
_BY_NAME: dict[str, _Registration] = {
    name: _Registration(tp, sp, builtin=True) for name, (tp, sp) in BUILTIN_TP_PLANS.items()
}
_NAMED: dict[str, PlanSource] = {}


def check_plan_mapping(plan: object, *, what: str) -> None:
    """Check that ``plan`` maps strings to styles or known style names.

    Raises:
        ValueError: Not a mapping, a non-string key, or a value that is not a style (naming the key).
    """
    if not isinstance(plan, Mapping):
        raise ValueError(f"{what} must be a mapping of FQN patterns to styles, got {type(plan).__name__}")
    for key, value in plan.items():
        if not isinstance(key, str):
            raise ValueError(f"{what} has a non-string key {key!r}")
        to_parallel_style(value, where=f"{what}[{key!r}]")


def _check_source(plan: object, *, what: str) -> None:
    if callable(plan) and not isinstance(plan, Mapping):
        return
    check_plan_mapping(plan, what=what)


def register_tp_plan(
    model_class: type | str,
    plan: PlanSource,
    *,
    sequence_parallel_plan: PlanMapping | None = None,
    overwrite: bool = False,
) -> None:
    """Register the tensor-parallel plan of a model class.

    `resolve_tp_plan` looks registrations up by class (walking the MRO), then by class name (walking the
    MRO again), so a name string reaches classes that cannot be imported here (``trust_remote_code``).
    Plan keys are FQN patterns relative to the model (``*`` matches one name component), as
    ``parallelize_module`` takes them.

    Args:
        model_class: The class, or its ``__name__``.
        plan: The tensor-parallel plan, or ``factory(model, sequence_parallel) -> plan`` (then it handles both
            variants itself and ``sequence_parallel_plan`` must be None).
        sequence_parallel_plan: The plan to use when sequence parallelism is asked for; without one, asking
            for sequence parallelism on this class raises.
        overwrite: Replace an existing registration (including a built-in one) instead of raising.

    Raises:
        ValueError: A bad class or plan (an unknown style name is named with its key), a factory together
            with ``sequence_parallel_plan``, or an existing registration without ``overwrite``.
    """
    if isinstance(model_class, str):
        if not model_class:
            raise ValueError("register_tp_plan: the class name must not be empty")
        key_name = model_class
    elif isinstance(model_class, type):
        key_name = model_class.__qualname__
    else:
        raise ValueError(
            f"register_tp_plan: model_class must be a class or a class name, got {type(model_class).__name__}"
        )
    _check_source(plan, what=f"tp plan of {key_name}")
    if sequence_parallel_plan is not None:
        if callable(plan) and not isinstance(plan, Mapping):
            raise ValueError(
                f"register_tp_plan({key_name}): a plan factory receives `sequence_parallel` itself; "
                "do not pass sequence_parallel_plan with it"
            )
        check_plan_mapping(sequence_parallel_plan, what=f"sequence-parallel plan of {key_name}")
    registration = _Registration(plan, sequence_parallel_plan)
    if isinstance(model_class, str):
        existing = _BY_NAME.get(model_class)
        if existing is not None and not overwrite:
            kind = "a built-in plan" if existing.builtin else "a plan"
            raise ValueError(
                f"{model_class!r} already has {kind} registered by name; pass overwrite=True to replace it"
            )
        _BY_NAME[model_class] = registration
    else:
        if model_class in _BY_CLASS and not overwrite:
            raise ValueError(f"{key_name} already has a plan registered; pass overwrite=True to replace it")
        _BY_CLASS[model_class] = registration


def register_named_tp_plan(name: str, plan: PlanSource, *, overwrite: bool = False) -> None:
    """Register a plan under a name, so that ``FSDP2Config(tp_plan=name)`` selects it.

    Args:
        name: The plan's name (any string; it is looked up before import paths are tried).
        plan: A plan mapping, or ``factory(model, sequence_parallel) -> plan``.
        overwrite: Replace an existing plan of that name instead of raising.

    Raises:
        ValueError: An empty name, a bad plan, or an existing name without ``overwrite``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_named_tp_plan: the name must be a non-empty string, got {name!r}")
    _check_source(plan, what=f"named tp plan {name!r}")
    if name in _NAMED and not overwrite:
        raise ValueError(f"a tp plan named {name!r} is already registered; pass overwrite=True to replace it")
    _NAMED[name] = plan


def named_plan(name: str) -> PlanSource | None:
    """The plan registered under ``name``, or None."""
    return _NAMED.get(name)


def named_plan_names() -> list[str]:
    """Sorted names of the registered named plans."""
    return sorted(_NAMED)


def registered_plan_for(model_class: type) -> tuple[str, PlanSource, PlanMapping | None] | None:
    """Find the registration of a model class: by class along the MRO, then by name along the MRO.

    Returns:
        ``(how it was found, plan, sequence-parallel plan)``, or None when nothing is registered.
    """
    for cls in model_class.__mro__:
        registration = _BY_CLASS.get(cls)
        if registration is not None:
            return (
                f"registered for class {cls.__qualname__}",
                registration.plan,
                registration.sequence_parallel_plan,
            )
    for cls in model_class.__mro__:
        registration = _BY_NAME.get(cls.__name__)
        if registration is not None:
            kind = "built-in plan" if registration.builtin else "plan registered"
            return (
                f"{kind} for class name {cls.__name__!r}",
                registration.plan,
                registration.sequence_parallel_plan,
            )
    return None
