"""automodel-moe's expert discovery on a model that automodel-peft has given expert adapters.

Cross-package (moe does not depend on peft), so it lives in the e2e tier, not in moe's unit tests.
"""

from __future__ import annotations

import pytest

from automodel_moe import find_experts


def test_experts_wrapped_by_peft_are_one_site() -> None:
    from automodel_peft import PeftConfig, apply_lora
    from automodel_testing import build_tiny_model

    model = build_tiny_model("qwen3_moe")
    apply_lora(
        model, PeftConfig(target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"], dim=2)
    )
    (site, _) = find_experts(model)
    assert site.fqn == "model.layers.0.mlp.experts" and type(site.module).__name__ == "ParamWrapper"
    assert type(site.core).__name__ == "Qwen3MoeExperts" and site.params == ("gate_up_proj", "down_proj")
    with pytest.raises(ValueError, match="match no parameter"):
        apply_lora(
            build_tiny_model("qwen3_moe"), PeftConfig(target_modules=["q_proj"], target_parameters=["nope"])
        )


def test_pipeline_stages_of_a_moe_with_expert_adapters_compute_what_the_model_computes() -> None:
    """The pipeline's forward probe runs the real layers with peft's expert adapters switched off (their
    per-call parametrization refuses fake tensors); it had fallen back to the layers' return annotation,
    which for GraniteMoeShared says tuple where the layer returns a tensor (the ep2_pp2_lora matrix
    failure of six families)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from automodel_moe import expert_weight_targets
    from automodel_peft import PeftConfig, apply_lora_to_linear_modules
    from automodel_pipelining import generate_stage_fqns, resolve_decoder_layout
    from automodel_pipelining.stage_module import build_stage_module
    from automodel_testing import make_batch
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config("granitemoeshared")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    targets = expert_weight_targets(model)
    apply_lora_to_linear_modules(
        model, PeftConfig(match_all_linear=True, dim=4, alpha=8, target_parameters=targets)
    )
    with torch.no_grad():  # B is zero at first: give the adapters something to add
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    batch = make_batch(config.vocab_size, 2, 16)
    with torch.no_grad():
        expected = copy.deepcopy(model)(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"]
        ).logits
    layout = resolve_decoder_layout(model)
    assert layout.layer_output_arity == (0,) * config.num_hidden_layers  # read from the layers themselves
    assert {name: p.requires_grad for name, p in model.named_parameters()} == trainable
    parts = generate_stage_fqns(layout, 2)
    stages = [build_stage_module(model, layout, parts[i], stage_index=i, num_stages=2) for i in range(2)]
    with torch.no_grad():
        x = batch["input_ids"]
        for stage in stages:
            x = stage(x, position_ids=batch["position_ids"])
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
