"""``automodel train`` on a vision-language model: the example job file
``examples/sft_qwen2_5_vl_frozen_tower.yaml`` with a tiny LLaVA, a folder of images with JSONL
conversations (the embedded example, written by `write_image_chat_example`), 2 gloo workers under FSDP2
with the vision tower frozen (``freeze_config``) and replicated (``distributed.multimodal``), and
activation checkpointing of the language model's blocks.

One launch (~30 s of start-up on a small CPU machine). It must show: the first step's loss equals
single-process transformers on the same rows (images included) within 1e-5, so the pixels reach the
model with their rows; the loss falls and the evaluation split is evaluated; the export is a Hugging
Face folder that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load and run; the frozen tower's
weights are those of the start while the language model moved; and the distributed checkpoint holds no
optimizer state for the frozen tower.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.extended, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_qwen2_5_vl_frozen_tower.yaml"


def _words(line: str) -> set[str]:
    texts = [p.get("text") or "" for m in json.loads(line)["messages"] for p in m["content"]]
    return {w for text in texts for w in re.findall(r"\w+|[^\w\s]+", text)}


def test_train_a_vlm_on_a_folder_of_images(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from automodel_all.cli.data import RowSampler, load_data
    from automodel_all.cli.image_data import write_image_chat_example
    from automodel_all.cli.packing import model_inputs
    from automodel_testing.vlm import save_tiny_llava

    example = write_image_chat_example(tmp_path / "example")
    words = {w for line in (example / "train.jsonl").read_text().splitlines() for w in _words(line)}
    words |= {w for line in (example / "validation.jsonl").read_text().splitlines() for w in _words(line)}
    model = save_tiny_llava(tmp_path / "model", sorted(words))
    output = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The example job file, with the tiny model and data, a short run and fp32 (for the 1e-5 check); its
    # freeze_config, frozen_sharding and activation-checkpointing scope are kept.
    command = [
        sys.executable, "-m", "automodel_all.cli", "train", str(EXAMPLE), "--model", str(model),
        "--data", str(example), "--steps", "6", "--seq-len", "48", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "0.01", "--warmup-steps", "1", "--checkpoint-every", "0",
        "--set", "model.dtype=float32",
        "--set", "distributed.mp_policy={param_dtype: float32, reduce_dtype: float32}",
        "--nproc-per-node", "2", "--device", "cpu", "--output-dir", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, [r["loss"] for r in records]
    evals = [json.loads(line) for line in (output / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [6] and evals[0]["eval_tokens"] > 0

    # Step 1 against transformers in one process: the same 8 rows of the global batch, with their images.
    rows, _ = load_data(output)
    batch = rows.batch(RowSampler(len(rows), 8, 1234).indices(0, 0, 1))
    reference = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(**model_inputs(batch)).logits
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    assert abs(float(loss) / int((labels != -100).sum()) - records[0]["loss"]) < 1e-5

    # The export: plain transformers loads and runs it; the tower did not move, the language model did.
    hf = output / "hf"
    assert "AutoModelForImageTextToText" in result.stdout
    trained = AutoModelForImageTextToText.from_pretrained(hf, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(hf)
    messages = json.loads((example / "validation.jsonl").read_text().splitlines()[0])["messages"]
    messages[0]["content"][0]["path"] = str(example / messages[0]["content"][0]["path"])
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(trained(**inputs).logits).all()
    start, end = load_file(model / "model.safetensors"), {}
    for file in hf.glob("*.safetensors"):
        end.update(load_file(file))
    assert set(start) == set(end)
    tower = [k for k in start if "vision_tower" in k]
    assert tower and all(torch.equal(start[k], end[k]) for k in tower)
    assert not any(torch.equal(start[k], end[k]) for k in start if "language_model" in k and "layers" in k)

    # No optimizer state for the frozen tower in the distributed checkpoint (AdamW keeps two per parameter).
    (checkpoint,) = [p for p in (output / "checkpoints").iterdir() if p.is_dir()]
    keys = list(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    optimizer = [k for k in keys if "exp_avg" in k]
    assert optimizer and not [k for k in optimizer if "vision_tower" in k], keys[:10]
    assert [k for k in optimizer if "language_model" in k]
