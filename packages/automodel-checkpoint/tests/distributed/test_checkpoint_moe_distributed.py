"""transformers MoE checkpoints (per-expert on disk, fused in memory) into FSDP2 and expert-parallel shards.

One two-rank launch: for Qwen3-MoE and Mixtral checkpoints written by ``save_pretrained`` (one file and
several files), a meta model sharded by `FSDP2Manager`, and one expert-parallel (ep=2) by
``automodel_moe.parallelize_model``, is loaded with `load_hf_checkpoint` and gives the logits of
``from_pretrained``; together the ranks read every checkpoint byte exactly once (each rank only its
slices: an EP rank reads only its own experts); `save_hf_checkpoint` of the EP model writes the
per-expert layout, which ``from_pretrained`` loads back to the same logits.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from automodel_testing import build_tiny_model, make_batch, run_distributed, save_tiny_checkpoint

pytestmark = pytest.mark.distributed

FAMILIES = ("qwen3_moe", "mixtral")


def _config() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config

    return FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))


def _fsdp2(family: str) -> nn.Module:
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes

    config = _config()
    ctx = MeshContext.build(config, ParallelismSizes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP2Manager(config, ctx.device_mesh).parallelize(build_tiny_model(family, meta=True))


def _ep(family: str) -> nn.Module:
    from automodel_mesh import MeshContext, ParallelismSizes
    from automodel_moe.parallelizer import parallelize_model

    config = _config()
    ctx = MeshContext.build(config, ParallelismSizes(ep_size=2))
    model = build_tiny_model(family, meta=True)
    parallelize_model(
        model, ctx.device_mesh, ctx.moe_mesh, mp_policy=config.mp_policy, **ctx.parallelize_axis_kwargs()
    )
    return model


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _case(model: nn.Module, src: str, expected: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from automodel_checkpoint import load_hf_checkpoint

    report = load_hf_checkpoint(model, src)
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    return {
        "logits": (_logits(model, ids) - expected).abs().max().item(),
        "bytes_read": report.bytes_read,
        "unexpected": report.unexpected,
        "missing": report.missing,
        "sharded_experts": all(isinstance(p, DTensor) for p in experts) and len(experts) == 2,
        "local_experts": [p.to_local().shape[0] for p in experts if isinstance(p, DTensor)],
    }


def run_two_ranks(checkpoints: dict[str, str], work: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from automodel_checkpoint import save_hf_checkpoint
    from automodel_testing import safetensors_differences

    ids = make_batch(128, 2, 12, seed=3)["input_ids"]
    out: dict[str, Any] = {}
    for name, src in checkpoints.items():
        family = name.split("/")[0]
        expected = _logits(AutoModelForCausalLM.from_pretrained(src), ids)
        out[f"{name}/fsdp2"] = _case(_fsdp2(family), src, expected, ids)
        ep_model = _ep(family)
        out[f"{name}/ep2"] = _case(ep_model, src, expected, ids)
        dst = Path(work, name.replace("/", "_"))
        save_hf_checkpoint(ep_model, dst, max_shard_size="60KB")
        save_hf_checkpoint(ep_model, f"{dst}-one-writer", max_shard_size="60KB", writers=1)
        dist.barrier()
        back = _logits(AutoModelForCausalLM.from_pretrained(str(dst)), ids)
        out[f"{name}/saved"] = {
            "logits": (back - expected).abs().max().item(),
            "keys": sorted(_saved_keys(dst)),
            "vs_one_writer": safetensors_differences(dst, f"{dst}-one-writer", files=True),
            "vs_save_pretrained": safetensors_differences(dst, src),
        }
    return out


def _saved_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            keys.extend(f.keys())
    return keys


def _data_bytes(folder: Path) -> int:
    """Bytes of tensor data in a safetensors checkpoint (file sizes minus headers)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        raw = file.read_bytes()
        header = int.from_bytes(raw[:8], "little")
        total += len(raw) - 8 - header
    return total


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Path]]:
    from automodel_moe.experts import routed_exchange_available

    if not routed_exchange_available():  # refused there (the matrix's EP fast slice shows it)
        pytest.skip("this transformers has no AllToAllEP: expert parallelism of routed experts is refused")
    root = tmp_path_factory.mktemp("moe")
    checkpoints: dict[str, Path] = {}
    for family in FAMILIES:
        checkpoints[f"{family}/one"] = save_tiny_checkpoint(family, root / f"{family}_one", seed=7)
    checkpoints["mixtral/many"] = save_tiny_checkpoint(
        "mixtral", root / "mixtral_many", seed=8, max_shard_size="100KB"
    )
    assert json.loads((root / "mixtral_many" / "model.safetensors.index.json").read_text())["weight_map"]
    per_rank = run_distributed(
        run_two_ranks,
        2,
        {k: str(v) for k, v in checkpoints.items()},
        str(root / "saved"),
        timeout_s=600,
        pg_timeout_s=120,
    )
    return per_rank, checkpoints


def test_moe_checkpoint_loads_into_fsdp2_and_ep_shards(
    moe_results: tuple[list[dict[str, Any]], dict[str, Path]],
) -> None:
    per_rank, checkpoints = moe_results
    for name, folder in checkpoints.items():
        total = _data_bytes(folder)
        for layout in ("fsdp2", "ep2"):
            results = [r[f"{name}/{layout}"] for r in per_rank]
            for r in results:
                assert r["logits"] < 1e-5, (name, layout, r)
                assert r["missing"] == [] and r["unexpected"] == [], (name, layout, r)
                assert r["bytes_read"] < total, (name, layout, r["bytes_read"], total)
            # Each byte read by exactly one rank: nobody reads another rank's experts.
            assert sum(r["bytes_read"] for r in results) == total, (name, layout, results, total)
        for r in per_rank:
            assert r[f"{name}/ep2"]["sharded_experts"] and r[f"{name}/ep2"]["local_experts"] == [4, 4]


def test_moe_save_writes_the_per_expert_layout_from_pretrained_loads(
    moe_results: tuple[list[dict[str, Any]], dict[str, Path]],
) -> None:
    per_rank, checkpoints = moe_results
    for name, folder in checkpoints.items():
        saved = per_rank[0][f"{name}/saved"]
        assert saved["logits"] < 1e-5, (name, saved["logits"])
        # The layout save_pretrained writes: the source checkpoint's keys, none fused.
        assert saved["keys"] == sorted(_saved_keys(folder)), name
        # Expert-parallel ranks writing their shares: one writer's files, save_pretrained's tensors.
        assert not saved["vs_one_writer"] and not saved["vs_save_pretrained"], (name, saved)
        assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in saved["keys"]), name
