"""GTE (Alibaba's gte-*-v1.5 encoders): BERT's post-norm block with a rotary embedding in place of learned positions,
Llama's module names and a gated MLP; and the types transformers builds from the same modules (`gte_shaped`): Nomic
BERT and Jina Embeddings v3.

Each `GteLayer` runs `self_attn` (the shared attention interface on rotated queries and keys, output projection
`o_proj`), adds its output (after `post_attention_dropout`, the identity in eval) to the block input, normalises the sum
(`post_attention_layernorm`), runs `mlp` on that and adds its output back, and normalises again
(`post_mlp_layernorm`). As in BERT, every norm follows a residual add: the attention reads the block input itself (no
`attention_norm_output`), `layer_mid` is what `post_attention_layernorm` receives, `mlp_norm_output` its output (the
MLP's input and the stream its output joins), and there is no final norm. The attention is bidirectional: the model
builds transformers' bidirectional mask (none on an unpadded batch, the padded keys masked otherwise). The embeddings
are the word embeddings' output; the token type embedding (where the config has one) is added and the sum normalised
before `layers[0]`, and positions enter only through the rotary embedding.

The types differ in their MLP and head:
- GTE: `down_proj(dropout(act_fn(gate_proj(x)) * up_proj(x)))`; logits `lm_head.decoder(layer_norm(gelu(dense(x))))`.
- Nomic BERT: the same MLP without the dropout and without biases; logits from BERT's prediction head
  (`cls.predictions`: dense, activation, LayerNorm, decoder).
- Jina Embeddings v3: a plain MLP `fc2(activation_fn(fc1(x)))` (no gate); its base model sits under `roberta`.
"""

from __future__ import annotations

from ..family import Family, Tiny
from ..parts import identities
from ..parts.vllm import encoder_on_vllm
from .bert import post_norm_locations
from .modernbert import BidirectionalWindow, rotary_note

POST_NORM = "{name} normalises after each residual add, not before a sublayer: {what}"


class Gte(Family):
    model_types = ("gte",)
    vllm = encoder_on_vllm("GTE")
    tiny = Tiny("GteConfig", "GteForMaskedLM", {"type_vocab_size": 2, "hidden_dropout_prob": 0.0})
    layers = "gte.layers"
    embed_tokens = "gte.embeddings.word_embeddings"
    final_norm = None
    attention_norm = None
    mlp_norm = "post_attention_layernorm"

    def locations(self):
        return post_norm_locations(super().locations())

    class ScoreFunction(BidirectionalWindow):
        def half_window(self, config, layer):
            return None  # every layer global

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: the attention's update joins the block input before `post_attention_layernorm`
            (`layer_mid`); the MLP's joins the normalised stream, and `post_mlp_layernorm` follows."""
            if sublayer == "attention":
                return stream + update
            return block.post_mlp_layernorm(block.post_attention_layernorm(stream) + update)

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(
                name="this encoder", what="the attention reads the block input itself"
            ),
            "final_norm_output": "no final norm: the heads read the last block's output, which ends in that block's "
            "own post_mlp_layernorm",
        }
    }

    kind_notes = {
        "*": {
            "embeddings": "the word embeddings' output; the token type embedding (where the config has one) is "
            "added and the sum normalised (embeddings.LayerNorm) before layers[0]; positions enter through the "
            "rotary embedding only",
            "attention_queries": rotary_note,
            "attention_keys": rotary_note,
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_output": "o_proj's output (post_attention_dropout, the identity in eval, follows in the block)",
            "layer_mid": "layer_input + attention_output, what post_attention_layernorm receives (post-norm)",
            "mlp_norm_output": "post_attention_layernorm(layer_mid): the MLP's input and the stream its output joins",
            "layer_output": "post_mlp_layernorm(mlp_norm_output + mlp_output): post-norm",
            "logits": "lm_head.decoder(lm_head.layer_norm(gelu(lm_head.dense(layer_output of the last layer))))",
        }
    }


def gte_shaped(
    name: str,
    model_type: str,
    base: str,
    config: str,
    masked_lm: str,
    summary: str,
    tiny: dict,
    notes: dict,
    **members,
) -> type[Gte]:
    """GTE's family on a type transformers builds from GTE's modules: its base model under `base`, its classes
    (`config`, `masked_lm`), its tiny kwargs, notes of its own, and the module names that differ (`members`)."""
    return type(
        name,
        (Gte,),
        {
            "__doc__": f"{summary}: GTE's post-norm rotary block under classes of its own (`gte.py`).",
            "__module__": __name__,
            "model_types": (model_type,),
            "layers": f"{base}.layers",
            "embed_tokens": f"{base}.embeddings.word_embeddings",
            "tiny": Tiny(config, masked_lm, tiny),
            "kind_notes": notes,
            "vllm": encoder_on_vllm(summary),
            **members,
        },
    )


NomicBert = gte_shaped(
    "NomicBert",
    "nomic_bert",
    "nomic_bert",
    "NomicBertConfig",
    "NomicBertForMaskedLM",
    "Nomic BERT",
    {},
    {
        "*": {
            "logits": "cls.predictions.decoder(transform(layer_output of the last layer)): BERT's prediction head "
            "(dense, activation, LayerNorm)"
        }
    },
)
JinaEmbeddingsV3 = gte_shaped(
    "JinaEmbeddingsV3",
    "jina_embeddings_v3",
    "roberta",
    "JinaEmbeddingsV3Config",
    "JinaEmbeddingsV3ForMaskedLM",
    "Jina Embeddings v3",
    {"type_vocab_size": 2, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    {
        "*": {
            "mlp_activation": "activation_fn(fc1(mlp_input)): no gate",
            "mlp_neurons": "what fc2 receives, equal to mlp_activation (no gate)",
        }
    },
    activation="activation_fn",
    down_projection="fc2",
)
