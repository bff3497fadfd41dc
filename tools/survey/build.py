"""How the survey builds a tiny model of every causal-LM type: from its config class's default, with small sizes
set where the class has them, each kind of block of a hybrid built, a registered family's own tiny recipe where there
is one, and per-type overrides where the generic sizes fail; and what the classes say before anything is built."""

from __future__ import annotations

import torch

from attnlens.family import TINY_DEFAULTS

# --- how tiny models are built: data ---------------------------------------------------------------------------

#: Sizes a tiny model starts from, each set where the config class's default has the attribute with a value of the
#: same type (under any alias): attnlens's TINY_DEFAULTS, then the other names configs use for the same sizes.
SIZES = {
    **TINY_DEFAULTS,
    "head_dim": 16,
    "sliding_window": 4,
    "n_layer": 3,
    "n_layers": 3,
    "num_layers": 3,
    "decoder_layers": 3,
    "n_embd": 64,
    "d_model": 64,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "decoder_attention_heads": 4,
    "n_inner": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "n_positions": 128,
    "encoder_layers": 3,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "num_decoder_layers": 3,
    "num_encoder_layers": 3,
    "num_decoder_attention_heads": 4,
    "num_encoder_attention_heads": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "attention_chunk_size": 4,
    "rotary_dim": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
#: Sizes of the other towers of a composite config (vision, audio): one layer, so their block lists never match the
#: text model's.
TOWER_SIZES = {
    **SIZES,
    "num_hidden_layers": 1,
    "depth": 1,
    "num_layers": 1,
    "n_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_heads": 2,
    "out_hidden_size": 64,
    "projection_dim": 32,
}
#: Sizes that follow from what else the config has: latent attention's head_dim is its rotary part, and its keys and
#: values are expanded to every query head.
WHEN = {"qk_rope_head_dim": {"head_dim": 8}, "kv_lora_rank": {"num_key_value_heads": 4}}
#: Sizes that may start unset (None) and still be set.
UNSET_SIZES = ("head_dim", "pad_token_id", "num_key_value_heads")
#: Per-layer lists (one entry per block): each kind in the default config's list, in order of first appearance, cycled
#: over the tiny depth, so a hybrid's every kind of block is built.
PER_LAYER = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")
#: Flags that make an encoder (BERT-like, XLM) run as a decoder, set where the config has them.
DECODER_FLAGS = {"is_decoder": True, "causal": True}

#: Per-type config keyword arguments, over SIZES (and over a registered family's `Family.tiny`), where the generic
#: sizes fail or hide a kind of block (a hybrid's attention blocks). A sub-config's are a nested dict; a text type's
#: apply inside the composites that hold it (`mllama_text_model` in `mllama`).
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},
    # bytes -> patches -> a global transformer -> bytes; its cache cannot be built from BltConfig (no
    # num_hidden_layers), so it runs without one
    "blt": {
        "use_cache": False,
        "encoder_hash_byte_group_vocab": 128,
        **{
            part: {
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "intermediate_size": 128,
                "num_hidden_layers": layers,
                "vocab_size": 128,
                **({"hidden_size_global": 64} if local else {}),
            }
            for part, layers, local in (
                ("patcher_config", 1, False),
                ("encoder_config", 1, True),
                ("decoder_config", 3, True),
                ("global_config", 2, False),
            )
        },
    },
    "cohere_compass_text": {
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("full_attention", "sliding_attention")
        }
    },
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "dots3_note": {
        "vision_config": {
            "per_layer_config": {},
            "mlp_layer_types": ["dense"],
            "adapter_in_dim": 32,
            "adapter_out_dim": 64,
        },
        "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 64},
    },
    # per-layer configs: the sliding layers' sizes come as swa_* arguments
    "dots3_note_text": {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "head_dim": 24,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 32,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 24,
        "swa_qk_nope_head_dim": 16,
        "swa_v_head_dim": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
    },
    "falcon_h1": {"mamba_d_ssm": 128},
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "intermediate_size": [128] * 4,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 128,
        "laurel_rank": 8,
        "activation_sparsity_pattern": [0.0] * 4,
    },
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "laguna": {"num_attention_heads_per_layer": [4, 4, 4]},
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
    # layers without rotary embedding (Llama 4's are its full-attention layers; the others are chunked)
    "llama4_text": {"no_rope_layers": [1, 0, 1]},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "mllama_text_model": {"cross_attention_layers": [1]},
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
        "hc_lowrank": 16,
        "ple_embed_dim": 64,
    },
    "reformer": {
        "axial_pos_embds": False,
        "attention_head_size": 16,
        "feed_forward_size": 128,
        "attn_layers": ["local", "lsh", "local"],
    },
    "smollm3": {"no_rope_layers": [1, 0, 1]},
    "xlstm": {"embedding_dim": 64, "num_blocks": 3, "qk_dim_factor": 1.0},  # 0.5 fails the tiny recurrent step
    "xmod": {"default_language": "en_XX"},
    # two hybrid blocks share one transformer (tied weights), so there must be two
    "zamba": {"num_hidden_layers": 4, "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_dt_rank": 4},
    "zaya": {"num_experts_per_tok": 1},
}


# --- building ------------------------------------------------------------------------------------------------


def _sized(config, sizes: dict) -> dict:
    """The entries of `sizes` that `config` (a default instance) has, of the same type (or may leave unset)."""
    chosen = {}
    for key, value in sizes.items():
        if isinstance(getattr(type(config), key, None), property):
            continue  # derived from other sizes (Falcon's head_dim)
        try:
            current = getattr(config, key)
        except Exception:  # noqa: BLE001  (absent, or a per-layer attribute that refuses a global read)
            continue
        if type(current) is type(value) is not bool or (current is None and key in UNSET_SIZES):
            chosen[key] = value
    for attribute, sizes in WHEN.items():
        if _has(config, attribute):
            chosen = _merge(chosen, sizes)
    return chosen


def _per_layer(config, kwargs: dict) -> dict:
    """`kwargs` with each per-layer list of `config` it does not set cycled over its depth (see PER_LAYER)."""
    depth = kwargs.get("num_hidden_layers", getattr(config, "num_hidden_layers", None))
    cycled = {}
    for key in PER_LAYER:
        kinds = vars(config).get(key)  # a field, not an alias or a property
        if isinstance(kinds, (list, tuple)) and key not in kwargs and len(set(kinds)) > 1 and depth:
            kinds = list(dict.fromkeys(kinds))
            cycled[key] = [kinds[i % len(kinds)] for i in range(depth)]
    return {**kwargs, **cycled}


def _has(config, attribute: str) -> bool:
    try:
        return hasattr(config, attribute)
    except Exception:  # noqa: BLE001  (per-layer attributes refuse a global read)
        return True


def _merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, nested dicts merged, None removing a key."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return {k: v for k, v in merged.items() if v is not None}


def default_config(model_type: str):
    """The config class's default instance (with the type's overrides where the bare default fails validation)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001
        return CONFIG_MAPPING[model_type](**OVERRIDES.get(model_type, {}))


def tiny_kwargs(model_type: str) -> dict:
    """The config keyword arguments of the survey's tiny model of `model_type`."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = default_config(model_type)
    text = default.get_text_config(decoder=True)
    family = registered().get(model_type)
    recipe = family.tiny if family is not None else None
    if recipe is not None and recipe[0] == config_class.__name__:  # the family's own tested recipe
        return _merge({**TINY_DEFAULTS, **recipe[2]}, OVERRIDES.get(model_type, {}))
    kwargs = {**_sized(default, SIZES), **{k: v for k, v in DECODER_FLAGS.items() if _has(default, k)}}
    for name in getattr(config_class, "sub_configs", {}):
        sub = getattr(default, name, None)
        if isinstance(sub, PreTrainedConfig):
            if sub is text and recipe is not None and recipe[0] == type(text).__name__:
                kwargs[name] = _merge({"model_type": sub.model_type, **TINY_DEFAULTS}, recipe[2])
            else:
                kwargs[name] = {"model_type": sub.model_type, **_sized(sub, SIZES if sub is text else TOWER_SIZES)}
            kwargs[name] = _merge(kwargs[name], OVERRIDES.get(sub.model_type, {}))  # a text type's, in a composite
            if sub is text:
                kwargs[name] = _per_layer(sub, kwargs[name])
    return _per_layer(default, _merge(kwargs, OVERRIDES.get(model_type, {})))


def build(model_type: str, **overrides):
    """The tiny model of `model_type` (config `overrides` on top): float32, eager attention, seeded, norms perturbed
    as `attnlens.models` does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = CONFIG_MAPPING[model_type](**_merge(tiny_kwargs(model_type), overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    # as transformers builds it: a composite config's text (or decoder) part goes to a text-only causal-LM class
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text = config.get_text_config(decoder=True)
    if not isinstance(config, model_class.config_class) and isinstance(text, model_class.config_class):
        config = text
    model = model_class(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                for parameter in module.parameters(recurse=False):
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def registered() -> dict:
    from attnlens.registry import registered

    return registered()


# --- what the classes say ---------------------------------------------------------------------------------------

#: Forward parameters and sub-configs that carry something other than text, by the words in their names.
MODALITY_WORDS = ("pixel", "image", "vision", "video", "audio", "speech", "input_features", "input_values")


def classes(model_type: str) -> tuple[str, str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return CONFIG_MAPPING[model_type].__name__, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def static_facts(model_type: str) -> dict:
    """What the classes say before anything is built: composite configs (their towers), non-text inputs, whether
    the config is an encoder-decoder's, registered types served by the same causal-LM class."""
    import inspect

    import transformers

    config_class, model_class = classes(model_type)
    default = default_config(model_type)
    text = default.get_text_config(decoder=True)
    towers = [n for n in getattr(type(default), "sub_configs", {}) if getattr(default, n, None) is not text]
    forward = getattr(transformers, model_class).forward
    inputs = [p for p in inspect.signature(forward).parameters if any(w in p for w in MODALITY_WORDS)]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    same = sorted(
        t
        for t in registered()  # registered types the mapping lacks (mllama_text_model) have no class
        if t != model_type and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t) == model_class
    )
    return {
        "config_class": config_class,
        "causal_lm_class": model_class,
        "sub_configs": towers,
        "modality_inputs": inputs,
        "encoder_decoder": bool(default.is_encoder_decoder),
        "same_class_as": same,
    }
