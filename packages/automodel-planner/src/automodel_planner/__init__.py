"""automodel-planner: the peak memory and traffic per rank of a training job, before any GPU is rented.

`estimate_peak` takes a `PlanInput` (a model on the meta device, its config, a validated layout and the
job's configs) and returns a `PeakEstimate`: parameters, gradients, optimizer state, FSDP's gathered
units, activations (profiled from the model's own forward on fake tensors), LoRA and FP8 extras and
collective buffers, line by line, for the rank that holds the most, and the bytes each collective sends
per step. Each line comes from the package that owns it, through one protocol (`PlannerTerm`);
``automodel plan`` prints it. No process group, no device, no memory allocated.
"""

from importlib.metadata import PackageNotFoundError, version

from automodel_planner.activations import (
    ActivationProfile,
    BlockActivations,
    activation_bytes,
    profile_activations,
)
from automodel_planner.devices import DEVICE_PRESETS, device_memory_bytes
from automodel_planner.estimate import PeakEstimate, ProfileCache, estimate_peak
from automodel_planner.facts import RankFacts, rank_facts
from automodel_planner.inputs import PlanInput
from automodel_planner.terms import ActivationMemory, PlannerTerm, planner_terms

try:
    __version__ = version("automodel-planner")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    __version__ = "0.0.0"

__all__ = [
    "DEVICE_PRESETS",
    "ActivationMemory",
    "ActivationProfile",
    "BlockActivations",
    "PeakEstimate",
    "PlanInput",
    "PlannerTerm",
    "ProfileCache",
    "RankFacts",
    "__version__",
    "activation_bytes",
    "device_memory_bytes",
    "estimate_peak",
    "planner_terms",
    "profile_activations",
    "rank_facts",
]
