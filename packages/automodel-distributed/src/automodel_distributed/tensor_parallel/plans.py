"""Built-in tensor-parallel plans, as data: FQN patterns of a ``*ForCausalLM`` model to style names.

Every plan shards attention by heads (q/k/v column-parallel, o row-parallel) and the MLP by its
intermediate dim (gate/up column-parallel, down row-parallel), the input embedding by vocabulary, and the
LM head by vocabulary with vocab-sharded DTensor logits (compute the loss under ``loss_parallel()``).
Attention and the MLP receive their input as a DTensor (gathered from sequence slices under sequence
parallelism, replicated without), so the input gradients of their column-parallel projections are
reduced once, summed, not one projection at a time.
The sequence-parallel variants (Megatron-style) additionally keep the activations outside attention and
the MLP sharded on the sequence dim: norms run on sequence slices, attention and the MLP all-gather their
input and the row-parallel projections reduce-scatter their output. The input embedding hands on the
full sequence (so masks and rotary tables cover all of it); the first decoder block cuts it
(`automodel_distributed.tensor_parallel.sequence`). See `automodel_distributed.tensor_parallel.styles`
for the style names.

Layouts a plan must know about beyond the Llama one:

- Qwen3 and Gemma3 normalise q and k per head *after* the column-parallel projection, on this rank's heads
  only, so their weights need ``replicated_with_grad_allreduce``.
- Gemma2 and Gemma3 have two more norms around the MLP.
- Phi-3 fuses q/k/v (and gate/up) into one projection and slices its output by position, so a column
  shard would cut across q, k and v: the fused projections gather their output and the following
  row-parallel projection splits its replicated input (weights are still sharded; attention runs on every
  head on every rank), as transformers' own plan does.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "BUILTIN_TP_PLANS",
    "DEFAULT_DECODER_PLAN",
    "DEFAULT_DECODER_SP_PLAN",
    "GEMMA2_SP_PLAN",
    "GEMMA2_TP_PLAN",
    "GEMMA3_SP_PLAN",
    "GEMMA3_TP_PLAN",
    "INEXACT_HF_TP_PLANS",
    "LLAMA_SP_PLAN",
    "LLAMA_TP_PLAN",
    "PHI3_SP_PLAN",
    "PHI3_TP_PLAN",
    "QWEN3_SP_PLAN",
    "QWEN3_TP_PLAN",
]

Plan = Mapping[str, str]

LLAMA_TP_PLAN: Plan = {
    "model.embed_tokens": "rowwise_rep",
    "model.layers.*.self_attn": "replicate_block_input",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp": "replicate_block_input",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_vocab",
}
"""Llama, Qwen2, Mistral, Gemma: tensor parallel only. Attention and the MLP take their input as a
replicated DTensor, so the input gradients of q, k and v (gate and up) are all-reduced once, summed."""

LLAMA_SP_PLAN: Plan = {
    "model.embed_tokens": "rowwise_rep",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.self_attn": "gather_seq_input",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise_seq",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.mlp": "gather_seq_input",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise_seq",
    "model.norm": "sequence_parallel",
    "lm_head": "colwise_seq_vocab",
}
"""Llama, Qwen2, Mistral, Gemma: tensor + sequence parallel."""

_HEAD_NORMS: Plan = {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
_FEEDFORWARD_NORMS_SP: Plan = {
    "model.layers.*.pre_feedforward_layernorm": "sequence_parallel",
    "model.layers.*.post_feedforward_layernorm": "sequence_parallel",
}

QWEN3_TP_PLAN: Plan = {**LLAMA_TP_PLAN, **_HEAD_NORMS}
QWEN3_SP_PLAN: Plan = {**LLAMA_SP_PLAN, **_HEAD_NORMS}
GEMMA2_TP_PLAN: Plan = LLAMA_TP_PLAN
GEMMA2_SP_PLAN: Plan = {**LLAMA_SP_PLAN, **_FEEDFORWARD_NORMS_SP}
GEMMA3_TP_PLAN: Plan = QWEN3_TP_PLAN
GEMMA3_SP_PLAN: Plan = {**LLAMA_SP_PLAN, **_HEAD_NORMS, **_FEEDFORWARD_NORMS_SP}

PHI3_TP_PLAN: Plan = {
    "model.embed_tokens": "rowwise_rep",
    "model.layers.*.self_attn.qkv_proj": "colwise_rep",
    "model.layers.*.self_attn.o_proj": "rowwise_rep",
    "model.layers.*.mlp.gate_up_proj": "colwise_rep",
    "model.layers.*.mlp.down_proj": "rowwise_rep",
    "lm_head": "colwise_vocab",
}
PHI3_SP_PLAN: Plan = {
    "model.embed_tokens": "rowwise_rep",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.self_attn": "gather_seq_input",
    "model.layers.*.self_attn.qkv_proj": "colwise_rep",
    "model.layers.*.self_attn.o_proj": "rowwise_rep_seq",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.mlp": "gather_seq_input",
    "model.layers.*.mlp.gate_up_proj": "colwise_rep",
    "model.layers.*.mlp.down_proj": "rowwise_rep_seq",
    "model.norm": "sequence_parallel",
    "lm_head": "colwise_seq_vocab",
}

BUILTIN_TP_PLANS: Mapping[str, tuple[Plan, Plan]] = {
    "LlamaForCausalLM": (LLAMA_TP_PLAN, LLAMA_SP_PLAN),
    "Qwen2ForCausalLM": (LLAMA_TP_PLAN, LLAMA_SP_PLAN),
    "Qwen3ForCausalLM": (QWEN3_TP_PLAN, QWEN3_SP_PLAN),
    "MistralForCausalLM": (LLAMA_TP_PLAN, LLAMA_SP_PLAN),
    "GemmaForCausalLM": (LLAMA_TP_PLAN, LLAMA_SP_PLAN),
    "Gemma2ForCausalLM": (GEMMA2_TP_PLAN, GEMMA2_SP_PLAN),
    "Gemma3ForCausalLM": (GEMMA3_TP_PLAN, GEMMA3_SP_PLAN),
    "Phi3ForCausalLM": (PHI3_TP_PLAN, PHI3_SP_PLAN),
}
"""Model class name -> (tensor-parallel plan, sequence-parallel plan); the registry starts with these."""

# The fallback for models with no registered and no transformers plan. Keys are relative to the base
# model (``model.base_model_prefix``), except ``lm_head``, which is relative to the model itself.
DEFAULT_DECODER_PLAN: Plan = {k.removeprefix("model."): v for k, v in LLAMA_TP_PLAN.items()}
"""Llama-style decoder plan, keys relative to the base model (``lm_head`` relative to the top)."""
DEFAULT_DECODER_SP_PLAN: Plan = {k.removeprefix("model."): v for k, v in LLAMA_SP_PLAN.items()}
"""Its sequence-parallel variant."""

_XIELU: Plan = {"model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}

HF_TP_PLAN_SUPPLEMENTS: Mapping[str, Plan] = {
    # Per-head q/k norms after the column-parallel projections (when the config has them).
    "Glm4MoeForCausalLM": _HEAD_NORMS,
    # xIELU's learned scalars, applied to this rank's slice of the MLP's features.
    "ApertusForCausalLM": _XIELU,
    "Apertus1p5TextForCausalLM": _XIELU,
}
"""Model class name -> entries transformers' plan lacks: replicated parameters applied to this rank's
slice of a sharded activation, whose gradients must be summed over the TP ranks (without them each
replica trains on its own part of the gradient and they drift apart). Entries that name no module of the
model (a config without q/k norms) are dropped."""

INEXACT_HF_TP_PLANS: Mapping[str, str] = {
    "DogeForCausalLM": (
        "its row-parallel dt_proj hands every rank the dynamic mask of all key/value heads (scaled by the "
        "replicated per-head parameter A) while attention runs on this rank's heads only"
    ),
}
"""Model class name -> why transformers' own tp plan for it is not exact; resolution skips that plan."""
