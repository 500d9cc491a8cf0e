"""AutoPipeline in one process: constructor and build validation, step errors, a one-rank pipeline's parity,
the parallelize_fn protocol and the debug summaries.

A one-rank gloo process group (created here, no other process) gives a real ``pp`` axis of size 1, so
every schedule runs with all its stages on this rank.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from automodel_mesh import MeshContext
from automodel_pipelining import AutoPipeline, PipelineConfig
from automodel_testing import build_tiny_model, causal_lm_loss, make_batch
from automodel_testing.versions import older_torch


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshContext]:
    from automodel_mesh import MeshKind, ParallelismSizes

    created = not dist.is_initialized()
    if created:
        folder = tempfile.mkdtemp(prefix="pp-unit-")
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
    try:
        yield MeshContext.build(MeshKind.FSDP2, ParallelismSizes(pp_size=1))
    finally:
        if created:
            dist.destroy_process_group()


def _pipe(mesh: MeshContext, **fields: Any) -> AutoPipeline:
    return AutoPipeline.from_config(PipelineConfig(**fields), mesh)


# ------------------------------------------------------------------------------------------ constructor


def test_needs_a_mesh() -> None:
    with pytest.raises(ValueError, match="world_mesh must be provided"):
        AutoPipeline(None)


def test_before_build_as_in_the_reference(mesh: MeshContext) -> None:
    pipe = _pipe(mesh, pp_schedule="interleaved_1f1b", pp_batch_size=4, pp_microbatch_size=2)
    info = pipe.info
    assert (info.enabled, info.schedule, info.has_first_stage, info.has_last_stage) == (
        False,
        None,
        False,
        False,
    )
    assert info.model_parts is None and info.stages is None
    with pytest.raises(RuntimeError, match=r"call AutoPipeline.build"):
        _ = pipe.parts
    assert pipe.pretty_print_stages() == "<no stages>"
    assert pipe.list_stage_modules() == [] and pipe.get_total_param_count() == 0
    # The config fields and axis names read as attributes.
    assert (pipe.pp_schedule, pipe.pp_batch_size, pipe.pp_microbatch_size) == ("interleaved_1f1b", 4, 2)
    assert pipe.layers_per_stage is None and pipe.patch_inner_model is True
    assert pipe.pp_axis_name == "pp" and pipe.dp_axis_names == ("dp_replicate", "dp_shard_cp")
    with pytest.raises(AttributeError):
        pipe.pp_batch_size = 8  # type: ignore[misc]


def test_needs_the_pipeline_axis(mesh: MeshContext) -> None:
    with pytest.raises(ValueError, match="world_mesh has no pipeline axis 'stages'"):
        AutoPipeline(mesh.device_mesh, pp_axis_name="stages")


def test_constructor_validates_config_fields(mesh: MeshContext) -> None:
    with pytest.raises(ValueError, match="pp_batch_size=3 is not divisible by pp_microbatch_size=2"):
        AutoPipeline(mesh.device_mesh, pp_batch_size=3, pp_microbatch_size=2)


def test_too_few_microbatches_fail_early(mesh: MeshContext) -> None:
    # DualPipeV puts 2 stages on the one rank and needs at least 2 microbatches.
    with pytest.raises(ValueError, match="'dualpipev' needs at least as many microbatches as stages"):
        _pipe(mesh, pp_schedule="dualpipev", pp_batch_size=1)


def test_missing_csv(mesh: MeshContext, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing.csv"):
        _pipe(mesh, pp_schedule=None, pp_schedule_csv=str(tmp_path / "missing.csv"))


def test_csv_rows_must_match_the_pipeline(mesh: MeshContext, tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n1F0,1B0\n")
    with pytest.raises(ValueError, match="has 2 rows but the pipeline has pp_size=1"):
        _pipe(mesh, pp_schedule=None, pp_schedule_csv=str(path))


def test_rounding_without_layers_per_stage_warns(mesh: MeshContext) -> None:
    with pytest.warns(UserWarning, match="round_virtual_stages_to_pp_multiple is ignored"):
        _pipe(mesh, round_virtual_stages_to_pp_multiple="up", pp_batch_size=2)


# ------------------------------------------------------------------------------------------ build


def test_build_rejects_unsupported_models(mesh: MeshContext) -> None:
    with pytest.raises(ValueError, match="ties its input and output embeddings"):
        _pipe(mesh).build(build_tiny_model("llama_tied", meta=True), loss_fn=causal_lm_loss)
    with pytest.raises(ValueError, match="needs loss_fn"):
        _pipe(mesh).build(build_tiny_model("llama", meta=True), loss_fn=None)
    with pytest.raises(ValueError, match=r"PipelineConfig\.loss_fn is set too; give the loss once"):
        _pipe(mesh, loss_fn=causal_lm_loss).build(
            build_tiny_model("llama", meta=True), loss_fn=torch.nn.MSELoss()
        )


def test_build_checks_the_split_against_the_schedule(mesh: MeshContext) -> None:
    four_layers = {"num_hidden_layers": 4}
    # The stage count is known only once the model is: then the schedule's rules apply.
    zbv = _pipe(mesh, pp_schedule="zbv", pp_batch_size=4, layers_per_stage=1)
    with pytest.raises(ValueError, match="needs exactly 2 stages per rank"):
        zbv.build(build_tiny_model("llama", meta=True, **four_layers), loss_fn=causal_lm_loss)
    dualpipev = _pipe(mesh, pp_schedule="dualpipev", pp_batch_size=1, layers_per_stage=2)
    with pytest.raises(ValueError, match="needs at least as many microbatches as stages: n_microbatches=1"):
        dualpipev.build(build_tiny_model("llama", meta=True, **four_layers), loss_fn=causal_lm_loss)
    explicit = _pipe(mesh, pp_batch_size=2, module_fqns_per_model_part=[["lm_head", "model.layers.9"]])
    with pytest.raises(ValueError, match=r"does not have: \['model.layers.9'\]"):
        explicit.build(build_tiny_model("llama", meta=True), loss_fn=causal_lm_loss)
    assert zbv.num_stages == dualpipev.num_stages == explicit.num_stages == 0


def test_parallelize_fn_gets_every_stage_and_the_mesh_kwargs(mesh: MeshContext) -> None:
    calls: list[tuple[nn.Module, dict[str, Any]]] = []

    def parallelize(stage: nn.Module, **kwargs: Any) -> None:
        calls.append((stage, kwargs))

    pipe = _pipe(mesh, pp_schedule="interleaved_1f1b", pp_batch_size=2)
    pipe.build(
        build_tiny_model("llama", meta=True, num_hidden_layers=4),
        loss_fn=causal_lm_loss,
        parallelize_fn=parallelize,
    )
    assert [stage for stage, _ in calls] == pipe.parts
    expected = {"world_mesh": mesh.device_mesh, "moe_mesh": None, **mesh.pipeline_axis_kwargs()}
    assert all(kwargs == expected for _, kwargs in calls)
    with pytest.raises(RuntimeError, match="already called"):
        pipe.build(build_tiny_model("llama", meta=True), loss_fn=causal_lm_loss)


# ------------------------------------------------------------------------------------------ running


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_one_rank_pipeline_matches_the_model(mesh: MeshContext, schedule: str) -> None:
    if schedule != "1f1b" and older_torch():
        pytest.skip("torch 2.11's multi-stage schedules send to their own rank at start, which gloo refuses")
    reference = build_tiny_model("qwen2", num_hidden_layers=4)
    pipe = _pipe(mesh, pp_schedule=schedule, pp_batch_size=4, pp_microbatch_size=2)
    pipe.build(build_tiny_model("qwen2", num_hidden_layers=4), loss_fn=causal_lm_loss)
    batch = make_batch(reference.config.vocab_size, 4, 8, seed=1)
    losses = pipe.step(batch["input_ids"], target=batch["labels"])
    assert len(losses) == 2
    pipe.scale_grads()
    expected = causal_lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"])
    expected.backward()
    assert abs(float(pipe.mean_loss(losses)) - float(expected.detach())) < 1e-5
    grads = {n: p.grad for part in pipe.parts for n, p in part.named_parameters()}
    assert set(grads) == {n for n, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-5)
    with torch.no_grad():
        eval_losses = pipe.step(batch["input_ids"], target=batch["labels"])
    assert abs(float(torch.stack(eval_losses).mean()) - float(expected.detach())) < 1e-5


def test_step_errors(mesh: MeshContext) -> None:
    pipe = _pipe(mesh, pp_batch_size=4, pp_microbatch_size=2, pp_seq_len=8)
    pipe.build(build_tiny_model("llama", num_hidden_layers=2), loss_fn=causal_lm_loss)
    batch = make_batch(128, 4, 8)
    with pytest.raises(ValueError, match="input 0 has 3 rows, which do not divide into microbatches"):
        pipe.step(batch["input_ids"][:3], target=batch["labels"][:3])
    with pytest.raises(ValueError, match="input 0 has 2 rows but the pipeline was built for pp_batch_size=4"):
        pipe.step(batch["input_ids"][:2], target=batch["labels"][:2])
    with pytest.raises(ValueError, match="pass target="):
        pipe.step(batch["input_ids"])
    with pytest.raises(ValueError, match="pass the input"):
        pipe.step(target=batch["labels"])
    longer = make_batch(128, 4, 12)
    with pytest.raises(ValueError, match=r"sequence length 12 .* call update_seq_len\(12\)"):
        pipe.step(longer["input_ids"], target=longer["labels"])
    pipe.update_seq_len(12)
    assert len(pipe.step(longer["input_ids"], target=longer["labels"])) == 2


def test_step_before_build(mesh: MeshContext) -> None:
    with pytest.raises(RuntimeError, match=r"call AutoPipeline.build"):
        _pipe(mesh, pp_batch_size=2).step(torch.zeros(2, 4, dtype=torch.long))


def test_info_and_summaries(mesh: MeshContext) -> None:
    model = build_tiny_model("llama", num_hidden_layers=4)
    total = sum(p.numel() for p in model.parameters())
    pipe = _pipe(mesh, pp_schedule="looped_bfs", pp_batch_size=2)
    pipe.build(model, loss_fn=causal_lm_loss)
    info = pipe.info
    assert info.enabled and info.has_first_stage and info.has_last_stage
    assert info.model_parts == pipe.parts and len(info.stages) == 2 and info.schedule is pipe.schedule
    assert pipe.stage_ids == (0, 1)
    assert pipe.list_stage_modules() == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
        ["model.layers.2", "model.layers.3", "model.norm", "lm_head", "model.rotary_emb"],
    ]
    counts = pipe.get_stage_param_counts()
    assert sum(counts) == pipe.get_total_param_count() == total
    assert pipe.get_total_param_count(trainable_only=True) == total
    text = pipe.pretty_print_stages()
    assert "stage 0:" in text and "stage 1:" in text and "lm_head" in text
    short = pipe.pretty_print_stages(max_modules_per_stage=2, trainable_only=True)
    assert "trainable parameters" in short and "lm_head" not in short and short.count("    ...") == 2
    summary = pipe.debug_summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["stage_param_counts"] == counts and summary["schedule"] == "loopedbfs"
