"""The package installs alone, reports its version, exports what exists and imports lazily."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import automodel_peft


def test_version_matches_the_installed_distribution() -> None:
    assert automodel_peft.__version__ == importlib.metadata.version("automodel-peft")


def test_every_exported_name_exists() -> None:
    missing = [name for name in automodel_peft.__all__ if not hasattr(automodel_peft, name)]
    assert not missing, missing


def test_import_and_config_do_not_import_peft_or_quant() -> None:
    code = (
        "import sys, automodel_peft\n"
        "automodel_peft.PeftConfig(target_modules=['q_proj'])\n"
        "heavy = ('peft', 'transformers', 'torchao', 'bitsandbytes', 'automodel_quant')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_one_adapter_rule_is_what_peft_declares() -> None:
    """``automodel_modules.ADAPTER_SEGMENTS`` (read by every package) is peft's own declaration."""
    from peft.tuners.lora.layer import LoraLayer

    from automodel_modules import ADAPTER_SEGMENTS

    # peft before 0.19 declared DoRA's magnitude vector apart from the other adapter layers.
    assert set(ADAPTER_SEGMENTS) == {*LoraLayer.adapter_layer_names, "lora_magnitude_vector"}
