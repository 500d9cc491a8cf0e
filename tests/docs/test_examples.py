"""The documentation's examples run as their docstrings say (so the guides cannot drift from the API).

Each file under ``docs/examples`` names its command in its docstring: ``torchrun --standalone
--nproc-per-node N <file>`` (run here with ``python -m torch.distributed.run``, gloo, CPU) or plain
``python <file>``. The test runs that command in a fresh temporary folder and requires exit status 0:
a renamed function, a changed signature or a new error in any package used by a guide fails it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
TORCHRUN = re.compile(r"torchrun --standalone --nproc-per-node (\d+) (\S+\.py)")


def _command(path: Path) -> tuple[list[str], int]:
    match = TORCHRUN.search(path.read_text())
    if match is None:
        return [sys.executable, str(path)], 1
    nproc = int(match.group(1))
    assert match.group(2) == path.name, f"{path.name}'s docstring runs {match.group(2)}"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(path),
    ], nproc


def _params() -> list[object]:
    params = []
    for path in sorted(EXAMPLES.glob("*.py")):
        _, nproc = _command(path)
        marks = [pytest.mark.distributed] if nproc > 1 else []
        params.append(pytest.param(path, id=path.stem, marks=marks))
    return params


@pytest.mark.parametrize("path", _params())
def test_example_runs(path: Path, tmp_path: Path) -> None:
    command, _ = _command(path)
    # faulthandler: a native crash in a rank (or the launcher) prints every thread's Python stack.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, (
        f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
