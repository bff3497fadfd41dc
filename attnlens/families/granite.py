"""Granite: the Llama layout with four multipliers from the config: the score scale, the residual branches, the
embeddings and the logits.

Scores are `queries @ keys^T * attention_multiplier` (not `1/sqrt(head_dim)`). Each sublayer's output is scaled by
`residual_multiplier` before the residual add, so `layer_mid = layer_input + residual_multiplier * attention_output`
and `layer_output = layer_mid + residual_multiplier * mlp_output`. `embeddings` is the token embedding module's output;
the first block receives it times `embedding_multiplier`. `logits` are the LM head's output divided by
`logits_scaling`, as the caller receives them.
"""

from .llama import Llama


class Granite(Llama):
    model_types = ("granite",)
    # Multipliers far from 1 (and a score scale unlike 1/sqrt(16)), so a family ignoring one fails the identities.
    tiny = ("GraniteConfig", "GraniteForCausalLM",
            {"attention_multiplier": 0.5, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
             "logits_scaling": 4.0})

    def residual_add(self, block, sublayer, stream, update):
        return stream + update * block.residual_multiplier

    def notes(self, config, layer, engine="eager"):
        r = config.residual_multiplier
        notes = {**super().notes(config, layer, engine),
                 "attention_scores": f"scaled by config.attention_multiplier ({config.attention_multiplier:g}), "
                                     f"not 1/sqrt(head_dim)",
                 "layer_mid": f"layer_input + residual_multiplier ({r:g}) * attention_output",
                 "layer_output": f"layer_mid + residual_multiplier ({r:g}) * mlp_output",
                 "embeddings": f"before embedding_multiplier: layers[0].layer_input is embeddings * "
                               f"{config.embedding_multiplier:g}",
                 "logits": f"the LM head's output divided by logits_scaling ({config.logits_scaling:g})"}
        return notes
