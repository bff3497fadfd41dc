"""NeoMME: a bidirectional encoder of text (and image patches) with local and global layers, QK-norm, a rotary
embedding per kind of layer, value embeddings, exclusive self-attention and a sigmoid-gated output projection.

Each `NeoMMEEncoderLayer` mixes its input with the normalised embeddings every layer receives
(`lambdas[0] * hidden + lambdas[1] * initial_hidden_states`), normalises the mix (`input_layernorm`, an RMSNorm
without a gain) and attends from it; `residual_multiplier` times the attention's output joins the block input
(`layer_mid`), and `residual_multiplier` times the MLP's output (`down_proj(act_fn(up_proj(x)))`, no gate) joins that.

Inside the attention, queries and keys are RMS-normalised per head (no gain) and rotated (two interleaved M-RoPE
axes, both the token index for text: the plain rotation, by the theta of the layer's kind); on the first and the last
global layer the value embedding of each token is added to the values after the projection (`attention_values` holds
the sum). The attention function's output is `attention_head_outputs`. Between it and the output projection the
model applies exclusive self-attention, `z - tanh(alpha_h) * (z . v) v` with `v` the token's own value for the head,
normalised, and then multiplies the merged result by `sigmoid(gate_proj(x))` before `o_proj`
(`output_projection`, a `NeoMMESigmoidGatedProjection`).

Local layers (`config.layer_types`) see a band of `per_layer_config[i].sliding_window` keys on both sides of each
query (`modernbert.BidirectionalWindow`); short and long bands alternate over the local layers. The token embeddings
are factorised (`word_embeddings`, `embedding_rank` wide, then `embedding_projection`); `embeddings` is the first
factor's output. The logits are `lm_head(final_norm_output @ unembedding_projection.weight)`.
"""

from __future__ import annotations

from ..family import Family, Tiny, after_attention
from ..locations import INTERFACE_CALL, ModuleInput, ModuleOutput, Operation, softmax_argument
from ..parts import identities
from ..parts.vllm import encoder_on_vllm
from .modernbert import BidirectionalWindow, band_note, rotary_note

BETWEEN = (
    "NeoMME does not merge the head outputs into what its output projection receives: exclusive self-attention "
    "first removes from each head's output its component along the token's own unit value "
    "(z - tanh(alpha_h) * (z . v) v), and the merged result is multiplied by sigmoid(gate_proj(x)) before o_proj; "
    "attnlens's identity between the head outputs and the premix (the heads merged, times a gate) takes the head "
    "outputs alone and cannot hold here, so neither the premix nor the gate is served; attention_output is "
    "o_proj's output"
)


class NeoMME(Family):
    model_types = ("neomme",)
    vllm = encoder_on_vllm("NeoMME")
    tiny = Tiny(
        "NeoMMEConfig",
        "NeoMMEForMaskedLM",
        {
            # three layers: local (band 2), local (the long band), global
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "embedding_rank": 32,
            "sliding_window": 2,
            "patch_size": 2,
        },
    )
    embed_tokens = "model.embed_tokens.word_embeddings"
    final_norm = "model.final_norm"
    activation = "act_fn"

    def locations(self):
        probabilities, probabilities_anchor = self.eager.probabilities
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_queries": Operation((INTERFACE_CALL,), "arg", 1),
            "attention_keys": Operation((INTERFACE_CALL,), "arg", 2),
            "attention_values": Operation((INTERFACE_CALL,), "arg", 3),
            "attention_scores": softmax_argument(INTERFACE_CALL),
            "attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=probabilities_anchor),
            "attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0),
            "attention_output": ModuleOutput("", 0),
            **after_attention(self),
        }

    class ScoreFunction(BidirectionalWindow):
        def half_window(self, config, layer):
            return config.per_layer_config[layer].sliding_window

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Each sublayer's output times the block's `residual_multiplier` joins the stream."""
            return stream + block.residual_multiplier * update

    kind_reasons = {"*": {"attention_premix": BETWEEN, "attention_gate": BETWEEN}}

    kind_notes = {
        "*": {
            "embeddings": "word_embeddings' output, embedding_rank wide: embedding_projection lifts it to "
            "hidden_size, and embedding_norm normalises that into layers[0]'s input (and every layer's "
            "initial_hidden_states)",
            "attention_norm_output": "input_layernorm(lambdas[0] * layer_input + lambdas[1] * the normalised "
            "embeddings): each block mixes in the first block's input before its norm",
            "attention_queries": lambda family, config, layer: (
                "q_norm per head, then " + rotary_note(family, config, layer)
            ),
            "attention_keys": lambda family, config, layer: (
                "k_norm per head, then " + rotary_note(family, config, layer)
            ),
            "attention_values": lambda family, config, layer: (
                "v_proj's heads plus the token's value embedding (the first and the last global layer add one)"
                if layer in _value_embedding_layers(config)
                else "v_proj's heads"
            ),
            "attention_probabilities": band_note,
            "attention_head_outputs": "the attention function's output, before exclusive self-attention and the "
            "output gate",
            "attention_output": "output_projection's output: o_proj(merged exclusive self-attention output * "
            "sigmoid(gate_proj(attention_norm_output)))",
            "layer_mid": "layer_input + residual_multiplier * attention_output",
            "layer_output": "layer_mid + residual_multiplier * mlp_output",
            "mlp_neurons": "what down_proj receives, equal to mlp_activation (no gate)",
            "logits": "lm_head(final_norm_output @ unembedding_projection.weight): the factorised unembedding",
        }
    }


def _value_embedding_layers(config) -> set[int]:
    """The layers whose values add the tokens' value embeddings: the first and the last global layer."""
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    return {full[0], full[-1]}
