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
