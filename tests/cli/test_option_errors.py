"""Every option of ``automodel train`` and ``automodel plan`` given a wrong value, a missing path or an
empty folder: exit status 2 and one line naming the option and the fix, before any worker starts.

Each case runs the command in this process (``main(argv)``) with its own output folder; the cases that
pass the first checks train the embedded default's tokenizer there (under a second each).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from automodel_all.cli.main import main

MISSING = "{tmp}/nowhere"
EMPTY = "{tmp}/empty"
A_FILE = "{tmp}/a_file"
CONFIG_ONLY = "{tmp}/config_only"
NO_TOKENIZER = "{tmp}/no_tokenizer"

TRAIN_CASES: dict[str, tuple[list[str], str]] = {
    "model missing": (["--model", MISSING], "does not exist; give a folder written by save_pretrained"),
    "model empty folder": (["--model", EMPTY], "has no config.json"),
    "model a file": (["--model", A_FILE], "is a file; give the folder"),
    "model without weights": (["--model", CONFIG_ONLY], "--set model.load_weights=false"),
    "model without tokenizer": (["--model", NO_TOKENIZER], "give one with --tokenizer FOLDER"),
    "dtype": (["--dtype", "float8"], "expected 'float32' or 'bfloat16' or 'float16'"),
    "data missing": (["--data", MISSING], "does not exist"),
    "data empty folder": (["--data", EMPTY], "holds no .arrow, .csv, .json"),
    "eval-data missing": (["--eval-data", MISSING], "does not exist"),
    "eval-split": (["--eval-split", "nosuch"], "not 'nosuch'"),
    "packing": (["--packing", "zigzag"], "expected 'concat' or 'packed' or 'padded'"),
    "tokenizer missing": (["--tokenizer", MISSING], "does not exist"),
    "tokenizer empty folder": (["--tokenizer", EMPTY], "has no tokenizer files"),
    "streaming fewer records than rows": (
        ["--streaming", "--global-batch-size", "100000"],
        "with data.streaming every row of a batch streams its own records",
    ),
    "streaming pictures": (["--streaming", "--data", "builtin:image_chat"], "data.streaming does not read"),
    "seq-len zero": (["--seq-len", "0"], "seq_len must be >= 1"),
    "seq-len text": (["--seq-len", "abc"], "expected an integer"),
    "strategy": (["--strategy", "foo"], "expected one of ['fsdp2', 'ddp', 'megatron_fsdp']"),
    "dp zero": (["--dp", "0"], "dp_size must be >= 1"),
    "dp too large": (["--dp", "3"], "leave dp_size=None to infer it"),
    "dp-replicate": (["--dp-replicate", "3"], "HSDP needs dp_size = dp_replicate_size * dp_shard_size"),
    "tp": (["--tp", "3"], "choose sizes whose product divides the number of ranks"),
    "pp": (["--pp", "5"], "choose sizes whose product divides the number of ranks"),
    "cp": (["--cp", "3"], "choose sizes whose product divides the number of ranks"),
    "cp-ulysses-degree": (["--cp", "2", "--cp-ulysses-degree", "3"], "cp_ulysses_degree=3 must divide"),
    "packing packed with cp and pp": (
        ["--packing", "packed", "--cp", "2", "--pp", "2", "--nproc-per-node", "4"],
        "a pipeline's microbatches would split",
    ),
    "ep on a dense model": (["--ep", "2"], "needs a mixture-of-experts model"),
    "pp-schedule": (["--pp", "2", "--pp-schedule", "foo"], "known schedules: 1f1b"),
    "lora-rank": (["--lora-rank", "0"], "must be a positive int (the LoRA rank)"),
    "activation-checkpointing": (["--activation-checkpointing", "partial"], "invalid choice: 'partial'"),
    "async-tp on cpu": (["--tp", "2", "--async-tp"], "enable_async_tensor_parallel=true needs CUDA GPUs"),
    "async-tp without sequence parallelism": (
        ["--async-tp", "--set", "distributed.sequence_parallel=false"],
        "enable_async_tensor_parallel=True needs FSDP2Config.sequence_parallel=True",
    ),
    "steps": (["--steps", "0"], "steps must be >= 1"),
    "global-batch-size zero": (["--global-batch-size", "0"], "global_batch_size must be >= 1"),
    "global-batch-size indivisible": (["--global-batch-size", "3"], "not divisible by the data-parallel"),
    "micro-batch-size": (["--micro-batch-size", "0"], "micro_batch_size must be >= 1"),
    "lr negative": (["--lr", "-1"], "lr must be a finite number > 0"),
    "lr text": (["--lr", "abc"], "expected a number"),
    "warmup-steps": (["--warmup-steps", "-1"], "warmup_steps must be >= 0"),
    "checkpoint-every": (["--checkpoint-every", "-1"], "checkpoint_every must be >= 0"),
    "eval-every": (["--eval-every", "-1"], "eval_every must be >= 0"),
    "output-dir a file": (["--output-dir", A_FILE], "is a file; give a folder"),
    "report-to unknown sink": (["--report-to", "jsonl,neptune"], "unknown sink 'neptune'; choose from jsonl"),
    "report-to twice": (["--report-to", "jsonl,jsonl"], "names a sink twice"),
    "plot without jsonl": (
        ["--report-to", "tensorboard", "--set", "train.plot=true"],
        "add jsonl to report.to",
    ),
    "nproc-per-node": (["--nproc-per-node", "0"], "nproc_per_node must be >= 1"),
    "nnodes": (["--nnodes", "0"], "nnodes must be >= 1"),
    "node-rank": (["--node-rank", "5"], "must be < nnodes=1"),
    "rdzv-endpoint": (["--rdzv-endpoint", "nocolon"], "must be HOST:PORT"),
    "max-restarts": (["--max-restarts", "-1"], "max_restarts must be >= 0"),
    "shutdown-timeout": (["--shutdown-timeout", "-1"], "shutdown_timeout must be >= 0"),
    "device": (["--device", "tpu"], "expected 'auto' or 'cpu' or 'cuda'"),
    "host-allocator": (["--host-allocator", "foo"], "expected 'auto' or 'glibc' or 'mimalloc'"),
    "set unknown key": (["--set", "train.nosuch=1"], "unknown key 'nosuch' in section 'train'"),
    "set syntax": (["--set", "nodot=1"], "expected SECTION.KEY=VALUE"),
}
if importlib.util.find_spec("flash_attn") is None:  # this machine lacks flash-attn, as a CPU host does
    TRAIN_CASES["set attn_implementation without its package"] = (
        ["--set", "model.attn_implementation=flash_attention_2"],
        "'flash_attention_2' needs a package this machine lacks",
    )

PLAN_CASES: dict[str, tuple[list[str], str]] = {
    "model missing": (["--model", MISSING], "does not exist"),
    "model empty folder": (["--model", EMPTY], "has no config.json"),
    "dtype": (["--dtype", "float8"], "expected 'float32' or 'bfloat16' or 'float16'"),
    "cluster device": (["--cluster", "8xFOO"], "expected one of H100"),
    "cluster syntax": (["--cluster", "abc"], "expected GPUs x device, such as 8xH100"),
    "cluster count": (["--cluster", "0xH100"], "at least 1"),
    "device-memory": (["--device-memory", "lots"], "expected a size such as 80GiB"),
    "calibrate without cluster": (["--calibrate", MISSING], "--calibrate needs --cluster"),
    "calibrate not a log": (["--calibrate", A_FILE, "--cluster", "8xH100"], "not a train_log.jsonl"),
    "cluster on a cpu": (
        ["--device", "cpu", "--cluster", "8xH100"],
        "launch.device=cpu contradicts --cluster",
    ),
    "world-size": (["--world-size", "0"], "expected at least 1"),
    "qlora-bits": (["--qlora-bits", "3"], "invalid choice"),
}


def _fixtures(tmp: Path) -> None:
    (tmp / "empty").mkdir()
    (tmp / "a_file").write_text("not a folder")
    for name in ("config_only", "no_tokenizer"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320}))
    (tmp / "no_tokenizer" / "model.safetensors").write_bytes(b"")


def _run(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = int(exc.code or 0)
    return code, [line for line in err.getvalue().splitlines() if line.startswith("automodel")]


def _check(command: str, argv: list[str], expected: str, tmp: Path) -> None:
    _fixtures(tmp)
    args = [arg.format(tmp=tmp) for arg in argv]
    # A plan for a cluster is the cluster's CUDA job, whatever this host is: no CPU device for it.
    device = [] if "--cluster" in args else ["--device", "cpu"]
    extra = ["--output-dir", str(tmp / "run"), *device] if command == "train" else device
    code, lines = _run([command, *extra, *args])
    flag = argv[0]
    assert code == 2, (argv, code, lines)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"automodel {command}: error: "), line
    assert flag in line or flag.lstrip("-") in line, f"the option {flag} is not named: {line}"
    assert expected in line, line


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_train_option_errors_name_the_option_and_the_fix(case: str, tmp_path: Path) -> None:
    _check("train", *TRAIN_CASES[case], tmp_path)


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan_option_errors_name_the_option_and_the_fix(case: str, tmp_path: Path) -> None:
    _check("plan", *PLAN_CASES[case], tmp_path)
