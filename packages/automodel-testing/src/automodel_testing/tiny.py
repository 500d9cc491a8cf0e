"""Tiny configs derived from each transformers family's own defaults, for the model matrix.

`derive_tiny_config` starts from the family's default config and rewrites it by rules that name no
family:

1. every size in `TINY_SIZES` that the config has, found under the family's own field name through its
   ``attribute_map`` (``n_embd`` for GPT-2's ``hidden_size``, ``d_model`` for MPT's), and never above the
   family's own default (a family that routes each token to one expert keeps one); sizes that the family
   defines as a multiple of its hidden size (`HIDDEN_MULTIPLES`) keep that multiple;
2. every dropout, stochastic-depth (``drop_path_rate``), layer-drop and jitter probability to 0 and the
   router's auxiliary outputs off (parity must be exact: models are compared in ``train()`` mode),
   ``use_cache=False``, untied embeddings unless the family only ties;
3. special token ids moved inside the tiny vocabulary;
4. consistency: grouped-query attention only where the family uses it, MLA head sizes add up and
   ``head_dim`` follows the rotary head size of MLA attention, per-layer lists (``layer_types`` and
   friends) are rebuilt for the tiny depth keeping every kind of layer the family has, in order of first
   appearance, and per-layer overrides (``per_layer_config``) keep their ratios to the defaults;
5. sub-configs (``sub_configs``: a DBRX attention config, the local encoder of BLT, the vision and text
   configs of a vision-language model) are derived by the same rules;
6. vision towers: images of `IMAGE_PATCHES` x `IMAGE_PATCHES` patches (``image_size`` follows
   ``patch_size``), a tower whose output width (``out_hidden_size``) is the text model's hidden size,
   and per-layer index lists (``fullatt_block_indexes``, ``deepstack_visual_indexes``) rebuilt for the
   tiny depth, keeping their share of the layers (at least one, ending at the last layer).

What the rules cannot know lives in `FAMILY_OVERRIDES` (data: model type -> config fields), kept as small
as the families allow. The result keeps every kind of layer, attention and routing the family has, at
hidden size 64 with 4 layers, so that a parity test exercises the family's own code paths.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "FAMILY_OVERRIDES",
    "HIDDEN_MULTIPLES",
    "IMAGE_PATCHES",
    "MOE_OVERRIDES",
    "NUM_LAYERS",
    "TINY_SIZES",
    "VOCAB_SIZE",
    "derive_tiny_config",
]

NUM_LAYERS = 4
"""Decoder layers of every tiny model: enough for 2 pipeline ranks with 2 stages each."""
VOCAB_SIZE = 128
HIDDEN_SIZE = 64
IMAGE_PATCHES = 4
"""Patches per side of a tiny image (a multiple of every family's 2x2 merge of patches)."""

TINY_SIZES: Mapping[str, int] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN_SIZE,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "dff": 128,
    "ffn_dim": 128,  # OPT, XGLM: a 3072-wide ReLU layer at hidden size 64 puts units within rounding of 0
    # mixture of experts
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "ffn_hidden_size": 128,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "dense_intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "zero_expert_num": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "router_hidden_size": 16,
    # multi-head latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "o_lora_rank": 16,
    "o_groups": 2,
    # windows and chunks shorter than the test sequence (16), so that they matter
    "sliding_window": 8,
    "sliding_window_size": 8,
    "attention_chunk_size": 8,
    "attention_window_size": 8,
    "local_attention": 8,
    "local_attention_window_len": 8,
    "window_size": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "rel_extent": 16,
    "log_scaling_n_floor": 16,
    # sparse-attention indexers
    "index_topk": 8,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    # linear attention and state-space layers
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_headdim": 16,
    "mamba_chunk_size": 8,
    "mamba_dt_rank": 8,
    "mamba_d_ssm": 128,
    "ssm_state_size": 8,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_mamba_heads": 2,
    "state_size": 8,
    "time_step_rank": 8,
    "chunk_size": 8,
    "n_groups": 1,
    "num_heads": 8,
    "rotary_dim": 8,
    "adapter_rank": 8,
    # per-layer embeddings, hyper-connections, n-gram embeddings
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "num_kv_shared_layers": 2,
    "hc_lowrank": 16,
    "ple_embed_dim": HIDDEN_SIZE,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": VOCAB_SIZE,
    "split_ngram_parts": 2,
    "n_layers_per_attn_res_block": 2,
    "unpadded_vocab_size": VOCAB_SIZE,
    "encoder_hash_byte_group_vocab": VOCAB_SIZE,
    "hidden_size_global": HIDDEN_SIZE,
    # vision-language models: image tokens of a 4 x 4-patch image pooled 2 x 2
    "mm_tokens_per_image": 4,
    "image_seq_length": 4,
}
"""Canonical field name -> tiny value, applied where the family's config has the field (at most the
family's default)."""

HIDDEN_MULTIPLES: tuple[str, ...] = (
    "attention_hidden_size",
    "lru_width",
    "backbone_hidden_size",
)
"""Fields the family sizes relative to its hidden size: the tiny value keeps the default's ratio."""

_SET_WHEN_NONE = frozenset(
    {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "n_shared_experts"}
)
"""Fields whose ``None`` default is no architectural choice (it is derived, or the default is unusable)."""

_LAYER_LISTS = ("layer_types", "mlp_layer_types", "block_types", "layers_block_type", "attention_layers")
"""Per-layer lists of kinds, rebuilt for the tiny depth (every kind kept, in order of first appearance)."""

FAMILY_OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    # The default leaves layer_types unset, which the model cannot run: a short-conv layer, then attention.
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # The default is a 24-layer global/local pattern given compactly; the tiny depth needs its own.
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    # The default has indexed-attention layers but leaves the indexer's sizes unset.
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    # Sliding-window layers use plain multi-head attention whose head is the MLA query/key head.
    "dots3_note_text": {
        "per_layer_config": {
            str(i): {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16} for i in (1, 3)
        }
    },
    # The default gives no rotary parameters per layer type, which the model reads.
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # The attention window is in pixels (not tokens): one merged 2 x 2-patch token per window.
    "qwen2_5_vl_vision": {"window_size": 28},
    # The model falls back to mrope sections of a 128-wide head when the config gives none.
    "qwen2_5_vl_text": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    },
    # The depth is the sum of three sections (input, recurrent, output), each 8 or more layers by default;
    # the default layer_types lists attention and mlp blocks separately, which a cycled list would halve.
    "dory": {
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
}
"""Model type (of a config or of a sub-config) -> config fields the generic rules cannot derive."""

MOE_OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    # The default config has the MoE block switched off (the experts exist only with enable_moe_block).
    "gemma4_text": {
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
    # The default config has a single expert (the released checkpoints have 64).
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2},
    # The default (and released) config has 7 experts, which no ep size of the matrix divides: EP refuses
    # it (a ValueError naming num_experts and ep_size); 8 experts shard, so its structure is tested.
    "flex_olmo": {"num_experts": 8},
}
"""Model type -> the ``derive_tiny_config`` overrides that make its tiny model a mixture of experts that
the matrix's ``ep_size=2`` shards, for families whose default config is dense, has one expert or an odd
expert count. Only the expert-parallel layouts of the model matrix use them (the other layouts keep the
default tiny model)."""


def _resolve(config_class: type, name: str) -> str:
    attribute_map: Mapping[str, str] = getattr(config_class, "attribute_map", {}) or {}
    return attribute_map.get(name, name)


def _cycle_kinds(kinds: Sequence[Any], length: int) -> list[Any]:
    distinct: list[Any] = []
    for kind in kinds:
        if kind not in distinct:
            distinct.append(kind)
    return [distinct[i % len(distinct)] for i in range(length)]


def _token_ids(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if value < VOCAB_SIZE else 1 + value % (VOCAB_SIZE - 1)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [_token_ids(v) for v in value]
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scaled(tiny: int, value: int, default: int) -> int:
    return max(1, round(tiny * value / default)) if default else tiny


def _per_layer(
    entries: Mapping[str, Mapping[str, Any]],
    defaults: Mapping[str, Any],
    fields: Mapping[str, Any],
    depth: int,
) -> dict[str, dict[str, Any]]:
    """Per-layer overrides for the tiny depth.

    Sizes keep their ratio to the defaults; an override of a layer of some kind (``layer_types``)
    applies to every tiny layer of that kind.
    """
    old_kinds, new_kinds = defaults.get("layer_types"), fields.get("layer_types")
    out: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        index = int(key)
        if isinstance(old_kinds, list) and isinstance(new_kinds, list) and index < len(old_kinds):
            targets = [i for i, kind in enumerate(new_kinds) if kind == old_kinds[index]]
        else:
            targets = [index] if index < depth else []
        scaled = {
            name: _scaled(fields[name], value, defaults[name])
            if _is_int(value) and name in fields and _is_int(defaults.get(name))
            else value
            for name, value in entry.items()
        }
        for target in targets:
            out[str(target).zfill(len(key))] = dict(scaled)
    return out


def _apply_relations(config_class: type, defaults: Mapping[str, Any], fields: dict[str, Any]) -> None:
    """Keep the sizes that families define from other sizes consistent (in `_RELATIONS` order)."""

    def get(name: str) -> Any:
        return fields.get(name, defaults.get(name))

    hidden = get(_resolve(config_class, "hidden_size"))
    # MLA: the query/key head is the rotary part plus the plain part; rotary runs over the rotary part.
    rope, nope = _resolve(config_class, "qk_rope_head_dim"), _resolve(config_class, "qk_nope_head_dim")
    if rope in fields and nope in fields:
        if "qk_head_dim" in defaults:
            fields["qk_head_dim"] = fields[rope] + fields[nope]
        if "head_dim" in defaults:
            fields["head_dim"] = fields[rope]
    # State-space layers: the inner width is heads x head size, and expand x hidden where given so.
    if "mamba_d_ssm" in fields and _is_int(get("mamba_n_heads")) and _is_int(get("mamba_d_head")):
        fields["mamba_d_ssm"] = get("mamba_n_heads") * get("mamba_d_head")
    if "mamba_headdim" in fields and _is_int(get("n_mamba_heads")) and _is_int(get("mamba_expand")):
        fields["mamba_headdim"] = get("mamba_expand") * hidden // get("n_mamba_heads")
    # Multimodal rotary embeddings: the sections (time, height, width) split half the tiny head.
    rotary = fields.get("rope_parameters", defaults.get("rope_parameters"))
    head = get("head_dim")
    if head is None and _is_int(hidden) and _is_int(get(_resolve(config_class, "num_attention_heads"))):
        head = hidden // get(_resolve(config_class, "num_attention_heads"))
    # A family that reads mrope sections (its config exempts them from rotary validation) but gives none
    # by default falls back to sections of a 128-wide head in its model: give the tiny head its own, in
    # the usual 2:3:3 split.
    sections = rotary.get("mrope_section") if isinstance(rotary, Mapping) else None
    reads_sections = "mrope_section" in (getattr(config_class, "ignore_keys_at_rope_validation", None) or ())
    if isinstance(rotary, Mapping) and sections is None and reads_sections:
        sections = [2, 3, 3]
    if isinstance(rotary, Mapping) and isinstance(sections, list) and _is_int(head):
        scaled = [max(1, section * (head // 2) // sum(sections)) for section in sections]
        scaled[-1] += head // 2 - sum(scaled)
        fields["rope_parameters"] = {**rotary, "mrope_section": scaled}
    # Vision towers: a tiny image of IMAGE_PATCHES x IMAGE_PATCHES patches (sizes given as int or pair).
    patch, image = get("patch_size"), defaults.get("image_size")
    if _is_int(patch) and (_is_int(image) or isinstance(image, list)):
        fields["image_size"] = IMAGE_PATCHES * patch if _is_int(image) else [IMAGE_PATCHES * patch] * 2
    elif isinstance(patch, list) and patch and isinstance(image, list):
        fields["image_size"] = [IMAGE_PATCHES * p for p in patch]


def _layer_indexes(indexes: Sequence[int], depth: int, default_depth: int) -> list[int]:
    """Indexes of special layers for the tiny depth: their share of the layers, ending at the last."""
    count = max(1, min(depth, round(len(indexes) * depth / max(default_depth, 1))))
    step = max(1, depth // count)
    return sorted(depth - 1 - j * step for j in range(count))


def _tiny_fields(config_class: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for canonical, value in TINY_SIZES.items():
        name = _resolve(config_class, canonical)
        if name not in defaults:
            continue
        default = defaults[name]
        if _is_int(default) and canonical == "num_hidden_layers":
            fields[name] = value  # the same depth for every family: pipeline layouts need enough layers
        elif _is_int(default):
            fields[name] = min(value, default)
        elif isinstance(default, list) and default and all(_is_int(v) for v in default):
            fields[name] = value  # a per-layer list of sizes: one size for the tiny depth
        elif default is None and canonical in _SET_WHEN_NONE:
            fields[name] = value
    hidden = _resolve(config_class, "hidden_size")
    for name in HIDDEN_MULTIPLES:
        if _is_int(defaults.get(name)) and _is_int(defaults.get(hidden)):
            fields[name] = _scaled(fields.get(hidden, HIDDEN_SIZE), defaults[name], defaults[hidden])
    for name, value in defaults.items():
        # "drop" covers dropout, attn_pdrop, drop_path_rate (stochastic depth), layerdrop, drop_connect_rate
        if isinstance(value, float) and ("drop" in name or "jitter" in name):
            fields[name] = 0.0
        elif name.endswith(("token_id", "token_ids", "token_index")):
            fields[name] = _token_ids(value)
    # Grouped-query attention only where the family uses it: a multi-head family keeps one key-value
    # head per query head (multi-head latent attention expands its latent to every head).
    heads, kv_heads = (
        _resolve(config_class, "num_attention_heads"),
        _resolve(config_class, "num_key_value_heads"),
    )
    if kv_heads in fields and heads in fields and defaults.get(kv_heads) in (None, defaults.get(heads)):
        fields[kv_heads] = fields[heads]
    if "use_cache" in defaults:
        fields["use_cache"] = False
    if "output_router_logits" in defaults:
        fields["output_router_logits"] = False
    if "tie_word_embeddings" in defaults:
        fields["tie_word_embeddings"] = False
    _apply_relations(config_class, defaults, fields)
    depth_name = next(
        (n for n in (_resolve(config_class, "num_hidden_layers"), "num_layers") if n in fields), None
    )
    depth = fields[depth_name] if depth_name else NUM_LAYERS
    for name in _LAYER_LISTS:
        kinds = defaults.get(name)
        if isinstance(kinds, list) and kinds:
            fields[name] = _cycle_kinds(kinds, depth)
    default_depth = defaults.get(depth_name) if depth_name else None
    for name, value in defaults.items():
        indexes = isinstance(value, list) and value and all(_is_int(v) for v in value)
        if name.endswith(("_indexes", "_indices")) and isinstance(default_depth, int) and indexes:
            fields[name] = _layer_indexes(value, depth, default_depth)
    if isinstance(defaults.get("per_layer_config"), Mapping) and defaults["per_layer_config"]:
        fields["per_layer_config"] = _per_layer(defaults["per_layer_config"], defaults, fields, depth)
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        sub_defaults = defaults.get(name)
        if isinstance(sub_defaults, Mapping) and isinstance(sub_class, type):
            sub_overrides = FAMILY_OVERRIDES.get(str(getattr(sub_class, "model_type", "")), {})
            fields[name] = {**sub_defaults, **_tiny_fields(sub_class, sub_defaults), **sub_overrides}
    # A vision tower that projects its output itself gives the text model's width.
    text = fields.get("text_config")
    if isinstance(text, Mapping) and _is_int(text.get("hidden_size")):
        for sub in fields.values():
            if isinstance(sub, dict) and sub is not text and _is_int(sub.get("out_hidden_size")):
                sub["out_hidden_size"] = text["hidden_size"]
    return fields


def _defaults(config_class: type, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The family's default fields; a default config that does not validate is built with its overrides."""
    try:
        return dict(config_class().to_dict())
    except (ValueError, TypeError):
        if not overrides:
            raise
        return dict(config_class(**overrides).to_dict())


def derive_tiny_config(model_type: str, **overrides: Any) -> PreTrainedConfig:
    """The tiny config of ``model_type``, derived from the family's defaults (see the module docstring).

    Args:
        model_type: A key of transformers' ``CONFIG_MAPPING`` (e.g. ``"gemma2"``).
        **overrides: Config fields set last (e.g. ``attn_implementation``).

    Returns:
        A fresh config with ``use_cache=False`` and no dropout (transformers picks SDPA attention by
        default where the family supports it).

    Raises:
        ValueError: An unknown model type.
    """
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"transformers has no config for model type {model_type!r}")
    config_class = CONFIG_MAPPING[model_type]
    family = FAMILY_OVERRIDES.get(model_type, {})
    fields = _tiny_fields(config_class, _defaults(config_class, family))
    fields.update(copy.deepcopy(dict(family)))
    fields.update(overrides)
    config: PreTrainedConfig = config_class(**fields)
    return config
