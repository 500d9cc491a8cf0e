"""automodel-cpu: the opt-in layer that makes CPU (gloo) training runs small and fast.

`CPURuntime` is the one object a strategy is given (``FSDP2Config(host_runtime=CPURuntime())``,
``context_parallel_region(..., host_runtime=...)``); the ``automodel`` command gives it to its CPU jobs
and preloads mimalloc into their workers (`automodel_cpu.mimalloc_preload`). Without it every automodel
strategy is plain torch. The parts, each a module named for what it does:

- `automodel_cpu.fsdp_buffer_pool`: FSDP2's host collective buffers kept from step to step, gloo's
  collectives in pieces (its sizes: `automodel_cpu.limits`);
- `automodel_cpu.copy_in_kernel`: the reduce-scatter copy-in without a gradient-sized temporary;
- `automodel_cpu.malloc_settings`: glibc's thresholds, returning free memory to the OS;
- `automodel_cpu.mimalloc_preload`: the environment that preloads mimalloc into worker processes;
- `automodel_cpu.ring_attention_kernel`: torch's ring attention for CPU SDPA (context parallelism).
"""

from importlib.metadata import PackageNotFoundError, version

from automodel_cpu.runtime import CPURuntime

try:
    __version__ = version("automodel-cpu")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    __version__ = "0.0.0"

__all__ = ["CPURuntime", "__version__"]
