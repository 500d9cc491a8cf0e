"""Model layout discovery, model validation and stage modules (single process, no process group).

Stage modules run back to back must reproduce the full model's logits, keep the full model's parameter
names (a stage's state_dict keys are a subset of the model's; the layers keep their original index) so a
checkpoint loads into them, and move rather than copy the model's modules.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from automodel_pipelining import (
    generate_stage_fqns,
    resolve_decoder_layout,
    validate_hf_model_for_pipeline_support,
)
from automodel_pipelining.stage_module import build_stage_module
from automodel_testing import build_tiny_model, make_batch, tiny_config


def _stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    layout = resolve_decoder_layout(model)
    parts = generate_stage_fqns(layout, num_stages)
    return [
        build_stage_module(model, layout, parts[i], stage_index=i, num_stages=num_stages)
        for i in range(num_stages)
    ]


# ------------------------------------------------------------------------------------------ layout


def test_layout_of_a_causal_lm() -> None:
    layout = resolve_decoder_layout(build_tiny_model("qwen2", meta=True, num_hidden_layers=3))
    assert layout.base == "model"
    assert layout.layers == "model.layers"
    assert layout.layer_fqns == ("model.layers.0", "model.layers.1", "model.layers.2")
    assert (layout.embed, layout.norm, layout.head) == ("model.embed_tokens", "model.norm", "lm_head")
    assert layout.shared == ("model.rotary_emb",)
    assert layout.first_extras == ()


def test_layout_of_a_bare_base_model() -> None:
    import transformers

    with torch.device("meta"):
        base = transformers.AutoModel.from_config(tiny_config("llama"))
    layout = resolve_decoder_layout(base)
    assert (layout.base, layout.layers, layout.embed, layout.norm, layout.head) == (
        "",
        "layers",
        "embed_tokens",
        "norm",
        None,
    )


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.h = nn.ModuleList([_Block(), _Block()])
        self.ln_f = nn.LayerNorm(4)
        self.vision = nn.Linear(4, 4)


class _Undeclared(nn.Module):
    """A model that declares no pipeline plan: found through the fallback names."""

    base_model_prefix = "transformer"

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Trunk()
        self.lm_head = nn.Linear(4, 8)


def test_layout_from_fallback_names() -> None:
    layout = resolve_decoder_layout(_Undeclared())
    assert (layout.embed, layout.layers, layout.norm, layout.head) == (
        "transformer.wte",
        "transformer.h",
        "transformer.ln_f",
        "lm_head",
    )
    # The toy trunk has no forward: the stage of its extra module is unknown, so only an explicit split
    # may place it.
    assert layout.first_extras == () and layout.unplaced == ("transformer.vision",)
    with pytest.raises(ValueError, match=r"stage of \['transformer.vision'\] is unknown"):
        generate_stage_fqns(layout, 2)


def test_layout_without_layers_names_the_way_out() -> None:
    with pytest.raises(
        ValueError, match=r"cannot find the decoder layers of Linear.*module_fqns_per_model_part"
    ):
        resolve_decoder_layout(nn.Linear(2, 2))


def test_tied_embeddings_are_rejected() -> None:
    model = build_tiny_model("llama_tied", meta=True)
    with pytest.raises(ValueError, match="ties its input and output embeddings"):
        validate_hf_model_for_pipeline_support(model)


def test_encoder_decoder_is_rejected() -> None:
    import transformers

    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        validate_hf_model_for_pipeline_support(model)


class _Multimodal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(vision_config={"hidden_size": 4}, is_encoder_decoder=False)
        self.layers = nn.ModuleList([nn.Linear(2, 2)])


def test_multimodal_is_rejected_unless_it_keeps_its_forward() -> None:
    with pytest.raises(ValueError, match=r"_Multimodal is multimodal .*vision_config"):
        validate_hf_model_for_pipeline_support(_Multimodal())
    allowed = _Multimodal()
    allowed._pp_keep_self_forward = True  # type: ignore[assignment]
    validate_hf_model_for_pipeline_support(allowed)


def test_untied_decoders_pass() -> None:
    for family in ("llama", "qwen2", "mistral"):
        validate_hf_model_for_pipeline_support(build_tiny_model(family, meta=True))


# ------------------------------------------------------------------------------------------ stage modules


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_stages_back_to_back_reproduce_the_model(family: str) -> None:
    reference = build_tiny_model(family, num_hidden_layers=5)
    stages = _stages(build_tiny_model(family, num_hidden_layers=5), 3)
    batch = make_batch(reference.config.vocab_size, 2, 12)
    x = batch["input_ids"]
    for stage in stages:
        x = stage(x, position_ids=batch["position_ids"])
    expected = reference(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)


# One family per mechanism the stage forward gets from running the model's own forward: scaled embeddings and
# soft-capped logits, per-layer sliding/global attention, an index-based layer loop, embedding/residual/logit
# multipliers, learned positions and extras run before/after the layers, linear attention, state-space layers;
# layers returning tuples read by index (bloom) or unpacked (bamba), a tensor under a tuple hint (gemma3).
OWN_FORWARD_FAMILIES = (
    "gemma2",
    "cohere2",
    "lfm2_moe",
    "granite",
    "opt",
    "biogpt",
    "qwen3_next",
    "mamba",
    "bloom",
    "bamba",
    "gemma3_text",
    "nemotron_h",  # its forward reads each layer's block_type before calling it
    "modernbert-decoder",  # its forward calls the embedding (a norm) on inputs_embeds too
)


@pytest.mark.parametrize("family", OWN_FORWARD_FAMILIES)
def test_stages_compute_what_the_model_computes(family: str) -> None:
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config(family)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(reference.state_dict())
    batch = make_batch(config.vocab_size, 2, 16)
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        x = batch["input_ids"]
        for stage in _stages(model, 3):
            x = stage(x, position_ids=batch["position_ids"])
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)


class _SideChannel(nn.Module):
    """Every layer also gets the embeddings: a later stage could not have them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([_Mixer(), _Mixer()])

    def forward(
        self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None
    ) -> Any:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, embeds)
        return hidden


class _Scaled(_SideChannel):
    """Scales the hidden states between layers: a stage boundary would scale them twice."""

    def forward(
        self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None
    ) -> Any:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden = 2 * layer(hidden, None)
        return hidden


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        return self.proj(hidden if extra is None else hidden + extra)


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        (_SideChannel(), "layer 0 gets inputs computed from the embeddings"),
        (_Scaled(), "changes the hidden states between layers 0 and 1"),
    ],
)
def test_forwards_a_stage_cannot_reproduce_are_found(model: nn.Module, problem: str) -> None:
    layout = resolve_decoder_layout(model)
    assert any(problem in p for p in layout.problems), layout.problems
    assert not resolve_decoder_layout(build_tiny_model("llama", meta=True)).problems


@pytest.mark.parametrize(
    ("family", "problem"),
    [
        ("nanochat", "norm runs both before and after the layers"),  # the final norm also runs first
    ],
)
def test_transformers_forwards_a_stage_cannot_reproduce_are_found(family: str, problem: str) -> None:
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(derive_tiny_config(family))
    assert any(problem in p for p in resolve_decoder_layout(model).problems)


def test_state_dict_keys_are_stable_and_checkpoints_load() -> None:
    reference = build_tiny_model("llama", num_hidden_layers=5, seed=3)
    full = reference.state_dict()
    stages = _stages(build_tiny_model("llama", num_hidden_layers=5, seed=0), 3)
    keys = [set(stage.state_dict()) for stage in stages]
    for stage_keys in keys:
        assert stage_keys <= set(full)
    assert set().union(*keys) == set(full)
    assert sum(len(k) for k in keys) == len(full)  # every key on exactly one stage
    assert any(k.startswith("model.layers.4.") for k in keys[2])  # original index, not 0
    # The container keeps its type and length; other stages' layers are parameter-free stand-ins.
    layers = stages[1].model.layers
    assert isinstance(layers, nn.ModuleList) and len(layers) == 5
    assert [i for i, layer in enumerate(layers) if next(layer.parameters(), None) is not None] == [2, 3]
    # A checkpoint of the full model loads into the stages unchanged, and they then compute its logits.
    for stage in stages:
        stage.load_state_dict({k: full[k] for k in stage.state_dict()}, strict=True)
    batch = make_batch(reference.config.vocab_size, 1, 8)
    x = batch["input_ids"]
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, reference(input_ids=batch["input_ids"]).logits, rtol=0, atol=1e-6)


def test_stages_move_modules_and_own_their_shells() -> None:
    model = build_tiny_model("llama", num_hidden_layers=4)
    stages = _stages(model, 2)
    first, last = stages
    assert first.model.embed_tokens is model.model.embed_tokens  # moved, not copied
    assert first.model.layers[1] is model.model.layers[1]
    assert last.lm_head is model.lm_head
    assert first.lm_head is None and last.model.embed_tokens is None
    assert next(first.model.norm.parameters(), None) is None  # the final norm's stand-in
    assert first.model.rotary_emb is not last.model.rotary_emb  # parameter-free modules are copied per stage
    assert first is not model and first.model is not model.model
    # The full model's structure is untouched, and hooks on a stage shell stay on that shell.
    assert isinstance(model.model.layers, nn.ModuleList) and len(model.model.layers) == 4
    first.register_forward_hook(lambda *_: None)
    first.model.register_forward_pre_hook(lambda *_: None)
    assert not model._forward_hooks and not model.model._forward_pre_hooks and not last._forward_hooks


def test_meta_device_models_split() -> None:
    stages = _stages(build_tiny_model("qwen2", meta=True, num_hidden_layers=4), 4)
    assert all(p.is_meta for stage in stages for p in stage.parameters())
    owned = [
        [i for i, m in enumerate(s.model.layers) if next(m.parameters(), None) is not None] for s in stages
    ]
    assert owned == [[0], [1], [2], [3]]


def test_middle_stage_rejects_token_ids() -> None:
    stages = _stages(build_tiny_model("llama", num_hidden_layers=3), 3)
    with pytest.raises(ValueError, match="stage 1 of 3 has no input embedding but got integer inputs"):
        stages[1](torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"got unsupported \['labels'\]"):
        stages[0](torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long))


class _WithDirectParam(_Undeclared):
    def __init__(self) -> None:
        super().__init__()
        self.transformer.scale = nn.Parameter(torch.ones(1))


def test_a_split_shell_must_not_own_parameters() -> None:
    model = _WithDirectParam()
    layout = resolve_decoder_layout(model)
    with pytest.raises(ValueError, match=r"'transformer' .* owns parameters \['scale'\] directly"):
        build_stage_module(model, layout, ["transformer.wte", "transformer.h.0"], stage_index=0, num_stages=2)
