"""FSDP2 unit planning and manager validation, without process groups."""

from __future__ import annotations

import pytest
import torch

from automodel_distributed import DDPConfig, FSDP2Config
from automodel_distributed.fsdp2 import FSDP2Manager
from automodel_distributed.fsdp2_units import plan_fsdp_units
from automodel_mesh import MeshContext
from automodel_testing import build_tiny_model


def _units(family: str, **kwargs: object) -> list[tuple[str, bool | int]]:
    model = build_tiny_model(family, meta=True, num_hidden_layers=3)
    return [(u.fqn, u.reshard_after_forward) for u in plan_fsdp_units(model, **kwargs)]  # type: ignore[arg-type]


def test_untied_model_gets_embedding_blocks_and_head_units() -> None:
    assert _units("llama", reshard_after_forward=None) == [
        ("model.embed_tokens", True),
        ("model.layers.0", True),
        ("model.layers.1", True),
        ("model.layers.2", False),  # the last block and the head run first in backward
        ("lm_head", False),
    ]


def test_tied_embeddings_stay_in_the_root() -> None:
    units = _units("llama_tied", reshard_after_forward=None)
    assert [fqn for fqn, _ in units] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert units[-1] == ("model.layers.2", False)


def test_explicit_and_pipelined_resharding() -> None:
    assert {r for _, r in _units("qwen2", reshard_after_forward=True)} == {True}
    # The plain embedding's backward gathers nothing: outside a pipeline it reshards under any setting.
    for setting in (2, False):
        units = _units("qwen2", reshard_after_forward=setting)
        assert units[0] == ("model.embed_tokens", True), units
        assert {r for _, r in units[1:]} == {setting}, units
    assert {r for _, r in _units("qwen2", reshard_after_forward=None, pipelined=True)} == {False}
    assert {r for _, r in _units("qwen2", reshard_after_forward=False, pipelined=True)} == {False}


def test_manager_rejects_other_configs_and_meshes() -> None:
    with pytest.raises(ValueError, match="FSDP2Manager needs an FSDP2Config, got DDPConfig"):
        FSDP2Manager(DDPConfig(), None)  # type: ignore[arg-type]
    # No mesh in a single process without a process group: nothing to shard, the model is returned as is,
    # and the default bf16 policy, which needs FSDP2 even on one rank, is named as ignored.
    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="mp_policy ignored: a single process without a process group"):
        assert FSDP2Manager(FSDP2Config(), MeshContext().device_mesh).parallelize(model) is model


class _ScaledEmbedding(torch.nn.Embedding):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2.0


def test_only_a_plain_embedding_skips_its_backward_all_gather() -> None:
    model = build_tiny_model("llama", meta=True, num_hidden_layers=3)
    units = plan_fsdp_units(model, reshard_after_forward=None)
    assert [u.unshard_in_backward for u in units] == [False, True, True, True, True]
    # A forward of its own (scaling, fake quantization) may read the weight in backward: keep the gather.
    old = model.get_input_embeddings()
    with torch.device("meta"):
        model.set_input_embeddings(_ScaledEmbedding(old.num_embeddings, old.embedding_dim))
    assert all(u.unshard_in_backward for u in plan_fsdp_units(model, reshard_after_forward=None))


def test_async_tensor_parallel_needs_sequence_parallel_and_compile() -> None:
    with pytest.raises(
        ValueError, match=r"enable_async_tensor_parallel=True needs FSDP2Config\.sequence_parallel"
    ):
        FSDP2Config(enable_async_tensor_parallel=True)
    # Without compile inductor's micro-pipelined TP pass never runs: the setting would act on nothing.
    with pytest.raises(ValueError, match=r"needs FSDP2Config\.enable_compile=True"):
        FSDP2Config(enable_async_tensor_parallel=True, sequence_parallel=True)
    FSDP2Config(enable_async_tensor_parallel=True, sequence_parallel=True, enable_compile=True)


def test_packed_sequence_patch_names_itself_without_flash_attention() -> None:
    import transformers.modeling_flash_attention_utils as fa_utils

    original = fa_utils._is_packed_sequence
    model = build_tiny_model("llama")  # sdpa: transformers never asks whether a batch is packed
    config = FSDP2Config(patch_is_packed_sequence=True, mp_policy=None)
    with pytest.warns(UserWarning, match=r"patch_is_packed_sequence ignored: .* attention is 'sdpa'"):
        FSDP2Manager(config, MeshContext().device_mesh).parallelize(model)
    assert fa_utils._is_packed_sequence is original  # nothing patched for a path that never runs


def test_a_pipeline_stand_in_is_neither_tied_nor_a_unit() -> None:
    # A tied model's pipeline stages: each holds a parameterless stand-in for the side another stage runs.
    first = build_tiny_model("llama_tied", meta=True, num_hidden_layers=2)
    first.lm_head = torch.nn.Identity()
    assert [u.fqn for u in plan_fsdp_units(first, reshard_after_forward=None)] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
    ]
    last = build_tiny_model("llama_tied", meta=True, num_hidden_layers=2)
    last.model.embed_tokens = torch.nn.Identity()
    units = plan_fsdp_units(last, reshard_after_forward=None)
    assert [(u.fqn, u.reshard_after_forward) for u in units] == [
        ("model.layers.0", True),
        ("model.layers.1", False),
        ("lm_head", False),
    ]
