"""``automodel train`` end to end: 2 gloo workers, a Hugging Face export, and an exact resume.

Two launches in all (each costs ~15-30 s of process start-up on a small CPU machine): a 10-step run on 2
workers that saves distributed checkpoints at steps 5 and 10, then a ``--resume`` run on ONE worker in a
copy of its output folder without the step-10 checkpoint. It must continue from step 5 with the same
losses: this proves the resume (model, AdamW state, learning-rate schedule and data position) and, as the
world size changed, the global-token loss normalisation (2 data-parallel ranks give the gradients of one
process) and DCP resharding. Observed difference: 5e-7 (fp32 rounding of the reduction order).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

_ARGS = [
    "--steps", "10", "--checkpoint-every", "5", "--seq-len", "64", "--global-batch-size", "8",
    "--micro-batch-size", "2", "--warmup-steps", "2", "--lr", "0.005", "--nproc-per-node", "2",
    "--device", "cpu", "--set", "train.keep_checkpoints=0", "--set", "train.sample_tokens=8",
    "--set", "model.config_overrides={num_hidden_layers: 2}",
]  # fmt: skip


def _train(output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "automodel_all.cli",
        "train",
        *_ARGS,
        "--output-dir",
        str(output),
        *extra,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def _losses(output: Path) -> dict[int, float]:
    lines = (output / "train_log.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def test_train_saves_a_loadable_model_and_resumes_exactly(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = tmp_path / "run"
    result = _train(first)
    losses = _losses(first)
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1] - 0.3, losses  # it learns
    assert f"saved the trained model to {first / 'hf'}" in result.stdout
    assert "sample: " in result.stdout

    # The export is a plain Hugging Face folder: no automodel code needed to load and run it.
    model = AutoModelForCausalLM.from_pretrained(first / "hf")
    tokenizer = AutoTokenizer.from_pretrained(first / "hf")
    assert model.config.num_hidden_layers == 2
    ids = tokenizer("The for statement", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    checkpoints = sorted(p.name for p in (first / "checkpoints").iterdir())
    assert checkpoints == ["step_00000005", "step_00000010"]

    # Resume from step 5 in a copy whose newest checkpoint is gone (as if the job had died at step 7).
    second = tmp_path / "resumed"
    shutil.copytree(first, second, ignore=shutil.ignore_patterns("step_00000010", "hf"))
    result = _train(second, "--resume", "--nproc-per-node", "1")
    assert f"resumed from {second / 'checkpoints' / 'step_00000005'} (step 5)" in result.stdout
    resumed = _losses(second)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(losses[step], abs=1e-5), (step, resumed[step], losses[step])
    assert (second / "hf" / "config.json").is_file()
