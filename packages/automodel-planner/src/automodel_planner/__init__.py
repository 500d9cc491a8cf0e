"""automodel-planner: the memory, traffic and step time of a training job, before any GPU is rented.

`estimate_peak` takes a `PlanInput` (a model on the meta device, its config, a validated layout and the
job's configs) and returns a `PeakEstimate`: parameters, gradients, optimizer state, FSDP's gathered
units, activations (profiled from the model's own forward on fake tensors), LoRA and FP8 extras and
collective buffers, line by line, for the rank that holds the most, and the bytes each collective sends
per step; on GPUs (`with_allocator_reserve`, `with_process_memory`) also the caching allocator's
reserve, the CUDA context and NCCL's buffers. Each line comes from the package that owns it, through
one protocol (`PlannerTerm`).
`estimate_throughput` adds the hardware (`Cluster`, `parse_cluster`: ``128xH100``) and returns a
`StepTime`: the step's compute, recompute, exposed collectives, pipeline bubble and optimizer, tokens/s
per GPU and MFU; its achievable fractions (`Efficiency`) are fitted on published runs
(`published_runs`). ``automodel plan`` prints both. No process group, no device, no memory allocated.
"""

from importlib.metadata import PackageNotFoundError, version

from automodel_planner.activations import (
    ActivationProfile,
    BlockActivations,
    StepProfile,
    activation_bytes,
    profile_activations,
    profile_step,
)
from automodel_planner.compute import BlockCompute, ComputeProfile
from automodel_planner.devices import DEVICE_PRESETS, device_memory_bytes
from automodel_planner.estimate import (
    PeakEstimate,
    ProfileCache,
    calibrate_efficiency,
    estimate_peak,
    estimate_throughput,
    flops_per_token,
    with_allocator_reserve,
)
from automodel_planner.facts import RankFacts, rank_facts
from automodel_planner.hardware import (
    DEVICES,
    Cluster,
    Device,
    cluster_from_mapping,
    device_named,
    parse_cluster,
)
from automodel_planner.inputs import PlanInput
from automodel_planner.published import (
    PublishedRun,
    fit_allocator_reserve,
    fit_efficiency,
    predict,
    published_runs,
    run_plan,
)
from automodel_planner.runtime_memory import with_process_memory
from automodel_planner.step_time import DEFAULT_EFFICIENCY, Efficiency, StepOptions, StepTime
from automodel_planner.terms import ActivationMemory, PlannerTerm, planner_terms

try:
    __version__ = version("automodel-planner")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    __version__ = "0.0.0"

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEVICES",
    "DEVICE_PRESETS",
    "ActivationMemory",
    "ActivationProfile",
    "BlockActivations",
    "BlockCompute",
    "Cluster",
    "ComputeProfile",
    "Device",
    "Efficiency",
    "PeakEstimate",
    "PlanInput",
    "PlannerTerm",
    "ProfileCache",
    "PublishedRun",
    "RankFacts",
    "StepOptions",
    "StepProfile",
    "StepTime",
    "__version__",
    "activation_bytes",
    "calibrate_efficiency",
    "cluster_from_mapping",
    "device_memory_bytes",
    "device_named",
    "estimate_peak",
    "estimate_throughput",
    "fit_allocator_reserve",
    "fit_efficiency",
    "flops_per_token",
    "parse_cluster",
    "planner_terms",
    "predict",
    "profile_activations",
    "profile_step",
    "published_runs",
    "rank_facts",
    "run_plan",
    "with_allocator_reserve",
    "with_process_memory",
]
