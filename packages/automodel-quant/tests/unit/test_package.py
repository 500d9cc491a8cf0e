"""The package installs alone, reports its version, exports what exists and imports lazily."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import automodel_quant


def test_version_matches_the_installed_distribution() -> None:
    assert automodel_quant.__version__ == importlib.metadata.version("automodel-quant")


def test_every_exported_name_exists() -> None:
    missing = [name for name in automodel_quant.__all__ if not hasattr(automodel_quant, name)]
    assert not missing, missing


def test_import_and_configs_do_not_import_torchao_or_bitsandbytes() -> None:
    code = (
        "import sys, automodel_quant\n"
        "from automodel_quant.qat import QATConfig\n"
        "from automodel_quant.fp8 import FP8Config\n"
        "from automodel_quant.bnb import BnBQuantizationConfig\n"
        "QATConfig(); FP8Config(); BnBQuantizationConfig()\n"
        "heavy = ('torchao', 'bitsandbytes', 'transformers')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
