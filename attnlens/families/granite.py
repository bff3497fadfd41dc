"""Granite: the Llama layout with four multipliers from the config: the score scale, the residual branches, the
embeddings and the logits.

Scores are `queries @ keys^T * attention_multiplier` (not `1/sqrt(head_dim)`). Each sublayer's output is scaled by
`residual_multiplier` before the residual add, so `layer_mid = layer_input + residual_multiplier * attention_output`
and `layer_output = layer_mid + residual_multiplier * mlp_output`. `embeddings` is the token embedding module's output;
the first block receives it times `embedding_multiplier`. `logits` are the LM head's output divided by
`logits_scaling`, as the caller receives them.

vLLM's Granite passes the residual stream between blocks as one tensor (no `(hidden, residual)` pair, no fused
norms), so the residual values are module inputs and outputs there; it multiplies the embedding module's output by
`embedding_multiplier` in place, so `embeddings` is a copy taken before that.
"""

from ..locations import Derived, ModuleInput, ModuleOutput
from ..vllm.locations import batched
from .llama import Llama


def _copy(envoy, value):
    return value[None].clone()


def _drop_batch(envoy, old, new):
    return new[0]


def unpaired_locations(family, locations):
    """vLLM locations for blocks that pass the residual stream as one tensor, not vLLM's `(hidden, residual)` pair
    (Granite, StableLM): the residual values are the modules' own inputs and outputs, with a batch axis of one.
    `layer_input` stays the pair's reader, which reads the hidden state alone where no residual is passed."""
    return {**locations, "attention_output": batched(ModuleOutput()),
            "layer_mid": batched(ModuleInput(family.mlp_norm)), "mlp_output": batched(ModuleOutput()),
            "layer_output": batched(ModuleOutput("", 0)),
            "final_norm_output": batched(ModuleOutput(family.path("final_norm", "vllm")))}


class Granite(Llama):
    model_types = ("granite",)
    # Multipliers far from 1 (and a score scale unlike 1/sqrt(16)), so a family ignoring one fails the identities.
    tiny = ("GraniteConfig", "GraniteForCausalLM",
            {"attention_multiplier": 0.5, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
             "logits_scaling": 4.0})
    vllm_model_types = ("granite",)

    def vllm_locations(self):
        embeddings = Derived(ModuleOutput(self.embed_tokens), _copy, _drop_batch, in_place=False,
                             note="a copy: vLLM then multiplies this tensor by embedding_multiplier in place; assign "
                                  "it to edit",
                             why_not="it is a copy (vLLM multiplies the tensor by embedding_multiplier in place)")
        return {**unpaired_locations(self, super().vllm_locations()), "embeddings": embeddings}

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
