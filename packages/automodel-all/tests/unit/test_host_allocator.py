"""launch.host_allocator: the rule of ``auto``, the workers' environment, and a real preloaded child."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from automodel_all.cli.host_allocator import mimalloc_library, resolve_host_allocator, worker_environment

linux = pytest.mark.skipif(platform.system() != "Linux", reason="mimalloc is preloaded with LD_PRELOAD")

# What the child reports: which malloc serves it, and whether the glibc tuning applied.
_PROBE = (
    "import ctypes\n"
    "from automodel_distributed.checkpoint.host_memory import configure_host_allocator, malloc_is_glibc\n"
    "print(hasattr(ctypes.CDLL(None), 'mi_version'), malloc_is_glibc(), configure_host_allocator())\n"
)


def _probe(extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | extra
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout.strip()


@linux
def test_auto_is_mimalloc_for_cpu_jobs_and_glibc_on_gpus() -> None:
    assert mimalloc_library() is not None, (
        "the cmeel-mimalloc wheel is a dependency of automodel-all on Linux"
    )
    assert resolve_host_allocator("auto", "cpu") == "mimalloc"
    assert resolve_host_allocator("auto", "cuda") == "glibc"
    assert resolve_host_allocator("glibc", "cpu") == "glibc"
    assert resolve_host_allocator("mimalloc", "cuda") == "mimalloc"
    with pytest.raises(ValueError, match=r"launch.host_allocator must be one of .*'jemalloc'"):
        resolve_host_allocator("jemalloc", "cpu")


@linux
def test_worker_environment_preloads_mimalloc_first() -> None:
    library = str(mimalloc_library())
    assert worker_environment("glibc", {"LD_PRELOAD": "/x/libfoo.so"}) == {}
    env = worker_environment("mimalloc", {"LD_PRELOAD": "/x/libfoo.so:/y/libbar.so"})
    assert env["LD_PRELOAD"] == f"{library} /x/libfoo.so /y/libbar.so"
    assert env["MIMALLOC_PURGE_DELAY"] == "-1"
    again = worker_environment("mimalloc", {"LD_PRELOAD": env["LD_PRELOAD"]})
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"], "the library was preloaded twice"


@linux
def test_a_preloaded_child_runs_on_mimalloc_and_skips_the_glibc_tuning() -> None:
    assert _probe(worker_environment("mimalloc", {})) == "True False False"
    assert _probe({}) == "False True True"
