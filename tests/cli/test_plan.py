"""``automodel plan``: mesh layout, the steps in order and per-rank memory, with no process started."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from automodel_all.cli.main import build_parser, job_from_args, main
from automodel_all.cli.plan import plan


def _plan(*argv: str) -> str:
    args = build_parser().parse_args(["plan", *argv])
    return plan(job_from_args(args), world_size=args.world_size)


def _mib(report: str, what: str) -> float:
    match = re.search(rf"^\s+{what}\s+([\d.]+) MiB", report, re.MULTILINE)
    assert match, report
    return float(match.group(1))


def test_fsdp2_shards_everything_over_the_data_parallel_ranks() -> None:
    two = _plan("--world-size", "2")
    four = _plan("--world-size", "4", "--global-batch-size", "16")
    assert "dense mesh (pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1)" in two
    assert "fully_shard each of 4 transformer blocks" in two
    # AdamW keeps two fp32 states: twice the fp32 parameters; sharding over 4 ranks halves each figure.
    assert _mib(two, "optimizer") == pytest.approx(2 * _mib(two, "parameters"), rel=1e-3)
    states = ("parameters", "gradients", "optimizer")
    assert sum(_mib(four, k) for k in states) == pytest.approx(
        sum(_mib(two, k) for k in states) / 2, rel=1e-2
    )


def test_ddp_replicates_and_tp_pp_lora_steps_are_listed_in_order() -> None:
    ddp = _plan("--strategy", "ddp", "--world-size", "4")
    fsdp = _plan("--world-size", "4")
    assert "no device mesh: data parallel over 4 rank(s)" in ddp
    assert "wrap in DistributedDataParallel over 4 ranks" in ddp
    assert _mib(ddp, "parameters") == pytest.approx(4 * _mib(fsdp, "parameters"), rel=1e-2)

    report = _plan("--world-size", "8", "--tp", "2", "--pp", "2", "--lora", "--activation-checkpointing")
    assert "dense mesh (pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)" in report
    steps = [
        "add LoRA adapters",
        "split into 2 pipeline stages over pp=2",
        "tensor-parallel plan over tp=2",
        "activation checkpointing (full)",
        "fully_shard each of 4 transformer blocks",
        "materialise the meta parameters",
        "freeze every parameter but the adapters",
    ]
    positions = [report.index(step) for step in steps]
    assert positions == sorted(positions), report
    # Only the adapters train: gradients and optimizer state are tiny next to the frozen base.
    assert _mib(report, "gradients") < _mib(report, "parameters") / 5


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--tp", "3", "--world-size", "6"], "tp_size=3 does not divide the model's num_attention_heads=4"),
        (["--tp", "2", "--world-size", "3"], "not divisible by pp_size * cp_size * tp_size"),
        (
            ["--pp", "8", "--world-size", "8", "--global-batch-size", "8"],
            "exceeds the model's num_hidden_layers=4",
        ),
        (["--strategy", "megatron_fsdp", "--device", "cpu"], "megatron_fsdp needs CUDA"),
        (["--ep", "2", "--world-size", "2"], "needs a mixture-of-experts model"),
    ],
)
def test_impossible_layouts_fail_with_a_clear_error(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("automodel plan: error: --"), err
    assert expected in err


def test_every_example_job_file_is_valid_and_the_runnable_ones_plan() -> None:
    from automodel_all.cli.config import build_job
    from automodel_all.cli.yaml_source import load_yaml

    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
    assert {p.name for p in examples} >= {"default.yaml", "llama_fsdp2_lora.yaml", "tp_pp.yaml"}
    for path in examples:
        build_job(load_yaml(path))  # every section and key exists and has the right type
    report = _plan(str(examples[0].parent / "tp_pp.yaml"), "--world-size", "8")
    assert "dense mesh (pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)" in report
    assert "split into 4 pipeline stages over pp=2 (schedule interleaved_1f1b" in report
    assert "fully_shard each of 8 transformer blocks" in report
    assert "fsdp2 on 2 rank(s)" in _plan(str(examples[0].parent / "default.yaml"), "--device", "cpu")


def test_peak_lines_device_fit_json_and_suggestions(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from automodel_all.cli.plan import device_memory as parse_device_memory
    from automodel_planner import DEVICE_PRESETS

    report = _plan("--world-size", "4")
    lines = ("parameters", "gradients", "optimizer", "gathered units", "activations", "communication buffers")
    for line in (*lines, "total"):
        assert _mib(report, line) > 0, line
    assert _mib(report, "total") == pytest.approx(sum(_mib(report, line) for line in lines), abs=0.05)
    # Full checkpointing keeps each block's input, and one block's interior while it is recomputed: of
    # the 4 blocks' interiors three go, about half of the activations.
    ac = _plan("--world-size", "4", "--activation-checkpointing")
    assert _mib(ac, "activations") < 0.55 * _mib(report, "activations")

    assert parse_device_memory("h100") == DEVICE_PRESETS["h100"]
    assert parse_device_memory("80GiB") == 80 * 2**30 and parse_device_memory("40GB") == 40 * 10**9
    assert main(["plan", "--device-memory", "80 bananas"]) == 2
    assert "--device-memory '80 bananas': expected a size" in capsys.readouterr().err

    assert main(["plan", "--world-size", "4", "--device-memory", "1MiB"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--world-size", "4", "--device-memory", "h200"]) == 0
    assert ": fits," in capsys.readouterr().out

    assert main(["plan", "--world-size", "4", "--json", "--suggest", "--device-memory", "a100-40g"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["fits"] is True and document["peak"]["peak_bytes"] == sum(
        document["peak"]["lines"].values()
    )
    peak = document["peak"]
    assert peak["lines"]["communication buffers"] == sum(peak["communication_buffers_bytes"].values())
    suggestions = document["suggestions"]
    assert suggestions and len(suggestions) <= 5
    peaks = [(s["peak_bytes"], s["communication_total_bytes"]) for s in suggestions]
    assert peaks == sorted(peaks)
    # Every suggested layout uses all 4 ranks.
    for entry in suggestions:
        sizes = entry["sizes"]
        assert 4 % (sizes["tp_size"] * sizes["pp_size"] * sizes["cp_size"] * sizes["dp_replicate_size"]) == 0


# The published shapes of the models the SFT examples name (config.json only: no weights are needed to plan).
_SHAPES = {
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
            max_position_embeddings=131072, rope_theta=500000.0,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False, max_position_embeddings=40960,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("example", "shape", "world", "expected"),
    [
        ("sft_llama_lora.yaml", "llama", 8, ["LlamaForCausalLM", "add LoRA adapters (rank 16, alpha 32)"]),
        ("sft_llama_full.yaml", "llama", 8, ["LlamaForCausalLM", "tensor-parallel plan over tp=2"]),
        ("sft_qwen3_moe_lora.yaml", "qwen3_moe", 8, ["Qwen3MoeForCausalLM", "expert parallelism over ep=8"]),
        (
            "sft_qwen3_moe_full.yaml",
            "qwen3_moe",
            16,
            ["Qwen3MoeForCausalLM", "experts sharded over ep_shard=2"],
        ),
    ],
)
def test_the_sft_examples_plan_for_their_model_shapes(
    example: str, shape: str, world: int, expected: list[str], tmp_path: Path
) -> None:
    import transformers

    name, fields = _SHAPES[shape]
    folder = tmp_path / shape
    getattr(transformers, name)(**fields).save_pretrained(folder)
    path = Path(__file__).parents[2] / "examples" / example
    report = _plan(str(path), "--model", str(folder), "--world-size", str(world), "--device", "cpu")
    for text in expected:
        assert text in report, report
    match = re.search(r"model: \S+ \(.*\), ([\d.]+) B parameters, ([\d.]+) ([MB]) trainable", report)
    assert match, report
    total = float(match.group(1))  # the published sizes (1.24 B and 30.5 B), plus adapters under LoRA
    assert (1.23 < total < 1.26) if shape == "llama" else (30.4 < total < 30.6), report
    lora = "lora" in example
    assert (match.group(3) == "M") == lora, report  # only the adapters train under LoRA
    assert _mib(report, "total") > 0


def test_the_vlm_example_plans_a_model_whose_text_config_has_no_causal_lm_class(tmp_path: Path) -> None:
    from automodel_testing.tiny import derive_tiny_config

    # Qwen2.5-VL: transformers maps its text config to no causal-LM class, so the planner profiles the
    # activations on the whole model run on text.
    derive_tiny_config("qwen2_5_vl").save_pretrained(tmp_path / "qwen2_5_vl")
    path = Path(__file__).parents[2] / "examples" / "sft_qwen2_5_vl_frozen_tower.yaml"
    report = _plan(str(path), "--model", str(tmp_path / "qwen2_5_vl"), "--world-size", "8", "--device", "cpu")
    assert "Qwen2_5_VLForConditionalGeneration" in report, report
    assert "freeze model.visual (freeze_config)" in report, report
    assert _mib(report, "activations") > 0


def test_fsdp_buffers_and_accumulated_gradients_are_the_real_allocations() -> None:
    """The FSDP2 lines for a known tiny model, from its units' sizes (what FSDP2 allocates)."""
    from automodel_all.cli.plan import plan_report

    def report(*argv: str) -> dict:
        args = build_parser().parse_args(["plan", "--world-size", "2", *argv])
        return plan_report(job_from_args(args), world_size=2)

    # 8 rows per data-parallel rank in micro-batches of 4: two micro-batches, the reduce-scatter deferred.
    two = report("--global-batch-size", "16", "--micro-batch-size", "4")
    model, estimate = two["model"], two["estimate"]

    def size(module: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    embed, block, head = size(model.model.embed_tokens), size(model.model.layers[0]), size(model.lm_head)
    norm = size(model.model.norm)
    assert embed == head != block
    # Root (the final norm), embedding, blocks one after another (two buffers), head (reuses the
    # embedding's buffer): FSDP2's all-gather outputs and reduce-scatter inputs, shared (one dtype).
    fsdp = estimate.buffers["FSDP all-gather / reduce-scatter"]
    assert fsdp == norm + embed + 2 * block
    assert estimate.lines["communication buffers"] == sum(estimate.buffers.values())
    # The unsharded, unreduced gradients of the first micro-batch: the whole model (all trainable).
    assert estimate.lines["accumulated gradients"] == size(model)
    # One micro-batch per step, or no deferral: no accumulated copy.
    one = report("--global-batch-size", "16", "--micro-batch-size", "8")["estimate"]
    assert "accumulated gradients" not in one.lines
    no_defer = "distributed.defer_fsdp_grad_sync=false"
    eager = report("--global-batch-size", "16", "--micro-batch-size", "4", "--set", no_defer)["estimate"]
    assert "accumulated gradients" not in eager.lines
    # LoRA: the frozen base makes no gradient, so the fresh unit gradient is the adapters' only.
    lora = report("--global-batch-size", "16", "--micro-batch-size", "4", "--lora")["estimate"]
    assert lora.lines["gathered units"] < estimate.lines["gathered units"]


def test_expert_parallel_units_stay_gathered_as_the_moe_config_says(tmp_path: Path) -> None:
    """Under EP, FSDP2 takes reshard_after_forward from the MoE config where the strategy leaves it unset
    (False by default): every unit stays gathered from forward to backward and is gathered once a step."""
    from automodel_all.cli.plan import plan_report
    from automodel_testing.tiny import derive_tiny_config

    derive_tiny_config("qwen3_moe").save_pretrained(tmp_path / "moe")

    def estimate(*argv: str) -> object:
        args = build_parser().parse_args(
            ["plan", "--model", str(tmp_path / "moe"), "--world-size", "4", "--ep", "4", *argv]
        )
        return plan_report(job_from_args(args), world_size=4)["estimate"]

    kept = estimate()
    assert kept.notes["gathered units"].startswith("every FSDP unit"), kept.notes
    assert "FSDP all-gather x1" in kept.communication, kept.communication
    resharded = estimate("--set", "moe.reshard_after_forward=true")
    assert "FSDP all-gather x2" in resharded.communication, resharded.communication
    assert resharded.lines["gathered units"] < kept.lines["gathered units"]
    # The strategy's own setting wins over the MoE config's.
    strategy = estimate("--set", "distributed.reshard_after_forward=true")
    assert strategy.lines["gathered units"] == resharded.lines["gathered units"]


def test_a_balanced_pipeline_split_is_planned_as_autopipeline_splits(tmp_path: Path) -> None:
    """``pipeline.balance_stages``: the planner places the layers as `AutoPipeline` does. A 4096-token
    vocabulary makes the LM head 7 layers of matmul work, so the first stage takes 5 of 6 layers and,
    with the embedding table (a lookup, no matmul work), the most parameters."""
    from automodel_all.cli.plan import plan_report
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config("llama")
    config.vocab_size, config.num_hidden_layers = 4096, 6
    config.save_pretrained(tmp_path / "llama")

    def report(*argv: str) -> dict:
        args = build_parser().parse_args(
            ["plan", "--model", str(tmp_path / "llama"), "--world-size", "2", "--pp", "2", *argv]
        )
        return plan_report(job_from_args(args), world_size=2)

    even = report()
    balanced = report("--set", "pipeline.balance_stages=true")
    model = even["model"]

    def size(module: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    embed, block = size(model.model.embed_tokens), size(model.model.layers[0])
    head = size(model.lm_head) + size(model.model.norm)
    assert even["estimate"].lines["parameters"] == max(embed, head) + 3 * block
    assert balanced["estimate"].lines["parameters"] == embed + 5 * block


def test_a_cluster_gives_the_step_time_and_suggestions_by_throughput(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import json

    assert main(["plan", "--cluster", "8xH100", "--tp", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["world_size"] == 8 and document["cluster"] == "8 x H100 (1 node of 8)"
    throughput = document["throughput"]
    assert throughput["step_seconds"] > 0 and 0 < throughput["mfu"] < 1
    assert throughput["tokens_per_s_per_gpu"] > 0
    assert "exposed TP all-reduce (or AG+RS)" in throughput["breakdown_seconds"]
    assert document["device_memory_bytes"] == 81_559 * 2**20, "the cluster's device memory is the default"
    # The CUDA context and NCCL's buffers (the tp and FSDP groups' rings) count towards the fit: a device
    # that holds the tensors and the allocator's reserve but not them is too small.
    lines = document["peak"]["lines"]
    assert lines["CUDA context"] > 0 and "tp" in document["peak"]["notes"]["NCCL buffers"]
    short = document["peak"]["peak_bytes"] - lines["NCCL buffers"] // 2
    assert main(["plan", "--cluster", "8xH100", "--tp", "2", "--json", "--device-memory", str(short)]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False
    # --suggest ranks by the same device memory: on a device holding less than a CUDA context, none fits.
    assert main(["plan", "--cluster", "8xH100", "--suggest", "--json", "--device-memory", "100MiB"]) == 0
    assert not any(entry["fits"] for entry in json.loads(capsys.readouterr().out)["suggestions"])

    assert main(["plan", "--cluster", "16xH100", "--suggest"]) == 0
    text = capsys.readouterr().out
    assert "predicted step on 16 x H100 (2 nodes of 8)" in text
    assert "fitting first, fastest first" in text and "tokens/s/GPU" in text

    own = tmp_path / "cluster.yaml"
    own.write_text("gpus: 4\ndevice: A100\ngpus_per_node: 4\ninter_node_gbps: 200\n")
    assert main(["plan", "--cluster", str(own)]) == 0
    assert "predicted step on 4 x A100 (1 node of 4)" in capsys.readouterr().out

    for argv, fragment in (
        (["--cluster", "8xV100"], "--cluster unknown device 'V100'"),
        (["--cluster", "8 GPUs"], "expected GPUs x device"),
        (["--cluster", "8xH100", "--world-size", "4"], "--world-size 4 contradicts --cluster (8 GPUs)"),
        (["--cluster", "8xA100", "--fp8"], "A100 has no float8 tensor cores"),
        (["--cluster", str(tmp_path / "missing.yaml")], "cannot read it"),
    ):
        assert main(["plan", *argv]) == 2
        assert fragment in capsys.readouterr().err


def test_checkpointing_modes_and_async_tp_are_plan_options(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    def breakdown(*argv: str) -> dict[str, float]:
        assert main(["plan", "--cluster", "8xH100", "--tp", "2", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)["throughput"]["breakdown_seconds"]

    full, bare = breakdown("--activation-checkpointing", "full"), breakdown("--activation-checkpointing")
    selective = breakdown("--activation-checkpointing", "selective")
    assert bare == full, "the flag alone means full checkpointing"
    # Selective checkpointing keeps the matmuls' outputs: it recomputes less than the whole blocks.
    assert 0 < selective["recompute"] < full["recompute"]

    sync = breakdown("--sequence-parallel", "--set", "distributed.enable_compile=true")
    overlapped = breakdown("--async-tp")  # implies sequence parallelism and the blocks' compile
    tp = "exposed TP all-reduce (or AG+RS)"
    # Its fused kernels move the sequence dim themselves: fewer layout copies than the partial sums add.
    assert overlapped[tp] < sync[tp] and overlapped["compute"] < sync["compute"]
    args = build_parser().parse_args(["plan", "--tp", "2", "--async-tp", "--activation-checkpointing"])
    distributed = job_from_args(args).sections["distributed"]
    assert distributed == {
        "activation_checkpointing": "full",
        "enable_async_tensor_parallel": True,
        "sequence_parallel": True,
        "enable_compile": True,
    }


def test_a_job_on_a_gpu_only_attention_kernel_plans_on_any_host(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    def plan(kernel: str) -> dict[str, object]:
        argv = ["plan", "--cluster", "8xH100", "--json", "--set", f"model.attn_implementation={kernel}"]
        assert main(argv) == 0, kernel  # flash-attn is not installed here, nor runs FlexAttention on CPU
        return json.loads(capsys.readouterr().out)

    sdpa, flash, flex, fa3 = (
        plan(k) for k in ("sdpa", "flash_attention_2", "flex_attention", "flash_attention_3")
    )
    # The embedded model is causal without a window: the same FLOPs and saved tensors as SDPA's kernel.
    assert flash["throughput"] == flex["throughput"] == sdpa["throughput"]
    assert flash["peak"] == sdpa["peak"]
    assert (
        fa3["throughput"]["breakdown_seconds"]["compute"] < sdpa["throughput"]["breakdown_seconds"]["compute"]
    )


def test_a_cluster_plans_the_gpu_job_and_a_published_run_as_a_job_predicts_as_the_table(
    tmp_path: Path,
) -> None:
    from automodel_all.cli.plan import plan_report
    from automodel_all.cli.published_jobs import published_job
    from automodel_all.cli.yaml_source import ConfigError, RawJob
    from automodel_planner.hardware import parse_cluster
    from automodel_planner.published import as_automodel_job, predict, predict_memory, published_runs

    def lines(dtype: str) -> dict[str, int]:
        raw = RawJob()
        raw.set("model", "dtype", dtype, "test")
        return plan_report(raw, hardware=parse_cluster("8xH100"))["estimate"].lines

    # On GPUs FSDP2 computes in bf16 whatever the parameters are stored in; this host (a CPU) would
    # compute in the model's dtype: the plan is the cluster's, not the host's.
    fp32, bf16 = lines("float32"), lines("bfloat16")
    assert fp32["activations"] == bf16["activations"]
    assert fp32["parameters"] == 2 * bf16["parameters"]
    # torch's AdamW keeps its two moments in the parameter's dtype.
    assert fp32["optimizer"] == 2 * fp32["parameters"] and bf16["optimizer"] == 2 * bf16["parameters"]
    cpu = RawJob()
    cpu.set("launch", "device", "cpu", "--device")
    with pytest.raises(ConfigError, match=r"launch\.device=cpu contradicts --cluster"):
        plan_report(cpu, hardware=parse_cluster("8xH100"))

    chosen = [
        r for r in published_runs() if r.shape == "llama3-8b" and r.cluster.startswith(("8x", "1x", "32x"))
    ]
    assert {bool(r.lora_dim) for r in chosen} == {True, False} and any(r.sizes.get("cp") for r in chosen)
    assert any(r.compile_loss and r.fp8_config for r in chosen)  # the compile and fp8 sections too
    for index, run in enumerate(chosen):
        raw = published_job(run, tmp_path / str(index))
        report = plan_report(raw, hardware=run.hardware(), suggest=index == 0, suggestions=99)
        ours = as_automodel_job(run)  # a job states our settings, not the source framework's internals
        assert report["throughput"].tokens_per_s_per_gpu == pytest.approx(predict(ours).tokens_per_s_per_gpu)
        # The published peaks are torch's reserved memory; the plan's also holds what a GPU process keeps
        # outside torch's allocator, and the job fits only with it.
        peak = report["estimate"]
        outside = peak.lines["CUDA context"] + peak.lines.get("NCCL buffers", 0)
        assert peak.total - outside == pytest.approx(predict_memory(ours).total, rel=1e-3), run.id
        assert report["fits"] == (peak.total <= report["device_memory"])
        assert report["resolved"].layout.dp_shard == run.sizes.get("dp_shard", 1), run.id
        if index == 0:  # fitting first, fastest first; within 0.5% of the fastest, lowest peak first
            ranked = report["suggestions"]
            speeds = [e["throughput"]["tokens_per_s_per_gpu"] for e in ranked if e["fits"]]
            tied = sum(speed >= max(speeds) * 0.995 for speed in speeds)
            assert [e["fits"] for e in ranked] == sorted((e["fits"] for e in ranked), reverse=True)
            assert min(speeds[:tied]) >= max(speeds) * 0.995 and speeds[tied:] == sorted(speeds[tied:])[::-1]
            peaks = [e["peak_bytes"] for e in ranked[:tied]]
            assert peaks == sorted(peaks)


def test_calibrating_on_a_measured_log_reproduces_its_step_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import json

    assert main(["plan", "--cluster", "8xH100", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["throughput"]["step_seconds"]
    log = tmp_path / "train_log.jsonl"
    # Two warm-up steps (left out), then a run twice as slow as predicted, with one slow outlier.
    times = [30.0, 5.0] + [2 * predicted] * 5 + [9 * predicted]
    log.write_text(
        "".join(json.dumps({"step": i + 1, "loss": 1.0, "seconds": t}) + "\n" for i, t in enumerate(times))
    )
    assert main(["plan", "--cluster", "8xH100", "--calibrate", str(log), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["calibration"]["measured_step_seconds"] == pytest.approx(2 * predicted)
    assert document["throughput"]["step_seconds"] == pytest.approx(2 * predicted, rel=1e-6)
    # The compute slows; the collectives do not. This small model's step is mostly NCCL's latency per
    # FSDP unit, so its compute must slow by far more than twice.
    assert 0 < document["calibration"]["factor"] < 0.3

    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"step": 1, "seconds": 1.0}) + "\n")
    for argv, fragment in (
        (["--calibrate", str(log)], "--calibrate needs --cluster"),
        (["--cluster", "8xH100", "--calibrate", str(short)], "1 step(s) with a time"),
        (["--cluster", "8xH100", "--calibrate", str(tmp_path / "none.jsonl")], "cannot read it"),
    ):
        assert main(["plan", *argv]) == 2
        assert fragment in capsys.readouterr().err
