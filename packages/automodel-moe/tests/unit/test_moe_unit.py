"""Single-process checks: config, family registry, the grouped experts math, and a lean import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from automodel_moe import MOE_FAMILIES, MoEFamily, MoEParallelizerConfig, find_moe_family, register_moe_family


def test_config_defaults_round_trip_and_validation() -> None:
    cfg = MoEParallelizerConfig()
    assert cfg.to_dict() == {
        "ignore_router_for_ac": True,
        "reshard_after_forward": False,
        "lm_head_precision": None,
        "wrap_outer_model": True,
        "mp_policy": None,
    }
    assert (
        MoEParallelizerConfig.from_dict({"lm_head_precision": "float32"}).lm_head_precision is torch.float32
    )
    assert MoEParallelizerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="reshard_after_forward"):
        MoEParallelizerConfig(reshard_after_forward=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown MoEParallelizerConfig field"):
        MoEParallelizerConfig.from_dict({"ep_size": 2})
    with pytest.raises(ValueError, match="mp_policy"):
        MoEParallelizerConfig(mp_policy="bf16")


def test_registry_finds_families_and_explains_registration() -> None:
    assert {"qwen3_moe", "qwen2_moe", "mixtral"} <= set(MOE_FAMILIES)
    from automodel_testing import build_tiny_model

    assert find_moe_family(build_tiny_model("mixtral")).sparse_block_class == "MixtralSparseMoeBlock"
    with pytest.raises(ValueError, match=r"register_moe_family\(MoEFamily"):
        find_moe_family(build_tiny_model("llama"))
    family = MoEFamily(model_type="toy_moe", sparse_block_class="ToyBlock", num_experts_field="n")
    try:
        register_moe_family(family)
        with pytest.raises(ValueError, match="already registered"):
            register_moe_family(family)
    finally:
        MOE_FAMILIES.pop("toy_moe", None)


@pytest.mark.parametrize("use_grouped_mm", [False, True])
def test_grouped_swiglu_matches_transformers_experts(use_grouped_mm: bool) -> None:
    """Sorting (token, choice) pairs by expert, grouped SwiGLU, weighting and summing = HF's experts."""
    from automodel_moe.experts import grouped_swiglu
    from automodel_testing import build_tiny_model

    experts = build_tiny_model("qwen3_moe", seed=3).model.layers[0].mlp.experts
    torch.manual_seed(0)
    x = torch.randn(10, 64)
    index = torch.stack([torch.randperm(8)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    expected = experts(x, index, weights)
    order = torch.argsort(index.reshape(-1), stable=True)
    counts = torch.bincount(index.reshape(-1), minlength=8)
    y = grouped_swiglu(
        x[order // 2],
        counts,
        experts.gate_up_proj,
        experts.down_proj,
        experts.act_fn,
        use_grouped_mm=use_grouped_mm,
    )
    got = torch.zeros_like(x).index_add(0, order // 2, y * weights.reshape(-1)[order, None])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_import_is_lean() -> None:
    code = (
        "import sys, automodel_moe; "
        "heavy = ('torch.distributed.tensor', 'torch.distributed.fsdp', 'transformers.models'); "
        "bad = [m for m in heavy if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("ignore_router", [True, False])
def test_checkpoint_recompute_keeps_routing_decisions(ignore_router: bool) -> None:
    """The router weight changes between forward and backward: only saved routing keeps the experts.

    The save-ops hook of the one activation-checkpointing applier with `ROUTER_SAVE_OPS` (what
    `ExpertParallel` hands the FSDP2 applier when ``ignore_router_for_ac``), against plain full recompute.
    """
    from automodel_distributed.activation_checkpointing import apply_activation_checkpointing
    from automodel_moe.parallelizer import ROUTER_SAVE_OPS
    from automodel_testing import build_tiny_model, make_batch

    model = build_tiny_model("mixtral", seed=0)  # Mixtral normalises its top-k values in place
    apply_activation_checkpointing(model, mode="full", save_ops=ROUTER_SAVE_OPS if ignore_router else ())
    block = model.model.layers[0]._checkpoint_wrapped_module.mlp
    seen: list[torch.Tensor] = []
    block.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
    loss = model(input_ids=make_batch(128, 2, 16)["input_ids"]).logits.sum()
    with torch.no_grad():
        block.gate.weight.mul_(-1.0)  # reverses the expert ranking if recomputed
    loss.backward()
    forward, recompute = seen[0], seen[-1]
    assert len(seen) == 2
    assert torch.equal(forward, recompute) is ignore_router
