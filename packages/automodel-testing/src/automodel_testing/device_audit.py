"""Catch library code that creates tensors on the default device instead of the one it means.

On a GPU job the compute device (``cuda:N``), the default device (usually ``cpu``, sometimes ``meta``
or ``cuda`` when a user calls ``torch.set_default_device``) and a process group's device (NCCL: CUDA;
gloo: CPU) differ. A tensor that library code makes with ``torch.zeros(n)`` and hands to a collective,
the model or the optimizer then lands on the wrong one. On a CPU test bench all three are ``cpu``, so
the mistake never shows.

`implicit_device_audit` makes it show on CPU. While it is active, every torch factory function that
``torch.set_default_device`` would redirect (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...;
torch's own list) called without ``device=`` *from a file of an automodel library package* raises
`ImplicitDeviceError` naming the file and line, exactly where a meta default device would have put
the tensor on ``meta``: the calls library code makes itself, and those torch's module constructors
(``nn.Linear(...)``) make for it. What torch, transformers or peft create for their own purposes is
theirs, and so are the test's own calls (a call that a torch-function mode of the library passes on,
such as the fake-tensor tracer's, belongs to whoever made it); ``automodel_testing`` is test tooling
and exempt. Every
finding is also recorded, so one that a library ``try`` swallowed still fails the run
(`run_distributed` reports the findings of each rank).

`run_distributed` activates it in every rank unless told not to (``device_audit=False``), so every
multi-process test (the distributed tier, the model matrix, the fault tests) runs under it. Its cost
was below the run-to-run noise of the matrix's fast slice (it looks at factory calls only).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

__all__ = ["LIBRARY_PACKAGES", "ImplicitDeviceError", "implicit_device_audit"]

LIBRARY_PACKAGES: tuple[str, ...] = (
    "automodel_all",
    "automodel_checkpoint",
    "automodel_cpu",
    "automodel_distributed",
    "automodel_infra",
    "automodel_mesh",
    "automodel_modules",
    "automodel_moe",
    "automodel_peft",
    "automodel_pipelining",
    "automodel_planner",
    "automodel_quant",
)
"""The import names whose code must name the device of every tensor it creates."""


class ImplicitDeviceError(RuntimeError):
    """Library code created a tensor without ``device=`` while `implicit_device_audit` was active."""


def _folders(names: tuple[str, ...]) -> tuple[str, ...]:
    folders = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            folders.append(os.path.realpath(location) + os.sep)
    return tuple(folders)


_TORCH_FOLDER = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_MODULE_CONSTRUCTORS = os.path.join(_TORCH_FOLDER, "nn", "modules") + os.sep
"""torch's module classes create their tensors on the device their caller names (``device=None``: the
default one), so a call from there is charged to the code that built the module."""


_FORWARDERS = frozenset({"__torch_function__", "__torch_dispatch__"})
"""A torch-function mode or tensor subclass (the library's fake-tensor tracer, say) re-issues the calls it
intercepts from these methods: the call belongs to whoever made it, one frame further out."""


@functools.lru_cache(maxsize=4096)
def _real(path: str) -> str:
    return os.path.realpath(path)


def _library_caller(frame: FrameType | None, library: tuple[str, ...]) -> str | None:
    """``file:line`` of the library code that made the call in ``frame``, if library code made it.

    That is ``frame`` itself, or the code that built a torch module whose constructor made the call.
    A call torch makes for its own purposes (DCP's bookkeeping, say) is torch's, not the caller's.
    """
    while frame is not None:
        if frame.f_code.co_name in _FORWARDERS:  # another mode passing on a call someone else made
            frame = frame.f_back
            continue
        path = _real(frame.f_code.co_filename)
        if path.startswith(library):
            return f"{path}:{frame.f_lineno}"
        if not path.startswith(_MODULE_CONSTRUCTORS):
            return None
        frame = frame.f_back
    return None


class _AuditMode(TorchFunctionMode):
    def __init__(self, library: tuple[str, ...]) -> None:
        super().__init__()
        self.library = library
        self.findings: list[str] = []
        self.constructors = _device_constructors()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.constructors and kwargs.get("device") is None:
            where = _library_caller(sys._getframe(1), self.library)
            if where is not None:
                message = (
                    f"{where}: torch.{getattr(func, '__name__', func)} without device= puts the tensor on "
                    "the default device, which on a GPU job is not the compute or the process group's "
                    "device; pass device= (the group's: automodel_modules.collective_device; a module's: "
                    "its parameters'; host bookkeeping: 'cpu')"
                )
                self.findings.append(message)
                raise ImplicitDeviceError(message)
        return func(*args, **kwargs)


@contextlib.contextmanager
def implicit_device_audit(packages: tuple[str, ...] = LIBRARY_PACKAGES) -> Iterator[list[str]]:
    """Refuse device-less tensor creation by ``packages`` while the context is open.

    Args:
        packages: Import names of the packages under audit (those not installed are skipped).

    Yields:
        The list of findings (``"file:line: ..."``), filled as they happen, including any the
        library caught.

    Mutates the torch-function mode stack of this thread for the duration of the context.
    """
    mode = _AuditMode(_folders(packages))
    with mode:
        yield mode.findings
