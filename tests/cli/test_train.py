"""``automodel train`` end to end: 2 gloo workers, a Hugging Face export, and an exact resume; and a
fine-tuning job as people run one (chat data, LoRA, evaluation, metrics) on a Qwen3-MoE-shaped model.

Three launches in all (each costs ~15-30 s of process start-up on a small CPU machine):

1. a 10-step run on 2 workers that saves distributed checkpoints at steps 5 and 10, then a ``--resume``
   run on ONE worker in a copy of its output folder without the step-10 checkpoint. It must continue
   from step 5 with the same losses: this proves the resume (model, AdamW state, learning-rate schedule
   and the data position recorded in the checkpoint) and, as the world size changed, the global-token
   loss normalisation (2 data-parallel ranks give the gradients of one process) and DCP resharding.
   Observed difference: 5e-7 (fp32 rounding of the reduction order).
2. LoRA SFT of a tiny Qwen3-MoE on the embedded chat dataset, experts parallel over 2 workers, with an
   evaluation split every 5 steps, every metric sink (JSON lines, TensorBoard, W&B offline, MLflow's
   SQLite store) and the loss-curve PNG: the metrics lines hold every field, each sink holds the same
   scalars, the configuration and the final model's folder, the expert-load histogram counts every
   routed token, the evaluation loss falls.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _dropped(run: Path, folder: Path, names: list[str]) -> set[str]:
    """What the copy of ``run`` leaves out: the final export and the step-10 checkpoint."""
    if folder == run:
        return {"hf"} & set(names)
    return {"step_00000010"} & set(names) if folder == run / "checkpoints" else set()


@pytest.mark.extended  # resume exactness runs by default in tests/faults (the flipped byte's fallback resume)
@pytest.mark.parametrize("hf_checkpoints", ["none", "only"])
def test_train_saves_a_loadable_model_and_resumes_exactly(tmp_path: Path, hf_checkpoints: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = tmp_path / "run"
    option = ("--set", f"train.hf_checkpoints={hf_checkpoints}")
    result = _train(first, *option)
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
    marker = json.loads((first / "checkpoints" / "step_00000005" / ".automodel_complete.json").read_text())
    assert marker["extra_state"]["data"]["step"] == 5 and marker["extra_state"]["reason"] == "periodic"
    assert (
        marker["extra_state"]["data"]["global_batch_size"] == 8
        and marker["extra_state"]["data"]["fingerprint"]
    )
    assert {"rank_state/rank_00000.pt", "rank_state/rank_00001.pt", "__0_0.distcp"} <= set(marker["files"])
    # train.hf_checkpoints=only: the weights as a Hugging Face folder, the optimizer's state in DCP.
    assert ("hf/model.safetensors" in marker["files"]) == (hf_checkpoints == "only")
    if hf_checkpoints == "only":
        AutoModelForCausalLM.from_pretrained(first / "checkpoints" / "step_00000005" / "hf")

    # Resume from step 5 in a copy whose newest checkpoint is gone (as if the job had died at step 7).
    second = tmp_path / "resumed"
    shutil.copytree(first, second, ignore=lambda folder, names: _dropped(first, Path(folder), names))
    result = _train(second, "--resume", "--nproc-per-node", "1", *option)
    assert f"resumed from {second / 'checkpoints' / 'step_00000005'} (step 5)" in result.stdout
    resumed = _losses(second)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(losses[step], abs=1e-5), (step, resumed[step], losses[step])
    assert (second / "hf" / "config.json").is_file()


def test_lora_sft_of_a_moe_model_on_chat_data_with_evaluation_and_metrics(tmp_path: Path) -> None:
    from automodel_all.cli.default_job import builtin_corpus, train_tokenizer
    from automodel_testing import save_tiny_checkpoint

    # 2 MoE layers, 8 experts, top-2, with the vocabulary of the embedded tokenizer.
    model = save_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe", vocab_size=2048)
    tokenizer = train_tokenizer(builtin_corpus(), tmp_path / "tokenizer")
    output = tmp_path / "sft"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "automodel_all.cli", "train", "--model", str(model),
        "--tokenizer", str(tokenizer),
        "--data", "builtin:chat", "--eval-split", "validation", "--eval-every", "5", "--steps", "10",
        "--seq-len", "64", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "0.01",
        "--warmup-steps", "2", "--ep", "2", "--lora", "--lora-rank", "4",
        "--report-to", "jsonl,tensorboard,wandb,mlflow", "--set", "report.wandb_mode=offline",
        "--set", "report.run_name=sft", "--set", "train.sample_prompt=What is 2 plus 3?",
        "--set", "train.sample_tokens=8",
        "--nproc-per-node", "2", "--device", "cpu", "--output-dir", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    fields = {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "seconds", "memory_gib", "skipped", "moe"}
    fields |= {"tflops_per_gpu", "mfu", "slowest_rank", "slowest_seconds"}
    assert all(fields <= set(r) for r in records)
    # TFLOP/s per GPU from the planner's count of this model (LoRA: the frozen base without its weight
    # gradients); no MFU on CPU (no peak to divide by); the slowest rank named each step.
    for r in records:
        assert r["mfu"] is None and r["tflops_per_gpu"] > 0, r
        assert r["slowest_rank"] in (0, 1) and r["slowest_seconds"] > 0, r
    # Loss on the answers only: far fewer label tokens than the 8 x 64 slots of a step.
    assert all(0 < r["tokens"] < 8 * 64 * 0.7 for r in records)
    moe = records[-1]["moe"]
    assert len(moe["tokens_per_expert"]) == 8 and moe["imbalance"] >= 1.0
    # Every routed token counted: 4 rows x 64 slots per rank, top-2, 2 MoE layers.
    assert sum(moe["tokens_per_expert"]) == pytest.approx(4 * 64 * 2 * 2)
    assert all(lo <= hi for lo, hi in zip(moe["min_over_ranks"], moe["max_over_ranks"], strict=True))
    evals = [json.loads(line) for line in (output / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [5, 10]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] and evals[1]["eval_ppl"] == pytest.approx(
        math.exp(evals[1]["eval_loss"])
    )
    assert (output / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard holds the same scalars as the JSON lines.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(output / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "eval/eval_loss", "moe/imbalance"}
    assert expected | {"train/tflops_per_gpu", "train/slowest_seconds"} <= tags, tags
    assert [e.value for e in board.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records])
    assert any((output / "tensorboard").glob("events.out.tfevents.*"))
    final_model = str((output / "hf").resolve())
    run = json.loads((output / "run.json").read_text())
    assert run["final_model"] == final_model and run["config"]["parallelism"]["ep_size"] == 2
    _check_wandb_run(output / "wandb", records, evals, final_model)
    _check_mlflow_run(output, records, evals, final_model)
    # --lora on a MoE model adapts the experts' stacked weights too (found in its structure), trained
    # under EP and saved in the PEFT format, which PeftModel loads.
    assert run["config"]["peft"]["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    _check_expert_adapters(output / "hf")
    assert "sample: 'User: What is 2 plus 3?\\nAssistant:" in result.stdout, result.stdout[-2000:]


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (``run-<id>.wandb``): a log of 32 KiB blocks, each record split
    into chunks with a 7-byte header (CRC-32 of type byte and data, length, type: 1 whole, 2 first,
    3 middle, 4 last) after a 7-byte file header; W&B's Python package no longer ships a reader."""
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, pos
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _check_wandb_run(folder: Path, records: list[dict], evals: list[dict], final_model: str) -> None:
    (run_file,) = folder.glob("offline-run-*/run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "summary":
            summary |= {item.key: json.loads(item.value_json) for item in record.summary.update}
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            assert record.run.display_name == "sft" and record.run.project == "automodel"
    assert sorted(history) == [r["step"] for r in records]
    assert [history[r["step"]]["train/loss"] for r in records] == pytest.approx([r["loss"] for r in records])
    assert [history[e["step"]]["eval/eval_loss"] for e in evals] == pytest.approx(
        [e["eval_loss"] for e in evals]
    )
    assert history[10]["moe/imbalance"] == pytest.approx(records[-1]["moe"]["imbalance"])
    assert summary["final_model"] == final_model
    assert config["parallelism"]["ep_size"] == 2, config


def _check_mlflow_run(output: Path, records: list[dict], evals: list[dict], final_model: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(output / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("automodel")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "sft" and run.info.status == "FINISHED"
    assert run.data.tags["final_model"] == final_model
    assert run.data.params["parallelism.ep_size"] == "2"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [r["step"] for r in records]
    assert [m.value for m in losses] == pytest.approx([r["loss"] for r in records])
    eval_losses = client.get_metric_history(run.info.run_id, "eval/eval_loss")
    assert [m.value for m in eval_losses] == pytest.approx([e["eval_loss"] for e in evals])
    config = json.loads(
        Path(client.download_artifacts(run.info.run_id, "config.json", str(output))).read_text()
    )
    assert config["parallelism"]["ep_size"] == 2


def _check_expert_adapters(hf: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), hf / "adapter")
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n}
    # peft nests one ParamWrapper per adapted parameter: two per experts module, two MoE layers.
    assert len(experts) == 4, sorted(experts)
    assert all(p.abs().max() > 0 for p in experts.values()), "the experts' adapters did not train"
