"""Internals of `run_distributed`: how a function travels to a rank process and runs there.

The parent cannot pickle the function itself: pytest collects test modules with
``--import-mode=importlib``, so a test module is usually not importable by name in a fresh
interpreter. The parent therefore sends a `FunctionRef` (file, module name, qualified name) and the
arguments as pickled bytes; the child imports the module (from its file when needed) *before* it
unpickles the arguments, which may reference classes defined in that module.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import os
import pathlib
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

__all__ = ["FunctionRef", "LaunchSpec", "rank_environment", "resolve_function_ref", "worker_main"]


@dataclass(frozen=True)
class FunctionRef:
    """Where a module-level function lives, so that another interpreter can find it.

    Attributes:
        module_name: The function's ``__module__``.
        module_file: The file of that module, or None when the module has no file.
        qualname: The function's ``__qualname__`` (dotted for static methods of classes).
    """

    module_name: str
    module_file: str | None
    qualname: str


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a rank needs, apart from its rank number and the result queue.

    Attributes:
        fn_ref: The function to run.
        payload: ``pickle.dumps((args, kwargs))``.
        world_size: Number of ranks.
        device: ``"cpu"`` or ``"cuda"``.
        backend: The ``torch.distributed`` backend.
        init_method: The rendezvous URL (``file://...``).
        pg_timeout_s: Timeout of the default process group, in seconds.
        init_process_group: Whether to create the default process group before calling the function.
        env: The whole environment of every rank: the caller's at launch plus the shared rank variables
            (see `rank_environment` for the per-rank ones).
        cwd: The caller's working directory at launch; every rank runs there.
        device_audit: Whether the function runs under `implicit_device_audit` (see `run_distributed`).
        output_dir: Where each rank's stdout and stderr go (`rank_output_path`); empty: inherited.
    """

    fn_ref: FunctionRef
    payload: bytes
    world_size: int
    device: str
    backend: str
    init_method: str
    pg_timeout_s: float
    init_process_group: bool
    env: Mapping[str, str]
    cwd: str
    device_audit: bool = True
    output_dir: str = ""


STACKS_SIGNAL = signal.SIGUSR1
"""The signal on which a rank writes every thread's Python stack to its output (``faulthandler``)."""


def rank_output_path(output_dir: str, rank: int) -> str:
    """The file that holds rank ``rank``'s stdout and stderr under ``output_dir``."""
    return os.path.join(output_dir, f"rank{rank}.log")


def _redirect_output(spec: LaunchSpec, rank: int) -> None:
    """Send this rank's stdout and stderr (file descriptors 1 and 2) to its file in ``spec.output_dir``.

    A forked rank inherits the fork server's descriptors, which point wherever the server's first
    caller's were (a pytest capture long closed): without this, a crash message is lost.
    """
    if not spec.output_dir:
        return
    fd = os.open(rank_output_path(spec.output_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def rank_environment(spec: LaunchSpec, rank: int) -> dict[str, str]:
    """The environment of one rank: the shared variables plus ``RANK`` and ``LOCAL_RANK``."""
    return {**spec.env, "RANK": str(rank), "LOCAL_RANK": str(rank)}


def _lookup(root: object, qualname: str) -> object:
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_function_ref(fn: Callable[..., Any]) -> FunctionRef:
    """Describe a module-level function so a spawned interpreter can import it.

    Args:
        fn: A function (or static/class method) reachable as ``module.qualname``.

    Returns:
        The function's `FunctionRef`.

    Raises:
        ValueError: If ``fn`` is a lambda, a nested function, a bound method, a ``functools.partial``
            or anything else that cannot be found again by module and qualified name.
    """
    qualname = getattr(fn, "__qualname__", None)
    module_name = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module_name, str):
        raise ValueError(
            f"run_distributed needs a function defined at module level, got {fn!r} "
            "(it has no __module__/__qualname__; wrap partials in a module-level function)."
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(
            f"run_distributed cannot send {module_name}.{qualname} to spawned processes: lambdas and "
            "nested functions cannot be imported by another interpreter. Define the function at module "
            "level (in the test file itself is fine)."
        )
    module = sys.modules.get(module_name)
    if module is None:
        raise ValueError(f"run_distributed: the module {module_name!r} of {qualname} is not imported.")
    try:
        found = _lookup(module, qualname)
    except AttributeError:
        found = None
    if found is not fn and found != fn:
        raise ValueError(
            f"run_distributed: {module_name}.{qualname} does not resolve back to {fn!r} "
            "(bound methods, decorated or shadowed names cannot be sent); pass a module-level function."
        )
    module_file = getattr(module, "__file__", None)
    if module_file is None and module_name == "__main__":
        raise ValueError("run_distributed: functions defined in an interactive __main__ cannot be spawned.")
    return FunctionRef(module_name, os.path.abspath(module_file) if module_file else None, qualname)


def _same_file(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _add_missing_parents(name: str, file: str) -> None:
    """Register placeholder packages for the missing parents of a dotted module name.

    pickle imports the top-level package of a class's module before it looks the module up in
    ``sys.modules``, so ``a.b.test_x`` loaded from its file also needs ``a`` and ``a.b``. Each
    placeholder's ``__path__`` is its folder when the folder names match, so relative imports work.
    """
    parts = name.split(".")
    folder: pathlib.Path | None = pathlib.Path(file).resolve().parent
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:depth])
        matches = folder is not None and folder.name == parts[depth - 1]
        if parent not in sys.modules:
            placeholder = ModuleType(parent)
            placeholder.__path__ = [str(folder)] if matches and folder is not None else []
            sys.modules[parent] = placeholder
        child = sys.modules.get(f"{parent}.{parts[depth]}")
        if child is not None and not hasattr(sys.modules[parent], parts[depth]):
            setattr(sys.modules[parent], parts[depth], child)
        folder = folder.parent if matches and folder is not None else None


def _import_module(ref: FunctionRef) -> ModuleType:
    """Import the module of ``ref``: normally when that finds the same file, else from the file."""
    loaded = sys.modules.get(ref.module_name)
    if loaded is not None:
        return loaded
    try:
        spec = importlib.util.find_spec(ref.module_name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and (ref.module_file is None or _same_file(spec.origin, ref.module_file)):
        return importlib.import_module(ref.module_name)
    if ref.module_file is None:
        raise ImportError(f"cannot import {ref.module_name!r} and it has no file to load it from")
    spec = importlib.util.spec_from_file_location(ref.module_name, ref.module_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ref.module_name!r} from {ref.module_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[ref.module_name] = module
    _add_missing_parents(ref.module_name, ref.module_file)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[ref.module_name]
        raise
    return module


def _load_function(ref: FunctionRef) -> Callable[..., Any]:
    fn = _lookup(_import_module(ref), ref.qualname)
    if not callable(fn):
        raise TypeError(f"{ref.module_name}.{ref.qualname} is not callable")
    return fn


def _become_group_leader() -> None:
    """Put this rank in its own process group so the parent can kill it with everything it started."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpgid(0, 0)


def _call(fn: Callable[..., Any], args: Any, kwargs: Any, audit: bool) -> Any:
    """``fn(*args, **kwargs)``, under `implicit_device_audit` when ``audit``; findings fail the rank."""
    if not audit:
        return fn(*args, **kwargs)
    from automodel_testing.device_audit import ImplicitDeviceError, implicit_device_audit

    with implicit_device_audit() as findings:
        result = fn(*args, **kwargs)
    if findings:  # raised where they happened; these were caught by the code under test
        raise ImplicitDeviceError("\n".join(dict.fromkeys(findings)))
    return result


def worker_main(rank: int, spec: LaunchSpec, queue: Any) -> None:
    """Entry point of one rank; reports ``("ok"|"error", rank, bytes|str)`` on ``queue``.

    The rank is forked from `run_distributed`'s fork server, which started long before this launch:
    its environment and working directory are replaced by the caller's at launch (``spec.env``,
    ``spec.cwd``) before anything else runs, so a rank sees what a freshly spawned interpreter would.
    The result is pickled here, so an unpicklable return value is reported as this rank's error
    instead of being lost in the queue's feeder thread. The default process group, whoever created
    it, is destroyed at the end. The rank's stdout and stderr go to its file in ``spec.output_dir``
    (the caller reports them), and a fatal signal (a native crash in torch, gloo or a kernel) first
    writes every thread's Python stack there, so the failure names where it happened; so does
    `STACKS_SIGNAL`, which the caller sends a rank that hangs.
    """
    _redirect_output(spec, rank)
    faulthandler.enable(all_threads=True)
    # A hung rank is asked for its stacks (run_distributed sends this before stopping it).
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    _become_group_leader()
    os.environ.clear()
    os.environ.update(rank_environment(spec, rank))
    os.chdir(spec.cwd)
    import torch
    import torch.distributed as dist

    try:
        message: tuple[str, int, Any]
        try:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            if spec.device == "cuda":
                torch.cuda.set_device(rank)
            if spec.init_process_group:
                dist.init_process_group(
                    backend=spec.backend,
                    init_method=spec.init_method,
                    rank=rank,
                    world_size=spec.world_size,
                    timeout=timedelta(seconds=spec.pg_timeout_s),
                )
            fn = _load_function(spec.fn_ref)
            args, kwargs = pickle.loads(spec.payload)
            result = _call(fn, args, kwargs, spec.device_audit)
            message = ("ok", rank, pickle.dumps(result))
        except BaseException:
            message = ("error", rank, traceback.format_exc())
        queue.put(message)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
