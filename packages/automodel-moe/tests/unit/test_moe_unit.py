"""Single-process checks: config, experts discovery and registry, the load meter, a lean import, routing-
preserving checkpointing."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from automodel_moe import (
    MOE_FAMILIES,
    ExpertsCall,
    MoEFamily,
    MoEParallelizerConfig,
    find_experts,
    find_routers,
    has_experts,
    register_moe_family,
)
from automodel_testing.versions import older_transformers


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


def _tiny(model_type: str, **overrides: Any) -> Any:
    import transformers

    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(derive_tiny_config(model_type, **overrides))


def test_experts_are_found_from_the_models_own_metadata() -> None:
    from automodel_testing import build_tiny_model

    sites = find_experts(build_tiny_model("qwen3_moe"))
    assert [s.fqn for s in sites] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    # transformers 5.17 marks them with its experts-implementation flag, before the ep plan style.
    source = "experts_implementation" if older_transformers() else "ep_plan"
    assert {(s.source, s.num_experts, s.params, s.call) for s in sites} == {
        (source, 8, ("gate_up_proj", "down_proj"), ExpertsCall.ROUTED)
    }
    gpt_oss = find_experts(build_tiny_model("gpt_oss"))[0]  # biases are cut by expert too
    assert gpt_oss.params == ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    # deepseek_v3: the first layer is dense; the MoE layers' shared experts are not routed experts.
    deepseek = find_experts(_tiny("deepseek_v3"))
    assert [s.fqn for s in deepseek] == [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    llama4 = find_experts(_tiny("llama4_text"))  # outside the convention: the registry's record
    assert {(s.source, s.call) for s in llama4} == {("registry", ExpertsCall.EVERY_TOKEN)}
    assert find_experts(build_tiny_model("llama")) == [] and not has_experts(build_tiny_model("llama"))
    # JetMoE (registry record): two experts modules per MoE block and two in its mixture-of-attention
    # heads, each called with rows sorted by expert and their counts.
    jetmoe = find_experts(_tiny("jetmoe"))
    assert [s.fqn for s in jetmoe[:4]] == [
        "model.layers.0.mlp.input_linear",
        "model.layers.0.mlp.output_linear",
        "model.layers.0.self_attention.experts.input_linear",
        "model.layers.0.self_attention.experts.output_linear",
    ]
    assert {(s.source, s.call, s.params, s.num_experts) for s in jetmoe} == {
        ("registry", ExpertsCall.GROUPED_ROWS, ("weight",), 8)
    }
    # LongCat-Flash's experts stack total (routed + identity) experts in gate_up_proj and routed ones in
    # down_proj: no one expert count to cut by, so they are seen (and refused) but not found.
    longcat = _tiny("longcat_flash")
    assert has_experts(longcat) and find_experts(longcat) == []
    from automodel_testing.tiny import MOE_OVERRIDES

    # Gemma 4 keeps its ep plan when its config switches the experts off: that model is dense.
    gemma4 = _tiny("gemma4_text")
    assert (older_transformers() or gemma4.ep_plan) and not has_experts(gemma4)  # 5.17 has no ep_plan
    assert {s.num_experts for s in find_experts(_tiny("gemma4_text", **MOE_OVERRIDES["gemma4_text"]))} == {8}


def test_routers_are_found_from_the_models_output_capture_metadata() -> None:
    from automodel_testing import build_tiny_model

    assert find_routers(build_tiny_model("qwen3_moe")) == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    assert find_routers(build_tiny_model("gpt_oss"))[0] == "model.layers.0.mlp.router"
    if not older_transformers():  # transformers 5.17's deepseek_v3 records no router_logits
        assert find_routers(_tiny("deepseek_v3")) == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    assert find_routers(build_tiny_model("llama")) == []


def test_tensor_parallel_plan_leaves_the_experts_and_routers_alone() -> None:
    """The plan entries left after ``exclude`` (pattern entries split where they match both kinds)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from automodel_distributed.tensor_parallel.apply import _leave_out

    if older_transformers():
        pytest.skip("transformers 5.17's deepseek_v3 records no router_logits: its routers are not found")
    model = _tiny("deepseek_v3")
    plan = {
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),  # the dense layer 0 only
        "model.layers.*.mlp.experts": ColwiseParallel(),
        "model.layers.*.mlp.shared_experts.up_proj": ColwiseParallel(),
        "model.layers.*.mlp": ColwiseParallel(),
    }
    exclude = [s.fqn for s in find_experts(model)] + find_routers(model)
    kept = _leave_out(model, plan, exclude)
    assert sorted(kept) == [
        "model.layers.*.mlp",  # a parent of excluded modules is not excluded
        "model.layers.*.mlp.gate_proj",
        "model.layers.*.mlp.shared_experts.up_proj",
    ]
    split = _leave_out(model, {"model.layers.*.mlp.*": plan["model.layers.*.mlp"]}, exclude)
    assert "model.layers.1.mlp.shared_experts" in split and "model.layers.0.mlp.gate_proj" in split
    assert not any(k.endswith((".experts", ".gate")) for k in split), sorted(split)


def test_registry_records_override_and_refuse_duplicates() -> None:
    assert MOE_FAMILIES["Llama4TextExperts"].call is ExpertsCall.EVERY_TOKEN
    family = MoEFamily(experts_class="ToyExperts", expert_params=("w",))
    try:
        register_moe_family(family)
        with pytest.raises(ValueError, match="already registered"):
            register_moe_family(family)
        assert register_moe_family(family, overwrite=True) is family
    finally:
        MOE_FAMILIES.pop("ToyExperts", None)


def test_expert_load_counts_the_routing_once_per_step() -> None:
    """One process: the histogram is the router's top-k counts, recomputes are not counted twice."""
    from automodel_distributed.activation_checkpointing import apply_activation_checkpointing
    from automodel_moe import ExpertLoad
    from automodel_testing import build_tiny_model, make_batch

    model = build_tiny_model("qwen3_moe", seed=0)
    picked: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda _m, args: picked.append(args[1].clone()))
    meter = ExpertLoad.attach([model])
    assert meter is not None and ExpertLoad.attach([build_tiny_model("llama")]) is None
    apply_activation_checkpointing(model, mode="full")
    ids = make_batch(128, 2, 16)["input_ids"]
    model(input_ids=ids).logits.sum().backward()  # forward + recompute in backward
    expected = torch.bincount(torch.cat([p.reshape(-1) for p in picked[:2]]), minlength=8)
    summary = meter.summary()
    assert summary["tokens_per_expert"] == [float(v) for v in expected]
    assert summary["min_over_ranks"] == summary["max_over_ranks"] == [int(v) for v in expected]
    assert sum(summary["tokens_per_expert"]) == 2 * 2 * 16 * 2  # layers x rows x tokens x top-k
    with meter.paused(), torch.no_grad():
        model(input_ids=ids)
    assert meter.summary()["tokens_per_expert"] == [0.0] * 8  # reset after a summary, paused since


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

    if ignore_router and older_transformers():
        pytest.skip(
            "transformers 5.17's grouped experts clamp the sorted expert ids in place, a saved output "
            "that torch's selective checkpointing refuses to see mutated; unreachable there through the "
            "API: expert parallelism, the only user of ROUTER_SAVE_OPS, is refused without AllToAllEP"
        )
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
