"""Run a module-level function on N gloo ranks under ``torchrun`` and collect what each rank returns.

The benchmarks use this instead of `automodel_testing.run_distributed`: that helper is built for tests
(it stops ranks that take more than a few seconds to exit after returning, which a heavily loaded
machine can exceed), while a benchmark should simply wait for the job as a user's ``torchrun`` would.

    results = launch(fn, 2, arg1, arg2, timeout_s=600)   # fn(arg1, arg2) on ranks 0 and 1

``fn`` must be defined at module level in a file (a benchmark script, even when it runs as
``__main__``); the worker imports that file under another name, so its ``if __name__ == "__main__"``
block does not run again. Arguments and results travel as pickles through a temporary folder. Each rank
runs with ``OMP_NUM_THREADS=1`` and one torch thread, in a default ``gloo`` process group unless
``init_process_group=False``.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HOST_SETTINGS", "HostSetting", "LaunchError", "launch"]


@dataclass(frozen=True)
class HostSetting:
    """The settings of ours that a CPU row's memory and step time depend on, as one job runs them.

    ``host_allocator`` is the workers' malloc the way the ``automodel`` launcher starts them
    (``launch.host_allocator``; its ``auto`` gives ``mimalloc`` on CPU), ``cpu_runtime`` whether the
    job gives the strategy ``automodel_cpu.CPURuntime()`` (``FSDP2Config.host_runtime``).
    """

    host_allocator: str
    cpu_runtime: bool
    label: str

    def env(self) -> dict[str, str]:
        """The environment variables of this setting's workers."""
        from automodel_cpu.mimalloc_preload import worker_environment

        return worker_environment(self.host_allocator)


# Every allocator-dependent CPU row is measured under each of these, in the same run; the first is
# what `automodel train` does on CPU, the last what plain torchrun gives with FSDP2Config's defaults.
HOST_SETTINGS: tuple[HostSetting, ...] = (
    HostSetting("mimalloc", True, "automodel train on CPU: mimalloc preloaded, CPURuntime"),
    HostSetting("glibc", True, "glibc malloc, CPURuntime (plain torchrun, opted in)"),
    HostSetting("glibc", False, "glibc malloc, no host runtime (plain torchrun, library defaults)"),
)


class LaunchError(RuntimeError):
    """The torchrun job failed; the message holds the tail of its output."""


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 900.0,
    init_process_group: bool = True,
    pg_timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return the per-rank results in order.

    ``env``: extra environment variables of the ranks (e.g. `HostSetting.env`)."""
    module = sys.modules[fn.__module__]
    source = getattr(module, "__file__", None)
    if source is None:
        raise ValueError(f"{fn!r} must be defined in a file")
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        job = Path(tmp)
        (job / "job.pkl").write_bytes(
            pickle.dumps(
                (str(Path(source).resolve()), fn.__name__, args, kwargs, init_process_group, pg_timeout_s)
            )
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "--no-python", sys.executable, __file__, str(job),
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(
                f"{fn.__name__} on {world_size} ranks did not finish in {timeout_s:.0f} s"
            ) from exc
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise LaunchError(f"{fn.__name__} on {world_size} ranks failed (exit {proc.returncode}):\n{tail}")
        return [pickle.loads((job / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _worker(job: Path) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    source, name, args, kwargs, init_pg, pg_timeout_s = pickle.loads((job / "job.pkl").read_bytes())
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_bench_target", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_bench_target"] = module
    spec.loader.exec_module(module)
    rank = int(os.environ["RANK"])
    if init_pg:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = getattr(module, name)(*args, **kwargs)
    finally:
        if init_pg and dist.is_initialized():
            dist.destroy_process_group()
    (job / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
