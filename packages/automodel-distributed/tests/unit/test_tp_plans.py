"""Plan resolution without processes: style names, registry, priority order, transformers' plan, errors."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from automodel_distributed.tensor_parallel import (
    BUILTIN_TP_PLANS,
    STYLE_NAMES,
    GatherSequenceInput,
    ReplicateBlockInput,
    ReplicatedWithGradAllReduce,
    SequenceParallelNorm,
    parallel_style,
    register_named_tp_plan,
    register_tp_plan,
    resolve_tp_plan,
    translate_hf_tp_plan,
    validate_tensor_parallel,
)
from automodel_distributed.tensor_parallel import registry as tp_registry
from automodel_distributed.tensor_parallel.derived import derived_tp_plan
from automodel_distributed.tensor_parallel.sequence import SequenceShardedBlock
from automodel_testing import build_tiny_model
from automodel_testing.versions import older_transformers

# ----------------------------------------------------------------------------- toy models


class _Attn(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q_proj(x) @ self.k_proj(x).transpose(-1, -2)
        return self.o_proj(scores.softmax(-1) @ self.v_proj(x))


class _Mlp(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(h, 2 * h),
            nn.Linear(h, 2 * h),
            nn.Linear(2 * h, h),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attn(h), _Mlp(h)
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(h), nn.LayerNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Base(nn.Module):
    def __init__(self, h: int, container: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, h)
        setattr(self, container, nn.ModuleList(_Block(h) for _ in range(2)))
        self.norm = nn.LayerNorm(h)


class ToyDecoderForCausalLM(nn.Module):
    """A Llama-shaped model that is not a transformers model and is registered nowhere."""

    base_model_prefix = "model"

    def __init__(self, h: int = 8, container: str = "layers", heads: int = 4) -> None:
        super().__init__()
        self.model = _Base(h, container)
        self.lm_head = nn.Linear(h, 32, bias=False)
        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=heads)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        h = self.model.embed_tokens(input_ids)
        for container in self.model.children():
            if isinstance(container, nn.ModuleList):
                for block in container:
                    h = block(h)
        return SimpleNamespace(logits=self.lm_head(self.model.norm(h)))


def _kinds(plan: dict[str, ParallelStyle]) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in plan.items()}


@pytest.fixture(autouse=True)
def _isolated_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts from the built-in registrations and leaves nothing behind."""
    for name in ("_BY_CLASS", "_BY_NAME", "_NAMED"):
        monkeypatch.setattr(tp_registry, name, dict(getattr(tp_registry, name)))


# ----------------------------------------------------------------------------- style names


@pytest.mark.parametrize(
    ("name", "cls", "inp", "out", "local"),
    [
        ("colwise", ColwiseParallel, Replicate(), Shard(-1), True),
        ("colwise_rep", ColwiseParallel, Replicate(), Replicate(), True),
        ("colwise_vocab", ColwiseParallel, Replicate(), Shard(-1), False),
        ("colwise_seq_rep", ColwiseParallel, Shard(1), Replicate(), True),
        ("colwise_seq_vocab", ColwiseParallel, Shard(1), Shard(-1), False),
        ("rowwise", RowwiseParallel, Shard(-1), Replicate(), True),
        ("rowwise_rep", RowwiseParallel, Replicate(), Replicate(), True),
        ("rowwise_seq", RowwiseParallel, Shard(-1), Shard(1), True),
        ("rowwise_rep_seq", RowwiseParallel, Replicate(), Shard(1), True),
        ("colwise_gather_output", ColwiseParallel, Replicate(), Replicate(), True),  # transformers' names
        ("rowwise_split_input", RowwiseParallel, Replicate(), Replicate(), True),
        ("embedding_rowwise", RowwiseParallel, Replicate(), Replicate(), True),
    ],
)
def test_style_names_translate_to_layouts(name: str, cls: type, inp: Any, out: Any, local: bool) -> None:
    style = parallel_style(name)
    assert isinstance(style, cls)
    assert style.input_layouts == (inp,)
    assert style.output_layouts == (out,)
    assert style.use_local_output is local


def test_other_style_names_and_fresh_objects() -> None:
    assert isinstance(parallel_style("sequence_parallel"), SequenceParallelNorm)
    assert isinstance(parallel_style("gather_seq_input"), GatherSequenceInput)
    assert type(parallel_style("replicate_block_input")).__name__ == "ReplicateBlockInput"
    assert isinstance(parallel_style("replicated_with_grad_allreduce"), ReplicatedWithGradAllReduce)
    assert parallel_style("colwise") is not parallel_style("colwise")
    with pytest.raises(ValueError, match=r"unknown tensor-parallel style 'colwize'.*'colwise'"):
        parallel_style("colwize")
    assert len(STYLE_NAMES) == 13


# ----------------------------------------------------------------------------- priority order


@pytest.fixture
def plan_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module with a plan dict and two plan functions."""
    name = f"tp_plans_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            PLAN = {"model.layers.*.self_attn.o_proj": "rowwise"}
            def make_plan():
                return {"model.layers.*.mlp.down_proj": "rowwise"}
            def make_plan_for(model, sequence_parallel):
                return {"model.layers.*.mlp.up_proj": "colwise_rep" if sequence_parallel else "colwise"}
            def broken():
                raise RuntimeError("boom")
            NOT_A_PLAN = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_priority_ladder_on_one_model(plan_module: str) -> None:
    """default < transformers' plan < registry < import path < named plan < user dict, on one model."""

    class Ladder(ToyDecoderForCausalLM):
        pass

    model = Ladder()
    with pytest.warns(UserWarning, match="default Llama-style"):
        assert len(resolve_tp_plan(model, tp_size=2)) == 11  # 9 layers, attention's and the MLP's inputs
    model.config.base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    }
    hf_keys = [
        "model.embed_tokens",
        "model.layers.*.self_attn.q_proj",
        "model.layers.*.self_attn.o_proj",
        "lm_head",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no default-plan warning
        assert list(resolve_tp_plan(model, tp_size=2)) == hf_keys
    register_tp_plan(Ladder, {"lm_head": "colwise_rep"})
    assert list(resolve_tp_plan(model, tp_size=2)) == ["lm_head"]
    path = f"{plan_module}.PLAN"
    assert list(resolve_tp_plan(model, path, tp_size=2)) == ["model.layers.*.self_attn.o_proj"]
    register_named_tp_plan(path, {"model.embed_tokens": "rowwise_rep"})
    assert list(resolve_tp_plan(model, path, tp_size=2)) == ["model.embed_tokens"]
    assert list(resolve_tp_plan(model, {"model.norm": "sequence_parallel"}, tp_size=2)) == ["model.norm"]


def test_user_dict_wins_over_everything() -> None:
    model = build_tiny_model("llama")
    plan = resolve_tp_plan(model, {"model.layers.*.mlp.gate_proj": "colwise"}, tp_size=2)
    assert _kinds(plan) == {"model.layers.*.mlp.gate_proj": "ColwiseParallel"}


def test_named_plan_then_import_path(plan_module: str) -> None:
    model = build_tiny_model("llama")
    register_named_tp_plan("unit-named", {"lm_head": "colwise_rep"})
    assert list(resolve_tp_plan(model, "unit-named", tp_size=2)) == ["lm_head"]
    # A name shadows an import path spelled the same way.
    register_named_tp_plan(f"{plan_module}.PLAN", {"lm_head": "colwise_vocab"})
    assert list(resolve_tp_plan(model, f"{plan_module}.PLAN", tp_size=2)) == ["lm_head"]
    assert list(resolve_tp_plan(model, f"{plan_module}.make_plan", tp_size=2)) == [
        "model.layers.*.mlp.down_proj"
    ]
    # A plan without sequence-parallel styles gets derived sequence parallelism: one entry per block.
    sp = resolve_tp_plan(model, f"{plan_module}.make_plan_for", sequence_parallel=True, tp_size=2)
    assert sp["model.layers.*.mlp.up_proj"].output_layouts == (Replicate(),)
    blocks = [k for k, v in sp.items() if isinstance(v, SequenceShardedBlock)]
    assert blocks == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert [sp[k].cut_output for k in blocks] == [True] * (len(blocks) - 1) + [False]


def test_named_factory_gets_the_model() -> None:
    model = build_tiny_model("llama")
    seen: list[tuple[str, bool]] = []

    def factory(m: nn.Module, sequence_parallel: bool) -> dict[str, str]:
        seen.append((type(m).__name__, sequence_parallel))
        return {"lm_head": "colwise_vocab"}

    register_named_tp_plan("unit-factory", factory)
    resolve_tp_plan(model, "unit-factory", sequence_parallel=True, tp_size=2)
    assert seen == [("LlamaForCausalLM", True)]


def test_import_path_errors_name_the_path(plan_module: str) -> None:
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match=r"tp_plan='no_such_pkg_x\.mod\.PLAN': cannot import module"):
        resolve_tp_plan(model, "no_such_pkg_x.mod.PLAN", tp_size=2)
    with pytest.raises(ValueError, match=rf"tp_plan='{plan_module}\.MISSING'.*no attribute 'MISSING'"):
        resolve_tp_plan(model, f"{plan_module}.MISSING", tp_size=2)
    with pytest.raises(ValueError, match=rf"tp_plan='{plan_module}\.broken': calling it .* failed.*boom"):
        resolve_tp_plan(model, f"{plan_module}.broken", tp_size=2)
    with pytest.raises(ValueError, match=rf"tp_plan='{plan_module}\.NOT_A_PLAN' must name a dict"):
        resolve_tp_plan(model, f"{plan_module}.NOT_A_PLAN", tp_size=2)


def test_unknown_plan_name_lists_registered_names() -> None:
    register_named_tp_plan("unit-listed", {"lm_head": "colwise_vocab"}, overwrite=True)
    with pytest.raises(
        ValueError, match=r"'nope' is neither a registered plan name \(registered: \[.*'unit-listed'"
    ):
        resolve_tp_plan(build_tiny_model("llama"), "nope", tp_size=2)


def test_user_plan_errors() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match=r"tp_plan\['lm_head'\]: unknown tensor-parallel style 'colwize'"):
        resolve_tp_plan(model, {"lm_head": "colwize"}, tp_size=2)
    with pytest.raises(ValueError, match="matches no module of LlamaForCausalLM"):
        resolve_tp_plan(model, {"transformer.h.*.attn": "colwise"}, tp_size=2)
    with pytest.warns(UserWarning, match=r"entries \['nothing\.here'\] match no module"):
        kept = resolve_tp_plan(model, {"lm_head": "colwise_vocab", "nothing.here": "colwise"}, tp_size=2)
    assert list(kept) == ["lm_head"]
    with pytest.raises(ValueError, match="tp_plan must be a dict"):
        resolve_tp_plan(model, 3, tp_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        resolve_tp_plan(model, tp_size=0)


def test_builtin_registry_covers_the_families() -> None:
    assert set(BUILTIN_TP_PLANS) >= {
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
        "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
    }  # fmt: skip
    for name, (tp, sp) in BUILTIN_TP_PLANS.items():
        assert sp.keys() > {k for k in tp if "norm" not in k} - {"model.embed_tokens"}, name
        assert tp["lm_head"] == "colwise_vocab" and sp["lm_head"] == "colwise_seq_vocab", name
    for family in ("llama", "qwen2", "mistral"):
        plan = resolve_tp_plan(build_tiny_model(family), sequence_parallel=True, tp_size=2)
        assert isinstance(plan["model.norm"], SequenceParallelNorm)
        assert isinstance(plan["model.layers.*.self_attn"], GatherSequenceInput)


def test_registry_by_class_then_by_name_along_the_mro() -> None:
    class MyLlama(type(build_tiny_model("llama"))):  # type: ignore[misc]
        pass

    class MyLlamaChild(MyLlama):
        pass

    model = build_tiny_model("llama")
    model.__class__ = MyLlamaChild
    # By name along the MRO: the built-in LlamaForCausalLM plan.
    assert "model.embed_tokens" in resolve_tp_plan(model, tp_size=2)
    register_tp_plan("MyLlama", {"lm_head": "colwise_rep"})
    assert list(resolve_tp_plan(model, tp_size=2)) == ["lm_head"]
    # By class beats by name, even for a base class further up the MRO.
    register_tp_plan(
        MyLlama, {"lm_head": "colwise_vocab"}, sequence_parallel_plan={"lm_head": "colwise_seq_vocab"}
    )
    assert resolve_tp_plan(model, tp_size=2)["lm_head"].use_local_output is False
    assert resolve_tp_plan(model, sequence_parallel=True, tp_size=2)["lm_head"].input_layouts == (Shard(1),)
    with pytest.raises(ValueError, match="already has a plan registered; pass overwrite=True"):
        register_tp_plan(MyLlama, {"lm_head": "colwise_rep"})
    register_tp_plan(MyLlama, {"lm_head": "colwise_rep"}, overwrite=True)
    # No sequence-parallel variant: the plan with derived sequence parallelism (one entry per block).
    derived = resolve_tp_plan(model, sequence_parallel=True, tp_size=2)
    assert (
        sum(isinstance(v, SequenceShardedBlock) for v in derived.values()) == model.config.num_hidden_layers
    )


def test_registration_errors() -> None:
    with pytest.raises(ValueError, match="already has a built-in plan registered by name"):
        register_tp_plan("LlamaForCausalLM", {"lm_head": "colwise_rep"})
    register_tp_plan("LlamaForCausalLM", {"lm_head": "colwise_rep"}, overwrite=True)
    assert list(resolve_tp_plan(build_tiny_model("llama"), tp_size=2)) == ["lm_head"]
    with pytest.raises(ValueError, match=r"tp plan of X\['a'\]: unknown tensor-parallel style 'bogus'"):
        register_tp_plan("X", {"a": "bogus"})
    with pytest.raises(ValueError, match="do not pass sequence_parallel_plan with it"):
        register_tp_plan("Y", lambda m, sp: {}, sequence_parallel_plan={})
    with pytest.raises(ValueError, match="model_class must be a class or a class name"):
        register_tp_plan(3, {})  # type: ignore[arg-type]
    register_named_tp_plan("unit-dup", {})
    with pytest.raises(ValueError, match="already registered; pass overwrite=True"):
        register_named_tp_plan("unit-dup", {})


def test_registered_factory_for_a_remote_code_class_name() -> None:
    model = ToyDecoderForCausalLM()
    model.__class__ = type("RemoteCodeForCausalLM", (ToyDecoderForCausalLM,), {})
    register_tp_plan(
        "RemoteCodeForCausalLM",
        lambda m, sp: {"lm_head": "colwise_seq_vocab" if sp else "colwise_vocab"},
    )
    assert resolve_tp_plan(model, sequence_parallel=True, tp_size=2)["lm_head"].input_layouts == (Shard(1),)


# ----------------------------------------------------------------------------- transformers' plan


def test_hf_plan_is_used_for_unregistered_classes_and_skips_moe_styles() -> None:
    model = build_tiny_model("qwen3_moe")
    raw = model._tp_plan
    assert raw["model.layers.*.mlp.experts"] == "moe_tp_experts"  # transformers 5 format, fully prefixed
    plan, note = translate_hf_tp_plan(model)
    assert plan is not None
    assert not any("experts" in k for k in plan)  # experts stay replicated, with their inner entries
    assert "model.layers.*.mlp.experts" in note
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert next(iter(plan)) == "model.embed_tokens" and plan["model.embed_tokens"] == "rowwise_rep"
    assert plan["lm_head"] == "colwise_vocab"  # transformers says colwise_gather_output
    assert "model.layers.*.mlp.gate_proj" not in plan  # every layer is sparse: matches no module
    styles = resolve_tp_plan(model, tp_size=2)
    # Attention takes its input as one DTensor (q, k, v's input gradients summed before one all-reduce);
    # the sparse MLP's router is not in the plan, so the MLP keeps transformers' per-projection form.
    assert styles.keys() == plan.keys() | {"model.layers.*.self_attn"}
    assert isinstance(styles["model.layers.*.self_attn"], ReplicateBlockInput)
    assert isinstance(styles["model.layers.*.self_attn.q_norm"], ReplicatedWithGradAllReduce)


@pytest.mark.parametrize(
    ("family", "summed", "kept"),
    [
        ("granite", {"self_attn", "mlp"}, set()),
        ("deepseek_v3", {"shared_experts"}, {"self_attn"}),  # MLA: q_a_proj reads the input, unstyled
        ("gpt_neox", set(), set()),  # fused query_key_value: one projection, nothing to sum
    ],
)
def test_declared_plans_sum_block_input_gradients_where_only_styled_modules_hold_parameters(
    family: str, summed: set[str], kept: set[str]
) -> None:
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(derive_tiny_config(family))
    styles = resolve_tp_plan(model, tp_size=2)
    added = {k.rsplit(".", 1)[-1] for k, s in styles.items() if isinstance(s, ReplicateBlockInput)}
    assert added == summed
    assert not added & kept
    # Pure: the same plan again, and the model's own plan untouched.
    assert resolve_tp_plan(model, tp_size=2).keys() == styles.keys()
    sequence = resolve_tp_plan(model, tp_size=2, sequence_parallel=True)
    assert {k.rsplit(".", 1)[-1] for k, s in sequence.items() if isinstance(s, ReplicateBlockInput)} == summed


def test_hf_plan_from_class_and_config_when_the_instance_has_none() -> None:
    model = ToyDecoderForCausalLM()
    model.config.base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    }
    plan, _ = translate_hf_tp_plan(model)
    assert plan == {
        "model.embed_tokens": "rowwise_rep",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "lm_head": "colwise_vocab",
    }


def test_hf_plan_with_unknown_styles_is_unusable() -> None:
    model = ToyDecoderForCausalLM()
    model._tp_plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp": "shard_sideways"}
    plan, note = translate_hf_tp_plan(model)
    assert plan is None
    assert "'shard_sideways'" in note


# ----------------------------------------------------------------------------- default plan and errors


def test_default_plan_for_a_llama_layout_warns() -> None:
    model = ToyDecoderForCausalLM()
    with pytest.warns(UserWarning, match="using the default Llama-style decoder tensor-parallel plan"):
        plan = resolve_tp_plan(model, tp_size=2)
    assert _kinds(plan) == {
        "model.embed_tokens": "RowwiseParallel",
        "model.layers.*.self_attn": "ReplicateBlockInput",
        "model.layers.*.mlp": "ReplicateBlockInput",
        **{f"model.layers.*.self_attn.{p}_proj": "ColwiseParallel" for p in "qkv"},
        "model.layers.*.self_attn.o_proj": "RowwiseParallel",
        "model.layers.*.mlp.gate_proj": "ColwiseParallel",
        "model.layers.*.mlp.up_proj": "ColwiseParallel",
        "model.layers.*.mlp.down_proj": "RowwiseParallel",
        "lm_head": "ColwiseParallel",
    }
    with pytest.warns(UserWarning, match="default"):
        sp = resolve_tp_plan(model, sequence_parallel=True, tp_size=2)
    assert isinstance(sp["model.norm"], SequenceParallelNorm)


def test_no_usable_plan_lists_the_ways_to_register_one() -> None:
    model = ToyDecoderForCausalLM(container="blocks")
    for block in model.model.blocks:  # nothing the derived plan could shard either
        block.self_attn, block.mlp = nn.Identity(), nn.Identity()
    model.lm_head = nn.Identity()  # type: ignore[assignment]
    model.model.embed_tokens = nn.Identity()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no usable tensor-parallel plan for ToyDecoderForCausalLM") as info:
        resolve_tp_plan(model, tp_size=2)
    message = str(info.value)
    for way in ("register_tp_plan(", "register_named_tp_plan(", "FSDP2Config(tp_plan=", "import path"):
        assert way in message
    assert "decoder blocks at `layers.<i>`" in message
    assert "no linear projection" in message
    assert resolve_tp_plan(model, tp_size=1) == {}


def test_default_plan_refuses_blocks_with_extra_parameters() -> None:
    model = ToyDecoderForCausalLM()
    for block in model.model.layers:
        block.self_attn.q_norm = nn.LayerNorm(4)  # a per-head norm the default plan would leave unreduced
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan = resolve_tp_plan(model, tp_size=2)  # the derived plan instead, saying why
    assert any("does not fit decoder block 'model.layers.0'" in str(w.message) for w in seen), seen
    assert "model.layers.0.self_attn.q_norm" not in plan  # stays replicated


def test_keys_get_the_peft_prefix() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    plan = resolve_tp_plan(model, tp_size=2)
    assert "base_model.model.model.layers.*.self_attn.q_proj" in plan
    assert "base_model.model.lm_head" in plan
    user = resolve_tp_plan(model, {"lm_head": "colwise_vocab"}, tp_size=2)
    assert list(user) == ["base_model.model.lm_head"]


def _tiny(model_type: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(derive_tiny_config(model_type))


def test_plan_less_models_get_the_derived_plan() -> None:
    # GPT-2: no registered, no transformers plan, no Llama layout: every Conv1D gathered, vocab-parallel ends.
    gpt2 = _tiny("gpt2")
    with pytest.warns(UserWarning, match="plan derived from the model's structure"):
        plan = resolve_tp_plan(gpt2, tp_size=2)
    assert isinstance(plan["transformer.h.0.attn.c_attn"], ColwiseParallel)
    assert plan["transformer.h.0.attn.c_attn"].output_layouts == (Replicate(),)
    assert plan["transformer.wte"].input_layouts == (Replicate(),)  # vocab-parallel embedding
    assert plan["lm_head"].use_local_output is False  # vocab-sharded logits (tied to wte: both Shard(0))
    assert "transformer.wpe" not in plan  # position embeddings stay replicated
    validate_tensor_parallel(gpt2, 2, plan=plan)  # Conv1D is a linear for the checks
    derived, _ = derived_tp_plan(gpt2, tp_size=2)
    assert derived is not None and set(derived) == set(plan)
    assert derived_tp_plan(nn.Sequential(nn.ReLU()), tp_size=2)[0] is None


def test_automatic_plans_that_do_not_fit_fall_through() -> None:
    # GPTBigCode (multi-query: one key/value head): no plan splits heads, the derived one gathers them.
    bigcode = _tiny("gpt_bigcode")
    with pytest.warns(UserWarning, match="derived"):
        plan = resolve_tp_plan(bigcode, tp_size=2)
    validate_tensor_parallel(bigcode, 2, plan=plan)
    # A transformers plan whose column-parallel attention cannot split one key/value head is skipped.
    toy = ToyDecoderForCausalLM(heads=1)
    toy._tp_plan = {  # type: ignore[assignment]
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
    }
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan = resolve_tp_plan(toy, tp_size=2)
    assert any("transformers' tp plan does not fit" in str(w.message) for w in seen), seen
    assert plan["model.layers.0.self_attn.k_proj"].output_layouts == (Replicate(),)


def test_inexact_transformers_plans_are_skipped() -> None:
    doge = _tiny("doge")
    assert translate_hf_tp_plan(doge)[0] is not None
    with pytest.warns(
        UserWarning, match="transformers' tp plan is not exact for it: its row-parallel dt_proj"
    ):
        plan = resolve_tp_plan(doge, tp_size=2)
    assert all(style.output_layouts == (Replicate(),) for key, style in plan.items() if key.endswith("_proj"))


# ----------------------------------------------------------------------------- derived SP: the stream check


def _meta_family(model_type: str) -> nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from automodel_testing.tiny import derive_tiny_config

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type} (an older one)")

    with torch.device("meta"), warnings.catch_warnings(action="ignore"):
        return AutoModelForCausalLM.from_config(derive_tiny_config(model_type))


@pytest.mark.parametrize(
    ("model_type", "refused"),
    [
        ("opt", None),  # plan-less: the derived plan and derived sequence parallelism
        ("longcat_flash", None),  # an MoE loop over the experts hit: the block stands in on fake tensors
        ("dory", None),  # norms and adds of block outputs between its sections: per position, exact
        ("hrm_text", r"outside its decoder blocks \('add' of a block's output with a full-length tensor"),
        ("inkling2_text", r"outside its decoder blocks \(.*'cat' between the blocks"),
    ],
)
def test_derived_sequence_parallel_checks_the_stream_between_blocks(
    model_type: str, refused: str | None
) -> None:
    model = _meta_family(model_type)
    if refused is None and model_type == "opt" and older_transformers():
        # Older transformers' OPT draws a layer-drop coin in training even at layerdrop 0 and branches
        # on it: no fake-tensor forward, so sequence parallelism is refused (clearly) there.
        refused = "does not run on fake tensors"
    if refused is None:
        plan = resolve_tp_plan(model, sequence_parallel=True, tp_size=2)
        assert any(isinstance(v, SequenceShardedBlock) for v in plan.values())
    else:
        with pytest.raises(ValueError, match=refused + r".*use sequence_parallel=False"):
            resolve_tp_plan(model, sequence_parallel=True, tp_size=2)
    # Plain TP needs no check, and the probe left no hook or forward behind.
    resolve_tp_plan(model, tp_size=2)
    assert all("forward" not in vars(m) and not m._forward_hooks for m in model.modules())


class _SkipBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h + skip)


class _SkipDecoder(nn.Module):
    """Each block also gets the stream from before the previous block (a skip across blocks)."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(32, h)
        self.model.layers = nn.ModuleList(_SkipBlock(h) for _ in range(3))
        self.lm_head = nn.Linear(h, 32, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        h = self.model.embed_tokens(input_ids)
        skip = h
        for block in self.model.layers:
            skip, h = h, block(h, skip)
        return SimpleNamespace(logits=self.lm_head(h))


def test_derived_sequence_parallel_refuses_a_block_output_given_as_a_side_input() -> None:
    with pytest.raises(ValueError, match="_SkipBlock given a block's output besides its stream"):
        resolve_tp_plan(_SkipDecoder(), sequence_parallel=True, tp_size=2)


@pytest.mark.parametrize(
    ("model_type", "entry"),
    [("sarvam_moe", "model.layers.*.self_attn.q_norm"), ("apertus", "model.layers.*.mlp.act_fn")],
)
def test_transformers_plans_get_the_gradient_sums_they_lack(model_type: str, entry: str) -> None:
    """Replicated parameters applied to a rank's slice that transformers' plan leaves out (found by the
    model matrix's export check: the TP replicas drifted apart) come from `HF_TP_PLAN_SUPPLEMENTS`."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from automodel_distributed.tensor_parallel.styles import ReplicatedWithGradAllReduce
    from automodel_testing.tiny import derive_tiny_config

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(derive_tiny_config(model_type))
    plan = resolve_tp_plan(model, tp_size=2)
    assert isinstance(plan.get(entry), ReplicatedWithGradAllReduce), sorted(plan)
