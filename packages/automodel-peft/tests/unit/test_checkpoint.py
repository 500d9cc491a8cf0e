"""save_adapters -> plain peft loads the same model; merge_adapters folds adapters into the base."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from automodel_peft import PeftConfig, adapter_state_dict, apply_lora, merge_adapters, save_adapters
from automodel_testing import build_tiny_model

Perturb = Callable[[nn.Module], None]

CONFIGS = {
    "lora": PeftConfig(target_modules=["q_proj", "v_proj", "down_proj"], dim=4, alpha=8),
    "dora": PeftConfig(match_all_linear=True, dim=4, use_dora=True),
    "post-dropout+head": PeftConfig(target_modules=["o_proj", "lm_head"], dropout=0.1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plain_peft_loads_the_saved_adapters(
    name: str, tmp_path: Path, batch: dict[str, torch.Tensor], perturb: Perturb
) -> None:
    from peft import PeftModel

    model = build_tiny_model("llama")
    apply_lora(model, CONFIGS[name])
    perturb(model)
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits
    folder = save_adapters(model, tmp_path / "adapter")
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "automodel_adapter.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"], "no temporary folder is left behind"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["r"] == CONFIGS[name].dim

    loaded = PeftModel.from_pretrained(build_tiny_model("llama"), str(folder))
    loaded.eval()
    with torch.no_grad():
        got = loaded(**batch).logits
    assert type(loaded).__name__ == "PeftModelForCausalLM"
    assert torch.equal(got, expected)


def test_keys_are_in_the_peft_format(perturb: Perturb) -> None:
    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(target_modules=["q_proj"], use_dora=True))
    keys = sorted(adapter_state_dict(model))
    assert keys[:3] == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    ]
    assert len(keys) == 6


def test_saving_replaces_an_existing_folder(tmp_path: Path) -> None:
    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(target_modules=["q_proj"]))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "stale.txt").write_text("old")
    save_adapters(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    metadata = json.loads((tmp_path / "adapter" / "automodel_adapter.json").read_text())
    assert metadata["peft_config"]["target_modules"] == ["q_proj"]


def test_a_model_without_adapters_cannot_be_saved(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no LoRA adapter 'default' to save"):
        save_adapters(build_tiny_model("llama"), tmp_path / "adapter")


def test_biases_are_refused(tmp_path: Path) -> None:
    import peft

    model = build_tiny_model("llama")
    apply_lora(model, peft.LoraConfig(r=2, target_modules=["q_proj"], bias="lora_only"))
    with pytest.raises(ValueError, match="bias='none'"):
        save_adapters(model, tmp_path / "adapter")


@pytest.mark.parametrize("dora", [False, True])
def test_keys_and_values_match_peft_and_ignore_wrappers(dora: bool, perturb: Perturb) -> None:
    import peft

    from automodel_distributed.activation_checkpointing import apply_activation_checkpointing

    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(target_modules=["q_proj", "up_proj"], use_dora=dora))
    perturb(model)
    ours = adapter_state_dict(model)
    theirs = {"base_model.model." + k: v for k, v in peft.get_peft_model_state_dict(model).items()}
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    apply_activation_checkpointing(model, mode="full")  # names gain _checkpoint_wrapped_module
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    wrapped = adapter_state_dict(model)
    assert sorted(wrapped) == sorted(ours) and all(torch.equal(wrapped[k], ours[k]) for k in ours)


@pytest.mark.parametrize("dora", [False, True])
def test_merge_gives_a_plain_model_with_the_same_outputs(
    dora: bool, batch: dict[str, torch.Tensor], perturb: Perturb
) -> None:
    model = build_tiny_model("llama")
    apply_lora(model, PeftConfig(match_all_linear=True, dim=4, use_dora=dora))
    perturb(model)
    with torch.no_grad():
        expected = model(**batch).logits
    merged = merge_adapters(model)
    assert merged is model
    assert set(merged.state_dict()) == set(build_tiny_model("llama").state_dict())
    assert not hasattr(merged, "peft_config")
    with torch.no_grad():
        got = merged(**batch).logits
    assert torch.allclose(got, expected, atol=1e-5), float((got - expected).abs().max())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_adapters(merged)


def test_merge_unwraps_a_peft_model(batch: dict[str, torch.Tensor], perturb: Perturb) -> None:
    import peft

    wrapped = peft.get_peft_model(build_tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    perturb(wrapped)
    with torch.no_grad():
        expected = wrapped(**batch).logits
    merged = merge_adapters(wrapped)
    assert type(merged).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert torch.allclose(merged(**batch).logits, expected, atol=1e-5)


def test_targets_peft_would_load_elsewhere_are_refused(tmp_path: Path) -> None:
    """DeepSeek-V3's dense MLP: PEFT (transformers 5) reads its projection names as the fused experts."""
    from transformers import AutoModelForCausalLM

    from automodel_peft import peft_reload_problem
    from automodel_testing.tiny import derive_tiny_config

    try:  # PEFT versions that convert v4 MoE targets on load (0.18 does not: it loads what was saved)
        import peft.utils.transformers_weight_conversion  # noqa: F401

        converts = True
    except ImportError:
        converts = False
    config = derive_tiny_config("deepseek_v3")
    for targets, refused in ((["q_a_proj", "down_proj"], converts), (["q_a_proj", "o_proj"], False)):
        model = AutoModelForCausalLM.from_config(config)
        apply_lora(model, PeftConfig(target_modules=targets, dim=4))
        problem = peft_reload_problem(model)
        if not refused:
            assert problem is None, problem
            save_adapters(model, tmp_path / "fine")
            continue
        assert problem is not None and "mlp.down_proj" in problem and "peft.exclude_modules" in problem
        with pytest.raises(ValueError, match="cannot be saved in the PEFT format"):
            save_adapters(model, tmp_path / "refused")
        assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(("model_type", "module"), [("laguna", "shared_experts"), ("inkling2_text", "sconv")])
def test_adapters_whose_keys_peft_renames_on_load_are_refused(
    tmp_path: Path, model_type: str, module: str
) -> None:
    """PEFT's load conversion rewrites these adapters' keys (Laguna's ``shared_expert.`` renaming, Inkling2's
    ``sconv.weight_proj``): they would be loaded nowhere. Without those modules the adapters round-trip."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from automodel_peft import peft_reload_problem
    from automodel_testing.tiny import derive_tiny_config

    try:
        import peft.utils.transformers_weight_conversion  # noqa: F401
    except ImportError:
        pytest.skip("this PEFT loads adapters under the names they were saved with")
    config = derive_tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, PeftConfig(dim=4, target_modules=["*_proj"]))
    problem = peft_reload_problem(model)
    assert problem is not None and module in problem and "renames their keys" in problem, problem
    with pytest.raises(ValueError, match="cannot be saved in the PEFT format"):
        save_adapters(model, tmp_path / "refused")
    model = AutoModelForCausalLM.from_config(config)
    apply_lora(model, PeftConfig(dim=4, exclude_modules=[f"*{module}*"]))
    assert peft_reload_problem(model) is None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    save_adapters(model, tmp_path / "fine")
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "fine"
    )
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n.removeprefix("base_model.model."): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
