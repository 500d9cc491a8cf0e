"""Tensor and sequence parallelism on real gloo ranks, against the unsharded transformers model.

One 2-rank launch runs every parity case; each case builds the reference model and the TP model from the
same seed in the same process, runs both on the same batch (the TP loss with transformers' ``labels=``
under ``loss_parallel()``), and reports the largest differences of logits, loss and every parameter
gradient (DTensors gathered with ``full_tensor()``). Training cases run several optimizer steps on both
and compare every step's loss and the final parameters. One 4-rank launch checks that the errors a model
can be refused with are raised on every rank before any collective (recorded with the profiler).
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from automodel_distributed.tensor_parallel import apply_tensor_parallel, resolve_tp_plan
from automodel_distributed.tensor_parallel import registry as tp_registry
from automodel_distributed.tensor_parallel.plans import QWEN3_TP_PLAN
from automodel_testing import (
    assert_grads_close,
    build_tiny_model,
    grads_by_name,
    make_batch,
    params_by_name,
    run_distributed,
    to_full,
)

pytestmark = pytest.mark.distributed

ATOL = 1e-5  # fp32 logits and gradients
LOSS_ATOL = 1e-5
STEP_ATOL = 1e-4  # per-step training losses; parameters after SGD steps
# AdamW's first update is lr * g / (|g| + eps): for the odd element whose gradient is ~1e-8 the last-bit
# noise of a sharded matmul (~4e-8) moves the parameter by up to ~lr, so parameters are compared loosely.
ADAMW_PARAM_ATOL = 1e-3
VOCAB, BATCH, SEQ = 128, 2, 16

# Families the testing package does not build: config class and fields on top of the tiny sizes.
_TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "use_cache": False,
    "attn_implementation": "sdpa",
}  # fmt: skip
_EXTRA_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),  # tied embeddings, padding_idx 0
    "gemma2": ("Gemma2Config", {"head_dim": 16, "attn_implementation": "eager"}),  # no sdpa in 5.24
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}),  # q/k norms, scaled embedding, 4 norms a block
    "phi3": ("Phi3Config", {"pad_token_id": 0}),  # fused qkv and gate_up projections
}
TP_FAMILIES = ("llama", "qwen2", "mistral", "llama_tied", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
SP_FAMILIES = ("llama", "qwen2", "mistral", "llama_tied", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
# No registered, no transformers, no Llama-shaped plan: the derived plan. GPT-2: Conv1D projections and
# learned positions; BLOOM: fused query_key_value, ALiBi from the attention mask. Their tiny configs come
# from automodel_testing.tiny (their defaults have dropout, which parity cannot have).
DERIVED_FAMILIES = ("gpt2", "bloom")
HF_PLAN_FAMILIES = ("qwen3_moe", "mixtral")  # no registration: transformers' plan, experts left replicated


def _build(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    import transformers

    if family in DERIVED_FAMILIES:
        from automodel_testing.tiny import derive_tiny_config

        config = derive_tiny_config(family, **overrides)  # SDPA where the family has it
    elif family in _EXTRA_FAMILIES:
        config_name, extra = _EXTRA_FAMILIES[family]
        config = getattr(transformers, config_name)(**{**_TINY, **extra, **overrides})
    else:
        return build_tiny_model(family, seed=seed, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return to_full(t)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


def _forward_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    with loss_parallel():
        out = model(**batch)
        out.loss.backward()
    return float(_full(out.loss)), _full(out.logits)


def _parity(
    build: Callable[[], nn.Module],
    mesh: Any,
    *,
    sequence_parallel: bool = False,
    tp_plan: Any = None,
    loss_in_context: bool = True,
    vocab: int = VOCAB,
    padded: bool = False,
) -> dict[str, Any]:
    """Reference and TP model from the same seed, same batch: max diffs of logits, loss and gradients.

    ``padded``: no ``position_ids`` and an ``attention_mask`` that left-pads the first row by 3 tokens.
    """
    reference, model = build(), build()
    batch = make_batch(vocab, BATCH, SEQ, seed=1)
    if padded:
        mask = torch.ones_like(batch["input_ids"])
        mask[0, :3] = 0
        labels = batch["labels"].masked_fill(mask == 0, -100)
        batch = {"input_ids": batch["input_ids"], "labels": labels, "attention_mask": mask}
    out = reference(**batch)
    out.loss.backward()
    ref_grads = grads_by_name(reference)
    apply_tensor_parallel(model, mesh, tp_plan=tp_plan, sequence_parallel=sequence_parallel)
    if loss_in_context:
        loss, logits = _forward_backward(model, batch)
    else:
        tp_out = model(**batch)
        tp_out.loss.backward()
        loss, logits = tp_out.loss.item(), tp_out.logits.detach()
    grads = grads_by_name(model)
    assert_grads_close(grads, ref_grads, atol=ATOL)  # same names, None on both sides alike
    return {
        "logits": float((logits - out.logits.detach()).abs().max()),
        "loss": abs(loss - out.loss.item()),
        "grads": _max_diff(grads, ref_grads),
        "num_grads": len(grads),
        "num_sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
    }


def _train(
    build: Callable[[], nn.Module],
    mesh: Any,
    *,
    optimizer: str,
    sequence_parallel: bool = False,
    steps: int = 4,
) -> dict[str, Any]:
    """``steps`` optimizer steps on both models; every step's loss and the final parameters compared."""
    reference, model = build(), build()
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)

    def make(m: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in m.parameters() if p.requires_grad]
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-6)
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)

    ref_opt, opt = make(reference), make(model)
    losses: list[tuple[float, float]] = []
    for step in range(steps):
        batch = make_batch(VOCAB, BATCH, SEQ, seed=10 + step)
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with loss_parallel():
            loss = model(**batch).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((float(_full(loss)), ref_loss.item()))
    params, ref_params = params_by_name(model), params_by_name(reference)
    assert params.keys() == ref_params.keys()
    return {
        "step_losses": losses,
        "loss": max(abs(a - b) for a, b in losses),
        "moved": abs(losses[-1][1] - losses[0][1]),
        "params": _max_diff(params, ref_params),
    }


def _peft_build(family: str, *, targets: list[str], seed: int = 0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import peft

        model = peft.get_peft_model(
            _build(family, seed=seed), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
        )
        generator = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():  # non-zero lora_B (peft initialises it to 0, which would hide any error)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        return model

    return build


class _HeadsAttention(nn.Module):
    """Attention written the old way: it reshapes with its own ``num_heads``."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for p in
                   (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


def _heads_attention_case(mesh: Any) -> dict[str, Any]:
    torch.manual_seed(5)
    reference = _HeadsAttention(32, 4)
    model = _HeadsAttention(32, 4)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(6))
    reference(x).square().sum().backward()
    plan = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    apply_tensor_parallel(model, mesh, tp_plan=plan)
    out = model(x)
    out.square().sum().backward()
    return {
        "logits": float((out - reference(x)).abs().max()),
        "grads": _max_diff(grads_by_name(model), grads_by_name(reference)),
        "num_heads": model.num_heads,
    }


def _default_plan_case(mesh: Any) -> dict[str, Any]:
    """A Llama-layout model with no registration and no transformers plan gets the default plan."""
    saved = dict(tp_registry._BY_NAME)
    del tp_registry._BY_NAME["LlamaForCausalLM"]

    def build() -> nn.Module:
        model = build_tiny_model("llama")
        model.__class__ = type("PlainDecoderForCausalLM", (type(model),), {"_tp_plan": None})
        model._tp_plan = {}
        model.config.base_model_tp_plan = None
        return model

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _parity(build, mesh)
    finally:
        tp_registry._BY_NAME.clear()
        tp_registry._BY_NAME.update(saved)
    result["warned"] = any("default Llama-style" in str(w.message) for w in caught)
    return result


def _replicated_logits_case(mesh: Any, sequence_parallel: bool) -> dict[str, Any]:
    model = build_tiny_model("llama")
    plan = dict(resolve_tp_plan(model, sequence_parallel=sequence_parallel, tp_size=2))
    plan["lm_head"] = "colwise_seq_rep" if sequence_parallel else "colwise_rep"
    result = _parity(lambda: build_tiny_model("llama"), mesh, tp_plan=plan, loss_in_context=False)
    return result


def _explicit_loss_parallel_case(mesh: Any) -> dict[str, Any]:
    """The documented recipe: cross entropy on the vocab-sharded DTensor logits under loss_parallel()."""
    reference, model = build_tiny_model("llama"), build_tiny_model("llama")
    batch = make_batch(VOCAB, BATCH, SEQ, seed=2)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    targets = batch["labels"][:, 1:].flatten()
    ref_loss = F.cross_entropy(reference(**inputs).logits[:, :-1].flatten(0, 1), targets)
    ref_loss.backward()
    apply_tensor_parallel(model, mesh)
    logits = model(**inputs).logits
    vocab_sharded = logits.placements == (Shard(2),)
    with loss_parallel():
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets)
        loss.backward()
    return {
        "vocab_sharded": vocab_sharded,
        "loss": abs(float(_full(loss)) - ref_loss.item()),
        "grads": _max_diff(grads_by_name(model), grads_by_name(reference)),
    }


class _WideOutputs(TorchDispatchMode):
    """Counts the op outputs as wide as the whole vocabulary (``width`` in their last dim).

    Local tensors only: a mode sees DTensor-level ops too, whose outputs report the global shape.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.count = width, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            local = isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor)
            if local and tensor.ndim and tensor.shape[-1] == self.width:
                self.count += 1
        return out


def _masked_ce_losses(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """`MaskedCrossEntropy` in its three reductions, with ignored labels and a mask."""
    from automodel_distributed.loss import MaskedCrossEntropy

    weights = torch.linspace(0.5, 1.5, labels.numel(), device=labels.device).reshape(labels.shape)
    return [
        MaskedCrossEntropy(reduction="sum")(logits, labels, mask, num_label_tokens=7),
        MaskedCrossEntropy(reduction="mean")(logits, labels),
        (MaskedCrossEntropy(reduction="none")(logits, labels, mask) * weights).sum(),
    ]


def _vocab_parallel_loss_case(mesh: Any) -> dict[str, Any]:
    """MaskedCrossEntropy keeps vocab-sharded logits sharded: the gathered loss, no vocab-wide tensor."""
    vocab = 101  # 51 + 50 rows: DTensor shards the vocabulary unevenly
    reference, model = _build("llama", vocab_size=vocab), _build("llama", vocab_size=vocab)
    batch = make_batch(vocab, BATCH, SEQ, seed=3)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    labels = batch["labels"].clone()
    labels[0, :3] = -100
    mask = torch.ones_like(labels)
    mask[1, -2:] = 0
    expected = _masked_ce_losses(reference(**inputs).logits, labels, mask)
    sum(expected).backward()
    apply_tensor_parallel(model, mesh)
    logits = model(**inputs).logits
    with _WideOutputs(vocab) as wide:
        losses = _masked_ce_losses(logits, labels, mask)
        sum(losses).backward()
    with _WideOutputs(vocab) as control:  # the gathered path, which the detector must see
        _masked_ce_losses(logits.detach().full_tensor(), labels, mask)
    return {
        "vocab_sharded": logits.placements == (Shard(2),),
        "loss": max(abs(float(a) - float(b)) for a, b in zip(losses, expected, strict=True)),
        "grads": _max_diff(grads_by_name(model), grads_by_name(reference)),
        "vocab_wide": wide.count,
        "vocab_wide_gathered": control.count,
    }


def _missing_head_norm_case(mesh: Any) -> dict[str, Any]:
    """Negative control: without replicated_with_grad_allreduce the q/k-norm gradients are wrong."""
    plan = {k: v for k, v in QWEN3_TP_PLAN.items() if not k.endswith("_norm")}
    reference, model = _build("qwen3"), _build("qwen3")
    batch = make_batch(VOCAB, BATCH, SEQ, seed=1)
    reference(**batch).loss.backward()
    apply_tensor_parallel(model, mesh, tp_plan=plan)
    _forward_backward(model, batch)
    grads, ref = grads_by_name(model), grads_by_name(reference)
    return {"q_norm": float((grads["model.layers.0.self_attn.q_norm.weight"] -
                             ref["model.layers.0.self_attn.q_norm.weight"]).abs().max())}  # fmt: skip


def _tied_and_meta_case(mesh: Any) -> dict[str, Any]:
    model = build_tiny_model("llama_tied")
    apply_tensor_parallel(model, mesh)
    meta = build_tiny_model("llama", meta=True)
    apply_tensor_parallel(meta, mesh, sequence_parallel=True)
    q = meta.model.layers[0].self_attn.q_proj.weight
    o = meta.model.layers[0].self_attn.o_proj.weight
    return {
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "tied_placements": model.lm_head.weight.placements == (Shard(0),),
        "meta_q": (q.device.type, tuple(q.to_local().shape), q.placements == (Shard(0),)),
        "meta_o": (o.device.type, tuple(o.to_local().shape), o.placements == (Shard(1),)),
    }


def _sp_input_errors_case(mesh: Any) -> dict[str, Any]:
    model = build_tiny_model("llama")
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    batch = make_batch(VOCAB, BATCH, SEQ, seed=1)
    odd = make_batch(VOCAB, BATCH, SEQ - 1, seed=1)
    bad = {
        "no_position_ids": {"input_ids": batch["input_ids"]},
        "odd_length": odd,
        "attention_mask": {  # no labels: the vocab-sharded logits' loss needs loss_parallel()
            "input_ids": batch["input_ids"],
            "attention_mask": torch.ones_like(batch["input_ids"]),
        },
    }
    messages = {}
    for label, inputs in bad.items():
        try:
            model(**inputs)
            messages[label] = "no error"
        except ValueError as exc:
            messages[label] = str(exc)
    return messages


def _tp2_cases(mesh: Any) -> dict[str, Callable[[], dict[str, Any]]]:
    cases: dict[str, Callable[[], dict[str, Any]]] = {}
    for family in TP_FAMILIES + HF_PLAN_FAMILIES:
        cases[f"tp/{family}"] = lambda f=family: _parity(lambda: _build(f), mesh)
    for family in SP_FAMILIES + DERIVED_FAMILIES:
        cases[f"sp/{family}"] = lambda f=family: _parity(lambda: _build(f), mesh, sequence_parallel=True)
    for family in DERIVED_FAMILIES:
        cases[f"tp/{family}"] = lambda f=family: _parity(lambda: _build(f), mesh)
    for family, eager in (("llama", False), ("llama", True), ("bloom", False)):
        # Masks and positions come from the full sequence: padding masks, implicit positions, eager.
        extra = {"attn_implementation": "eager"} if eager else {}
        cases[f"sp-padded/{family}{'-eager' if eager else ''}"] = lambda f=family, x=extra: _parity(
            lambda: _build(f, **x), mesh, sequence_parallel=True, padded=True
        )
    for mode in ("tp", "sp"):  # 129 = 65 + 64 rows: DTensor shards the vocabulary unevenly
        cases[f"{mode}/uneven-vocab"] = lambda sp=mode == "sp": _parity(
            lambda: _build("llama", vocab_size=129), mesh, sequence_parallel=sp, vocab=129
        )
    cases["tp/default-plan"] = lambda: _default_plan_case(mesh)
    cases["tp/replicated-logits"] = lambda: _replicated_logits_case(mesh, False)
    cases["sp/replicated-logits"] = lambda: _replicated_logits_case(mesh, True)
    cases["tp/explicit-loss-parallel"] = lambda: _explicit_loss_parallel_case(mesh)
    cases["tp/vocab-parallel-masked-ce"] = lambda: _vocab_parallel_loss_case(mesh)
    cases["tp/heads-attribute"] = lambda: _heads_attention_case(mesh)
    cases["control/missing-head-norm-style"] = lambda: _missing_head_norm_case(mesh)
    cases["tp/tied-and-meta"] = lambda: _tied_and_meta_case(mesh)
    cases["sp/input-errors"] = lambda: _sp_input_errors_case(mesh)
    lora_targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"]
    for family in ("llama", "qwen2"):
        build = _peft_build(family, targets=lora_targets)
        cases[f"lora-tp/{family}"] = lambda b=build: _parity(b, mesh)
    cases["lora-sp/llama"] = lambda: _parity(
        _peft_build("llama", targets=lora_targets), mesh, sequence_parallel=True
    )
    cases["train-tp-adamw/llama"] = lambda: _train(lambda: _build("llama"), mesh, optimizer="adamw")
    cases["train-sp-sgd/llama_tied"] = lambda: _train(
        lambda: _build("llama_tied"), mesh, optimizer="sgd", sequence_parallel=True
    )
    cases["train-tp-sgd/qwen3"] = lambda: _train(lambda: _build("qwen3"), mesh, optimizer="sgd")
    cases["train-sp-adamw/lora-llama"] = lambda: _train(
        _peft_build("llama", targets=lora_targets), mesh, optimizer="adamw", sequence_parallel=True
    )
    return cases


def _run_tp2() -> dict[str, dict[str, Any]]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    results: dict[str, dict[str, Any]] = {}
    for name, case in _tp2_cases(mesh).items():
        start = time.perf_counter()
        try:
            results[name] = case()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
    return results


# ----------------------------------------------------------------------------- 4 ranks: early errors

_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


class _CollectiveRecorder(TorchDispatchMode):
    """Records every c10d operator (eager ``dist.*`` and DTensor's functional collectives) it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "namespace", None) in _COMM_NAMESPACES:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _collectives_during(fn: Callable[[], Any]) -> tuple[str, list[str]]:
    """Run ``fn``; return its ValueError message and the collectives it issued."""
    message = "no error"
    with _CollectiveRecorder() as recorder:
        try:
            fn()
        except ValueError as exc:
            message = str(exc)
    return message, sorted(set(recorder.seen))


def _async_tp_on_cpu() -> tuple[str, list[str]]:
    """Async TP on a gloo mesh: refused before anything changes (it would act on nothing there)."""
    from automodel_distributed import FSDP2Config, FSDP2Manager
    from automodel_mesh import MeshContext, ParallelismSizes

    config = FSDP2Config(enable_async_tensor_parallel=True, sequence_parallel=True, enable_compile=True)
    ctx = MeshContext.build(config, ParallelismSizes(tp_size=4))  # builds groups: outside the recorder
    model = build_tiny_model("llama", num_key_value_heads=4)
    return _collectives_during(lambda: FSDP2Manager(config, ctx.device_mesh).parallelize(model))


def _run_tp4_errors() -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    model = build_tiny_model("llama")  # 4 heads over 2 key-value heads
    out["heads"] = _collectives_during(lambda: apply_tensor_parallel(model, mesh))
    out["heads_untouched"] = not any(isinstance(p, DTensor) for p in model.parameters())
    wide = {"num_key_value_heads": 4}
    tied = build_tiny_model("llama_tied", **wide)
    tie_plan = {"model.embed_tokens": "rowwise_rep", "lm_head": "rowwise"}  # the shared weight, two ways
    out["tie"] = _collectives_during(lambda: apply_tensor_parallel(tied, mesh, tp_plan=tie_plan))
    local_head = build_tiny_model("llama", **wide)
    out["local_head"] = _collectives_during(
        lambda: apply_tensor_parallel(local_head, mesh, tp_plan={"lm_head": "colwise"})
    )
    out["async_tp"] = _async_tp_on_cpu()
    # The detector itself sees eager collectives and DTensor's (sharding a model scatters its weights).
    out["control"] = _collectives_during(lambda: dist.all_reduce(torch.ones(1), group=mesh.get_group()))
    out["control_tp"] = _collectives_during(lambda: apply_tensor_parallel(local_head, mesh))
    return out


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def tp2() -> dict[str, dict[str, Any]]:
    start = time.perf_counter()
    results = run_distributed(_run_tp2, 2, timeout_s=600)
    assert results[0].keys() == results[1].keys()
    print(f"\n2-rank TP launch: {time.perf_counter() - start:.1f} s")
    for name, result in results[0].items():
        print(f"  {name}: {result}")
    return results[0]


def _check_ok(tp2: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    result = tp2[name]
    assert "error" not in result, result.get("error")
    return result


def _assert_parity(result: dict[str, Any]) -> None:
    assert result["logits"] <= ATOL, result
    assert result["loss"] <= LOSS_ATOL, result
    assert result["grads"] <= ATOL, result
    assert result["num_grads"] > 0 and result["num_sharded"] > 0, result


@pytest.mark.parametrize("family", TP_FAMILIES + HF_PLAN_FAMILIES + DERIVED_FAMILIES)
def test_tp_parity(tp2: dict[str, dict[str, Any]], family: str) -> None:
    _assert_parity(_check_ok(tp2, f"tp/{family}"))


@pytest.mark.parametrize("family", SP_FAMILIES + DERIVED_FAMILIES)
def test_tp_sp_parity(tp2: dict[str, dict[str, Any]], family: str) -> None:
    _assert_parity(_check_ok(tp2, f"sp/{family}"))


@pytest.mark.parametrize("case", ["llama", "llama-eager", "bloom"])
def test_sp_padding_masks_and_implicit_positions(tp2: dict[str, dict[str, Any]], case: str) -> None:
    _assert_parity(_check_ok(tp2, f"sp-padded/{case}"))


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_uneven_vocabulary(tp2: dict[str, dict[str, Any]], mode: str) -> None:
    _assert_parity(_check_ok(tp2, f"{mode}/uneven-vocab"))


def test_default_plan_parity_and_warning(tp2: dict[str, dict[str, Any]]) -> None:
    result = _check_ok(tp2, "tp/default-plan")
    _assert_parity(result)
    assert result["warned"]


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_replicated_logits_variant(tp2: dict[str, dict[str, Any]], mode: str) -> None:
    """lm_head 'colwise_rep': plain logits, and transformers' labels= loss works without loss_parallel."""
    _assert_parity(_check_ok(tp2, f"{mode}/replicated-logits"))


def test_vocab_parallel_logits_with_loss_parallel(tp2: dict[str, dict[str, Any]]) -> None:
    result = _check_ok(tp2, "tp/explicit-loss-parallel")
    assert result["vocab_sharded"]
    assert result["loss"] <= LOSS_ATOL and result["grads"] <= ATOL, result


def test_masked_cross_entropy_keeps_vocab_sharded_logits_sharded(tp2: dict[str, dict[str, Any]]) -> None:
    result = _check_ok(tp2, "tp/vocab-parallel-masked-ce")
    assert result["vocab_sharded"]
    assert result["loss"] <= LOSS_ATOL and result["grads"] <= ATOL, result
    assert result["vocab_wide"] == 0 and result["vocab_wide_gathered"] > 0, result


def test_per_module_head_counts_are_divided(tp2: dict[str, dict[str, Any]]) -> None:
    result = _check_ok(tp2, "tp/heads-attribute")
    assert result["num_heads"] == 2
    assert result["logits"] <= ATOL and result["grads"] <= ATOL, result


def test_head_norm_style_is_needed(tp2: dict[str, dict[str, Any]]) -> None:
    """The parity check can fail: leaving Qwen3's q_norm plain leaves its gradient partial."""
    assert _check_ok(tp2, "control/missing-head-norm-style")["q_norm"] > 1e-3


def test_tied_embeddings_stay_tied_and_meta_models_shard(tp2: dict[str, dict[str, Any]]) -> None:
    result = _check_ok(tp2, "tp/tied-and-meta")
    assert result["tied"] and result["tied_placements"]
    assert result["meta_q"] == ("meta", (32, 64), True)
    assert result["meta_o"] == ("meta", (64, 32), True)


def test_sequence_parallel_rejects_bad_batches(tp2: dict[str, dict[str, Any]]) -> None:
    result = _check_ok(tp2, "sp/input-errors")
    assert "needs a sequence length divisible by it, got 15" in result["odd_length"]
    assert result["no_position_ids"] == result["attention_mask"] == "no error"  # built over the full sequence


@pytest.mark.parametrize("case", ["lora-tp/llama", "lora-tp/qwen2", "lora-sp/llama"])
def test_lora_parity(tp2: dict[str, dict[str, Any]], case: str) -> None:
    result = _check_ok(tp2, case)
    _assert_parity(result)
    assert result["num_grads"] == 2 * (2 * 5 + 1)  # lora_A and lora_B of 5 targets per layer + lm_head


@pytest.mark.parametrize(
    "case",
    ["train-tp-adamw/llama", "train-sp-sgd/llama_tied", "train-tp-sgd/qwen3", "train-sp-adamw/lora-llama"],
)
def test_training_steps_match(tp2: dict[str, dict[str, Any]], case: str) -> None:
    result = _check_ok(tp2, case)
    assert result["loss"] <= STEP_ATOL, result
    assert result["moved"] > 1e-3, result  # the steps changed the model
    assert result["params"] <= (ADAMW_PARAM_ATOL if "adamw" in case else STEP_ATOL), result


def test_errors_come_before_any_collective_on_every_rank() -> None:
    start = time.perf_counter()
    results = run_distributed(_run_tp4_errors, 4, timeout_s=300)
    print(f"\n4-rank error launch: {time.perf_counter() - start:.1f} s")
    expected = {
        "heads": "num_key_value_heads=2 is not divisible by tp_size=4",
        "tie": "tied parameters ['lm_head.weight', 'model.embed_tokens.weight'] would be sharded differently",
        "local_head": "return this rank's vocabulary slice as a plain tensor",
        "async_tp": "enable_async_tensor_parallel=True needs CUDA devices",
    }
    for rank, out in enumerate(results):
        for key, fragment in expected.items():
            message, collectives = out[key]
            assert fragment in message, (rank, key, message)
            assert collectives == [], (rank, key, collectives)
        assert out["heads_untouched"]
        assert out["control"][1], "the recorder did not see a real all-reduce"
        assert out["control_tp"][0] == "no error" and out["control_tp"][1], out["control_tp"]
