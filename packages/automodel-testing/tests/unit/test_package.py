"""Package-level contracts: the public API and a lean import."""

from __future__ import annotations

import subprocess
import sys

import automodel_testing

LEAN_IMPORT = """
import sys
import automodel_testing
import torch
heavy = [name for name in ("transformers", "pytest", "torch.distributed.tensor") if name in sys.modules]
assert not heavy, heavy
assert not torch.cuda.is_initialized()
"""


def test_public_api() -> None:
    assert set(automodel_testing.__all__) == {
        "DistributedRunError",
        "ParityReport",
        "TINY_FAMILIES",
        "assert_grads_close",
        "assert_tensors_close",
        "available_gpus",
        "build_tiny_model",
        "causal_lm_loss",
        "grads_by_name",
        "load_script",
        "make_batch",
        "normalize_fqn",
        "params_by_name",
        "reference_loss_and_grads",
        "run_distributed",
        "safetensors_differences",
        "save_tiny_checkpoint",
        "skip_unless_gpus",
        "stored_tensors",
        "tiny_config",
        "to_full",
        "train_parity",
    }
    assert all(hasattr(automodel_testing, name) for name in automodel_testing.__all__)


def test_import_is_lean() -> None:
    subprocess.run([sys.executable, "-c", LEAN_IMPORT], check=True, timeout=120)
