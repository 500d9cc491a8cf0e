"""Every torch factory call in the library sources names its device: the static half of #39's device audit.

The runtime half (`automodel_testing.device_audit`, on in every `run_distributed` rank) catches what runs
in the tests, including ``nn.Linear(...)`` and other modules that library code builds without a device;
this check catches the calls no test reaches. ``automodel_testing`` is test tooling and exempt.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from automodel_testing.device_audit import ImplicitDeviceError, implicit_device_audit

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {
    "arange", "as_tensor", "asarray", "empty", "empty_strided", "eye", "full", "linspace", "logspace",
    "ones", "rand", "randint", "randn", "randperm", "scalar_tensor", "tensor", "tril_indices",
    "triu_indices", "zeros",
}  # fmt: skip


def _implicit_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        func = node.func
        if func.attr in FACTORIES and isinstance(func.value, ast.Name) and func.value.id == "torch":
            keywords = {k.arg for k in node.keywords}
            if "device" not in keywords and None not in keywords:  # None: a **kwargs that may carry it
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{func.attr}")
    return found


def test_library_factory_calls_name_their_device() -> None:
    found = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        if "automodel_testing" not in path.parts:
            found += _implicit_calls(path)
    assert found == [], "pass device= (the group's, the module's or 'cpu'):\n" + "\n".join(found)


PROBE = """
import torch
from torch import nn


def implicit():
    return torch.zeros(2)


def swallowed():
    try:
        torch.arange(3)
    except Exception:
        pass


def module():
    return nn.Linear(2, 2)


def explicit():
    return torch.zeros(2, device="cpu")


class Forwarding(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
"""


def test_the_runtime_audit_refuses_library_calls_and_records_caught_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "device_audit_probe").mkdir()
    (tmp_path / "device_audit_probe" / "__init__.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import device_audit_probe as probe

    with implicit_device_audit(packages=("device_audit_probe",)) as findings:
        torch.zeros(3)  # the test's own call: not library code
        assert probe.explicit().device == torch.device("cpu")
        assert findings == []
        with pytest.raises(ImplicitDeviceError, match=r"__init__\.py:7: torch\.zeros without device="):
            probe.implicit()
        probe.swallowed()  # caught by the code under test, still recorded
        with pytest.raises(ImplicitDeviceError, match=r"__init__\.py:18: torch\.empty without device="):
            probe.module()  # nn.Linear's own torch.empty, charged to the library line that built it
        with probe.Forwarding():  # a library mode passing on the test's own call: the test's
            torch.arange(3)
    where = [m.groups() for finding in findings if (m := re.search(r":(\d+): (torch\.\w+) ", finding))]
    assert where == [("7", "torch.zeros"), ("12", "torch.arange"), ("18", "torch.empty")]
    assert len(where) == len(findings), findings
