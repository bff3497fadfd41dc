"""MPNet: BERT's post-norm block with an attention of its own arithmetic and a bucketed relative position bias added to
its scores (T5's buckets, bidirectional), an encoder only (transformers has no causal LM for it).

Each `MPNetLayer` runs `attention` (an `MPNetAttention`, renamed `self_attn`: `attn`, the `MPNetSelfAttention` that
does the arithmetic itself with no attention interface, then `LayerNorm(attn's output + layer_input)`), then
`intermediate` and `output` (renamed `mlp`: `LayerNorm(dense(activation) + stream)`), as BERT's does.

`attn` computes `q @ k^T / sqrt(head_dim)`, adds `position_bias` in place, then the mask, softmax, dropout, `@ v`,
the heads merged and `o`. The position bias (`attention_position_bias`, editable) is computed once per forward by the
encoder (`MPNetEncoder.compute_position_bias`: `relative_attention_bias`, an embedding of 32 buckets by heads, over
T5's bidirectional buckets of each key-query distance, max distance 128), expanded to the batch, and handed to every
block as the same tensor: a block's copy is served, and assigning it changes that block's bias alone.
"""

from __future__ import annotations

from ..family import Tiny
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import identities, scoring
from ..parts.eager import EagerFunction
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm
from .bert import POST_NORM, Bert

BIAS = "MPNet's bucketed relative position bias (attention_position_bias), computed by the encoder"
NO_CACHE = "{family.name} is an encoder only (transformers has no causal LM for it): it keeps no KV cache"
SHARED_BIAS = (
    "every block receives the one tensor the encoder computed, so an in-place edit would reach every later block: "
    "the value is that tensor's copy; assign it to change this block's bias"
)


def _bias_copy(envoy, held):
    return held.clone()


def _bias_back(envoy, held, new):
    return new


class MPNet(Bert):
    model_types = ("mpnet",)
    vllm = encoder_on_vllm("MPNet")
    tiny = Tiny("MPNetConfig", "MPNetForMaskedLM", {})
    layers = "mpnet.encoder.layer"
    embed_tokens = "mpnet.embeddings.word_embeddings"
    mlp_norm = "attention.LayerNorm"
    output_projection = "attn.o"
    # the attention does its own arithmetic, whatever attn_implementation says: no eager-only values
    eager = EagerFunction(only=())
    padding_changes_values = (
        "MPNet's position ids skip only tokens of id 1 (its padding_idx, whatever the config's pad_token_id): "
        "padding of another id moves the positions"
    )
    sizes = Sizes(
        num_heads=("attn.num_attention_heads",),
        head_dim=("attn.attention_head_size",),
        scale=(lambda module, found: module.attn.attention_head_size**-0.5,),
    )

    def locations(self):
        inner = dict(module="attn")
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            # the third argument of MPNetAttention's call of its `attn`
            "attention_position_bias": Derived(
                Operation(("self_attn_0",), "arg", 2, anchor="self.attn("),
                view=_bias_copy,
                unview=_bias_back,
                in_place=False,
                why_not=SHARED_BIAS,
            ),
            "attention_queries": Operation(("q_0",), anchor="self.q(", **inner),
            "attention_keys": Operation(("k_0",), anchor="self.k(", **inner),
            "attention_values": Operation(("v_0",), anchor="self.v(", **inner),
            # what the softmax receives: scaled, the bias added, and the mask where there is padding
            "attention_scores": softmax_argument(**inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="self.dropout(", **inner),
            "attention_head_outputs": Operation(("c_1",), anchor="permute", **inner),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput("intermediate"),
            "mlp_activation": ModuleInput(),  # MPNetOutput receives the activation's output itself
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(self.down_projection),
            "layer_output": ModuleOutput("", 0),
            "logits": OutputField("logits"),
        }

    class ScoreFunction(scoring.Bidirectional):
        def score_bias(self, config, layer):
            return BIAS

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            """`q @ k^T / sqrt(head_dim)` (a division, as MPNet computes it, not a product with the scale), then the
            mask; the position bias is the identities' `score_bias_value`."""
            scores = self.products(queries, keys) / heads.head_dim**0.5
            mask = self.mask(queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype, scores.device)
            return scores + mask

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return module.attn.o(premix)

        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: the attention's update joins the block input before `attention.LayerNorm` (`layer_mid`); the
            MLP's joins the normalised stream, and the block's `output.LayerNorm` follows."""
            if sublayer == "attention":
                return stream + update
            return block.output.LayerNorm(block.attention.LayerNorm(stream) + update)

        def score_bias_value(self, module, values, layer):
            return values["attention_position_bias"]

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself").replace(
                "BERT", "MPNet"
            ),
            "final_norm_output": "MPNet has no final norm: its head reads the last block's output, which ends in that "
            "block's own LayerNorm",
            **dict.fromkeys(CACHE_VALUES, NO_CACHE),
        }
    }

    kind_notes = {
        "*": {
            "attention_queries": "no rotary embedding: positions enter as learned embeddings and the score bias",
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_position_bias": "[batch, num_heads, query, key]: relative_attention_bias (32 buckets by "
            "heads) of T5's bidirectional buckets of each key-query distance (max distance 128), the same in every "
            "block (computed once by the encoder); a copy: assign it to change this block's",
            "attention_scores": "queries @ keys^T / sqrt(head_dim) + attention_position_bias + the mask",
            "attention_head_outputs": "probabilities @ values, heads moved after the positions (attn's `c`)",
            "attention_output": "attention.attn.o's output (dropout, the identity in eval, follows)",
            "layer_mid": "layer_input + attention_output, what attention.LayerNorm receives (post-norm)",
            "mlp_norm_output": "attention.LayerNorm(layer_mid): the MLP's input and the stream its output joins",
            "mlp_activation": "intermediate's output, read as what output (renamed mlp) receives: the same tensor",
            "mlp_neurons": "what output.dense receives, equal to mlp_activation (no gate)",
            "layer_output": "output.LayerNorm(mlp_norm_output + mlp_output): post-norm",
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + position embeddings): MPNetEmbeddings' output" if layer == 0 else None
            ),
        }
    }
