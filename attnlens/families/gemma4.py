"""Gemma 4: Gemma 3's block (QK-norm, sliding and full layers, norms after attention and the MLP), with unscaled
scores, normed values, per-layer head sizes, keys and values shared across layers, a scalar on each block's output,
and optionally per-layer inputs and a mixture-of-experts branch beside the MLP.

- Scores are `queries @ keys^T` unscaled (`scaling = 1.0`): q_norm and k_norm (RMSNorms) set their scale. Values are
  read after `v_norm`, an RMSNorm without weights. The eager function could soft-cap, but the attention never passes a
  cap, so the masked scores are its fifth assignment (`attn_weights_4`), as on Gemma 2 and 3.
- Full-attention layers have their own head size (`global_head_dim`) and, with `attention_k_eq_v`, their own number
  of key/value heads (`num_global_key_value_heads`) and no `v_proj`: the values are the key projection, v-normed
  (the keys are the same projection, k-normed and rotated). Sizes are read per layer from each attention module.
- The last `num_kv_shared_layers` layers compute no keys or values: each reuses those of the last earlier layer of its
  type. Their `attention_keys` and `attention_values` are those reused tensors, as the attention function receives
  them.
- Each block ends `layer_output = (layer_mid + post_feedforward_layernorm(mlp part)) * layer_scalar`. With
  `enable_moe_block` the MLP part is `post_feedforward_layernorm_1(mlp_output)` plus a routed-experts branch on
  `layer_mid` (`router`, `pre_feedforward_layernorm_2`, `experts`, `post_feedforward_layernorm_2`): `mlp_output` is
  the dense MLP's alone. With per-layer inputs (`hidden_size_per_layer_input`, PLE) the block then adds a gated
  projection of its layer's slice of the per-layer embeddings before the scalar; that branch is no standardized value
  (the identity `layer_mid + mlp part == layer_output` holds only without it).

Gemma 4 Unified is this layout without per-layer inputs and without the experts branch. "gemma4" and
"gemma4_unified" checkpoints load as `...ForConditionalGeneration`, the language model under
`model.language_model` (`multimodal.LanguageModelOf`).
"""

from dataclasses import replace

from ..family import TINY_DEFAULTS, Joined
from ..parts import identities
from ..parts.multimodal import VLLM_LANGUAGE_MODEL, LanguageModelOf
from ..parts.sizes import kv_heads_from_groups
from .gemma3 import Gemma3
from .granite import unpaired_locations

#: Two layer types with their own head sizes: sliding layers of 2 key/value heads of 16, full layers (the last must
#: be full) of one shared key/value head of 32 with values from the key projection; no per-layer inputs (see above).
TINY = {
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    "hidden_size_per_layer_input": 0,
    "final_logit_softcapping": 30.0,
}
SHARED = {
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}

#: vLLM's tiny checkpoints: keys and values shared by the last two layers, CPU head sizes of 32 (sliding), 64 (full).
VLLM_SIZES = {**SHARED, "head_dim": 32, "global_head_dim": 64}


def shared_kv_locations(locations: dict) -> dict:
    """A layer's vLLM locations where its kernel reads another layer's keys and values (`vllm.shared_kv`)."""
    from ..locations.vllm import SharedKernelInput

    kernel = locations["attention_queries"].kernel
    return {
        **locations,
        "attention_keys": SharedKernelInput(kernel, 1),
        "attention_values": SharedKernelInput(kernel, 2),
    }


def _gemma4text_vllm_locations(family):
    return unpaired_locations(family, Gemma3.vllm.locations(family))


class Gemma4Text(Gemma3):
    model_types = ("gemma4_text",)
    # per layer: full layers may have fewer key/value heads
    sizes = replace(Gemma3.sizes, num_kv_heads=(kv_heads_from_groups,))
    tiny = ("Gemma4TextConfig", "Gemma4ForCausalLM", TINY)
    # vLLM (model_executor/models/gemma4.py): the same module names; each block passes the residual stream as one
    # tensor (`unpaired_locations`); the kernel gets per-layer head counts and sizes, scale 1.0; a shared layer's kernel
    # gets `attn(q, None, None)` (`vllm.shared_kv`). The checkpoint shares keys and values and has per-layer inputs.
    vllm = replace(
        Gemma3.vllm,
        model_types=("gemma4_text",),
        tiny={**VLLM_SIZES, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128},
        locations=_gemma4text_vllm_locations,
    )
    # Keys and values shared across layers are tested on Gemma 4 Unified (the same attention code): transformers 5.24's
    # Gemma 4 slices per-layer inputs when it reaches the shared layers, so sharing needs them, which tiny recipes
    # leave out (tests/families/test_flagships.py runs both).
    tiny_layouts = {
        "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
    }

    class Identities(identities.Identities):
        block_arguments = {
            "per_layer_input": 1
        }  # Gemma4TextModel calls each block as block(hidden, per_layer_input, ...)

        def residual_add(self, block, sublayer, stream, update, per_layer_input=None, **arguments):
            if sublayer != "mlp":
                return super().residual_add(block, sublayer, stream, update)
            if getattr(block, "enable_moe_block", False):
                flat = stream.reshape(-1, stream.shape[-1])
                _, weights, index = block.router(flat)
                experts = block.experts(block.pre_feedforward_layernorm_2(flat), index, weights).reshape(stream.shape)
                update = block.post_feedforward_layernorm_1(update) + block.post_feedforward_layernorm_2(experts)
            h = stream + block.post_feedforward_layernorm(update)
            if getattr(block, "hidden_size_per_layer_input", 0):  # the per-layer-input branch, from the block's input
                h = h + block.post_per_layer_input_norm(
                    block.per_layer_projection(block.act_fn(block.per_layer_input_gate(h)) * per_layer_input)
                )
            return h * block.layer_scalar

    # residual_add applies the post-feedforward norm, after the experts branch joins the MLP's output
    mlp_post_norm = None

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"kv_shared"} if self.shared_from(config, layer) is not None else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if engine == "vllm" and "kv_shared" in kind:
            locations = shared_kv_locations(locations)
        return locations

    @staticmethod
    def shared_from(config, layer: int) -> int | None:
        """The layer whose keys and values `layer` reuses, or None where it computes its own."""
        first = config.num_hidden_layers - getattr(config, "num_kv_shared_layers", 0)
        if layer < first:
            return None
        return max(i for i in range(first) if config.layer_types[i] == config.layer_types[layer])

    kind_notes = {
        "*": {
            "attention_queries": "after q_norm (RMSNorm) and the rotary embedding",
            "attention_keys": "after k_norm (RMSNorm) and the rotary embedding",
            "attention_values": "after v_norm (an RMSNorm without weights)",
            "attention_scores": lambda family, config, layer: (
                "not scaled (scaling 1.0): q_norm and k_norm set the "
                "scale"
                + (
                    "; use_bidirectional_attention='all': the model attends in both directions, the family's score "
                    "function is causal and does not reproduce it"
                    if getattr(config, "use_bidirectional_attention", None) == "all"
                    else ""
                )
            ),
            "mlp_output": lambda family, config, layer: (
                "the dense MLP's output only: the experts branch beside it (on layer_mid) is no standardized value; "
                "layer_output's note has how they join"
                if getattr(config, "enable_moe_block", False)
                else None
            ),
            "layer_output": lambda family, config, layer: family.layer_output_note(config),
        },
        "full_attention": {
            "attention_values": Joined(
                lambda family, config, layer: (
                    "the key projection's output (this layer has no v_proj), not rotated"
                    if config.attention_k_eq_v
                    else None
                )
            ),
        },
        "kv_shared": dict.fromkeys(
            ("attention_keys", "attention_values"),
            lambda family, config, layer: (
                f"reused from layer {family.shared_from(config, layer)} (num_kv_shared_layers: this layer computes no "
                f"keys or values); in generate's prefill transformers runs this layer on the last position only"
            ),
        ),
    }

    @staticmethod
    def layer_output_note(config) -> str:
        parts = "post_feedforward_layernorm(mlp_output)"
        if getattr(config, "enable_moe_block", False):
            parts = (
                "post_feedforward_layernorm(post_feedforward_layernorm_1(mlp_output) + the experts branch: "
                "post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(layer_mid))), routed by router)"
            )
        ple = ""
        if getattr(config, "hidden_size_per_layer_input", 0):
            ple = (
                " + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) * per_layer_input"
                "))) with h the sum so far: the per-layer-input branch, no standardized value (the identities "
                "recompute it from the block's per_layer_input argument)"
            )
        return f"(layer_mid + {parts}{ple}) * layer_scalar"


class Gemma4UnifiedText(Gemma4Text):
    model_types = ("gemma4_unified_text",)
    vllm = replace(
        Gemma4Text.vllm,
        model_types=(),
        refusal="vLLM 0.32 registers no Gemma4UnifiedForCausalLM: it runs Gemma 4 Unified only as the multimodal "
        "Gemma4UnifiedForConditionalGeneration (model type 'gemma4_unified', served)",
    )
    tiny = ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", TINY)
    tiny_layouts = {"kv_shared": {**SHARED, "use_double_wide_mlp": True}}

    class Identities(identities.Identities):
        block_arguments = {}  # its blocks take no per-layer input


class Gemma4(LanguageModelOf, Gemma4Text):
    model_types = ("gemma4",)
    tiny = (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        {"text_config": {"model_type": "gemma4_text", **TINY_DEFAULTS, **TINY}},
    )
    tiny_layouts = {}
    vllm = replace(
        Gemma4Text.vllm,
        model_types=("gemma4",),
        names=VLLM_LANGUAGE_MODEL,  # vLLM's gemma4_mm, its Gemma4ForCausalLM as language_model (tests_vllm)
        tiny={
            "text_config": {**tiny[2]["text_config"], **Gemma4Text.vllm.tiny},
            "vision_config": {
                "model_type": "gemma4_vision",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "position_embedding_size": 64,
            },
        },
    )
    # vLLM builds the vision tower's config even where no prompt has an image: a tiny one


class Gemma4Unified(LanguageModelOf, Gemma4UnifiedText):
    model_types = ("gemma4_unified",)
    refuses_images = (
        "Gemma 4 Unified lets an image's tokens attend each other both ways (its mask, from mm_token_type_ids), "
        "where the family's mask is causal (its image tokens are not laid out): the probabilities above the "
        "diagonal inside an image are positive where the family's mask zeroes them"
    )
    tiny = (
        "Gemma4UnifiedConfig",
        "Gemma4UnifiedForConditionalGeneration",
        {"text_config": {"model_type": "gemma4_unified_text", **TINY_DEFAULTS, **TINY}},
    )
    tiny_layouts = {}
    vllm = replace(
        Gemma4UnifiedText.vllm,
        model_types=("gemma4_unified",),
        names=VLLM_LANGUAGE_MODEL,  # vLLM's gemma4_unified, its Gemma4ForCausalLM as language_model
        tiny={
            "text_config": {**tiny[2]["text_config"], **VLLM_SIZES, "use_double_wide_mlp": True},
            "vision_config": {
                "model_type": "gemma4_unified_vision",
                "mm_embed_dim": 32,
                "mm_posemb_size": 16,
                "output_proj_dims": 64,
            },
        },
    )
