"""Ergo: one fused `qkv_proj`, per-head QK RMSNorm, rotary embedding on sliding layers only (full layers have no
positional encoding and may scale their queries and keys), norms before and after each sublayer, residual adds that
are learned per-channel gates, a squared-ReLU dense MLP on the first layers and a mixture of experts with per-expert
norms and a shared expert on the rest.

The attention views `qkv_proj`'s output per head and splits it `[queries | keys | values]` along the heads, then
normalises each query and key head (`q_norm`, `k_norm`); sliding layers rotate them (interleaved pairs), full layers
rotate nothing and, where `config.global_attention_scale` is set, multiply both by its square root. The eager
function is Llama's, so the attention values are the common ones, read at its call.

The block normalises each sublayer's output (`post_attention_layernorm`, `post_feedforward_layernorm`) and does not
add it to the stream: `ErgoResidualGate` mixes them per hidden channel, `sigmoid(w) * update + sqrt(1 + sigmoid(w)) *
exp(-softplus(w) / 2) * stream` (`attention_residual_gate` for `layer_mid`, `feedforward_residual_gate` for
`layer_output`), so the stream is scaled as well as added to. `layer_mid` is read as the input of the norm in front
of the MLP (`pre_feedforward_layernorm`), `layer_output` as the block's output.

Layers whose `config.mlp_layer_types` entry is "dense" run `down_proj(relu2(up_proj(x)))` (no gate: the activation is
what the down projection receives); the "sparse" ones route each token to top-k experts (sigmoid scores, renormalised
and times `moe_routed_scaling_factor`), each expert `relu2(x @ up) @ down` followed by an RMSNorm with that expert's
own scale, and add a shared expert (a relu2 MLP followed by an RMSNorm): no activation or neuron tensor exists there.

Loaded in half precision, transformers keeps the embeddings, every norm and both gates in float32
(`_keep_in_fp32_modules_strict`): the residual stream and the norms' outputs are float32, the sublayers run in the
model's dtype, and the scores are float32 (the mask, built in the embeddings' dtype, promotes the products).
"""

from ..family import Family, MLPArithmetic, Tiny, VLLMLayout
from ..parts import identities
from ..parts.fused import FusedQKV
from ..parts.moe import PER_EXPERT, SparseMoE
from ..parts.vllm import not_in_transformers

#: The gate's arithmetic, in words, as the notes say it (`update` the normalised sublayer output).
GATE = "sigmoid(w) * {update} + sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2) * {stream}"


def _full_layer_scaling(family, config, layer) -> str:
    scale = getattr(config, "global_attention_scale", None)
    return "" if scale is None else f", times sqrt(global_attention_scale) = sqrt({scale:g})"


class Ergo(SparseMoE, Family):
    model_types = ("ergo",)
    vllm = VLLMLayout(refusal=not_in_transformers("Ergo", "ErgoForCausalLM", "ErgoConfig", "ergo"))
    tiny = Tiny(
        "ErgoConfig",
        "ErgoForCausalLM",
        {
            "intermediate_size": None,  # Ergo sizes its MLPs by the three below
            "first_dense_intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            # sliding, full, sliding: both kinds of attention, the full one between two that rotate
            "global_attention_every_n_layers": 2,
            "global_attention_scale": 2.0,  # full layers scale their queries and keys
            "num_dense_blocks": 1,  # dense, sparse, sparse
        },
    )
    fused_qkv = FusedQKV("qkv_proj", "blocks")  # viewed per head and split [q | k | v] along the heads
    mlp_norm = "pre_feedforward_layernorm"
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    class Identities(identities.Identities):
        def post_norm(self, block, sublayer, name, output):
            return block.get_submodule(name)(output.float())  # the block norms its sublayers' outputs in float32

        def residual_add(self, block, sublayer, stream, update, **arguments):
            gate = block.attention_residual_gate if sublayer == "attention" else block.feedforward_residual_gate
            return gate(update, stream)

        def mlp_arithmetic(self, mlp):
            # no gate projection: relu2(up_proj(x)) is both the activation and what down_proj receives
            return MLPArithmetic(
                lambda neurons: mlp.down_proj(neurons),
                lambda x: mlp.up_proj(x),
                lambda z: mlp.act_fn(z),
                lambda x, activation: activation,
                says=("up_proj(mlp input)", "activation", "down_proj(neurons)"),
            )

    absent = {
        **Family.absent,
        **dict.fromkeys(
            PER_EXPERT,
            "a sparse mixture of experts: no [batch, seq, intermediate] tensor exists. mlp.experts (ErgoExperts) "
            "repeats each token once per route and forms relu2(x @ up_proj[e]) (no gate) per expert, only for the "
            "routes to it; the shared expert's is formed inside mlp.shared_experts; mlp_output is their combination",
        ),
    }

    kind_notes = {
        "sliding_attention": {
            "attention_queries": "RMS-normalised per head (q_norm), then rotated (interleaved pairs)",
            "attention_keys": "RMS-normalised per head (k_norm), then rotated (interleaved pairs)",
        },
        "full_attention": {
            "attention_queries": lambda family, config, layer: (
                "RMS-normalised per head (q_norm), not rotated (full-attention layers have no positional "
                f"encoding){_full_layer_scaling(family, config, layer)}"
            ),
            "attention_keys": lambda family, config, layer: (
                "RMS-normalised per head (k_norm), not rotated (full-attention layers have no positional "
                f"encoding){_full_layer_scaling(family, config, layer)}"
            ),
        },
        "*": {
            "layer_input": "float32 even in a model loaded in half precision: transformers keeps Ergo's embeddings, "
            "norms and residual gates in float32 (_keep_in_fp32_modules_strict), so the residual stream and the norms' "
            "outputs are float32 while attention and the MLP run in the model's dtype",
            "attention_scores": "float32 in a half-precision model: the mask is built in the float32 embeddings' "
            "dtype and promotes the products (the pattern is cast back to the queries' dtype)",
            "layer_mid": "attention_residual_gate(post_attention_layernorm(attention_output), layer_input): "
            + GATE.format(update="update", stream="layer_input")
            + ", w the gate's weight per hidden channel",
            "layer_output": "feedforward_residual_gate(post_feedforward_layernorm(mlp_output), layer_mid): "
            + GATE.format(update="update", stream="layer_mid")
            + ", w the gate's weight per hidden channel",
        },
        "!moe": {
            "mlp_activation": "relu2(up_proj(mlp_input)), squared ReLU with no gate: also the neurons",
            "mlp_neurons": "the activation itself: the dense MLP has no gate or up product",
        },
        "moe": {
            "mlp_output": "the routed experts' outputs, each RMS-normalised with its expert's own scale "
            "(experts.post_expert_norm), weighted by the router's sigmoid scores renormalised over the top "
            "{config.num_experts_per_tok} and times moe_routed_scaling_factor ({config.moe_routed_scaling_factor:g}), "
            "summed, plus the shared expert (mlp.shared_experts, a relu2 MLP then an RMSNorm)",
        },
    }
