"""The job file and options: errors name the key and the line; sections map onto the components' configs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from automodel_all.cli.config import build_job, resolve_job
from automodel_all.cli.main import build_parser, job_from_args
from automodel_all.cli.yaml_source import ConfigError, load_yaml
from automodel_distributed.config import DDPConfig, FSDP2Config
from automodel_mesh import ParallelismSizes
from automodel_peft import PeftConfig
from automodel_pipelining.config import PipelineConfig


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def _job_error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        build_job(load_yaml(path))
    return str(info.value)


def test_wrong_type_names_the_key_and_the_line(tmp_path: Path) -> None:
    message = _job_error(
        tmp_path,
        """
        train:
          steps: 10
          lr: fast
        """,
    )
    assert message.startswith(f"{tmp_path / 'job.yaml'}:3:"), message
    assert "train.lr" in message
    assert "'fast'" in message


def test_unknown_key_names_the_key_the_line_and_a_close_match(tmp_path: Path) -> None:
    message = _job_error(
        tmp_path,
        """
        model:
          dtype: float32
        distributed:
          strategy: fsdp2
          reshard_after_fwd: true
        """,
    )
    assert ":5:" in message
    assert "unknown key 'reshard_after_fwd'" in message
    assert "reshard_after_forward" in message


def test_unknown_section_and_duplicate_key(tmp_path: Path) -> None:
    assert ":2: unknown section 'trian'" in _job_error(tmp_path, "model: {}\ntrian:\n  steps: 3\n")
    assert ":3: train.steps appears twice" in _job_error(tmp_path, "train:\n  steps: 3\n  steps: 4\n")


def test_a_config_s_own_validation_error_points_at_its_key(tmp_path: Path) -> None:
    message = _job_error(
        tmp_path,
        """
        parallelism:
          tp_size: 2
          pp_size: 0
        """,
    )
    assert ":3:" in message
    assert "pp_size must be >= 1" in message


def test_bool_is_not_an_int_and_int_is_a_float(tmp_path: Path) -> None:
    message = _job_error(tmp_path, "train:\n  steps: true\n")
    assert ":2:" in message
    assert "expected an integer" in message
    job = build_job(load_yaml(_write(tmp_path, "train:\n  lr: 1\n")))
    assert job.train.lr == 1.0
    assert isinstance(job.train.lr, float)


def test_sections_map_onto_the_components_dataclasses(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        distributed:
          strategy: fsdp2
          activation_checkpointing: true
          mp_policy: {param_dtype: bfloat16, reduce_dtype: float32}
        parallelism:
          tp_size: 2
          pp_size: 2
        pipeline:
          pp_schedule: gpipe
        peft:
          dim: 4
          use_dora: true
          target_modules: [q_proj, v_proj]
        """,
    )
    job = build_job(load_yaml(path))
    assert isinstance(job.distributed, FSDP2Config)
    assert job.distributed.activation_checkpointing is True  # kept as given, as in NeMo AutoModel
    assert job.distributed.mp_policy is not None
    assert job.distributed.mp_policy.param_dtype is torch.bfloat16
    assert job.parallelism == ParallelismSizes(tp_size=2, pp_size=2)
    assert isinstance(job.pipeline, PipelineConfig)
    assert job.pipeline.pp_schedule == "gpipe"
    assert job.peft == PeftConfig(dim=4, use_dora=True, target_modules=["q_proj", "v_proj"])
    assert job.qat is None
    assert job.fp8 is None
    resolved = resolve_job(job, 8)
    assert (resolved.layout.pp, resolved.layout.dp_shard, resolved.layout.tp) == (2, 2, 2)
    assert resolved.pipeline is not None
    # global batch 16 over dp=2 -> 8 rows per pipeline, micro-batches chosen so each of 2 stages has one
    assert resolved.pipeline.pp_batch_size == 8
    assert resolved.pipeline.n_microbatches >= 2


def test_options_override_the_file_and_are_named_in_errors(tmp_path: Path) -> None:
    path = _write(tmp_path, "train:\n  steps: 10\ndistributed:\n  strategy: fsdp2\n")
    args = build_parser().parse_args(
        ["train", str(path), "--steps", "7", "--strategy", "ddp", "--lora", "--set", "train.lr=0.01"]
    )
    job = build_job(job_from_args(args))
    assert job.train.steps == 7
    assert job.train.lr == 0.01
    assert isinstance(job.distributed, DDPConfig)
    assert job.peft is not None
    assert job.peft.match_all_linear
    bad = build_parser().parse_args(["train", "--set", "train.steps=many"])
    with pytest.raises(ConfigError, match=r"^--set train.steps: train.steps: expected an integer"):
        build_job(job_from_args(bad))
    with pytest.raises(ConfigError, match=r"^--tp: expected an integer"):
        job_from_args(build_parser().parse_args(["plan", "--tp", "two"]))


def test_strategy_must_be_known(tmp_path: Path) -> None:
    message = _job_error(tmp_path, "distributed:\n  strategy: zero3\n")
    assert ":2: distributed.strategy" in message
    assert "fsdp2" in message


def test_resolve_rejects_layouts_and_batches_that_do_not_fit(tmp_path: Path) -> None:
    job = build_job(
        load_yaml(_write(tmp_path, "parallelism:\n  tp_size: 2\ntrain:\n  global_batch_size: 6\n"))
    )
    with pytest.raises(ConfigError, match=r"job.yaml:1: layout for 3 rank\(s\):.*not divisible"):
        resolve_job(job, 3)
    with pytest.raises(ConfigError, match=r"job.yaml:4: train.global_batch_size=6 is not divisible by the"):
        resolve_job(job, 8)


def test_the_launcher_resolves_the_job_the_workers_receive(tmp_path: Path) -> None:
    from automodel_all.cli.launch import prepare_job, torchrun_args

    args = build_parser().parse_args(
        ["train", "--global-batch-size", "8", "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    )
    resolved, plain = prepare_job(job_from_args(args))
    # What the workers get is explicit: device, absolute output folder, the chosen micro-batch,
    # the trained tokenizer and the initial weights of the embedded default.
    assert plain["launch"]["device"] == "cpu"
    assert plain["train"]["output_dir"] == str(tmp_path / "out")
    assert plain["train"]["micro_batch_size"] == 4  # 8 rows over 2 data-parallel ranks
    assert (Path(plain["data"]["tokenizer"]) / "tokenizer.json").is_file()
    assert (Path(plain["model"]["name_or_path"]) / "config.json").is_file()
    assert resolved.world_size == 2
    assert resolved.grad_accumulation_steps == 1
    flags = torchrun_args(resolved.job)
    assert flags[:4] == ["--nnodes", "1", "--nproc-per-node", "2"]
    assert "--standalone" in flags
    assert flags[-2:] == ["--module", "automodel_all.cli.train"]

    multi = build_job(job_from_args(build_parser().parse_args(["train", "--nnodes", "2"])))
    with pytest.raises(ConfigError, match=r"^--nnodes: launch.nnodes=2 needs --rdzv-endpoint"):
        torchrun_args(multi)
    node = build_job(
        job_from_args(
            build_parser().parse_args(
                [
                    "train",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "1",
                    "--rdzv-endpoint",
                    "node0:29400",
                    "--rdzv-id",
                    "j",
                ]
            )
        )
    )
    flags = torchrun_args(node)
    assert flags[flags.index("--rdzv-endpoint") + 1] == "node0:29400"
    assert flags[flags.index("--node-rank") + 1] == "1"


def test_host_allocator_is_a_launch_field_checked_by_name(tmp_path: Path) -> None:
    message = _job_error(tmp_path, "launch:\n  host_allocator: jemalloc\n")
    assert "launch.host_allocator" in message and "'mimalloc'" in message, message
    job = build_job(job_from_args(build_parser().parse_args(["train", "--host-allocator", "glibc"])))
    assert job.launch.host_allocator == "glibc"
    assert build_job(job_from_args(build_parser().parse_args(["train"]))).launch.host_allocator == "auto"


def test_settings_that_would_act_on_nothing_are_named_with_their_line(tmp_path: Path) -> None:
    from automodel_all.cli.config import inert_settings

    path = _write(
        tmp_path,
        """
        train:
          eval_every: 5
          resume_fallback: true
        launch:
          rdzv_id: myjob
        report:
          to: [jsonl, wandb]
          project: mine
          mlflow_tracking_uri: http://mlflow:5000
        """,
    )
    lines = inert_settings(build_job(load_yaml(path)))
    assert lines == [
        f"{path}:5: launch.rdzv_id ignored: it acts only with launch.rdzv_endpoint (a c10d rendezvous)",
        f"{path}:2: train.eval_every ignored: there is no evaluation data (data.eval_path, data.eval_split)",
        f"{path}:3: train.resume_fallback ignored: nothing resumes: set train.resume (or "
        "launch.max_restarts, whose restarted workers resume)",
        f"{path}:9: report.mlflow_tracking_uri ignored: report.to has none of mlflow",
    ]
    acting = _write(
        tmp_path,
        """
        data:
          eval_split: validation
        train:
          eval_every: 5
          resume: true
          resume_fallback: true
        launch:
          rdzv_endpoint: node0:29400
          rdzv_id: myjob
        """,
    )
    assert inert_settings(build_job(load_yaml(acting))) == []
