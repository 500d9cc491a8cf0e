"""PipelineConfig validation and serialisation; schedule names, placement, microbatch rules, CSV files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from automodel_pipelining import PipelineConfig
from automodel_pipelining.schedules import (
    SCHEDULES,
    check_microbatches,
    normalize_schedule_name,
    read_csv_schedule,
    stage_ids_this_rank,
    stage_to_rank,
)

REFERENCE_DEFAULTS = {
    "pp_schedule": "1f1b",
    "pp_schedule_csv": None,
    "pp_microbatch_size": 1,
    "pp_batch_size": 1,
    "layers_per_stage": None,
    "round_virtual_stages_to_pp_multiple": None,
    "module_fqns_per_model_part": None,
    "patch_inner_model": True,
    "patch_causal_lm_model": True,
    "patch_stage_backward_maybe_with_nosync": False,
    "dtype": None,
    "scale_grads_in_schedule": False,
    "loss_fn": None,
    "pp_seq_len": None,
}
OWN_FIELDS = {"balance_stages": False}  # automodel's own, after the reference's


def test_fields_and_defaults_match_the_reference() -> None:
    assert PipelineConfig().to_dict() == REFERENCE_DEFAULTS | OWN_FIELDS
    assert [f.name for f in dataclasses.fields(PipelineConfig)] == list(REFERENCE_DEFAULTS | OWN_FIELDS)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        PipelineConfig("gpipe")  # type: ignore[misc]


def test_to_dict_from_dict_round_trip() -> None:
    config = PipelineConfig(
        pp_schedule="interleaved_1f1b",
        pp_batch_size=8,
        pp_microbatch_size=2,
        layers_per_stage=3,
        round_virtual_stages_to_pp_multiple="up",
        module_fqns_per_model_part=[["model.embed_tokens"], ["lm_head"]],
        dtype=torch.bfloat16,
        pp_seq_len=128,
    )
    assert PipelineConfig.from_dict(config.to_dict()) == config
    assert config.n_microbatches == 4


def test_from_dict_names_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown PipelineConfig field\(s\) \['pp_size'\]"):
        PipelineConfig.from_dict({"pp_size": 2})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"pp_batch_size": 6, "pp_microbatch_size": 4},
            "pp_batch_size=6 is not divisible by pp_microbatch_size=4",
        ),
        ({"pp_batch_size": 0}, "pp_batch_size must be a positive int"),
        ({"pp_microbatch_size": True}, "pp_microbatch_size must be a positive int"),
        ({"pp_schedule": "zigzag"}, "pp_schedule: unknown pipeline schedule 'zigzag'"),
        ({"pp_schedule": None}, "needs pp_schedule or pp_schedule_csv"),
        ({"pp_schedule_csv": ""}, "pp_schedule_csv must be a file path"),
        ({"layers_per_stage": 0}, "layers_per_stage must be a positive int or None"),
        ({"pp_seq_len": -3}, "pp_seq_len must be a positive int or None"),
        ({"round_virtual_stages_to_pp_multiple": "nearest"}, "round_virtual_stages_to_pp_multiple"),
        ({"module_fqns_per_model_part": "model.layers.0"}, "module_fqns_per_model_part must be a list"),
        ({"module_fqns_per_model_part": [["a"], "b"]}, r"module_fqns_per_model_part\[1\]"),
        ({"module_fqns_per_model_part": [["a", ""]]}, "non-FQN entries"),
        ({"module_fqns_per_model_part": []}, "is empty"),
        ({"patch_inner_model": 1}, "patch_inner_model must be a bool"),
        ({"balance_stages": "yes"}, "balance_stages must be a bool"),
        (
            {"balance_stages": True, "module_fqns_per_model_part": [["model.layers.0"]]},
            "balance_stages=True chooses the split, but module_fqns_per_model_part gives one",
        ),
        ({"scale_grads_in_schedule": "yes"}, "scale_grads_in_schedule must be a bool"),
        ({"dtype": "bf16"}, "dtype must be a torch.dtype"),
        ({"loss_fn": 3}, "loss_fn must be callable"),
    ],
)
def test_validation_names_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**fields)  # type: ignore[arg-type]


def test_csv_alone_is_enough() -> None:
    assert PipelineConfig(pp_schedule=None, pp_schedule_csv="schedule.csv").pp_schedule is None


# ------------------------------------------------------------------------------------------ schedules


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("1F1B", "1f1b"),
        ("GPipe", "gpipe"),
        ("interleaved_1f1b", "interleaved1f1b"),
        ("Interleaved1F1B", "interleaved1f1b"),
        ("looped-bfs", "loopedbfs"),
        ("zero_bubble", "interleavedzerobubble"),
        ("InterleavedZeroBubble", "interleavedzerobubble"),
        ("ZBVZeroBubble", "zbvzerobubble"),
        ("zbv", "zbvzerobubble"),
        ("DualPipeV", "dualpipev"),
        ("ScheduleGPipe", "gpipe"),
    ],
)
def test_schedule_names(name: str, canonical: str) -> None:
    assert normalize_schedule_name(name) == canonical


def test_every_schedule_names_a_torch_class() -> None:
    from torch.distributed.pipelining import schedules

    for spec in SCHEDULES.values():
        assert hasattr(schedules, spec.torch_class), spec


def test_single_stage_placement() -> None:
    assert [stage_ids_this_rank(r, 4, 4, "single") for r in range(4)] == [(0,), (1,), (2,), (3,)]
    with pytest.raises(ValueError, match="one stage per rank"):
        stage_ids_this_rank(0, 2, 4, "single")


def test_loop_placement_is_r_r_plus_w() -> None:
    assert [stage_ids_this_rank(r, 4, 8, "loop") for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert stage_ids_this_rank(1, 2, 6, "loop") == (1, 3, 5)


def test_v_placement_is_r_and_2w_minus_1_minus_r() -> None:
    assert [stage_ids_this_rank(r, 4, 8, "v") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [stage_ids_this_rank(r, 2, 4, "v") for r in range(2)] == [(0, 3), (1, 2)]


@pytest.mark.parametrize(
    ("pp", "stages", "style"), [(2, 4, "loop"), (4, 8, "loop"), (2, 4, "v"), (4, 8, "v"), (2, 8, "v")]
)
def test_placement_matches_torch(pp: int, stages: int, style: str) -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert stage_to_rank(pp, stages, style) == generate_stage_to_rank_mapping(pp, stages, style=style)  # type: ignore[arg-type]


def test_placement_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="do not divide"):
        stage_ids_this_rank(0, 3, 4, "loop")
    with pytest.raises(ValueError, match="outside"):
        stage_ids_this_rank(2, 2, 4, "loop")


def test_too_few_microbatches() -> None:
    with pytest.raises(
        ValueError, match=r"'dualpipev' needs at least as many microbatches as stages: n_microbatches=4"
    ):
        check_microbatches(SCHEDULES["dualpipev"], n_microbatches=4, num_stages=8, pp_size=4)
    with pytest.raises(ValueError, match="'1f1b' needs at least as many microbatches as stages"):
        check_microbatches(SCHEDULES["1f1b"], n_microbatches=1, num_stages=2, pp_size=2)
    with pytest.raises(ValueError, match="multiple of 2"):
        check_microbatches(SCHEDULES["interleaved1f1b"], n_microbatches=5, num_stages=4, pp_size=2)
    warnings = check_microbatches(SCHEDULES["gpipe"], n_microbatches=1, num_stages=4, pp_size=4)
    assert warnings and "bubble" in warnings[0]
    assert check_microbatches(SCHEDULES["dualpipev"], n_microbatches=8, num_stages=8, pp_size=4) == []


def _write(tmp_path: Path, rows: list[str]) -> str:
    path = tmp_path / "schedule.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_csv_placement(tmp_path: Path) -> None:
    path = _write(tmp_path, ["0F0,2F0,2B0,0B0", "1F0,3F0,3B0,1B0"])
    schedule = read_csv_schedule(path, 2)
    assert schedule.stages_by_rank == ((0, 2), (1, 3))
    assert schedule.num_stages == 4
    assert not schedule.split_backward
    split = read_csv_schedule(_write(tmp_path, ["0F0,1F0,1I0,1W0,0I0,0W0"]), 1)
    assert split.split_backward


@pytest.mark.parametrize(
    ("rows", "pp", "message"),
    [
        (["0F0", "1F0"], 3, "has 2 rows but the pipeline has pp_size=3"),
        (["0F0,1F0", "1B0"], 2, "stage 1 appears on ranks 0 and 1"),
        (["0F0", "2F0"], 2, r"stage ids must be 0..n-1"),
        (["0F0,2F0", "1F0"], 2, "different numbers of stages"),
        (["0F0,oops"], 1, "malformed action 'oops'"),
    ],
)
def test_csv_errors(tmp_path: Path, rows: list[str], pp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_csv_schedule(_write(tmp_path, rows), pp)


def test_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_csv_schedule(str(tmp_path / "missing.csv"), 2)


def test_a_dtype_without_static_shapes_warns() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        PipelineConfig(dtype=torch.bfloat16)
        PipelineConfig(dtype=torch.bfloat16, pp_seq_len=16)  # static shapes read it: no warning
    assert [str(w.message) for w in seen] == [
        "PipelineConfig.dtype is ignored: only static stage shapes (pp_seq_len) read it; set pp_seq_len, "
        "or drop dtype (torch infers the shapes and dtypes from a first forward)"
    ]


def test_layers_per_stage_beside_a_fixed_split_warns() -> None:
    import warnings

    fqns = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        PipelineConfig(layers_per_stage=1, module_fqns_per_model_part=fqns)
        PipelineConfig(layers_per_stage=1, pp_schedule_csv="schedule.csv")
    assert [str(w.message) for w in seen] == [
        "PipelineConfig.layers_per_stage is ignored: module_fqns_per_model_part gives the stages",
        "PipelineConfig.layers_per_stage is ignored: pp_schedule_csv fixes the stage count",
    ]


def test_patch_inner_model_under_the_whole_model_patch_warns() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        PipelineConfig(patch_inner_model=False)
        PipelineConfig(patch_inner_model=False, patch_causal_lm_model=False)  # acts: no warning
    assert [str(w.message) for w in seen] == [
        "PipelineConfig.patch_inner_model=False is ignored: patch_causal_lm_model=True replaces the whole "
        "model's forward, the base model's included; set both to False to keep the model's own forward"
    ]


def test_nested_sync_patch_without_nested_fsdp_modules_warns(tmp_path: Path) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from automodel_pipelining._runtime import warn_nested_sync_without_target

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
        rooted = fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh=mesh)
        nested = torch.nn.Sequential(fully_shard(torch.nn.Linear(2, 2), mesh=mesh))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            warn_nested_sync_without_target(True, [plain, rooted])  # nothing for it to act on
            warn_nested_sync_without_target(True, [plain, nested])  # acts on the nested unit
            warn_nested_sync_without_target(False, [plain])  # off
    finally:
        dist.destroy_process_group()
    assert len(seen) == 1 and str(seen[0].message).startswith(
        "PipelineConfig.patch_stage_backward_maybe_with_nosync ignored: it acts on FSDP modules inside"
    ), [str(w.message) for w in seen]
